"""What the tests build again and again, built in one place: a standalone layer fed with random keys
and values the way the cache feeds it, the attention mask over it, the small policies whose sizes sit
off every grid, and random token ids.

Import from a test module as ``from builders import ...`` (``tests/`` is on the path, as for
``conftest``). Importing this module needs no transformers: the layer (``kvtier.hf``) is imported
when one is built. Tiny models live in :mod:`kvtier.testing` (through ``conftest``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier import AdaptivePolicy, OffloadPolicy, TierPolicy, get_policy
from kvtier.attention.mask import KVMask

#: Policies whose tiers every short sequence crosses (block, group and window sizes off the grid);
#: the attention tests run each, the backend tests the first two.
POLICIES = {
    "int4+sign": TierPolicy(
        hot_tokens=9, warm_tokens=14, block_tokens=7, sink_tokens=3, value_group_size=4, layer_overrides={}
    ),
    "int2+int3": TierPolicy(
        hot_tokens=5,
        warm_tokens=10,
        block_tokens=5,
        warm_bits=2,
        cold="quant",
        cold_bits=3,
        sink_tokens=2,
        value_group_size=6,
        layer_overrides={},
    ),
    "int6+rot": TierPolicy(
        hot_tokens=8, warm_tokens=16, block_tokens=8, warm_bits=6, cold_rotation=True, sink_tokens=0, layer_overrides={}
    ),
    "int8+evict": TierPolicy(
        hot_tokens=4, warm_tokens=9, block_tokens=3, warm_bits=8, cold="evict", sink_tokens=4, layer_overrides={}
    ),
    "int3 all": TierPolicy(
        hot_tokens=6, warm_tokens=None, block_tokens=4, warm_bits=3, sink_tokens=1, layer_overrides={}
    ),
}


def build_layer_kv(
    policy: TierPolicy, B: int, H: int, D: int, chunks: Sequence[int], pads: Sequence[int], seed: int = 0, **layer_kw
):
    """A standalone ``TieredLayer(policy, **layer_kw)`` fed like the attention path feeds it: random
    keys (uneven channel scales, a common offset) and values ``[B, H, sum(chunks), D]`` in calls of
    ``chunks`` tokens, each but the last followed by ``settle``; row ``b``'s first ``pads[b]`` tokens
    are padding. Returns ``(layer, keys, values, valid)``, ``valid: [B, total]`` the real tokens."""
    from kvtier.hf.layer import TieredLayer

    g = torch.Generator().manual_seed(seed)
    layer = TieredLayer(policy, **layer_kw)
    total = sum(chunks)
    keys = torch.randn(B, H, total, D, generator=g) * torch.linspace(0.2, 3, D) + torch.randn(D, generator=g)
    values = torch.randn(B, H, total, D, generator=g)
    valid = torch.arange(total)[None, :] >= torch.tensor(pads[:B])[:, None]
    pos = 0
    for c in chunks:
        layer.update(keys[:, :, pos : pos + c], values[:, :, pos : pos + c], kwargs={})
        pos += c
        if pos < total:
            layer.settle(valid[:, :pos])
    return layer, keys, values, valid


def build_layer(
    policy: TierPolicy, B: int, H: int, D: int, chunks: Sequence[int], pads: Sequence[int], seed: int = 0, **layer_kw
):
    """:func:`build_layer_kv` without the keys and values: ``(layer, valid)``."""
    layer, _, _, valid = build_layer_kv(policy, B, H, D, chunks, pads, seed, **layer_kw)
    return layer, valid


def mask_for(valid: torch.Tensor, q: int) -> KVMask:
    """The causal mask of the last ``q`` tokens of ``valid: [B, N]`` as queries (no padding mask
    when every token is real)."""
    B, N = valid.shape
    return KVMask(B, q, N, N - q, 0, None if bool(valid.all()) else valid, True)


def off_policy(hot=9, block=7, sinks=3, warm=0, dtype="model", **offload) -> TierPolicy:
    """An offloading policy with small tiers (sizes off the grid) so short sequences cross every
    boundary; prefetch on unless given (auto would turn it off for the host-RAM backend on the CPU)."""
    offload.setdefault("prefetch", True)
    return TierPolicy(
        hot_tokens=hot,
        warm_tokens=warm,
        block_tokens=block,
        sink_tokens=sinks,
        value_group_size=4,
        cold="offload",
        exact_dtype=dtype,
        offload=OffloadPolicy(**offload),
        layer_overrides={},
    )


def offload_layer(policy, B=3, H=2, D=12, chunks=(37, 11, 3, 20, 2), pads=(0, 7, 30), seed=0, q=1):
    """:func:`build_layer_kv` with the offload tests' sizes, the last ``q`` tokens left in hot as the
    current query's keys: ``(layer, keys, values, valid)``."""
    return build_layer_kv(policy, B, H, D, [*chunks, q], pads, seed)


def adaptive_policy(bits: float, **adaptive) -> TierPolicy:
    """The ``adaptive`` preset sized for the tiny Llama (head dim 16) streaming a few hundred tokens:
    ``bits`` per element, warm-up 64 tokens, fitted at 256; ``adaptive`` sets other fields."""
    return get_policy("adaptive").replace(
        hot_tokens=16,
        sink_tokens=4,
        block_tokens=16,
        value_group_size=16,
        adaptive=AdaptivePolicy(bits=bits, warmup_tokens=64, fit_tokens=256, **adaptive),
    )


def token_ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """Random ids ``[batch, n]`` of the tiny models' plain-text tokens (3..96)."""
    return torch.randint(3, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


def stream_logits(model, cache, ids: torch.Tensor, chunk: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of ``ids [B, N]`` fed through ``cache`` in calls of ``chunk`` tokens (``mask [B, N]``:
    the attention mask, left padding included, or None), ``[B, N, vocab]``."""
    logits = []
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            m = None if mask is None else mask[:, : s + chunk]
            logits.append(model(ids[:, s : s + chunk], attention_mask=m, cache=cache).logits)
    return torch.cat(logits, 1)


def vq_reference64(rows: torch.Tensor, f: dict, codec, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 oracle of attention over a vq tier's stored codes: ``rows [B, H, R, D]`` over the
    keys and values decoded in float64 from ``f`` (the codec's fields and ``valid [B, 1, n, T]``);
    ``(out [B, H, R, D], lse [B, H, R])``, zeros and ``-inf`` for a row with nothing valid."""
    from kvtier.codecs import vq
    from kvtier.quant import rotation

    B, H, n, T = f["k_rms"].shape
    r = rotation(dim).double()
    book_k, book_v = vq.codebook(codec.key_bits).double(), vq.codebook(codec.value_bits).double()
    ik, iv = codec.indices(f, "k", dim), codec.indices(f, "v", dim)
    k64 = book_k[ik].reshape(B, H, n, T, dim) * f["k_rms"].double().unsqueeze(-1) + f["k_mean"].double()
    v64 = (book_v[iv].reshape(B, H, n, T, dim) * f["v_rms"].double().unsqueeze(-1)) @ r.T
    v64 = v64 + f["v_mean"].double().unsqueeze(-1)
    scores = (rows.double() @ r) @ k64.reshape(B, H, n * T, dim).transpose(-1, -2)
    scores = scores.masked_fill(~f["valid"].reshape(B, 1, 1, n * T), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v64.reshape(B, H, n * T, dim), lse
