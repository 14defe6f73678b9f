"""kvtier: tiered (hot / warm / cold) KV cache for Hugging Face transformers.

>>> import kvtier
>>> with kvtier.enable(model):
...     out = model.generate(**inputs, cache=kvtier.TieredCache(model.config, "default"))

The core (policies, planner, codecs, tiers, the block store, kernels, diagnostics) imports without
transformers; the transformers adapter's names (``TieredCache``, ``TieredLayer``, ``enable``,
``disable``, ``register``) come from :mod:`kvtier.hf` on first use and need ``kvtier[hf]``.
"""

from typing import Any

from .diagnostics import MemoryReport, memory_report
from .errors import BudgetWarning, CacheFullError, KVTierError
from .offload import OffloadError
from .policy import PRESETS, AdaptivePolicy, OffloadPolicy, SparsePolicy, TierPolicy, get_policy

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "BudgetWarning",
    "CacheFullError",
    "KVTierError",
    "MemoryReport",
    "OffloadError",
    "OffloadPolicy",
    "SparsePolicy",
    "TierPolicy",
    "AdaptivePolicy",
    "TieredCache",
    "TieredLayer",
    "disable",
    "enable",
    "get_policy",
    "memory_report",
    "register",
]


def __getattr__(name: str) -> Any:
    if name in ("TieredCache", "TieredLayer", "disable", "enable", "register"):
        from .adapters import hf_attribute

        return hf_attribute(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
