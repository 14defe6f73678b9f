"""Memory diagnostics: the bytes a cache actually holds, per tier and per layer.

Bytes are read off the cache's tensors (their storages, each counted once), not computed from
a formula, so a transient or forgotten dense copy shows up. ``dense_fp16_bytes`` is what an
fp16 ``DynamicCache`` would hold for the same tokens (``2 * B * H * seq * D * 2`` per layer).
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .cache.state import LayerState
from .codecs import VqCodec
from .codecs.vq import codebook_bytes
from .stats import OffloadStats, SparseStats, tensor_bytes

__all__ = [
    "TIERS",
    "TOKEN_TIERS",
    "MemoryReport",
    "OffloadStats",
    "SparseStats",
    "leak_check",
    "memory_report",
    "reachable_tensor_bytes",
    "tensor_bytes",
    "untiered_tensors",
]

#: Byte groups of a report: resident tiers, ``staging`` (prefetched blocks held for a layer's
#: attention, normally empty between steps), ``measure`` (an adaptive budget's warm-up statistics,
#: freed when it allocates), ``store`` (offloaded blocks), ``other`` (untiered layers).
TIERS = ("sink", "hot", "warm", "cold", "staging", "measure", "store", "other")
TOKEN_TIERS = ("sink", "hot", "warm", "cold", "evicted")
_OPTIONAL = ("staging", "measure", "store", "other")


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
        block tables, checksums, staging buffers, an adaptive budget's warm-up statistics (read
        off the tensors).
    offloaded_bytes : bytes of offloaded blocks in a block store (host RAM slabs or disk files).
    dense_fp16_bytes : what an fp16 ``DynamicCache`` would hold for the same tokens.
    seq_len : tokens seen (the longest layer).
    tokens : token slots per tier, summed over layers.
    per_tier : bytes per tier, summed over layers.
    per_layer : one dict per layer: ``bytes`` and ``tokens`` by tier, ``dense_fp16_bytes``, and for a
        tiered layer ``widths``: the code widths ``[key bits, value bits]`` of its warm and cold
        tiers (None for a tier without codes; 16 for exact ones), from newest to oldest.
    shared_bytes : bytes this cache reads that the process holds once for every cache: the vq
        codebooks (:func:`kvtier.codecs.vq.codebook_bytes`) when a tier holds vector codes; not in
        ``total_bytes`` (they do not grow with tokens, layers or caches).
    """

    total_bytes: int
    resident_bytes: int
    offloaded_bytes: int
    dense_fp16_bytes: int
    seq_len: int
    tokens: dict[str, int] = field(default_factory=dict)
    per_tier: dict[str, int] = field(default_factory=dict)
    per_layer: list[dict[str, Any]] = field(default_factory=list)
    shared_bytes: int = 0

    @property
    def ratio(self) -> float:
        """``total_bytes / dense_fp16_bytes``."""
        return self.total_bytes / self.dense_fp16_bytes if self.dense_fp16_bytes else float("nan")

    @property
    def resident_ratio(self) -> float:
        """``resident_bytes / dense_fp16_bytes``."""
        return self.resident_bytes / self.dense_fp16_bytes if self.dense_fp16_bytes else float("nan")

    def allocation(self) -> str:
        """A table of the bits held per layer, keys vs values, by age (hot/sinks exact, warm, cold),
        with each tier's token slots, the tokens evicted, and bytes per element (metadata included)."""
        head = f"{'layer':>5}  {'warm K/V bits':>13} {'slots':>6}  {'cold K/V bits':>13} {'slots':>6}"
        lines = [head + f"  {'evicted':>7}  bits/elt"]
        for d in self.per_layer:
            w = d.get("widths")
            if not w:
                continue
            tok, nb = d["tokens"], d["bytes"]

            def kv(x):
                return "-" if x is None else f"{x[0]}/{x[1]}"

            elts = 2 * d["dense_fp16_bytes"] / 4  # K and V elements held for the layer's tokens
            bits = 8 * sum(nb.values()) / elts if elts else float("nan")
            lines.append(
                f"{d['layer']:>5}  {kv(w.get('warm')):>13} {tok.get('warm', 0):>6}  {kv(w.get('cold')):>13} "
                f"{tok.get('cold', 0):>6}  {tok.get('evicted', 0):>7}  {bits:8.3f}"
            )
        return "\n".join(lines)

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
        if self.shared_bytes:
            lines.append(f"  shared once per process (vq codebooks): {self.shared_bytes / 1024:.1f} KiB")
        return "\n".join(lines)


def untiered_tensors(layer: Any) -> list[torch.Tensor]:
    """Every tensor a layer that is not tiered (a transformers cache layer: the sliding-window
    layers of hybrid models) holds in its attributes, directly or in lists, tuples and dicts:
    ``keys`` and ``values`` and whatever else it keeps (``DynamicSlidingWindowLayer`` keeps its
    window in an 8-byte ``_sliding_window_tensor``). What :func:`memory_report` counts as a
    layer's ``other`` bytes, and what a byte cap must count for it."""
    found: list[torch.Tensor] = []
    stack = list(getattr(layer, "__dict__", {}).values())
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return found


def _layer_dense_fp16(layer: Any) -> int:
    if isinstance(layer, LayerState):
        if not layer.is_initialized:
            return 0
        return 2 * layer.batch * layer.kv_heads * layer.seen * layer.head_dim * 2
    keys = getattr(layer, "keys", None)
    return 0 if keys is None or not isinstance(keys, torch.Tensor) else 2 * keys.numel() * 2


def memory_report(cache: Any) -> MemoryReport:
    """Measure a :class:`~kvtier.TieredCache` (or any transformers cache)."""
    per_layer, all_tensors = [], []
    per_tier = dict.fromkeys(TIERS, 0)
    tokens = dict.fromkeys(TOKEN_TIERS, 0)
    seq = offloaded = 0
    vector_codes = False
    for idx, layer in enumerate(cache.layers):
        stored = 0
        if isinstance(layer, LayerState):
            groups = layer.tier_tensors()
            counts = layer.token_counts()
            seq = max(seq, layer.seen)
            stored = layer.offloaded_bytes()
        else:
            groups = {"other": untiered_tensors(layer)}
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
        entry = {"layer": idx, "bytes": nbytes, "tokens": counts, "dense_fp16_bytes": _layer_dense_fp16(layer)}
        if isinstance(layer, LayerState):
            vector_codes |= any(isinstance(getattr(t, "codec", None), VqCodec) for t in (layer.warm, layer.cold))
            entry["widths"] = {
                name: None if t is None or not hasattr(t, "codec") else [t.codec.key_bits, t.codec.value_bits]
                for name, t in (("warm", layer.warm), ("cold", layer.cold))
            }
        per_layer.append(entry)
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
        shared_bytes=codebook_bytes() if vector_codes else 0,
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
