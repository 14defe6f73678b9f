"""kvtier's exceptions and warnings (a leaf module: imports nothing of kvtier).

Every error kvtier raises on purpose is a :class:`KVTierError` (or a ``ValueError``/``TypeError``
for a bad argument), with a one-line message that says what to do.
"""

from __future__ import annotations


class KVTierError(RuntimeError):
    """A kvtier cache was misused, or is unusable after a fault it could not undo."""


class CacheFullError(KVTierError):
    """A call would make a capped cache (``TieredCache(..., max_bytes=N, on_full="error")``) hold
    more than ``N`` bytes; the cache is left as it was before the call."""


class StorageRangeError(KVTierError):
    """A call's keys or values are too large for the format a tier would store them in (fp16 sinks
    and hot tokens of an fp32 model beyond 65,504, or quantization parameters beyond their fp16 /
    fp8 range); storing them would decode ``inf``/``NaN`` or clamped values. Raised at the call
    that would store them, which is undone: the cache is left as it was before the call."""


class BudgetWarning(UserWarning):
    """An approximation budget the user chose (e.g. ``OffloadPolicy.max_blocks``) is cutting more
    than a small share of what exact attention would read: output is no longer near-exact."""
