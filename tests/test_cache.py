"""TieredCache inside transformers: exact equivalence, generation modes, hybrids, dtypes, reports."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvtier
from builders import token_ids
from conftest import tiny_llama
from kvtier import TieredCache, TierPolicy
from kvtier.diagnostics import reachable_tensor_bytes

# Small tiers so a few hundred tokens cross every boundary.
SMALL = TierPolicy(
    hot_tokens=16, warm_tokens=32, block_tokens=8, sink_tokens=4, value_group_size=8, layer_overrides={0: "exact"}
)


def left_padded(lengths, seed=0):
    T = max(lengths)
    ids = token_ids(T, seed, batch=len(lengths))
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, : T - n] = 0
        mask[b, T - n :] = 1
    return ids, mask


def generate(model, cache, **kw):
    with kvtier.enable(model):
        return model.generate(cache=cache, do_sample=False, **kw)


def test_exact_matches_dynamic_greedy(model):
    ids = token_ids(60)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False, cache=DynamicCache(config=model.config))
    out = generate(model, TieredCache(model.config, "exact"), input_ids=ids, max_new_tokens=40)
    assert torch.equal(out, ref)


def test_exact_matches_dynamic_logits_chunked(model):
    """Chunked forward (prefill in pieces), logits equal to the last bit."""
    ids = token_ids(70)
    dyn, tier = DynamicCache(config=model.config), TieredCache(model.config, "exact")
    with torch.no_grad():
        for s in range(0, 70, 16):
            a = model(ids[:, s : s + 16], cache=dyn).logits
            with kvtier.enable(model):
                b = model(ids[:, s : s + 16], cache=tier).logits
            assert torch.equal(a, b)


def test_exact_matches_dynamic_left_padded_batch(model):
    ids, mask = left_padded([30, 45, 12])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24)
    ref = model.generate(cache=DynamicCache(config=model.config), do_sample=False, **kw)
    assert torch.equal(generate(model, TieredCache(model.config, "exact"), **kw), ref)


def test_exact_matches_dynamic_beam_search(model):
    ids = token_ids(30)
    kw = dict(input_ids=ids, max_new_tokens=20, num_beams=3, num_return_sequences=3)
    ref = model.generate(cache=DynamicCache(config=model.config), do_sample=False, **kw)
    assert torch.equal(generate(model, TieredCache(model.config, "exact"), **kw), ref)


def test_exact_matches_dynamic_sampling(model):
    ids = token_ids(30)
    torch.manual_seed(5)
    ref = model.generate(ids, max_new_tokens=20, do_sample=True, top_k=20, cache=DynamicCache(config=model.config))
    torch.manual_seed(5)
    with kvtier.enable(model):
        out = model.generate(ids, max_new_tokens=20, do_sample=True, top_k=20, cache=TieredCache(model.config, "exact"))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("policy", [SMALL, SMALL.replace(cold="quant", cold_bits=3), SMALL.replace(cold="evict")])
@pytest.mark.parametrize("mode", ["greedy", "beam", "padded", "sample"])
def test_lossy_policies_generate(model, policy, mode):
    kw: dict = dict(max_new_tokens=30, min_new_tokens=30)
    if mode == "padded":
        kw["input_ids"], kw["attention_mask"] = left_padded([90, 60, 100])
    else:
        kw["input_ids"] = token_ids(100)
    if mode == "beam":
        kw["num_beams"] = 3
    cache = TieredCache(model.config, policy)
    with kvtier.enable(model):
        if mode == "sample":
            out = model.generate(cache=cache, do_sample=True, **kw)
        else:
            out = model.generate(cache=cache, do_sample=False, **kw)
    assert out.shape[1] == kw["input_ids"].shape[1] + 30
    layer = cache.layers[1]
    counts = layer.token_counts()
    assert counts["warm"] > 0 and (counts["cold"] > 0 or counts["evicted"] > 0)
    assert cache.layers[0].token_counts()["hot"] == cache.get_seq_length()  # layer 0 exact by override


def test_lossy_close_to_exact_logits(model):
    """A 8-bit warm tier barely moves the logits; the reference path really reads the tiers."""
    ids = token_ids(120)
    out = {}
    for name, pol in {
        "exact": "exact",
        "int8": SMALL.replace(warm_bits=8, warm_tokens=None),
        "int2": SMALL.replace(warm_bits=2, warm_tokens=None),
    }.items():
        cache = TieredCache(model.config, pol)
        with kvtier.enable(model), torch.no_grad():
            for s in range(0, 120, 10):
                logits = model(ids[:, s : s + 10], cache=cache).logits
        out[name] = logits.float()
    err8 = (out["int8"] - out["exact"]).abs().max()
    err2 = (out["int2"] - out["exact"]).abs().max()
    assert 0 < err8 < err2


def test_requires_enable(model):
    cache = TieredCache(model.config, "default")
    with pytest.raises(RuntimeError, match="kvtier.enable"):
        model(token_ids(40), cache=cache)


def test_enable_disable_restores():
    m = tiny_llama()
    before = m.config._attn_implementation
    with kvtier.enable(m):
        assert m.config._attn_implementation == "kvtier"
    assert m.config._attn_implementation == before
    kvtier.enable(m)
    kvtier.disable(m)
    assert m.config._attn_implementation == before


def test_kvtier_attention_with_dynamic_cache_matches_sdpa(model):
    ids, mask = left_padded([20, 33])
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    out = generate(model, DynamicCache(config=model.config), input_ids=ids, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(out, ref)


def tiny_qwen2_hybrid():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention"] * 2,
        pad_token_id=0,
        eos_token_id=2,
    )
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m


def test_hybrid_sliding_layers():
    m = tiny_qwen2_hybrid()
    cache = TieredCache(m.config, "exact")
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds[1] == "TieredLayer" and kinds[0] == "DynamicSlidingWindowLayer"
    ids = token_ids(50)
    ref = m.generate(ids, max_new_tokens=15, do_sample=False, cache=DynamicCache(config=m.config))
    assert torch.equal(generate(m, cache, input_ids=ids, max_new_tokens=15), ref)
    lossy = TieredCache(m.config, SMALL)
    generate(m, lossy, input_ids=ids, max_new_tokens=15)
    assert lossy.memory_report().per_tier["other"] > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes(dtype):
    m = tiny_llama(dtype=dtype)
    cache = TieredCache(m.config, SMALL.replace(exact_dtype="half"))
    with kvtier.enable(m), torch.no_grad():
        logits = m(token_ids(100), cache=cache).logits
        logits = m(token_ids(3), cache=cache).logits
    assert torch.isfinite(logits).all()
    hot = cache.layers[1].hot.k
    assert hot.dtype == (torch.float16 if dtype == torch.float32 else dtype)


@pytest.mark.parametrize("policy", ["default", "max-compression", "kivi2", "sink-window", "exact", SMALL])
def test_memory_report_counts_every_tensor(model, policy):
    cache = TieredCache(model.config, policy)
    with kvtier.enable(model), torch.no_grad():
        model(token_ids(300, batch=2), cache=cache)
        model(token_ids(1, batch=2), cache=cache)
    r = cache.memory_report()
    assert r.total_bytes == reachable_tensor_bytes(cache)
    assert r.resident_bytes == r.total_bytes and r.offloaded_bytes == 0
    cfg = model.config
    assert r.dense_fp16_bytes == 2 * 2 * cfg.num_key_value_heads * 301 * cfg.head_dim * 2 * cfg.num_hidden_layers
    assert sum(r.per_tier.values()) == r.total_bytes
    d = r.to_dict()
    assert {"total_bytes", "resident_bytes", "offloaded_bytes", "dense_fp16_bytes", "tokens", "per_layer"} <= d.keys()


def test_bad_override_index(model):
    with pytest.raises(ValueError, match="layer_overrides key 7"):
        TieredCache(model.config, TierPolicy(layer_overrides={7: "exact"}))


def test_layer_overrides_take_variant_names():
    # a layer may name a preset variant: its cold tier in vector codes, or its own adaptive budget
    from kvtier.codecs import VqCodec

    model = tiny_llama(head_dim=64)  # the presets' 64-token value groups
    policy = kvtier.get_policy("default").replace(layer_overrides={1: "default:vq3/3", -1: "adaptive@4:codes=vq"})
    cache = TieredCache(model.config, policy)
    names = ["default", "default:vq3/3", "default", "adaptive@4:codes=vq"]
    assert [layer.policy.name for layer in cache.layers] == names
    assert [layer.budget is not None for layer in cache.layers] == [False, False, False, True]
    with kvtier.enable(model), torch.no_grad():
        model(token_ids(1300), cache=cache)  # past sinks, hot and default's 1,024-token warm window
        model(token_ids(1), cache=cache)
    codecs = [type(layer.cold.codec) for layer in cache.layers]
    assert codecs[1] is VqCodec and codecs[3] is VqCodec and codecs[0] is not VqCodec and codecs[2] is not VqCodec
    assert cache.allocation()["allocated"]
