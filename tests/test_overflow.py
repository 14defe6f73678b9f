"""Storage ranges (issue 33, item 2): keys or values too large for the format a tier stores them in
are refused at the call that would store them, with a one-line :class:`~kvtier.errors.StorageRangeError`,
and the cache is left as it was; never ``inf`` in a tier and ``NaN`` logits.

Two limits: fp16 sinks and hot tokens of an fp32 model (``exact_dtype="half"``, the ``default``,
``chat`` and ``offload-cpu`` presets: 65,504), and the quantization parameters of the warm and cold
codecs and the offload key sketch (fp16 scales, zeros, means and maxima; fp8 e4m3 ``(a, b)``, 448).
The ``exact`` preset stores the model's dtype and keeps working; ``exact_dtype="bfloat16"`` (fp32's
range) is the suggested fix for the first limit. The model's own ``inf``/``NaN`` is not checked.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DynamicCache

import kvtier
from builders import token_ids
from conftest import tiny_llama
from kvtier import TieredCache
from kvtier.codecs import Fp8Codec, KBitCodec, MixedCodec, SignCodec
from kvtier.errors import StorageRangeError

FP16_PRESETS = ("default", "chat", "offload-cpu")
LAYER = 2  # the layer whose keys are scaled up


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7)


@contextlib.contextmanager
def scaled_keys(model, factor: float, layer: int = LAYER):
    """Scale one layer's ``k_proj`` (its keys, post-RoPE too) by ``factor`` for the block."""
    w = model.model.layers[layer].self_attn.k_proj.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w.mul_(factor)
    try:
        yield
    finally:
        with torch.no_grad():
            w.copy_(saved)


def _key_max(model, ids) -> float:
    with torch.no_grad():
        dc = DynamicCache(config=model.config)
        model(ids, cache=dc)
    return float(dc.layers[LAYER].keys.abs().amax())


def _refused_and_unchanged(model, policy, factor: float, match: str) -> None:
    """A prefill, then a call with scaled keys: refused naming the layer; then the same cache gives
    the logits of a cache that never saw the refused call."""
    # bad's own blocks leave the hot window
    first, bad, after = (token_ids(n, seed, batch=2) for n, seed in ((150, 1), (300, 2), (3, 3)))
    cache, fresh = TieredCache(model.config, policy), TieredCache(model.config, policy)
    with kvtier.enable(model), torch.no_grad():
        model(first, cache=cache)
        model(first, cache=fresh)
        before = cache.memory_report()
        with scaled_keys(model, factor):
            assert _key_max(model, bad) > 7e4
            with pytest.raises(StorageRangeError, match=match) as err:
                model(bad, cache=cache)
        assert "\n" not in str(err.value) and f"layer {LAYER}" in str(err.value)
        assert cache.get_seq_length() == 150 and cache.memory_report().to_dict() == before.to_dict()
        got, want = model(after, cache=cache).logits, model(after, cache=fresh).logits
    assert torch.isfinite(got).all() and torch.equal(got, want)
    cache.close()
    fresh.close()


@pytest.mark.parametrize("preset", FP16_PRESETS)
def test_fp16_hot_tier_refuses_keys_beyond_fp16_and_leaves_the_cache_unchanged(model, preset):
    assert kvtier.get_policy(preset).exact_dtype == "half"
    _refused_and_unchanged(model, preset, 1e6, r"keys reach \|x\| = .*65504.*exact_dtype='bfloat16'")


@pytest.mark.parametrize("preset", FP16_PRESETS)
def test_bfloat16_exact_dtype_holds_keys_beyond_fp16(model, preset):
    # the fix the error suggests: sinks and hot ring in bf16 (fp32's range), quantized tiers beyond
    policy = kvtier.get_policy(preset).replace(exact_dtype="bfloat16")
    cache = TieredCache(model.config, policy)
    with kvtier.enable(model), torch.no_grad(), scaled_keys(model, 2e5):
        assert _key_max(model, token_ids(300, 1, batch=2)) > 7e4
        model(token_ids(300, 1, batch=2), cache=cache)  # past chat's 192-token hot window
        logits = model(token_ids(3, 3, batch=2), cache=cache).logits
    assert torch.isfinite(logits).all()
    assert cache.layers[LAYER].hot.k.dtype == torch.bfloat16
    assert cache.memory_report().tokens["warm" if preset != "offload-cpu" else "cold"] > 0
    cache.close()


def test_exact_preset_keeps_fp32_keys_beyond_fp16(model):
    ids = token_ids(150, 1, batch=2)
    with kvtier.enable(model), torch.no_grad(), scaled_keys(model, 1e6):
        cache = TieredCache(model.config, "exact")
        got = model(ids, cache=cache).logits
        want = model(ids, cache=DynamicCache(config=model.config)).logits
    assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("preset", FP16_PRESETS)
def test_quantized_tiers_refuse_blocks_beyond_their_parameters_and_leave_the_cache_unchanged(model, preset):
    # bf16 sinks and hot ring hold |K| ~ 2e7, but no fp16 scale (step) or sketch maximum does
    policy = kvtier.get_policy(preset).replace(exact_dtype="bfloat16")
    _refused_and_unchanged(model, policy, 1e8, r"cannot quantize a block .*float16 \(largest 65504\)")


def _block(scale: float, D: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 2, 3, 8, D, generator=g) * scale
    v = torch.randn(2, 2, 3, 8, D, generator=g) * scale
    valid = torch.ones(2, 1, 3, 8, dtype=torch.bool)
    valid[1, :, 0, :3] = False  # padding stays out of the statistics (and of the check)
    return k, v, valid


CODECS = {
    "int4": (KBitCodec(4, 8), 3e6),
    "int2-rot": (KBitCodec(2, 8, rotate=True), 3e6),
    "sign-rot": (SignCodec(8, rotate=True), 3e6),
    "fp8": (Fp8Codec(8), 3e6),  # the keys' fp16 shift (midrange) stops at 65504, as k-bit zeros do
    "k3v2-fp16": (MixedCodec(3, 2, 8, meta="fp16"), 3e6),
    "k2v1-fp8": (MixedCodec(2, 1, 8, meta="fp8"), 3e3),  # fp8 e4m3 parameters stop at 448
}


@pytest.mark.parametrize("name", list(CODECS))
def test_codec_refuses_a_block_beyond_its_parameter_range(name):
    codec, big = CODECS[name]
    with pytest.raises(StorageRangeError, match=r"cannot quantize a block whose keys/values reach") as err:
        codec.encode(*_block(big))
    assert "\n" not in str(err.value)
    # a block within range: finite parameters, finite decode within the codec's error
    k, v, valid = _block(big / 1e3)
    fields = codec.encode(k, v, valid)
    dk, dv = codec.decode(fields, 16, torch.float32)
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    for x, d in ((k, dk), (v, dv)):
        rel = ((d - x) * valid.unsqueeze(-1)).norm() / (x * valid.unsqueeze(-1)).norm()
        assert rel < 0.9  # the 1- and 2-bit codes are coarse; an overflow would be inf or ~1e3


def test_codec_leaves_non_finite_model_output_alone():
    # inf/NaN from the model is not a range error: the block is stored as the quantizer makes it
    k, v, valid = _block(1.0)
    k[0, 0, 0, 0, 0] = float("inf")
    KBitCodec(4, 8).encode(k, v, valid)
    MixedCodec(2, 2, 8, meta="fp8").encode(k, v, valid)
