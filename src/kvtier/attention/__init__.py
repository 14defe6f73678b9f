"""Attention over the tiers, framework-free: partials read from the packed tiers, merged by LSE.

Owns kvtier's attention function (:mod:`.interface`), the compact mask (:mod:`.mask`), the
per-step :class:`~.plan.AttentionPlan` (:mod:`.plan`: the only reader of thresholds, query
length, device and kernel availability; ``force=``), the backends (:mod:`.backends`: torch, C++
CPU, Triton, one :class:`~.backends.Selection` type), the path that follows the plan
(:mod:`.tiered`), attention over offloaded cold blocks (:mod:`.offloaded`: sketch-scored
selection, exact attention over the fetched blocks), the torch maths of partials and their merge
(:mod:`.partials`), sparse selection (:mod:`.sparse`), work counting (:mod:`.work`) and the dense
oracle (:mod:`.reference`).

May import (lower layers only): torch, ``kvtier.cache`` (state, tiers), ``kvtier.offload``
(the offloaded tier, sketches), ``kvtier.kernels``, ``kvtier.codecs``, ``kvtier.quant``,
``kvtier.policy`` and the leaf modules; transformers only inside :meth:`KVMask.dense`; never
``kvtier.sizing`` / ``kvtier.diagnostics``, ``kvtier.hf`` or ``kvtier.vllm``. The registration with
transformers (``register``, ``enable``, ``disable``, ``kvtier_mask``) is in the adapter,
:mod:`kvtier.hf` (``kvtier.enable``).
"""

from .interface import kvtier_attention
from .mask import KVMask

__all__ = ["KVMask", "kvtier_attention"]
