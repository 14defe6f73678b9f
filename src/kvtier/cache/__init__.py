"""The tiered KV cache's storage and per-layer state machine, framework-free.

Owns tier storage (:mod:`.tiers`: sink and hot buffers, packed block tiers), block codecs and what
a policy stores (:mod:`.codecs`), and one layer's state machine (:mod:`.state`: moves, the journal
of all-or-nothing changes, input checks, eviction for byte caps). May import: torch,
``kvtier.quant``, ``kvtier.policy``, ``kvtier.errors``, ``kvtier.stats`` and (lazily, for offloaded
cold tiers) ``kvtier.offload``; never transformers, ``kvtier.attention`` or ``kvtier.hf``.

``TieredLayer`` and ``TieredCache`` (the transformers objects) live in :mod:`kvtier.hf`; the names
here, and the modules ``cache.layer`` / ``cache.tiered``, stay as aliases (they need transformers).
"""

from typing import Any

from .state import LayerState

__all__ = ["LayerState", "TieredCache", "TieredLayer"]


def __getattr__(name: str) -> Any:
    if name in ("TieredCache", "TieredLayer"):
        from ..adapters import hf_attribute

        return hf_attribute(__name__, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
