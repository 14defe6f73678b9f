"""TieredLayer bookkeeping under random appends: conservation, exact hot/sinks, bounded warm error."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import TierPolicy
from kvtier.hf.layer import TieredLayer


def run_layer(policy: TierPolicy, chunks: list[int], B: int, H: int, D: int, pads: list[int], seed: int):
    """Feed random chunks through a layer as the attention path would (update, then settle)."""
    g = torch.Generator().manual_seed(seed)
    layer = TieredLayer(policy)
    total = sum(chunks)
    keys = torch.randn(B, H, total, D, generator=g) * torch.linspace(0.1, 5, D)
    values = torch.randn(B, H, total, D, generator=g)
    valid = torch.arange(total)[None, :] >= torch.tensor(pads)[:, None]
    # pads carry huge values: they must not leak into any statistics
    keys[~valid[:, None, :, None].expand_as(keys)] = 1e4
    values[~valid[:, None, :, None].expand_as(values)] = -1e4
    pos = 0
    for c in chunks:
        layer.update(keys[:, :, pos : pos + c], values[:, :, pos : pos + c], kwargs={})
        pos += c
        layer.settle(valid[:, :pos])
        check_invariants(layer, policy, keys[:, :, :pos], values[:, :, :pos], valid[:, :pos])
    return layer


def check_invariants(layer, policy, keys, values, valid):
    seen = keys.shape[2]
    counts = layer.token_counts()
    assert layer.seen == seen
    assert counts["hot"] + counts["warm"] + counts["cold"] + counts["evicted"] == seen
    assert layer.hot_start == seen - counts["hot"]
    if policy.hot_tokens is not None:
        assert counts["hot"] < policy.hot_tokens + policy.block_tokens
        assert counts["hot"] >= min(seen, policy.hot_tokens)
    # hot is exact
    hk, hv = layer.hot.view()
    assert torch.equal(hk, keys[:, :, layer.hot_start :]) and torch.equal(hv, values[:, :, layer.hot_start :])
    # sinks: the first real tokens of each row, exact, that already left hot
    if layer.sinks.k is not None:
        for b in range(keys.shape[0]):
            real = valid[b, : layer.hot_start].nonzero().flatten()[: layer.sinks.size]
            n = int(layer.sinks.filled[b])
            assert n == real.numel()
            assert torch.equal(layer.sinks.k[b, :, :n], keys[b, :, real])
            assert torch.equal(layer.sinks.v[b, :, :n], values[b, :, real])
    # warm: within the k-bit bound for real tokens (warm input is always exact)
    warm = layer.warm
    if warm is not None and warm.nblocks:
        start = counts["evicted"] + counts["cold"]
        wk, wv, wvalid = warm.dense(torch.float32)
        ref_k, ref_v = keys[:, :, start : start + warm.ntokens], values[:, :, start : start + warm.ntokens]
        T, D = policy.block_tokens, keys.shape[-1]
        ks = warm.fields["k_scale"].float().expand(-1, -1, -1, T, -1).reshape(*wk.shape[:2], -1, D)
        G = warm.codec.value_group
        vs = warm.fields["v_scale"].float().repeat_interleave(G, dim=-1).reshape(*wv.shape[:2], -1, D)
        m = wvalid[:, None, :, None].expand_as(wk)
        assert ((wk - ref_k).abs() <= 0.75 * ks + 1e-4)[m].all()
        assert ((wv - ref_v).abs() <= 0.75 * vs + 1e-4)[m].all()
        # real tokens in warm: valid and not sinks
        assert torch.equal(
            wvalid.sum(), (valid[:, start : start + warm.ntokens]).sum() - _sinks_in(layer, start, warm.ntokens, valid)
        )
    for tier in (layer.warm, layer.cold):
        if tier is not None and tier.nblocks:
            k, v, _ = tier.dense(torch.float32)
            assert torch.isfinite(k).all() and torch.isfinite(v).all()
            assert k.abs().max() < 1e3 and v.abs().max() < 1e3  # no pad value leaked


def _sinks_in(layer, start, n, valid) -> torch.Tensor:
    if layer.sinks.k is None:
        return torch.tensor(0)
    total = 0
    for b in range(valid.shape[0]):
        real = valid[b].nonzero().flatten()[: layer.sinks.size]
        total += int(((real >= start) & (real < start + n)).sum())
    return torch.tensor(total)


policies = st.builds(
    lambda hot, warm_blocks, block, sinks, bits, cold, cold_bits, rot, group: TierPolicy(
        hot_tokens=hot,
        warm_tokens=None if warm_blocks is None else warm_blocks * block,
        block_tokens=block,
        sink_tokens=sinks,
        warm_bits=bits,
        cold=cold,
        cold_bits=cold_bits,
        cold_rotation=rot,
        value_group_size=group,
        layer_overrides={},
    ),
    hot=st.integers(0, 12),
    warm_blocks=st.one_of(st.none(), st.integers(0, 4)),
    block=st.integers(1, 7),
    sinks=st.integers(0, 5),
    bits=st.sampled_from([2, 3, 4, 6, 8]),
    cold=st.sampled_from(["sign", "quant", "evict"]),
    cold_bits=st.sampled_from([2, 3, 4]),
    rot=st.booleans(),
    group=st.sampled_from([4, 12]),
)


@settings(max_examples=60, deadline=None)
@given(
    policy=policies,
    chunks=st.lists(st.integers(1, 23), min_size=1, max_size=8),
    B=st.integers(1, 3),
    H=st.integers(1, 2),
    pad_seed=st.integers(0, 1000),
    seed=st.integers(0, 1000),
)
def test_random_appends_keep_invariants(policy, chunks, B, H, pad_seed, seed):
    total = sum(chunks)
    g = torch.Generator().manual_seed(pad_seed)
    pads = torch.randint(0, max(1, total // 2), (B,), generator=g).tolist()
    pads[0] = 0
    run_layer(policy, chunks, B, H, 12, pads, seed)


def test_reorder_follows_every_tier():
    policy = TierPolicy(hot_tokens=4, warm_tokens=8, block_tokens=4, sink_tokens=2, layer_overrides={})
    layer = run_layer(policy, [30], 3, 2, 8, [0, 3, 5], 0)
    before = {name: [t.clone() for t in ts] for name, ts in layer.tier_tensors().items()}
    idx = torch.tensor([2, 0, 0])
    layer.reorder_cache(idx)
    for name, ts in layer.tier_tensors().items():
        for old, new in zip(before[name], ts):
            assert torch.equal(new, old.index_select(0, idx))
