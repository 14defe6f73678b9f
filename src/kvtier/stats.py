"""Work and memory counters: leaf module (imports torch only; nothing from kvtier).

Owns :func:`tensor_bytes` (bytes of the distinct storages behind tensors), :class:`SparseStats`
(attention work of a layer) and :class:`OffloadStats` (block traffic of offloading layers). The
cache, attention, offload and diagnostics modules all import their counters from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


class _Counters:
    """Dataclass counters that add up field by field."""

    def add(self, other: _Counters) -> None:
        """Add ``other``'s counts (same class) to these."""
        for f in fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class SparseStats(_Counters):
    """Attention work of a layer. A (query row, key token) *pair* costs ``2 D`` FLOPs for its
    score and ``2 D`` for its value (one unit each); a block bound costs about one unit.
    ``pairs`` counts the pairs a dense pass evaluates (every real token, every row); ``scored`` and
    ``valued`` what was actually evaluated; ``bytes_*`` the tier bytes a dense pass reads and
    those read (sinks and hot tokens are counted as always attended). These count the calls that
    selected (``calls``); calls longer than ``SparsePolicy.max_query_tokens`` (prefill) attend
    densely and are counted apart: ``dense_calls`` and their ``dense_pairs``."""

    pairs: int = 0
    scored: int = 0
    valued: int = 0
    bounds: int = 0
    bytes_total: int = 0
    bytes_read: int = 0
    calls: int = 0
    dense_calls: int = 0
    dense_pairs: int = 0

    def dense(self, pairs: int, nbytes: int = 0) -> None:
        """Account work done without selection (sinks, hot)."""
        self.pairs += pairs
        self.scored += pairs
        self.valued += pairs
        self.bytes_total += nbytes
        self.bytes_read += nbytes

    @property
    def skipped(self) -> float:
        """Fraction of attention work (score + value FLOPs, bounds included) skipped."""
        return 1 - (self.scored + self.valued + self.bounds) / (2 * self.pairs) if self.pairs else 0.0

    def to_dict(self) -> dict:
        return {
            "pairs": self.pairs,
            "scored": self.scored,
            "valued": self.valued,
            "bounds": self.bounds,
            "skipped_fraction": self.skipped,
            "value_skipped_fraction": 1 - self.valued / self.pairs if self.pairs else 0.0,
            "bytes_total": self.bytes_total,
            "bytes_read": self.bytes_read,
            "bytes_skipped_fraction": 1 - self.bytes_read / self.bytes_total if self.bytes_total else 0.0,
            "calls": self.calls,
            "dense_calls": self.dense_calls,
            "dense_pairs": self.dense_pairs,
        }


@dataclass
class OffloadStats(_Counters):
    """Block traffic of offloading layers (see :mod:`kvtier.offload`).

    A *block* here is one record: one cold block of one (row, KV head). ``needed`` counts the
    distinct records an attention call (query chunk) read; each was either staged by the
    prefetcher (``hits``) or read synchronously (``misses``), so ``hits + misses == needed``.
    ``prefetched`` records were read ahead, ``unused`` of them were not needed. ``bytes_moved``
    counts every record read from the store (prefetched or missed). ``stall_s`` is the time the
    attention waited for data (a prefetch still in flight, or the synchronous reads);
    ``fetch_s`` the worker's time reading ahead. Records attended where they lie in a host-RAM
    store (no copy: :mod:`kvtier.kernels.offload_cpu`) count as ``in_place`` instead, so that
    ``hits + misses + in_place == needed``.

    Selection (the two-level CPU path): ``blocks_total`` cold records present at its calls,
    ``blocks_scored`` of them scored from their sketch (none at a call reusing a selection);
    ``reused`` calls that reused the layer's previous selection instead of selecting; at each
    fresh selection, ``reuse_needed`` records selected and ``reuse_hits`` of them also in the
    layer's previous selection (how much a reused selection would have held).
    ``skipped_*`` (only while :attr:`kvtier.offload.tier.OffloadTier.measure_skipped` is set): the
    exact softmax mass of the cold blocks a query row did not attend, summed over ``skipped_rows``
    rows, and its largest value.
    ``est_skipped_*`` (at each fresh selection where the read budget ``max_blocks`` could bind,
    i.e. a layer holds more cold blocks than it): the same share estimated from the sketches,
    free to compute, summed over ``est_skipped_rows`` rows, and its largest value. Where only the
    ``mass`` rule cuts, the estimate is below ``1 - mass`` by construction and is not computed.
    """

    calls: int = 0
    needed: int = 0
    hits: int = 0
    misses: int = 0
    in_place: int = 0
    prefetched: int = 0
    unused: int = 0
    bytes_moved: int = 0
    stall_s: float = 0.0
    fetch_s: float = 0.0
    blocks_total: int = 0
    blocks_scored: int = 0
    reused: int = 0
    reuse_needed: int = 0
    reuse_hits: int = 0
    skipped_mass: float = 0.0
    skipped_rows: int = 0
    skipped_max: float = 0.0
    est_skipped_mass: float = 0.0
    est_skipped_rows: int = 0
    est_skipped_max: float = 0.0

    def add(self, other: OffloadStats) -> None:
        """Add ``other``'s counts; ``skipped_max`` and ``est_skipped_max`` take the larger."""
        top = max(self.skipped_max, other.skipped_max)
        est_top = max(self.est_skipped_max, other.est_skipped_max)
        super().add(other)
        self.skipped_max = top
        self.est_skipped_max = est_top

    @property
    def hit_rate(self) -> float:
        """``hits / needed`` (1.0 when nothing was needed)."""
        return self.hits / self.needed if self.needed else 1.0

    @property
    def blocks_moved(self) -> int:
        """Records read from the store: prefetched plus missed."""
        return self.prefetched + self.misses

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["blocks_moved"] = self.blocks_moved
        return d
