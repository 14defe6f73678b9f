"""Attention over the tiers, framework-free: partials read from the packed tiers, merged by LSE.

Owns kvtier's attention function (:mod:`.interface`), the compact mask (:mod:`.mask`), the
per-step :class:`~.plan.AttentionPlan` (:mod:`.plan`: the only reader of thresholds, query
length, device and kernel availability; ``force=``), the backends (:mod:`.backends`: torch, C++
CPU, Triton, one :class:`~.backends.Selection` type), the path that follows the plan
(:mod:`.tiered`), the torch maths of partials and their merge (:mod:`.partials`), sparse selection
(:mod:`.sparse`), work counting (:mod:`.work`) and the dense oracle (:mod:`.reference`).
May import: torch, ``kvtier.cache`` (state, tiers, codecs), ``kvtier.kernels``, ``kvtier.quant``,
``kvtier.policy``, ``kvtier.stats``, ``kvtier.indexing`` and (lazily, for offloaded layers)
``kvtier.offload.attention``; transformers only inside :meth:`KVMask.dense`; never ``kvtier.hf``.
``kvtier.offload.attention`` imports :mod:`.plan`, :mod:`.partials` and :mod:`.mask` from here;
storage (``kvtier.cache``, the rest of ``kvtier.offload``) never imports this package.

The registration with transformers (``register``, ``enable``, ``disable``, ``kvtier_mask``) is in
the adapter, :mod:`kvtier.hf`; those names stay available here, resolved on first use.
"""

from typing import Any

from .interface import kvtier_attention
from .mask import KVMask

__all__ = ["KVMask", "disable", "enable", "kvtier_attention", "kvtier_mask", "register"]


def __getattr__(name: str) -> Any:
    if name in ("disable", "enable", "kvtier_mask", "register"):
        from ..adapters import hf_attribute

        return hf_attribute(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
