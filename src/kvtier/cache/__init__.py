"""The tiered KV cache: tier storage, block codecs, the per-layer cache and the Cache."""

from .layer import TieredLayer
from .tiered import TieredCache

__all__ = ["TieredCache", "TieredLayer"]
