"""Packed KV pages in vLLM's own block pool: the attention backend and everything it runs.

- :mod:`.policy`: :class:`~.policy.PagePolicy` (what an engine stores and how it attends), presets, backend names;
- :mod:`.paged`: the side buffer, the step plan (:func:`~.paged.plan_step`) and the plain-torch path;
- :mod:`.attention`: :class:`~.attention.PagedAttention` ``(fmt, backend)`` with ``plan`` / ``run`` /
  ``update``: every path choice of a step, made once; backends torch, C++ and Triton;
- :mod:`.prefill`: prefill chunks through kvtier's bf16 kernel or vLLM's CPU attention;
- :mod:`.backend`: vLLM's attention backend classes (imports vLLM at module level).

The page format itself (layout, encode, decode) is :class:`kvtier.codecs.pages.PageFormat`. May
import torch, vLLM (only :mod:`.backend`, and :class:`.prefill.VllmPrefill` when made),
``kvtier.codecs``, ``kvtier.quant``, ``kvtier.errors``, ``kvtier.kernels`` and
``kvtier.attention.partials``; never :mod:`kvtier.vllm.store`, transformers or ``kvtier.hf``.
Imports nothing itself: the public names are in :mod:`kvtier.vllm`.
"""
