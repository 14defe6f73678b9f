"""Cold-tier offload storage: exact KV blocks in host RAM or on disk, with resident 1-bit key sketches.

``store`` (block pool, RAM or memory-mapped files with crc32), ``records`` (record byte layout),
``sketch`` (resident 1-bit key sketches and mass estimates), ``tier`` (the per-layer cold tier:
sketches + block table over a store, its storage moves and reads), ``selection`` (its selection
memory: reuse, prediction, budget estimates), ``staging`` (its prefetched blocks and the fetch in
flight), ``prefetch`` (the per-cache worker and layer schedule).
Enabled by a policy with ``cold="offload"`` (presets ``offload-cpu`` and ``offload-disk``); the
attention over the fetched blocks is :mod:`kvtier.attention.offloaded`.

Storage only, framework-free. May import (lower layers only): torch, ``kvtier.kernels``,
``kvtier.codecs``, ``kvtier.quant``, ``kvtier.policy`` and the leaf modules (``kvtier.errors``,
``kvtier.stats``, ``kvtier.indexing``, ``kvtier.tier``); never ``kvtier.cache``, ``kvtier.attention``, the
adapters or transformers.
"""

from .store import BlockStore, OffloadError, RecordError

__all__ = ["BlockStore", "OffloadError", "RecordError"]
