"""The tiered KV cache's storage and per-layer state machine, framework-free.

Owns tier storage (:mod:`.tiers`: sink and hot buffers, packed block tiers), one layer's state
machine (:mod:`.state`: moves, the journal of all-or-nothing changes, input checks, eviction for
byte caps, driving an offloaded cold tier) and the adaptive policy's per-layer widths and budget
(:mod:`.adaptive`). Block codecs and what a policy stores are in :mod:`kvtier.codecs`.

May import (lower layers only): torch, ``kvtier.offload`` (the offloaded tier it drives, the
prefetch schedule), ``kvtier.kernels``, ``kvtier.codecs``, ``kvtier.quant``, ``kvtier.policy`` and the
leaf modules (``kvtier.tier``, ``kvtier.errors``, ``kvtier.stats``, ``kvtier.indexing``); never
``kvtier.attention``, ``kvtier.sizing`` / ``kvtier.diagnostics``, the adapters or transformers. The transformers
objects (``TieredLayer``, ``TieredCache``) live in :mod:`kvtier.hf` (``kvtier.TieredCache``).
"""

from .state import LayerState

__all__ = ["LayerState"]
