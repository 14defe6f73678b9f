"""The fast per-tier attention against the reference oracle (decode every tier, one SDPA call),
over awkward sizes: lengths off the block and group grid, batch > 1 with left padding, GQA ratios,
head dims that are not multiples of 8, every bit width and cold mode, decode and chunked prefill.

Tolerance follows the flash-attention rule: the fast path's error against an fp64 reference is at
most twice the error of the fp32 reference itself (plus a tiny absolute floor)."""

from __future__ import annotations

import pytest
import torch

from builders import POLICIES, build_layer, mask_for
from kvtier import TierPolicy
from kvtier.attention.partials import Partial, merge
from kvtier.attention.reference import reference_attention
from kvtier.attention.tiered import tiered_attention
from kvtier.policy import SparsePolicy


def check_close(layer, query, mask, scaling=0.3, force=None):
    fast = tiered_attention(layer, query, mask, scaling, force=force)
    ref32 = reference_attention(layer, query, mask, scaling)
    ref64 = reference_attention(layer, query.double(), mask, scaling)
    # rows that attend nothing (pad queries) must be exactly zero in both
    err_fast = (fast.double() - ref64).abs().max().item()
    err_ref = (ref32.double() - ref64).abs().max().item()
    assert torch.isfinite(fast).all()
    assert err_fast <= 2 * err_ref + 1e-5, (err_fast, err_ref)
    return fast


@pytest.fixture(params=["torch", "cpu", "fused"])
def path(request):
    """The backend forced (``force=``): torch ops, the per-tier CPU kernel at any row count, or the
    fused whole-layer kernel for every call it covers (block selection: the per-tier kernel)."""
    from kvtier.kernels import cpu, fused_cpu

    if request.param == "cpu" and not cpu.available():
        pytest.skip("CPU kernel could not be built here")
    if request.param == "fused" and not fused_cpu.available():
        pytest.skip("fused CPU kernel could not be built here")
    return request.param


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("D", [12, 16])
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("B,pads", [(1, [0]), (3, [0, 7, 30])])
def test_fast_matches_reference(name, D, gqa, q, B, pads, path):
    policy = POLICIES[name]
    if policy.value_group_size > D or D % min(policy.value_group_size, D):
        policy = policy.replace(value_group_size=D)
    H = 2
    layer, valid = build_layer(policy, B, H, D, [37, 11, 3, 20, 2, q], pads, seed=D * gqa + q)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(B, H * gqa, q, D, generator=g)
    check_close(layer, query, mask_for(valid, q), force=path)


def test_long_query_is_split_and_still_matches(monkeypatch, path):
    from kvtier.attention import plan

    monkeypatch.setattr(plan, "SCORE_BUDGET", 200)  # the thresholds: several query chunks
    monkeypatch.setattr(plan, "FLASH_PASS_BUDGET", 200)  # (the flash op's passes, where it runs)
    layer, valid = build_layer(POLICIES["int4+sign"], 2, 2, 16, [50, 40], [0, 13])
    query = torch.randn(2, 4, 40, 16)
    assert len(plan.plan_for(layer, query, None, path).chunks) > 1
    check_close(layer, query, mask_for(valid, 40), force=path)


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


SPARSE = [
    SparsePolicy(local_window=6, select="blocks", method="topk", level=0.5),
    SparsePolicy(local_window=0, select="blocks", method="quantile", level=0.3),
    SparsePolicy(local_window=10, select="blocks", method="mass", level=0.9),
]


@pytest.mark.parametrize("sp", SPARSE, ids=lambda s: s.method)
@pytest.mark.parametrize("name", ["int4+sign", "int2+int3", "int6+rot"])
@pytest.mark.parametrize("q", [1, 4])
def test_sparse_matches_reference_on_selected_blocks(sp, name, q, path):
    """With sparsity, the fast path equals the reference restricted to the kept blocks: it drops
    exactly the blocks the selection drops and nothing else."""
    policy = POLICIES[name].replace(sparse=sp, value_group_size=8)
    B, H, D, gqa = 2, 2, 16, 3
    layer, valid = build_layer(policy, B, H, D, [60, 21, q], [0, 11])
    query = torch.randn(B, H * gqa, q, D)
    mask = mask_for(valid, q)
    fast = tiered_attention(layer, query, mask, 0.3, force=path)
    stats = layer.sparse_stats
    assert stats.pairs > 0 and 0 <= stats.valued <= stats.pairs and stats.scored <= stats.pairs
    # reference on the same layer with the dropped blocks' tokens marked invalid
    from kvtier.attention import plan
    from kvtier.attention.partials import to_rows

    rows = to_rows(query, H, 0.3)
    q_pos = layer.seen - q + torch.arange(q)
    tiers = [t for t in (layer.cold, layer.warm) if t is not None and t.nblocks]
    from kvtier.attention.sparse import block_bounds, select_blocks

    T = policy.block_tokens
    ends, start = [], layer.evicted
    for t in tiers:
        ends.append(start + T * torch.arange(1, t.nblocks + 1))
        start += t.ntokens
    forced = torch.cat(ends)[None, None, None, :] > (q_pos.repeat(gqa) - sp.local_window)[None, None, :, None]
    keep = select_blocks(torch.cat([block_bounds(rows, t) for t in tiers], -1), sp, forced, T)
    # every row of a head: compare one query head at a time on its own kept set
    for h in range(H * gqa):
        for i in range(q):
            r = (h % gqa) * q + i
            kv = h // gqa
            ref_layer, _ = build_layer(policy, B, H, D, [60, 21, q], [0, 11])
            for t, k_t in zip(
                [t for t in (ref_layer.cold, ref_layer.warm) if t is not None and t.nblocks],
                keep.split([t.nblocks for t in tiers], -1),
            ):
                drop = ~k_t[:, kv, r]  # [B, n]
                t.fields["valid"] = t.fields["valid"] & ~drop[:, None, :, None]
            # this head's whole chunk (causality by position), compared at row i only
            sub = reference_attention(_head_view(ref_layer, kv), query[:, h : h + 1], mask, 0.3)[:, i : i + 1]
            got = fast[:, i : i + 1, h : h + 1]
            assert (got - sub).abs().max() < 1e-4
    assert plan.SCORE_BUDGET > 0


def _head_view(layer, kv):
    """A shallow copy of ``layer`` holding only KV head ``kv`` (for per-head references)."""
    import copy

    out = copy.copy(layer)
    out.kv_heads = 1
    out.hot = copy.copy(layer.hot)
    out.hot.k, out.hot.v = layer.hot.k[:, kv : kv + 1], layer.hot.v[:, kv : kv + 1]
    out.sinks = copy.copy(layer.sinks)
    if layer.sinks.k is not None:
        out.sinks.k, out.sinks.v = layer.sinks.k[:, kv : kv + 1], layer.sinks.v[:, kv : kv + 1]
    for name in ("warm", "cold"):
        t = getattr(layer, name)
        if t is not None:
            c = copy.copy(t)
            c.fields = {k: (v if v.shape[1] == 1 else v[:, kv : kv + 1]) for k, v in t.fields.items()}
            setattr(out, name, c)
    return out


def test_sparse_skips_work_and_counts_it(path):
    policy = POLICIES["int3 all"].replace(hot_tokens=8, block_tokens=8, sparse=SparsePolicy(4, "blocks", "topk", 0.25))
    layer, valid = build_layer(policy, 1, 2, 16, [400, 1], [0])
    tiered_attention(layer, torch.randn(1, 2, 1, 16), mask_for(valid, 1), 0.25, force=path)  # 1 row per KV head
    s = layer.sparse_stats.to_dict()
    assert s["skipped_fraction"] > 0.6  # ~75% of ~49 warm blocks dropped, hot/sinks kept
    assert s["bytes_read"] < 0.4 * s["bytes_total"]
    assert s["scored"] < 0.45 * s["pairs"]


def test_select_tokens_mass_rule():
    from kvtier.attention.sparse import select_tokens

    # weights relative to max: 1, 1/2, 1/4 (x2), 1/1000, invalid
    s = torch.log(torch.tensor([[1.0, 0.5, 0.25, 0.25, 1e-3, 1.0]]))
    s[0, -1] = float("-inf")
    keep = select_tokens(s, SparsePolicy(select="tokens", method="mass", level=0.8), None)
    # cumulative bucket mass: 1 (40%), 1.5 (60%), 2 (80%) -> buckets 0..2 kept
    assert keep.tolist() == [[True, True, True, True, False, False]]
    keep = select_tokens(s, SparsePolicy(select="tokens", method="mass", level=0.5), None)
    assert keep.tolist() == [[True, True, False, False, False, False]]
    forced = torch.tensor([[False, False, False, False, True, True]])
    keep = select_tokens(s, SparsePolicy(select="tokens", method="mass", level=0.5), forced)
    assert keep.tolist() == [[True, True, False, False, True, False]]  # invalid never kept


def test_select_tokens_quantile_rule():
    from kvtier.attention.sparse import select_tokens

    s = torch.tensor([[5.0, 1.0, 3.0, 2.0, 4.0, float("-inf")]])
    keep = select_tokens(s, SparsePolicy(select="tokens", method="quantile", level=0.4), None)
    assert keep.tolist() == [[True, False, False, False, True, False]]  # ceil(0.4 * 5) = 2 kept


@pytest.mark.parametrize("level", [0.9, 0.99, 0.999])
def test_select_tokens_row_mass_rule_bounds_the_dropped_mass(level):
    """With the row's other mass (``rest_lse``), the tokens dropped carry at most 1 - level of the
    row's softmax weight, the row's top token is always kept, and a larger rest drops more."""
    from kvtier.attention.sparse import select_tokens

    g = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 3, 500, generator=g) * 2.5
    scores[..., 450:] = float("-inf")  # invalid tail
    tier_lse = scores.logsumexp(-1)
    sp = SparsePolicy(select="tokens", method="mass", level=level)
    kept_before = None
    for shift in (-8.0, 0.0, 3.0, 40.0):  # rest from negligible to dominant (exp overflow range too)
        rest = tier_lse + shift
        keep = select_tokens(scores, sp, None, rest)
        total = torch.logaddexp(tier_lse, rest)
        dropped = (scores.masked_fill(keep, float("-inf")).logsumexp(-1) - total).exp()
        assert (dropped <= 1 - level + 1e-6).all()
        assert keep.gather(-1, scores.argmax(-1, keepdim=True)).all()
        n = keep.sum(-1)
        if kept_before is not None:
            assert (n <= kept_before).all()
        kept_before = n
    assert (kept_before < 450).all()
    # without rest it is the tier-only rule: dropped <= 1 - level of the tier's own mass
    keep = select_tokens(scores, sp, None)
    assert ((scores.masked_fill(keep, float("-inf")).logsumexp(-1) - tier_lse).exp() <= 1 - level + 1e-6).all()


@pytest.mark.parametrize("q", [1, 4, 5, 9])
def test_sparse_applies_only_to_short_calls(q, path):
    """Calls longer than ``max_query_tokens`` attend densely - the same output as the policy without
    sparsity - and count their work as dense; shorter ones select."""
    sp = SparsePolicy(local_window=2, select="tokens", method="mass", level=0.5, max_query_tokens=4)
    policy = POLICIES["int4+sign"].replace(sparse=sp)
    B, H, D = 2, 2, 16
    out = {}
    for name, pol in (("sparse", policy), ("dense", policy.replace(sparse=None))):
        layer, valid = build_layer(pol, B, H, D, [80, 13, q], [0, 5])
        query = torch.randn(B, H * 3, q, D, generator=torch.Generator().manual_seed(2)) * 3
        out[name] = tiered_attention(layer, query, mask_for(valid, q), 0.3, force=path)
        if name == "sparse":
            stats = layer.sparse_stats
    if q > sp.max_query_tokens:
        assert torch.equal(out["sparse"], out["dense"])
        assert stats.calls == stats.pairs == stats.scored == stats.valued == stats.bytes_total == 0
        assert stats.dense_calls == 1 and stats.dense_pairs > 0
    else:
        assert stats.calls == 1 and stats.dense_calls == stats.dense_pairs == 0
        assert 0 < stats.valued < stats.pairs
        assert not torch.equal(out["sparse"], out["dense"])


@pytest.mark.parametrize("method,level,rest", [("mass", 0.9, False), ("mass", 0.97, True), ("quantile", 0.3, False)])
@pytest.mark.parametrize("name", ["int4+sign", "int2+int3", "int6+rot"])
def test_token_sparse_tier_matches_masked_reference(method, level, rest, name, path):
    """A tier's token-sparse partial equals: exact softmax over the decoded tier, value average
    over the kept tokens only (renormalized), with the full log-sum-exp; with ``rest`` the mass
    rule counts the row's other attended mass (``rest_lse``) too."""
    from kvtier.attention.backends import Selection
    from kvtier.attention.backends.cpu import CpuBackend
    from kvtier.attention.backends.torch import TorchBackend
    from kvtier.attention.partials import to_rows
    from kvtier.attention.sparse import select_tokens

    # torch: chunk-wise decoding (prefill rows) and the bit-plane path (decode rows)
    backend = {"cpu": CpuBackend(), "torch": TorchBackend(chunked=True), "fused": TorchBackend()}[path]
    sp = SparsePolicy(local_window=0, select="tokens", method=method, level=level)
    layer, _ = build_layer(POLICIES[name].replace(value_group_size=8), 2, 2, 16, [70, 30], [0, 9])
    query = torch.randn(2, 6, 2, 16)
    rows = to_rows(query, 2, 0.3)
    # other mass per row: from far below to far above the tier's (both ends of the rule)
    rest_lse = torch.linspace(-6, 12, 2 * 2 * 6).reshape(2, 2, 6) if rest else None
    for tier in (layer.cold, layer.warm):
        if tier is None or not tier.nblocks:
            continue
        start = layer.evicted + (layer.cold.ntokens if tier is layer.warm and layer.cold is not None else 0)
        never = torch.full((rows.shape[2],), 10**9)  # no local window
        sel = Selection("tokens", method, level, never, start, rest_lse)
        got = backend.tier(rows, tier.fields, tier.codec, 16, sel)
        k, v, valid = tier.dense(torch.float64)
        scores = rows.double() @ k.transpose(-1, -2)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        keep = select_tokens(scores.float(), sp, None, rest_lse)
        p = torch.softmax(scores, -1) * keep
        ref = (p @ v) / p.sum(-1, keepdim=True)
        assert torch.allclose(got.out.double(), ref, atol=1e-4)
        assert torch.allclose(got.lse.double(), torch.logsumexp(scores, -1), atol=1e-4)


@pytest.mark.parametrize("method,level", [("mass", 0.95), ("quantile", 0.4)])
@pytest.mark.parametrize("name", ["int4+sign", "int3 all"])
def test_token_sparse_kernel_equals_torch_path(method, level, name):
    """Whole-layer token-sparse attention (local window forced) is the same through the per-tier
    kernel, the fused whole-layer kernel and torch ops, and all count the same work."""
    from kvtier.kernels import cpu, fused_cpu

    if not (cpu.available() and fused_cpu.available()):
        pytest.skip("CPU kernels could not be built here")
    policy = POLICIES[name].replace(value_group_size=8, sparse=SparsePolicy(12, "tokens", method, level))
    results = {}
    for p in ("torch", "cpu", "fused"):
        layer, valid = build_layer(policy, 2, 2, 16, [90, 17, 1], [0, 21])
        query = torch.randn(2, 6, 1, 16, generator=torch.Generator().manual_seed(3))
        out = tiered_attention(layer, query, mask_for(valid, 1), 0.3, force=p)
        results[p] = (out, layer.sparse_stats.to_dict())
    for p in ("cpu", "fused"):
        assert (results["torch"][0] - results[p][0]).abs().max() < 1e-4
        assert results["torch"][1] == results[p][1]
    assert results["fused"][1]["value_skipped_fraction"] > 0


def test_select_blocks_bound_rule_is_a_guarantee():
    """method='bound' drops blocks only while the *upper bounds* of their mass sum to <= 1 - level,
    so the true mass dropped never exceeds 1 - level (here checked against exact scores)."""
    from kvtier.attention.sparse import select_blocks

    g = torch.Generator().manual_seed(0)
    B, H, R, n, T = 2, 3, 5, 40, 8
    scores = torch.randn(B, H, R, n, T, generator=g) * 3 - torch.linspace(0, 12, n)[:, None]
    exact = torch.randn(B, H, R, 16, generator=g) * 3 + 4  # sinks + hot
    bounds = scores.amax(-1) + torch.rand(B, H, R, n, generator=g)  # valid (loose) upper bounds
    exact_lse = exact.logsumexp(-1)
    total = torch.logsumexp(torch.cat([exact, scores.flatten(-2)], -1), -1)
    counts = torch.full((1, 1, 1, n), T)
    for level in (0.9, 0.99, 0.999):
        sp = SparsePolicy(local_window=0, select="blocks", method="bound", level=level, min_blocks=0)
        keep = select_blocks(bounds, sp, torch.zeros(1, dtype=torch.bool), T, counts=counts, exact_lse=exact_lse)
        dropped = (scores.logsumexp(-1) - total.unsqueeze(-1)).exp() * ~keep
        assert (dropped.sum(-1) <= 1 - level + 1e-6).all()
        assert (~keep).any()  # the rule does drop blocks when their bounds are low
    with pytest.raises(ValueError, match="bound"):
        select_blocks(bounds, sp, torch.zeros(1, dtype=torch.bool), T)


@pytest.mark.parametrize("name", ["int4+sign", "int2+int3"])
def test_bound_sparse_attention_error_is_bounded(name):
    """End to end: with dropped mass <= eps, the output moves by at most 2 eps max|v| from the reference."""
    eps = 0.05
    policy = POLICIES[name].replace(
        sparse=SparsePolicy(0, "blocks", "bound", 1 - eps, min_blocks=0), value_group_size=8
    )
    layer, valid = build_layer(policy, 2, 2, 16, [90, 1], [0, 7])
    # a fixed query: for ~7% of random ones the bounds drop no block at all (nothing to check)
    query = torch.randn(2, 6, 1, 16, generator=torch.Generator().manual_seed(0)) * 3
    mask = mask_for(valid, 1)
    fast = tiered_attention(layer, query, mask, 0.3)
    ref = reference_attention(layer, query, mask, 0.3)
    assert layer.sparse_stats.valued < layer.sparse_stats.pairs  # some blocks were dropped
    vmax = max(float(t.abs().max()) for t in _decoded_values(layer))
    assert (fast - ref).abs().max() <= 2 * eps * vmax + 1e-4


def _decoded_values(layer):
    out = [layer.hot.view()[1]]
    if layer.sinks.v is not None:
        out.append(layer.sinks.v)
    for t in (layer.cold, layer.warm):
        if t is not None and t.nblocks:
            out.append(t.codec.decode_values(t.fields, layer.hot.view()[1].shape[-1], torch.float32))
    return out


FIXED_SHAPES = {  # warm bits, cold mode: every code width of the fused kernel's compiled paths
    "int4+sign": dict(warm_bits=4, cold="sign", cold_rotation=False),
    "int2+int3": dict(warm_bits=2, cold="quant", cold_bits=3),
    "int6+rot": dict(warm_bits=6, cold="sign", cold_rotation=True),
    "int8+int2": dict(warm_bits=8, cold="quant", cold_bits=2),
    "int3+int6": dict(warm_bits=3, cold="quant", cold_bits=6),
    "int4+int8": dict(warm_bits=4, cold="quant", cold_bits=8, cold_rotation=False),
}


@pytest.mark.parametrize("name", list(FIXED_SHAPES))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("q", [1, 4])
def test_fused_fixed_shape_paths_match_reference(name, D, groups, q, monkeypatch):
    """Head dims 64 and 128 take the fused kernel's compiled (bits, D) paths: the same oracle
    bound as every other path, batch 2 with left padding, GQA 3, lengths off the block grid."""
    from kvtier.attention.plan import plan_for
    from kvtier.kernels import fused_cpu

    if not fused_cpu.available():
        pytest.skip("fused CPU kernel could not be built here")
    policy = TierPolicy(
        hot_tokens=9,
        warm_tokens=21,
        block_tokens=7,
        sink_tokens=3,
        value_group_size=D // groups,
        layer_overrides={},
        **FIXED_SHAPES[name],
    )
    layer, valid = build_layer(policy, 2, 2, D, [61, 13, 2, q], [0, 9], seed=D + q)
    assert layer.cold.nblocks and layer.warm.nblocks
    query = torch.randn(2, 6, q, D, generator=torch.Generator().manual_seed(q)) * 0.5
    assert all(c.fused for c in plan_for(layer, query).chunks), "the automatic plan takes the fused kernel"
    calls = []
    real = fused_cpu.layer_attention
    monkeypatch.setattr(fused_cpu, "layer_attention", lambda *a: calls.append(1) or real(*a))
    check_close(layer, query, mask_for(valid, q), scaling=D**-0.5)
    assert calls, "the fused kernel did not run"


@pytest.mark.parametrize("method,level", [("mass", 0.9), ("quantile", 0.3)])
@pytest.mark.parametrize("D", [64, 128])
def test_fused_token_sparse_equals_per_tier_kernel(method, level, D):
    """Token selection in the fused kernel's compiled paths keeps the same tokens as the per-tier
    kernel (same output, same work counts), with the exact tokens counted in the row's mass."""
    from kvtier.kernels import cpu, fused_cpu

    if not (cpu.available() and fused_cpu.available()):
        pytest.skip("CPU kernels could not be built here")
    policy = TierPolicy(
        hot_tokens=8,
        warm_tokens=None,
        block_tokens=16,
        sink_tokens=4,
        value_group_size=D,
        exact_dtype="half",
        sparse=SparsePolicy(16, "tokens", method, level),
        layer_overrides={},
    )
    results = {}
    for p in ("cpu", "fused"):
        layer, valid = build_layer(policy, 2, 3, D, [300, 5, 1], [0, 40])
        query = torch.randn(2, 9, 1, D, generator=torch.Generator().manual_seed(5))
        out = tiered_attention(layer, query, mask_for(valid, 1), D**-0.5, force=p)
        results[p] = (out, layer.sparse_stats.to_dict())
    assert (results["cpu"][0] - results["fused"][0]).abs().max() < 1e-5
    assert results["cpu"][1] == results["fused"][1]
    assert results["fused"][1]["value_skipped_fraction"] > 0.3


def test_fused_kernel_is_the_same_on_more_threads():
    """Heads are split across threads; each has its own buffers: 1 and 2 threads agree exactly."""
    from kvtier.kernels import fused_cpu

    if not fused_cpu.available():
        pytest.skip("fused CPU kernel could not be built here")
    policy = TierPolicy(
        hot_tokens=8,
        warm_tokens=64,
        block_tokens=16,
        sink_tokens=4,
        value_group_size=32,
        sparse=SparsePolicy(16, "tokens", "mass", 0.9),
        layer_overrides={},
    )
    layer, valid = build_layer(policy, 2, 4, 64, [200, 3, 1], [0, 17])
    query = torch.randn(2, 8, 1, 64, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(tiered_attention(layer, query, mask_for(valid, 1), 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_a_kernel_that_does_not_build_warns_and_reports_unavailable():
    from kvtier.kernels import build

    def broken():
        raise RuntimeError("no compiler")

    with pytest.warns(UserWarning, match="demo kernel unavailable, using the torch path: no compiler"):
        assert build.check(broken, "demo kernel", "the torch path") is False
    assert build.check(lambda: object(), "demo kernel", "the torch path") is True
