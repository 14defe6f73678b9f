"""Cold-tier offload: exact KV blocks in host RAM or on disk, fetched per query by 1-bit key sketches.

``store`` (block pool, RAM or memory-mapped files with crc32), ``records`` (record byte layout),
``sketch`` (resident 1-bit key sketches and mass estimates), ``tier`` (the per-layer cold tier:
sketches + block table over a store), ``prefetch`` (the per-cache worker and layer schedule),
``attention`` (selection and exact attention over the fetched blocks). Enabled by a policy with
``cold="offload"`` (presets ``offload-cpu`` and ``offload-disk``).

Storage only, framework-free: ``store``, ``records``, ``sketch``, ``tier`` and ``prefetch`` may
import torch, ``kvtier.quant``, ``kvtier.cache.codecs``, ``kvtier.policy``, ``kvtier.errors``,
``kvtier.stats``, ``kvtier.indexing`` and ``kvtier.kernels``; never ``kvtier.attention``,
``kvtier.hf`` or transformers. ``attention`` (the attention path over offloaded blocks) may also
import ``kvtier.attention`` (partials, mask) and ``kvtier.cache.state``.
"""

from .store import BlockStore, OffloadError, RecordError

__all__ = ["BlockStore", "OffloadError", "RecordError"]
