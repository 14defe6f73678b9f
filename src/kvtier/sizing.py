"""Memory sizing (the ``kvtier plan`` command): bytes per tier for a model, a sequence length and a
policy, before running. (The *attention* plan, one per forward step, is :mod:`kvtier.attention.plan`.)

:func:`estimate` replays the cache's placement rules (hot window, block migration, warm capacity,
sinks) as arithmetic and prices each tier with the same codec byte formulas the cache stores, so
an estimate and ``TieredCache.memory_report()`` after a real run agree (tests check within 2%).

Inputs are bounded (``MAX_SEQ_LEN``, ``MAX_BATCH``, ``MAX_TOTAL_TOKENS``, ``MAX_SHAPE``): the
offloaded store's slab plan is replayed slab by slab, so its cost grows with ``batch * seq_len``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .cache.tiers import hot_capacity
from .codecs import make_codecs, storage_dtype
from .inputs import read_input
from .policy import PRESETS, TierPolicy, get_policy

#: Built-in model shapes: layers, KV heads, head_dim (all full-attention layers).
BUILTIN: dict[str, dict[str, Any]] = {
    "llama-2-7b": {"num_hidden_layers": 32, "num_key_value_heads": 32, "head_dim": 128},
    "llama-2-13b": {"num_hidden_layers": 40, "num_key_value_heads": 40, "head_dim": 128},
    "llama-3.1-8b": {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128},
    "mistral-7b": {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128},
    "qwen2.5-7b": {"num_hidden_layers": 28, "num_key_value_heads": 4, "head_dim": 128},
    "qwen2.5-coder-1.5b": {"num_hidden_layers": 28, "num_key_value_heads": 2, "head_dim": 128},
    "smollm2-135m": {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64},
}

MAX_SEQ_LEN = 1 << 24  # 16,777,216 tokens per row: beyond any model's context
MAX_BATCH = 1 << 16
MAX_TOTAL_TOKENS = 1 << 26  # batch * seq_len: the store's slab plan takes ~4 s for llama-2-13b here
MAX_SHAPE = 1 << 12  # layers, KV heads, head_dim

# "store": offloaded blocks (RAM or disk); "measure": an adaptive budget's warm-up statistics
TIERS = ("sink", "hot", "warm", "cold", "store", "other", "measure")
_TABLE = ("sink", "hot", "warm", "cold", "store")  # the columns of format_estimates
TOKEN_TIERS = ("sink", "hot", "warm", "cold", "evicted")


def _bounded(name: str, value: object, low: int, high: int) -> str | None:
    """``None`` when ``value`` is an int in ``[low, high]``, else what is wrong with it (one line)."""
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return None
    return f"{name}={value!r} is not allowed: expected an int in [{low}, {high}]"


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: layer kinds (``"full_attention"`` or a sliding kind),
    KV heads, head_dim, and the sliding window of sliding layers."""

    name: str
    layer_types: tuple[str, ...]
    kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        types = self.layer_types
        if isinstance(types, str) or not all(isinstance(t, str) for t in types):
            raise ValueError(f"layer_types={types!r} is not allowed: expected a sequence of layer kinds (str)")
        object.__setattr__(self, "layer_types", tuple(types))
        problems = [
            _bounded("layers", len(self.layer_types), 1, MAX_SHAPE),
            _bounded("kv_heads", self.kv_heads, 1, MAX_SHAPE),
            _bounded("head_dim", self.head_dim, 1, MAX_SHAPE),
            None if self.sliding_window is None else _bounded("sliding_window", self.sliding_window, 1, MAX_SEQ_LEN),
        ]
        for problem in problems:
            if problem:
                raise ValueError(problem)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


def model_shape(model: str) -> ModelShape:
    """A built-in name, a ``config.json`` path, or a folder holding one.

    Raises
    ------
    ValueError : unknown name, missing or unreadable file, or a config that lacks a field or has a
        bad value (the message names the file and the field).
    """
    if model in BUILTIN:
        c = BUILTIN[model]
        return ModelShape(model, ("full_attention",) * c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"])
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"--model {model!r}: the folder holds no config.json")
        path = path / "config.json"
    if not path.exists():
        raise ValueError(f"--model {model!r}: expected one of {sorted(BUILTIN)} or a path to a config.json")
    data = read_input(path, "--model")  # a FIFO, a device or a huge file: refused in one line
    try:
        cfg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON config ({err})") from None
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object (a model config), got {type(cfg).__name__}")

    def need(key: str, high: int = MAX_SHAPE) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{path} lacks {key!r}")
        problem = _bounded(key, cfg[key], 1, high)
        if problem:
            raise ValueError(f"{path}: {problem}")
        return cfg[key]

    layers = need("num_hidden_layers")
    heads = need("num_attention_heads")
    kv = need("num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads
    if heads % kv:  # grouped-query attention shares each KV head among a whole number of query heads
        raise ValueError(
            f"{path}: num_attention_heads={heads} is not allowed: expected a multiple of num_key_value_heads={kv}"
        )
    if cfg.get("head_dim") is not None:
        head_dim = need("head_dim")
    else:
        hidden = need("hidden_size", 1 << 20)
        if hidden % heads:
            raise ValueError(
                f"{path}: hidden_size={hidden} is not allowed without head_dim: expected a multiple of "
                f"num_attention_heads={heads} (head_dim would be {hidden / heads:g})"
            )
        head_dim = hidden // heads
    types = cfg.get("layer_types") or ["full_attention"] * layers
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"{path}: layer_types={types!r} is not allowed: expected a list of {layers} layer kinds")
    window = cfg.get("sliding_window") if any(t != "full_attention" for t in types) else None
    try:
        return ModelShape(path.parent.name or str(path), tuple(types), kv, head_dim, window)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


@dataclass
class Estimate:
    """Planned bytes per tier (summed over layers) for one policy."""

    policy: str
    seq_len: int
    batch: int
    fp16_bytes: int
    per_tier: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.per_tier.values())

    @property
    def ratio(self) -> float:
        return self.total_bytes / self.fp16_bytes

    @property
    def offloaded_bytes(self) -> int:
        """Bytes in a block store (host RAM or disk)."""
        return self.per_tier.get("store", 0)

    @property
    def resident_bytes(self) -> int:
        """Bytes next to the compute: everything but the store."""
        return self.total_bytes - self.offloaded_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "seq_len": self.seq_len,
            "batch": self.batch,
            "fp16_bytes": self.fp16_bytes,
            "total_bytes": self.total_bytes,
            "resident_bytes": self.resident_bytes,
            "offloaded_bytes": self.offloaded_bytes,
            "ratio": self.ratio,
            "resident_ratio": self.resident_bytes / self.fp16_bytes,
            "per_tier": self.per_tier,
            "tokens": self.tokens,
        }


def layer_estimate(
    policy: TierPolicy, n: int, B: int, H: int, D: int, dtype: torch.dtype, budget: Any = None
) -> tuple[dict, dict]:
    """Bytes and token slots per tier of one tiered layer after ``n`` tokens (no padding); an
    adaptive layer needs its cache's :class:`~kvtier.cache.adaptive.Budget` (``budget``): its warm
    window follows the budget, its cold codes are priced at the budget's code rate and its warm-up
    statistics are held until the warm-up ends."""
    elt = torch.empty((), dtype=storage_dtype(policy, dtype)).element_size()
    if policy.hot_tokens is None:
        return {"hot": 2 * B * H * n * D * elt}, {"hot": n}
    T = policy.block_tokens
    hot_start = T * max(0, (n - policy.hot_tokens) // T) if n > policy.hot_tokens else 0
    hot = n - hot_start
    bound = policy.hot_tokens + T  # a hot buffer's steady size (kvtier.cache.tiers.HotBuffer)
    capacity = 0 if not n else bound if n >= bound else hot_capacity(n, bound)
    blocks = hot_start // T
    warm_cap = blocks if policy.warm_tokens is None else min(blocks, policy.warm_tokens // T)
    if budget is not None:  # sized when the last block left the hot window (one token at a time: here)
        room = budget.warm_blocks(hot_start + policy.hot_tokens, blocks, planned=True)
        warm_cap = blocks if math.isinf(room) else int(min(warm_cap, room))  # the warm-up: every block warm
        group = budget.adaptive.keep_blocks[1]  # the eviction rung steps down whole groups
        if group > 1:  # (kvtier.cache.state.LayerState._push_warm: up to g - 1 wait in warm)
            warm_cap = max(0, warm_cap - (group - 1))
            warm_cap += (blocks - warm_cap) % group
    cold_blocks = blocks - warm_cap
    warm_codec, cold_codec = make_codecs(policy, D)
    nbytes = {"sink": 0, "hot": 2 * B * H * capacity * D * elt, "warm": 0, "cold": 0}
    if budget is not None and n:  # the warm-up's statistics, until the allocation frees them
        nbytes["measure"] = budget.planned_measure_bytes(n, blocks)
    tokens = {"sink": 0, "hot": hot, "warm": warm_cap * T, "cold": 0, "evicted": 0}
    if blocks and policy.sink_tokens:
        nbytes["sink"] = 2 * B * H * policy.sink_tokens * D * elt + 8 * B
        tokens["sink"] = policy.sink_tokens
    if warm_cap:
        nbytes["warm"] = warm_codec.nbytes(B, H, warm_cap, T, D) + B * warm_cap * T
    if cold_blocks and policy.cold == "offload":
        from .offload.tier import planned_bytes

        nbytes["cold"], nbytes["store"] = planned_bytes(policy, B, H, cold_blocks, D, storage_dtype(policy, dtype))
        tokens["cold"] = cold_blocks * T
    elif cold_blocks and budget is not None:  # planned_rates: per token stepping down (``keep`` included)
        nbytes["cold"] = int(round(budget.planned_rates()[0] / budget.layers * cold_blocks * T))
        j, g = budget.adaptive.keep_blocks
        kept = (cold_blocks // g * j + cold_blocks % g) * T
        tokens["cold"], tokens["evicted"] = kept, cold_blocks * T - kept
    elif cold_blocks:
        if cold_codec is None:
            tokens["evicted"] = cold_blocks * T
        else:
            nbytes["cold"] = cold_codec.nbytes(B, H, cold_blocks, T, D) + B * cold_blocks * T
            tokens["cold"] = cold_blocks * T
    return nbytes, tokens


def estimate(
    model: str | ModelShape,
    seq_len: int,
    policy: str | TierPolicy = "default",
    batch: int = 1,
    dtype: torch.dtype = torch.float16,
) -> Estimate:
    """Estimate the bytes of a :class:`~kvtier.TieredCache` holding ``seq_len`` tokens per row.

    Raises
    ------
    ValueError : ``seq_len`` outside ``[1, MAX_SEQ_LEN]``, ``batch`` outside ``[1, MAX_BATCH]``, their
        product above ``MAX_TOTAL_TOKENS``, a dtype that is not a floating torch dtype, or a bad
        model or policy.
    """
    for problem in (_bounded("seq_len", seq_len, 1, MAX_SEQ_LEN), _bounded("batch", batch, 1, MAX_BATCH)):
        if problem:
            raise ValueError(problem)
    if seq_len * batch > MAX_TOTAL_TOKENS:
        raise ValueError(
            f"batch * seq_len = {batch} * {seq_len} is not allowed: expected at most {MAX_TOTAL_TOKENS} tokens in all"
        )
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype!r} is not allowed: expected a floating torch dtype, e.g. torch.float16")
    shape = model if isinstance(model, ModelShape) else model_shape(model)
    pol = get_policy(policy)
    B, H, D, n = batch, shape.kv_heads, shape.head_dim, seq_len
    per_tier = dict.fromkeys(TIERS, 0)
    tokens = dict.fromkeys(TOKEN_TIERS, 0)
    fp16 = 0
    layer_policies = {
        i: pol.for_layer(i, shape.num_layers) for i, kind in enumerate(shape.layer_types) if kind == "full_attention"
    }
    budgets: dict[TierPolicy, Any] = {}
    for p in layer_policies.values():
        if p.adaptive is not None and p not in budgets:
            from .cache.adaptive import Budget

            budgets[p] = Budget(p, sum(q == p for q in layer_policies.values()))
            budgets[p].join(0, B, H, D, dtype)
    for i, kind in enumerate(shape.layer_types):
        if kind == "full_attention":
            lp = layer_policies[i]
            nbytes, toks = layer_estimate(lp, n, B, H, D, dtype, budgets.get(lp))
            for k, v in nbytes.items():
                per_tier[k] += v
            for k, v in toks.items():
                tokens[k] += v
            fp16 += 2 * B * H * n * D * 2
        else:  # sliding layers stay dense in transformers' own layer, bounded by the window
            held = min(n, shape.sliding_window or n)
            per_tier["other"] += 2 * B * H * held * D * torch.empty((), dtype=dtype).element_size()
            fp16 += 2 * B * H * held * D * 2
    for optional in ("store", "other", "measure"):
        if not per_tier[optional]:
            del per_tier[optional]
    return Estimate(pol.name, seq_len, batch, fp16, per_tier, tokens)


def capped_tokens(
    model: str | ModelShape,
    max_bytes: int,
    policy: str | TierPolicy = "default",
    batch: int = 1,
    dtype: torch.dtype = torch.float16,
) -> int:
    """The most tokens per row a cache capped at ``max_bytes`` holds (``TieredCache(...,
    max_bytes=N)``): with ``on_full="error"`` a call past it raises ``CacheFullError``; with
    ``"evict"`` the cache keeps about this many (sinks and the newest tokens). 0 if not even one
    token fits. Bytes grow with the length, so this is a bisection over :func:`plan`."""
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes!r} is not allowed: expected an int > 0 (bytes)")
    shape = model if isinstance(model, ModelShape) else model_shape(model)
    lo, hi = 0, min(MAX_SEQ_LEN, MAX_TOTAL_TOKENS // batch)  # estimate(lo) fits (or lo = 0)
    if estimate(shape, hi, policy, batch, dtype).total_bytes <= max_bytes:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate(shape, mid, policy, batch, dtype).total_bytes <= max_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def policy_width(plans: list[Estimate]) -> int:
    """Width of the policy column of a table of ``plans`` (a variant's name can be long)."""
    return max(16, *(len(p.policy) + 2 for p in plans))


def format_estimates(shape: ModelShape, plans: list[Estimate]) -> str:
    """A readable table of plans (GB = 1e9 bytes)."""
    gb = 1e9
    w = policy_width(plans)
    head = f"{'policy':<{w}}" + "".join(f"{t:>10}" for t in _TABLE) + f"{'total GB':>11}{'vs fp16':>9}{'resident':>10}"
    lines = [
        f"{shape.name}: {shape.num_layers} layers x {shape.kv_heads} KV heads x head_dim {shape.head_dim}, "
        f"{plans[0].seq_len} tokens x batch {plans[0].batch}",
        f"fp16 KV cache: {plans[0].fp16_bytes / gb:.2f} GB ({plans[0].fp16_bytes / 2**30:.2f} GiB)",
        "",
        head,
    ]
    for p in plans:
        row = "".join(f"{p.per_tier.get(t, 0) / gb:>10.3f}" for t in _TABLE)
        resident = p.resident_bytes / p.fp16_bytes
        lines.append(f"{p.policy:<{w}}{row}{p.total_bytes / gb:>11.3f}{p.ratio:>9.3f}{resident:>10.3f}")
    return "\n".join(lines)


def all_presets() -> list[str]:
    return list(PRESETS)
