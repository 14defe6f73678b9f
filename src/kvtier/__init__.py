"""kvtier: tiered (hot / warm / cold) KV cache for Hugging Face transformers.

>>> import kvtier
>>> with kvtier.enable(model):
...     out = model.generate(**inputs, cache=kvtier.TieredCache(model.config, "default"))
"""

from .attention import disable, enable, register
from .cache import TieredCache, TieredLayer
from .diagnostics import MemoryReport, memory_report
from .errors import CacheFullError, KVTierError
from .offload import OffloadError
from .policy import PRESETS, OffloadPolicy, SparsePolicy, TierPolicy, get_policy

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "CacheFullError",
    "KVTierError",
    "MemoryReport",
    "OffloadError",
    "OffloadPolicy",
    "SparsePolicy",
    "TierPolicy",
    "TieredCache",
    "TieredLayer",
    "disable",
    "enable",
    "get_policy",
    "memory_report",
    "register",
]
