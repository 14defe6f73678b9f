"""Adaptive precision under a byte budget: the ``(a, b)`` quantizer, the mixed-width codec and its
kernels against the torch reference, the greedy allocation, the budget held while streaming, and
``on_full="degrade"``. Tiny random Llama, no files."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvtier
from builders import adaptive_policy, token_ids
from conftest import tiny_llama
from kvtier import AdaptivePolicy, get_policy
from kvtier.attention.backends.cpu import CpuBackend
from kvtier.attention.partials import exact_partial, merge, packed_partial
from kvtier.cache.adaptive import allocate
from kvtier.codecs import MixedCodec, make_codecs
from kvtier.quant import quantize_ab

FP8 = torch.float8_e4m3fn


# --- the quantizer -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, FP8])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantize_ab_bound(dtype, bits):
    x = torch.randn(3, 64, 20) * 4
    valid = torch.rand(3, 64, 1) > 0.2
    q, a, b = quantize_ab(x, bits, dim=1, valid=valid, dtype=dtype)
    assert a.dtype == dtype and b.dtype == dtype and q.max() < (1 << bits)
    xh = q.float() * a.float() + b.float()
    err = torch.where(valid, (x - xh).abs(), torch.zeros_like(x))
    assert bool((err <= a.float() / 2 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float16, FP8])
def test_quantize_ab_constant_zero_and_empty_groups(dtype):
    x = torch.zeros(2, 8, 4)
    x[1] = 3.0
    valid = torch.ones(2, 8, 1, dtype=torch.bool)
    valid[0, :, :] = False  # a group without valid entries
    for bits in (1, 2, 3):
        for clip in (False, True):
            q, a, b = quantize_ab(x, bits, dim=1, valid=valid, dtype=dtype, clip=clip)
            xh = q.float() * a.float() + b.float()
            assert torch.isfinite(xh).all() and torch.isfinite(a.float()).all()
            assert (xh[1] - 3.0).abs().max() <= a[1].float().max() / 2 + 1e-6


def test_quantize_ab_clip_lowers_error_of_bell_shaped_data():
    x = torch.randn(8, 64, 64)
    for bits in (2, 3):
        errs = []
        for clip in (False, True):
            q, a, b = quantize_ab(x, bits, dim=1, dtype=FP8, clip=clip)
            errs.append(float(((q.float() * a.float() + b.float() - x) ** 2).mean()))
        assert errs[1] < errs[0]


def test_quantize_ab_one_bit_is_a_centered_sign():
    x = torch.randn(4, 64, 8) + 2.0
    q, a, b = quantize_ab(x, 1, dim=1, dtype=torch.float16)
    xh = q.float() * a.float() + b.float()
    mean = x.mean(1, keepdim=True)
    assert torch.allclose((xh.amax(1) + xh.amin(1)) / 2, mean.squeeze(1), atol=1e-2)
    assert float(((xh - x) ** 2).mean()) < 0.5 * float(x.var(1).mean())


# --- the codec -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kb,vb,meta", [(3, 2, "fp8"), (2, 1, "fp16"), (4, 3, "fp8"), (1, 4, "fp8")])
def test_mixed_codec_roundtrip_and_bytes(kb, vb, meta):
    codec = MixedCodec(kb, vb, 8, rotate=True, meta=meta)
    k, v = torch.randn(2, 3, 2, 16, 16), torch.randn(2, 3, 2, 16, 16)
    valid = torch.rand(2, 1, 2, 16) > 0.1
    f = codec.encode(k, v, valid)
    assert sum(t.numel() * t.element_size() for t in f.values()) == codec.nbytes(2, 3, 2, 16, 16)
    kd, vd = codec.decode(f, 16, torch.float32)
    m = valid.unsqueeze(-1).expand_as(k)
    # relative error shrinks with the width (rotation is orthonormal: errors compare in either basis)
    ek = float(((kd - k)[m] ** 2).mean() / (k[m] ** 2).mean())
    ev = float(((vd - v)[m] ** 2).mean() / (v[m] ** 2).mean())
    assert ek < {1: 0.6, 2: 0.2, 3: 0.06, 4: 0.02}[kb]
    assert ev < {1: 0.6, 2: 0.2, 3: 0.06, 4: 0.02}[vb]


def test_mixed_codec_validation():
    with pytest.raises(ValueError, match="key_bits"):
        MixedCodec(0, 2, 8)
    with pytest.raises(ValueError, match="meta"):
        MixedCodec(2, 2, 8, meta="bf16")


def test_policy_cold_value_bits_makes_a_mixed_codec():
    p = get_policy("default").replace(cold_value_bits=2, cold_meta="fp8")
    _, cold = make_codecs(p, 64)
    assert isinstance(cold, MixedCodec) and (cold.key_bits, cold.value_bits, cold.meta) == (3, 2, "fp8")
    with pytest.raises(ValueError, match="cold_value_bits"):
        get_policy("default").replace(cold="sign", cold_value_bits=2)
    with pytest.raises(ValueError, match="adaptive"):
        get_policy("default").replace(cold="sign", adaptive=AdaptivePolicy())


@pytest.mark.parametrize(
    "kwargs,match",
    [({"bits": 0.1}, "bits"), ({"widths": (5,)}, "widths"), ({"widths": ()}, "widths"), ({"meta": "x"}, "meta")],
)
def test_adaptive_policy_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptivePolicy(**kwargs)


# --- kernels against the torch reference ---------------------------------------------------------
@pytest.mark.parametrize(
    "kb,vb,meta,group", [(3, 2, "fp8", 16), (2, 1, "fp16", 8), (4, 2, "fp8", 16), (1, 3, "fp8", 4)]
)
@pytest.mark.parametrize("rotate", [True, False])
def test_fused_kernel_reads_mixed_widths(kb, vb, meta, group, rotate):
    if not CpuBackend.layer_available():
        pytest.skip("the fused C++ kernel did not build here")
    torch.manual_seed(kb * 10 + vb)
    B, H, n, T, D, R = 2, 3, 3, 16, 16, 6  # GQA: 6 rows per KV head
    codec = MixedCodec(kb, vb, group, rotate=rotate, meta=meta)
    k, v = torch.randn(B, H, n, T, D) * 2, torch.randn(B, H, n, T, D)
    valid = torch.rand(B, 1, n, T) > 0.15
    valid[1, :, 0, :5] = False  # left padding of row 1
    f = codec.encode(k, v, valid)
    f["valid"] = valid
    rows = torch.randn(B, H, R, D) * 0.3
    hk, hv = torch.randn(B, H, 5, D), torch.randn(B, H, 5, D)
    allowed = torch.ones(1, 1, 5, dtype=torch.bool)
    out, _, _ = CpuBackend().layer(rows, [(hk, hv, allowed)], [(f, codec, 0)])
    # float64 oracle from the decoded tier; fp32 torch reference on the packed codes
    kd, vd = codec.decode(f, D, torch.float64)
    kall = torch.cat([hk.double(), kd.reshape(B, H, n * T, D)], 2)
    vall = torch.cat([hv.double(), vd.reshape(B, H, n * T, D)], 2)
    ok = torch.cat([torch.ones(B, 5, dtype=torch.bool), valid.reshape(B, n * T)], 1)
    s = rows.double() @ kall.transpose(-1, -2)
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    want = torch.softmax(s, -1) @ vall
    ref = merge([exact_partial(rows, hk, hv, None), packed_partial(rows, f, codec, D, None, None)])
    err_ref = float((ref.double() - want).abs().max())
    err = float((out.double() - want).abs().max())
    assert err <= 2 * err_ref + 1e-5


# --- the allocation ------------------------------------------------------------------------------
class _Errors:
    def __init__(self, k: dict, v: dict):
        self.k, self.v = k, v

    def distortion(self, side: str, width: int) -> float:
        return (self.k if side == "k" else self.v)[width]


def test_allocate_greedy_spends_where_error_drops_most():
    widths = (1, 2, 3)
    code = {1: 1.0, 2: 2.0, 3: 3.0}
    errors = {
        0: _Errors({1: 10.0, 2: 2.0, 3: 1.0}, {1: 1.0, 2: 0.5, 3: 0.4}),
        1: _Errors({1: 4.0, 2: 3.0, 3: 2.9}, {1: 0.2, 2: 0.1, 3: 0.1}),
    }
    assert allocate(errors, widths, code, budget=4.0) == {0: (1, 1), 1: (1, 1)}
    assert allocate(errors, widths, code, budget=5.0) == {0: (2, 1), 1: (1, 1)}
    assert allocate(errors, widths, code, budget=6.0) == {0: (3, 1), 1: (1, 1)}
    assert allocate(errors, widths, code, budget=7.0) == {0: (3, 1), 1: (2, 1)}
    # room for everything, but layer 1's values gain nothing from 3 bits: that step is not taken
    assert allocate(errors, widths, code, budget=100.0) == {0: (3, 3), 1: (3, 2)}


# --- the budget while streaming ------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=3)


@pytest.mark.parametrize("bits", [5.0, 6.0])  # head_dim 16: metadata and the hot ring weigh more than at 64
def test_budget_holds_past_fit_tokens(llama, bits):
    cache = kvtier.TieredCache(llama.config, adaptive_policy(bits))
    ids = token_ids(512)
    ratios = []
    with kvtier.enable(llama), torch.no_grad():
        for s in range(0, ids.shape[1], 16):
            llama(ids[:, s : s + 16], cache=cache, use_cache=True)
            rep = cache.memory_report()
            if s + 16 >= 256:
                ratios.append(rep.ratio)
                assert rep.total_bytes <= bits / 16 * rep.dense_fp16_bytes, (s + 16, rep.ratio * 16)
    alloc = cache.allocation()
    assert alloc["allocated"] and len(alloc["layers"]) == 4
    # the budget is used: a warm window grows once the slack allows it
    assert cache.memory_report().tokens["warm"] > 0
    assert max(ratios) * 16 > bits - 0.75
    table = cache.memory_report().allocation()
    assert "cold K/V bits" in table and len(table.splitlines()) == 5


def test_one_long_prompt_is_measured_with_its_queries(llama):
    # the first call attends to exact tokens only (plain SDPA); its queries must still be observed,
    # or a prompt given in one call is allocated by the proxy alone
    cache = kvtier.TieredCache(llama.config, adaptive_policy(5.0))
    with kvtier.enable(llama), torch.no_grad():
        llama(token_ids(300, seed=1), cache=cache, use_cache=True)
        llama(token_ids(16, seed=2), cache=cache, use_cache=True)
    (budget,) = cache.budgets.values()
    assert budget.allocated and all(e.out_energy > 0 for e in budget.errors.values())


def test_adaptive_warm_tier_is_coded_like_its_cold_tier():
    warm, _ = make_codecs(get_policy("adaptive"), 64)
    assert isinstance(warm, MixedCodec)
    assert (warm.key_bits, warm.value_bits, warm.rotate, warm.meta) == (3, 3, True, "fp8")
    warm, _ = make_codecs(get_policy("default"), 64)  # fixed presets keep their 4-bit KIVI warm tier
    assert not isinstance(warm, MixedCodec) and warm.bits == 4


def test_adaptive_fast_path_matches_reference(llama):
    ids = token_ids(300, seed=5, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    logits = {}
    for attention in ("fast", "reference"):
        cache = kvtier.TieredCache(llama.config, adaptive_policy(5.0), attention=attention)
        with kvtier.enable(llama), torch.no_grad():
            for s in range(0, 296, 37):
                llama(ids[:, s : s + 37], cache=cache, use_cache=True, attention_mask=mask[:, : s + 37])
            out = llama(ids[:, 296:], cache=cache, use_cache=True, attention_mask=mask).logits
        logits[attention] = out
        assert cache.memory_report().tokens["cold"] > 0
    assert torch.allclose(logits["fast"], logits["reference"], atol=2e-3, rtol=1e-3)


def test_adaptive_decode_plans_the_fused_kernel_over_mixed_widths(llama):
    # mixed key / value widths and eviction must not send decoding to a slower path
    if not CpuBackend.layer_available():
        pytest.skip("the fused C++ kernel did not build here")
    from kvtier.attention.plan import plan_for

    cache = kvtier.TieredCache(llama.config, adaptive_policy(4.0, keep=0.5))  # mixed widths on this model
    ids = token_ids(400, seed=8)
    with kvtier.enable(llama), torch.no_grad():
        for s in range(0, 400, 40):
            llama(ids[:, s : s + 40], cache=cache, use_cache=True)
    cfg = llama.config
    query = torch.zeros(1, cfg.num_attention_heads, 1, cfg.hidden_size // cfg.num_attention_heads)
    mixed = 0
    for layer in cache.tiered_layers:
        assert layer.cold is not None and layer.cold.nblocks and layer.evicted
        mixed += layer.cold.codec.key_bits != layer.cold.codec.value_bits
        plan = plan_for(layer, query)
        assert all(c.fused for c in plan.chunks), plan
    assert mixed  # the allocation gave some layer different key and value widths


def test_bits_needs_an_adaptive_policy(llama):
    with pytest.raises(ValueError, match="bits"):
        kvtier.TieredCache(llama.config, "default", bits=2.5)
    c = kvtier.TieredCache(llama.config, "adaptive", bits=3.0)
    assert c.policy.adaptive.bits == 3.0 and len(c.budgets) == 1


@pytest.mark.parametrize("preset", ["default", "adaptive"])
def test_degrade_stays_under_the_cap_and_keeps_more_tokens_than_evict(llama, preset):
    policy = get_policy(preset).replace(hot_tokens=16, sink_tokens=4, block_tokens=16, value_group_size=16)
    if policy.adaptive is not None:
        # bits=4: a budget the tiny model can hold (2.5 warns: its exact ring alone takes 2.25 bits)
        policy = policy.replace(
            adaptive=dataclasses.replace(policy.adaptive, bits=4.0, warmup_tokens=64, fit_tokens=256)
        )
    else:
        policy = policy.replace(warm_tokens=512, sparse=None)
    cap = 60_000
    ids = token_ids(800, seed=2)
    evicted = {}
    for on_full in ("evict", "degrade"):
        cache = kvtier.TieredCache(llama.config, policy, max_bytes=cap, on_full=on_full)
        with kvtier.enable(llama), torch.no_grad():
            for s in range(0, ids.shape[1], 16):
                llama(ids[:, s : s + 16], cache=cache, use_cache=True)
                assert cache.memory_report().total_bytes <= cap
        evicted[on_full] = cache.memory_report().tokens["evicted"]
        if on_full == "degrade":  # the oldest go down first: a recent warm window stays
            assert all(layer.token_counts()["warm"] > 0 for layer in cache.layers)
    assert evicted["degrade"] < evicted["evict"]
