"""Alias kept for existing imports: ``kvtier.cache.tiered.TieredCache`` is
:class:`kvtier.hf.cache.TieredCache` (the transformers adapter; importing this needs transformers).
Nothing in kvtier imports this module."""

from ..hf.cache import ON_FULL, TieredCache

__all__ = ["ON_FULL", "TieredCache"]
