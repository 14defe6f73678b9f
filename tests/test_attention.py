"""The fast per-tier attention against the reference oracle (decode every tier, one SDPA call),
over awkward sizes: lengths off the block and group grid, batch > 1 with left padding, GQA ratios,
head dims that are not multiples of 8, every bit width and cold mode, decode and chunked prefill.

Tolerance follows the flash-attention rule: the fast path's error against an fp64 reference is at
most twice the error of the fp32 reference itself (plus a tiny absolute floor)."""

from __future__ import annotations

import pytest
import torch

from kvtier import TierPolicy
from kvtier.attention.mask import KVMask
from kvtier.attention.partials import Partial, merge
from kvtier.attention.reference import reference_attention
from kvtier.attention.tiered import tiered_attention
from kvtier.cache.layer import TieredLayer


def build_layer(policy, B, H, D, chunks, pads, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = TieredLayer(policy)
    total = sum(chunks)
    keys = torch.randn(B, H, total, D, generator=g) * torch.linspace(0.2, 3, D) + torch.randn(D, generator=g)
    values = torch.randn(B, H, total, D, generator=g)
    valid = torch.arange(total)[None, :] >= torch.tensor(pads)[:, None]
    pos = 0
    for c in chunks:
        layer.update(keys[:, :, pos : pos + c], values[:, :, pos : pos + c], kwargs={})
        pos += c
        if pos < total:
            layer.settle(valid[:, :pos])
    return layer, valid


def mask_for(valid, q):
    B, N = valid.shape
    padding = None if bool(valid.all()) else valid
    return KVMask(B, q, N, N - q, 0, padding, True)


def check_close(layer, query, mask, scaling=0.3):
    fast = tiered_attention(layer, query, mask, scaling)
    ref32 = reference_attention(layer, query, mask, scaling)
    ref64 = reference_attention(layer, query.double(), mask, scaling)
    # rows that attend nothing (pad queries) must be exactly zero in both
    err_fast = (fast.double() - ref64).abs().max().item()
    err_ref = (ref32.double() - ref64).abs().max().item()
    assert torch.isfinite(fast).all()
    assert err_fast <= 2 * err_ref + 1e-5, (err_fast, err_ref)
    return fast


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


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("D", [12, 16])
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("B,pads", [(1, [0]), (3, [0, 7, 30])])
def test_fast_matches_reference(name, D, gqa, q, B, pads):
    policy = POLICIES[name]
    if policy.value_group_size > D or D % min(policy.value_group_size, D):
        policy = policy.replace(value_group_size=D)
    H = 2
    layer, valid = build_layer(policy, B, H, D, [37, 11, 3, 20, 2, q], pads, seed=D * gqa + q)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(B, H * gqa, q, D, generator=g)
    check_close(layer, query, mask_for(valid, q))


def test_long_query_is_split_and_still_matches(monkeypatch):
    import kvtier.attention.tiered as tiered

    monkeypatch.setattr(tiered, "SCORE_BUDGET", 200)  # force several query chunks
    layer, valid = build_layer(POLICIES["int4+sign"], 2, 2, 16, [50, 40], [0, 13])
    query = torch.randn(2, 4, 40, 16)
    check_close(layer, query, mask_for(valid, 40))


def test_merge_of_empty_parts_is_zero_not_nan():
    out = torch.randn(1, 1, 2, 4)
    empty = Partial(torch.zeros(1, 1, 2, 4), torch.full((1, 1, 2), float("-inf")))
    assert torch.equal(merge([empty, empty]), torch.zeros(1, 1, 2, 4))
    full = Partial(out, torch.zeros(1, 1, 2))
    assert torch.allclose(merge([empty, full]), out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_queries(dtype):
    layer, valid = build_layer(POLICIES["int4+sign"], 2, 2, 16, [60, 1], [0, 9])
    query = torch.randn(2, 4, 1, 16).to(dtype)
    fast = tiered_attention(layer, query, mask_for(valid, 1), 0.25)
    ref = reference_attention(layer, query.float(), mask_for(valid, 1), 0.25)
    assert fast.dtype == dtype
    assert (fast.float() - ref).abs().max() < 2e-2
