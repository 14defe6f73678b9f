"""Fused kernels over kvtier's stored formats: C++ CPU kernels (sources in ``csrc/``, compiled on
first use by :mod:`kvtier.kernels.build`, with a warning and the torch path as fallback) and
Triton kernels (CUDA, or Triton's CPU interpreter in the tests). Each has a torch reference
(:mod:`kvtier.attention.partials`, :meth:`kvtier.codecs.pages.PageFormat.decode`); the attention
backends (:mod:`kvtier.attention.backends`) and the vLLM adapter call them where a plan says.

Owns the kernel sources and their build: ``csrc/`` (``numeric.h``, the numeric helpers every kernel ``.cpp``
includes; ``page_codes.h``, the packed-page codes; ``codec_constants.h`` is not a file but written
by :mod:`.build` from :mod:`kvtier.codecs.constants`), the C++ wrappers (:mod:`.cpu` one packed
tier, :mod:`.fused_cpu` a whole layer, :mod:`.offload_cpu` and :mod:`.sketch_cpu` offloaded blocks,
:mod:`.vllm_paged_cpu` and :mod:`.prefill_cpu` vLLM pages, :mod:`.parallel` the thread probe) and the
Triton kernels (:mod:`.triton_decode` behind :mod:`.dispatch`, :mod:`.triton_pages`). Layouts and
constants come from the codecs (``KERNEL_FIELDS``, ``AFFINE_MODES``, ``PageFormat.layout()``, the
generated header), never restated here (``tests/test_kernel_sources.py``).

May import (lower layers only): torch, ``kvtier.codecs``, ``kvtier.quant``; Triton only inside the
Triton modules, which nothing imports at import time. Never ``kvtier.offload``, ``kvtier.cache``,
``kvtier.attention``, the adapters or transformers.
"""
