"""Memory diagnostics: the bytes a cache actually holds, per tier and per layer.

Bytes are read off the cache's tensors (their storages, each counted once), not computed from
a formula, so a transient or forgotten dense copy shows up. ``dense_fp16_bytes`` is what an
fp16 ``DynamicCache`` would hold for the same tokens (``2 * B * H * seq * D * 2`` per layer).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

#: Byte groups of a report: resident tiers, ``staging`` (prefetched blocks held for a layer's
#: attention, normally empty between steps), ``store`` (offloaded blocks), ``other`` (untiered layers).
TIERS = ("sink", "hot", "warm", "cold", "staging", "store", "other")
TOKEN_TIERS = ("sink", "hot", "warm", "cold", "evicted")
_OPTIONAL = ("staging", "store", "other")


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def reachable_tensor_bytes(root: Any) -> int:
    """Bytes of all distinct tensor storages reachable from ``root`` through attributes,
    dicts, lists and tuples (a check on :func:`memory_report`, independent of it)."""
    found: list[torch.Tensor] = []
    stack, visited = [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
                # wrapper subclasses (e.g. optimum-quanto's packed tensors) hold their data inside
                names, _ = obj.__tensor_flatten__()
                stack.extend(getattr(obj, n) for n in names)
            else:
                found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif (
            hasattr(obj, "__dict__")
            and not isinstance(obj, type)
            and type(obj).__module__.startswith(("kvtier", "transformers.cache_utils"))
        ):
            stack.extend(vars(obj).values())
    return tensor_bytes(found)


@dataclass
class MemoryReport:
    """What a cache holds.

    Attributes
    ----------
    total_bytes : every byte the cache holds: ``resident_bytes + offloaded_bytes``.
    resident_bytes : bytes next to the compute: sinks, hot, warm, cold sketches and codes,
        block tables, checksums, staging buffers (read off the tensors).
    offloaded_bytes : bytes of offloaded blocks in a block store (host RAM slabs or disk files).
    dense_fp16_bytes : what an fp16 ``DynamicCache`` would hold for the same tokens.
    seq_len : tokens seen (the longest layer).
    tokens : token slots per tier, summed over layers.
    per_tier : bytes per tier, summed over layers.
    per_layer : one dict per layer: ``bytes`` and ``tokens`` by tier, ``dense_fp16_bytes``.
    """

    total_bytes: int
    resident_bytes: int
    offloaded_bytes: int
    dense_fp16_bytes: int
    seq_len: int
    tokens: dict[str, int] = field(default_factory=dict)
    per_tier: dict[str, int] = field(default_factory=dict)
    per_layer: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """``total_bytes / dense_fp16_bytes``."""
        return self.total_bytes / self.dense_fp16_bytes if self.dense_fp16_bytes else float("nan")

    @property
    def resident_ratio(self) -> float:
        """``resident_bytes / dense_fp16_bytes``."""
        return self.resident_bytes / self.dense_fp16_bytes if self.dense_fp16_bytes else float("nan")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["resident_ratio"] = self.resident_ratio
        return d

    def __str__(self) -> str:
        mib = 2**20
        lines = [
            f"KV cache: {self.total_bytes / mib:.2f} MiB for {self.seq_len} tokens "
            f"({self.ratio:.3f} of fp16 {self.dense_fp16_bytes / mib:.2f} MiB)",
        ]
        if self.offloaded_bytes:
            lines.append(
                f"  resident {self.resident_bytes / mib:.2f} MiB ({self.resident_ratio:.3f} of fp16), "
                f"offloaded {self.offloaded_bytes / mib:.2f} MiB"
            )
        for tier in TIERS:
            if self.per_tier.get(tier):
                slots = f"  {self.tokens[tier]:>9} token-slots" if tier in self.tokens else ""
                lines.append(f"  {tier:<7} {self.per_tier[tier] / mib:9.2f} MiB{slots}")
        return "\n".join(lines)


@dataclass
class SparseStats:
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

    def add(self, other: SparseStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

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
class OffloadStats:
    """Block traffic of offloading layers (see :mod:`kvtier.offload`).

    A *block* here is one record: one cold block of one (row, KV head). ``needed`` counts the
    distinct records an attention call (query chunk) read; each was either staged by the
    prefetcher (``hits``) or read synchronously (``misses``), so ``hits + misses == needed``.
    ``prefetched`` records were read ahead, ``unused`` of them were not needed. ``bytes_moved``
    counts every record read from the store (prefetched or missed). ``stall_s`` is the time the
    attention waited for data (a prefetch still in flight, or the synchronous reads);
    ``fetch_s`` the worker's time reading ahead.
    """

    calls: int = 0
    needed: int = 0
    hits: int = 0
    misses: int = 0
    prefetched: int = 0
    unused: int = 0
    bytes_moved: int = 0
    stall_s: float = 0.0
    fetch_s: float = 0.0

    def add(self, other: OffloadStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

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


def _layer_dense_fp16(layer: Any) -> int:
    from .cache.layer import TieredLayer

    if isinstance(layer, TieredLayer):
        if not layer.is_initialized:
            return 0
        return 2 * layer.batch * layer.kv_heads * layer.seen * layer.head_dim * 2
    keys = getattr(layer, "keys", None)
    return 0 if keys is None or not isinstance(keys, torch.Tensor) else 2 * keys.numel() * 2


def memory_report(cache: Any) -> MemoryReport:
    """Measure a :class:`~kvtier.TieredCache` (or any transformers cache)."""
    from .cache.layer import TieredLayer

    per_layer, all_tensors = [], []
    per_tier = dict.fromkeys(TIERS, 0)
    tokens = dict.fromkeys(TOKEN_TIERS, 0)
    seq = offloaded = 0
    for idx, layer in enumerate(cache.layers):
        stored = 0
        if isinstance(layer, TieredLayer):
            groups = layer.tier_tensors()
            counts = layer.token_counts()
            seq = max(seq, layer.seen)
            stored = layer.offloaded_bytes()
        else:
            groups = {
                "other": [
                    t
                    for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                    if isinstance(t, torch.Tensor)
                ]
            }
            counts = {}
        nbytes = {tier: tensor_bytes(ts) for tier, ts in groups.items()}
        if stored:
            nbytes["store"] = stored
            offloaded += stored
        for tier, b in nbytes.items():
            per_tier[tier] += b
        for tier, c in counts.items():
            tokens[tier] += c
        all_tensors.extend(t for ts in groups.values() for t in ts)
        per_layer.append(
            {"layer": idx, "bytes": nbytes, "tokens": counts, "dense_fp16_bytes": _layer_dense_fp16(layer)}
        )
    resident = tensor_bytes(all_tensors)
    return MemoryReport(
        total_bytes=resident + offloaded,
        resident_bytes=resident,
        offloaded_bytes=offloaded,
        dense_fp16_bytes=sum(d["dense_fp16_bytes"] for d in per_layer),
        seq_len=seq,
        tokens=tokens,
        per_tier={k: v for k, v in per_tier.items() if v or k not in _OPTIONAL},
        per_layer=per_layer,
    )


def leak_check(fn: Any, repeats: int = 3) -> list[int]:
    """Run ``fn()`` ``repeats`` times and return the bytes of live CPU/CUDA tensors after each
    run; a growing list means something keeps tensors alive between runs."""
    out = []
    for _ in range(repeats):
        fn()
        gc.collect()
        live = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        out.append(tensor_bytes(live))
    return out
