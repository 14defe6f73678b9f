"""Attention over the tiers, framework-free: partials read from the packed tiers, merged by LSE.

Owns kvtier's attention function (:mod:`.interface`), the compact mask (:mod:`.mask`), the fast
path (:mod:`.tiered`), per-tier partials and their merge (:mod:`.partials`), sparse selection
(:mod:`.sparse`) and the dense oracle (:mod:`.reference`). May import: torch, ``kvtier.cache``
(state, tiers, codecs), ``kvtier.kernels``, ``kvtier.quant``, ``kvtier.policy``, ``kvtier.stats``,
``kvtier.indexing`` and (lazily, for offloaded layers) ``kvtier.offload.attention``; transformers
only inside :meth:`KVMask.dense`; never ``kvtier.hf``.

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
