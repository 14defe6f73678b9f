"""The fp8 (e4m3) codec: a float64 oracle of encode/decode, its policy switch and preset, the tiny
Llama against DynamicCache, planner bytes == reported bytes, and sparse selection (refused)."""

from __future__ import annotations

import pytest
import torch

import kvtier
from builders import stream_logits
from conftest import ADAPTER_ERROR
from kvtier import TierPolicy, get_policy
from kvtier.codecs import FP8, FP8_MAX, Fp8Codec, KBitCodec, make_codecs
from kvtier.sizing import ModelShape, estimate

# Every finite e4m3 value, ascending (the oracle rounds to the nearest of them in float64).
_GRID = torch.arange(256, dtype=torch.uint8).view(FP8).double()
_GRID = _GRID[torch.isfinite(_GRID)].unique()


def fp8_round64(x: torch.Tensor) -> torch.Tensor:
    """Round float64 ``x`` (within +-448) to the nearest e4m3 value in float64 (ties: either)."""
    idx = torch.searchsorted(_GRID, x.contiguous()).clamp(1, len(_GRID) - 1)
    lo, hi = _GRID[idx - 1], _GRID[idx]
    return torch.where((x - lo).abs() <= (hi - x).abs(), lo, hi)


def oracle64(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float64 reference of a decoded code: ``x / scale`` rounded to the nearest e4m3, times ``scale``."""
    s = scale.double()
    return fp8_round64(x.double() / s) * s


def amax_scale64(x: torch.Tensor, dim: int, valid: torch.Tensor) -> torch.Tensor:
    """Float64 absmax / 448 over the valid entries of ``dim`` (what the stored scale rounds)."""
    return torch.where(valid, x.double(), torch.zeros((), dtype=torch.float64)).abs().amax(dim, keepdim=True) / FP8_MAX


def per_tensor_fp8(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``QuantizedCache(backend="fp8")`` rule: one absmax scale for the whole tensor."""
    scale = x.abs().amax().float() / FP8_MAX
    return (x.float() / scale).to(FP8).float() * scale


def kv(B=2, H=2, n=3, T=8, D=32, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, n, T, D, generator=g)
    v = torch.randn(B, H, n, T, D, generator=g)
    if outliers:  # keys: a few large channels (as real K has); values: a few loud tokens
        k[..., :: max(1, D // 5)] *= 30.0
        v[:, :, :, ::3] *= 20.0
    return k, v


def _err(a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor) -> float:
    """Mean absolute difference over the valid tokens (``valid [B,1,n,T]``)."""
    return float((a.double() - b.double()).abs()[valid.unsqueeze(-1).expand_as(a)].mean())


@pytest.mark.parametrize("D, G", [(32, 32), (32, 8), (48, 16), (20, 5), (7, 7)])
@pytest.mark.parametrize("partial", [False, True])
def test_fp8_codec_vs_float64_oracle_and_per_tensor_cast(D, G, partial):
    B, H, n, T = 2, 2, 3, 8
    k, v = kv(B, H, n, T, D, seed=D + G)
    valid = torch.ones(B, 1, n, T, dtype=torch.bool)
    if partial:  # a length off the block grid (last block 5 of 8 tokens), and left padding in row 1
        valid[:, :, -1, 5:] = False
        valid[1, :, 0, :3] = False
        k = k.masked_fill(~valid.unsqueeze(-1), 1e4)  # padding garbage must not enter the scales
        v = v.masked_fill(~valid.unsqueeze(-1), -1e4)
    codec = Fp8Codec(G)
    f = codec.encode(k, v, valid)
    assert f["k_codes"].dtype == torch.uint8 and f["v_codes"].dtype == torch.uint8
    assert f["k_scale"].dtype == torch.float16 and f["k_scale"].shape == (B, H, n, 1, D)
    assert f["v_scale"].shape == (B, H, n, T, D // G)
    kd, vd = codec.decode(f, D, torch.float32)
    tv = valid.unsqueeze(-1)  # [B,1,n,T,1]
    # keys are centered first: the shift is each channel's midrange over the valid tokens, in fp16
    assert f["k_shift"].dtype == torch.float16 and f["k_shift"].shape == (B, H, n, 1, D)
    lo = torch.where(tv, k.double(), torch.full((), float("inf"), dtype=torch.float64)).amin(3, keepdim=True)
    hi = torch.where(tv, k.double(), torch.full((), float("-inf"), dtype=torch.float64)).amax(3, keepdim=True)
    assert torch.allclose(f["k_shift"].double(), (lo + hi) / 2, rtol=2.0**-10, atol=0)
    shift = f["k_shift"].float()
    kc = k - shift  # what the key codes hold
    # scales: absmax / 448 over the valid tokens only (padding garbage left out), rounded up into fp16
    for stored, ideal in (
        (f["k_scale"], amax_scale64(kc, 3, tv)),
        (f["v_scale"].unsqueeze(-1), amax_scale64(v.reshape(B, H, n, T, D // G, G), 5, tv.unsqueeze(-1))),
    ):
        ratio = stored.double() / ideal.clamp_min(2.0**-14)
        assert bool(((ratio >= 1) & (ratio <= 1 + 2.0**-9)).all())
    zero = torch.zeros(())
    for x, got, scale, c in ((k, kd, f["k_scale"], shift), (v, vd, f["v_scale"].repeat_interleave(G, -1), zero)):
        # codes: the nearest e4m3 of (x - shift) / scale, as the float64 oracle rounds it (fp32 division aside)
        ref = oracle64(x - c, scale) + c.double()
        assert _err(got, x, valid) <= _err(ref, x, valid) * (1 + 1e-4) + 1e-7
        assert _err(got, ref, valid) <= 1e-3 * _err(ref, x, valid) + 1e-6
        # the e4m3 rounding bound per entry: 2**-4 relative (to the centered value), 2**-10 of the
        # scale among subnormals
        s = scale.float().expand_as(x)
        bound = torch.maximum((x - c).abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-5) + 1e-6
        assert bool(((got - x).abs() <= bound)[valid.unsqueeze(-1).expand_as(x)].all())
        # finer scales beat one scale per tensor (transformers' fp8 QuantizedCache) on outliers
        dense = x.masked_fill(~valid.unsqueeze(-1).expand_as(x), 0.0)
        assert _err(got, x, valid) < _err(per_tensor_fp8(dense), x, valid)
    assert sum(t.numel() * t.element_size() for t in f.values()) == codec.nbytes(B, H, n, T, D)


@pytest.mark.parametrize("D", [16, 48])
def test_fp8_rotated_codec_decodes_back(D):
    k, v = kv(D=D, seed=3)
    valid = torch.ones(2, 1, 3, 8, dtype=torch.bool)
    plain, rot = Fp8Codec(D), Fp8Codec(D, rotate=True)
    kr, vr = rot.decode(rot.encode(k, v, valid), D, torch.float32)
    kp, _ = plain.decode(plain.encode(k, v, valid), D, torch.float32)
    assert (kr - k).abs().max() <= 2.0**-4 * k.abs().max()
    assert (vr - v).abs().max() <= 2.0**-4 * v.abs().max()
    assert rot.name == "fp8-rot" and plain.name == "fp8"
    assert float((kp - k).abs().mean()) > 0  # a lossy code in both cases


@pytest.mark.parametrize("value", [0.0, 1.0, -3.5, 1e4, 1e-8])
def test_fp8_constant_and_zero_groups(value):
    k = torch.full((1, 1, 2, 8, 16), value)
    valid = torch.ones(1, 1, 2, 8, dtype=torch.bool)
    codec = Fp8Codec(8)
    kd, vd = codec.decode(codec.encode(k, k, valid), 16, torch.float32)
    for x in (kd, vd):
        assert torch.isfinite(x).all()
        assert (x - value).abs().max() <= 2.0**-4 * abs(value) + 2.0**-24


def test_fp8_empty_block_and_no_graph():
    k, v = kv(n=2, D=16)
    k.requires_grad_(True)
    valid = torch.ones(2, 1, 2, 8, dtype=torch.bool)
    valid[:, :, 1] = False  # a block without a real token
    f = Fp8Codec(16).encode(k, v, valid)
    assert all(not t.requires_grad and t.grad_fn is None for t in f.values())
    assert bool((f["k_codes"][:, :, 1] == 0).all()) and torch.isfinite(f["k_scale"].float()).all()


@pytest.mark.parametrize("rotate", [False, True])
def test_fp8_key_range_bounds_the_stored_keys(rotate):
    """Quest bounds from the codes: the exact per-channel min/max of the stored keys over valid tokens."""
    k, v = kv(n=3, D=16, seed=5)
    valid = torch.ones(2, 1, 3, 8, dtype=torch.bool)
    valid[0, :, 2, 4:] = False
    valid[1, :, 1] = False  # an empty block
    codec = Fp8Codec(16, rotate=rotate)
    f = codec.encode(k, v, valid)
    f["valid"] = valid
    lo, hi = codec.key_range(f)
    stored = f["k_codes"].view(FP8).float() * f["k_scale"].float() + f["k_shift"].float()  # rotated space when rotate
    inside = (stored >= lo.unsqueeze(3)) & (stored <= hi.unsqueeze(3))
    assert bool(inside[valid.unsqueeze(-1).expand_as(stored)].all())
    real = valid[0, 0, 0]
    assert torch.equal(hi[0, :, 0], stored[0, :, 0][:, real].amax(1))  # tight
    assert torch.equal(lo[1, :, 1], torch.zeros(2, 16)) and torch.equal(hi[1, :, 1], torch.zeros(2, 16))


# --- policy -------------------------------------------------------------------------------------


def test_fp8_policy_switch_and_preset():
    p = get_policy("fp8")
    assert p.warm_bits == "fp8" and p.warm_tokens is None and p.sparse is None and p.name == "fp8"
    warm, cold = make_codecs(p, 64)
    assert isinstance(warm, Fp8Codec) and cold is None and warm.value_group == 64
    warm, cold = make_codecs(TierPolicy(cold="quant", cold_bits="fp8", cold_rotation=True), 64)
    assert isinstance(warm, KBitCodec) and isinstance(cold, Fp8Codec) and cold.rotate
    with pytest.raises(ValueError, match=r"warm_bits='fp9' is not allowed: expected one of \(2, 3, 4, 6, 8, 'fp8'\)"):
        TierPolicy(warm_bits="fp9")
    with pytest.raises(ValueError, match=r"^sparse=SparsePolicy\(.*None with an fp8 tier"):
        get_policy("default").replace(warm_bits="fp8")
    with pytest.raises(ValueError, match="None with an fp8 tier"):
        get_policy("default").replace(cold_bits="fp8")
    get_policy("default").replace(cold="evict", cold_bits="fp8")  # no fp8 tier: allowed


# --- the cache on the tiny Llama -----------------------------------------------------------------

SMALL = get_policy("fp8").replace(hot_tokens=8, block_tokens=8, sink_tokens=4, value_group_size=8)


def test_fp8_cache_close_to_dynamic_and_paths_agree(model):
    from transformers import DynamicCache

    ids = torch.randint(3, 97, (2, 77), generator=torch.Generator().manual_seed(0))
    full = stream_logits(model, DynamicCache(config=model.config), ids, 7)
    out = {}
    for name, policy in (("fp8", SMALL), ("int4", SMALL.replace(warm_bits=4)), ("int8", SMALL.replace(warm_bits=8))):
        for att in ("fast", "per-tier", "reference"):
            with kvtier.enable(model):
                cache = kvtier.TieredCache(model.config, policy, attention=att)
                out[name, att] = stream_logits(model, cache, ids, 7)
        assert cache.layers[1].warm.nblocks >= 7  # the tokens are in the warm tier
    for att in ("per-tier", "reference"):  # the fused kernel is skipped for fp8; every path agrees
        assert (out["fp8", att] - out["fp8", "fast"]).abs().max() < 1e-4
    err = {name: float((out[name, "fast"] - full).abs().max()) for name in ("fp8", "int4", "int8")}
    assert err["int8"] < err["fp8"] < 0.7 * err["int4"], err


@pytest.mark.skipif(ADAPTER_ERROR is not None, reason="generate(cache=...) needs transformers >= 5.24")
def test_fp8_generate_matches_dynamic(model):
    from transformers import DynamicCache

    ids = torch.randint(3, 97, (2, 61), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: excluded from the fp8 scales
    ref = model.generate(ids, attention_mask=mask, cache=DynamicCache(config=model.config), max_new_tokens=20)
    with kvtier.enable(model):
        got = model.generate(ids, attention_mask=mask, cache=kvtier.TieredCache(model.config, SMALL), max_new_tokens=20)
    assert torch.equal(got, ref)


def test_hf_fp8_baseline_builds_and_runs(model):
    from kvtier.eval.caches import cache_spec, kv_bytes

    spec = cache_spec("hf-fp8")
    assert not spec.is_tiered
    cache = spec.build(model)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    with spec.context(model), torch.no_grad():
        model(ids[:, :30], cache=cache)
        model(ids[:, 30:], cache=cache)
    fp16 = 2 * 4 * 2 * 40 * 16 * 2  # K and V, 4 layers, 2 KV heads, 40 tokens, dim 16, 2 bytes
    assert kv_bytes(cache) >= fp16 // 2  # one byte per entry at least


@pytest.mark.parametrize("seq", [1, 13, 150, 333])
@pytest.mark.parametrize("policy", ["fp8", "fp8-cold"])
def test_fp8_plan_equals_memory_report(model, seq, policy):
    p = SMALL if policy == "fp8" else SMALL.replace(warm_bits=4, warm_tokens=32, cold="quant", cold_bits="fp8")
    ids = torch.randint(3, 97, (2, seq), generator=torch.Generator().manual_seed(seq))
    with kvtier.enable(model):
        cache = kvtier.TieredCache(model.config, p)
        stream_logits(model, cache, ids, 100)
    report = cache.memory_report()
    planned = estimate(ModelShape("tiny", ["full_attention"] * 4, 2, 16), seq, p, 2, torch.float32)
    assert planned.total_bytes == report.total_bytes
    assert planned.per_tier == {t: b for t, b in report.per_tier.items() if b or t in planned.per_tier}


def test_fp8_block_bounds_are_upper_bounds(model):
    """Block selection's Quest bounds (read from key_range) bound every score of their block; sparse
    attention itself is refused with an fp8 tier (the selecting kernels read affine codes only)."""
    from kvtier.attention.sparse import block_bounds

    ids = torch.randint(3, 97, (1, 90), generator=torch.Generator().manual_seed(3))
    with kvtier.enable(model):
        cache = kvtier.TieredCache(model.config, SMALL.replace(cold_rotation=True))
        stream_logits(model, cache, ids, 30)
    tier = cache.layers[2].warm
    rows = torch.randn(1, 2, 3, 16)
    bounds = block_bounds(rows, tier)  # [B,H,R,n]
    k, _ = tier.codec.decode(tier.fields, 16, torch.float32)  # [B,H,n,T,D]
    scores = torch.einsum("bhrd,bhntd->bhrnt", rows, k).masked_fill(~tier.fields["valid"].unsqueeze(2), -1e30)
    assert bool((scores.amax(-1) <= bounds + 1e-4).all())
