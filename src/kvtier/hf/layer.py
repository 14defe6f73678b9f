"""``TieredLayer``: kvtier's per-layer state as a transformers cache layer.

transformers treats a cache layer that does not subclass ``CacheLayerMixin`` as a linear-attention
layer, so the adapter's layer is the framework-free :class:`kvtier.cache.state.LayerState` (all the
logic: tiers, moves, journal, checks) plus ``CacheLayerMixin``. Nothing else is added here.
May import: transformers, ``kvtier.cache``.
"""

from __future__ import annotations

from transformers.cache_utils import CacheLayerMixin

from ..cache.state import LayerState


class TieredLayer(LayerState, CacheLayerMixin):
    """A transformers cache layer holding sinks, hot, warm and cold tiers (see
    :mod:`kvtier.cache.state`; the parameters are :class:`~kvtier.cache.state.LayerState`'s)."""
