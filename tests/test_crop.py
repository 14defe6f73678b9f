"""``crop()`` for assisted and prompt-lookup decoding (issue 33, item 9).

A tiered layer can remove its latest tokens while they are still exact (in the hot buffer: every
token for ``exact``); beyond that ``crop`` raises a one-line ``KVTierError`` and nothing changes,
in any layer. ``exact`` then decodes token for token like ``DynamicCache`` with a draft model or
prompt lookup; the lossy presets give their own non-assisted greedy output on the tiny model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvtier
from builders import token_ids
from conftest import tiny_llama
from kvtier.errors import KVTierError
from kvtier.hf.layer import TieredLayer

LAYER_PRESETS = ["exact", "default", "chat", "kivi2", "fp8", "sink-window", "offload-cpu", "adaptive"]


def _layer_state(layer: TieredLayer) -> dict:
    """What a layer holds, copied (counts, the hot tokens, every other tier tensor)."""
    out: dict = {"counts": (layer.seen, layer.hot_start, layer.evicted, layer.token_counts())}
    k, v = layer.hot.view()
    out["hot"] = [k.clone(), v.clone()]
    for name, ts in layer.tier_tensors().items():
        if name != "hot":
            out[name] = [t.clone() for t in ts]
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], list):
            assert len(a[key]) == len(b[key]) and all(torch.equal(x, y) for x, y in zip(a[key], b[key])), key
        else:
            assert a[key] == b[key], key


def _fed_layer(name: str, total: int, chunks: tuple[int, ...] = (200,), B: int = 2, pads: tuple[int, ...] = (0, 5)):
    """A layer of preset ``name`` fed ``sum(chunks)`` random tokens (left padding ``pads``) as the
    attention path does (update, then settle); also the keys, values and validity fed."""
    g = torch.Generator().manual_seed(0)
    H, D = 2, 16
    keys = torch.randn(B, H, total, D, generator=g)
    values = torch.randn(B, H, total, D, generator=g)
    valid = torch.arange(total)[None, :] >= torch.tensor(pads)[:, None]
    layer = TieredLayer(kvtier.get_policy(name))
    pos = 0
    for c in chunks:
        layer.update(keys[:, :, pos : pos + c], values[:, :, pos : pos + c], kwargs={})
        pos += c
        layer.settle(valid[:, :pos])
    return layer, keys, values, valid


@pytest.mark.parametrize("name", LAYER_PRESETS)
def test_crop_removes_the_latest_exact_tokens_and_decoding_goes_on(name):
    """A draft of 9 tokens, 6 of them rejected: crop(-6) leaves the accepted tokens exact in hot,
    ``seen``, the sequence length and the mask size drop by 6, and the next tokens append after them."""
    layer, keys, values, valid = _fed_layer(name, 260, chunks=(200, 1, 9))
    before = layer.token_counts()
    assert layer.is_croppable and layer.croppable_tokens == before["hot"] >= 9
    layer.crop(-6)
    seen = 204
    assert layer.seen == layer.get_seq_length() == seen and layer.get_mask_sizes(1) == (seen + 1, 0)
    counts = layer.token_counts()
    assert counts["hot"] == before["hot"] - 6
    assert {k: v for k, v in counts.items() if k != "hot"} == {k: v for k, v in before.items() if k != "hot"}
    hk, hv = layer.hot.view()  # exact in the storage dtype (fp16 for presets with exact_dtype="half")
    assert torch.equal(hk, keys[:, :, layer.hot_start : seen].to(hk.dtype))
    assert torch.equal(hv, values[:, :, layer.hot_start : seen].to(hv.dtype))
    # the next call appends the corrected tokens where the rejected ones were, and settles as usual
    layer.update(keys[:, :, seen:260], values[:, :, seen:260], kwargs={})
    layer.settle(valid[:, :260])
    counts = layer.token_counts()
    assert layer.seen == 260 and counts["hot"] + counts["warm"] + counts["cold"] + counts["evicted"] == 260
    hk, _ = layer.hot.view()
    assert torch.equal(hk, keys[:, :, layer.hot_start : 260].to(hk.dtype))


@pytest.mark.parametrize("name", ["default", "kivi2", "offload-cpu"])
def test_crop_beyond_the_hot_window_is_refused_and_changes_nothing(name):
    layer, *_ = _fed_layer(name, 200)
    most = layer.croppable_tokens
    assert 0 < most < 200
    before = _layer_state(layer)
    with pytest.raises(KVTierError, match=f"cannot crop {most + 1} tokens: only the latest {most} are still exact"):
        layer.crop(-(most + 1))
    _assert_same(_layer_state(layer), before)
    layer.crop(-most)  # the whole hot window can go
    assert layer.seen == 200 - most and layer.hot.length == 0


def test_exact_layer_crops_every_token_and_matches_a_layer_that_never_saw_them():
    layer, keys, values, valid = _fed_layer("exact", 120, chunks=(100, 20))
    layer.crop(-20)
    ref, *_ = _fed_layer("exact", 120, chunks=(100,))
    _assert_same(_layer_state(layer), _layer_state(ref))
    layer.crop(-100)
    assert layer.seen == 0 and layer.hot.length == 0


@pytest.mark.parametrize(
    "arg, exc, match",
    [
        (3, ValueError, r"crop\(tokens_to_remove=3\) is not allowed: expected an int <= 0"),
        (-1.0, TypeError, r"crop\(tokens_to_remove=-1.0\) is not allowed: expected an int <= 0"),
        (True, TypeError, r"crop\(tokens_to_remove=True\) is not allowed"),
    ],
)
def test_crop_arguments_are_checked(arg, exc, match):
    layer, *_ = _fed_layer("default", 100)
    before = _layer_state(layer)
    with pytest.raises(exc, match=match):
        layer.crop(arg)
    layer.crop(0)  # a no-op, as transformers calls it
    _assert_same(_layer_state(layer), before)


def test_a_layer_without_a_hot_window_is_not_croppable():
    policy = kvtier.TierPolicy(hot_tokens=0, layer_overrides={})
    assert not TieredLayer(policy).is_croppable
    assert all(TieredLayer(kvtier.get_policy(n)).is_croppable for n in kvtier.PRESETS)


# --- the cache: all or nothing across layers, mask sizes, journal ----------------------------------
@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=1)


def _state(cache: kvtier.TieredCache) -> dict:
    return {
        (layer.layer_idx, key): value
        for layer in cache.tiered_layers
        if layer.is_initialized
        for key, value in _layer_state(layer).items()
    }


def _forward(model, cache, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    seen = cache.get_seq_length()
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True, attention_mask=mask[:, : seen + ids.shape[1]]).logits


def test_cache_crop_beyond_a_lossy_layer_changes_no_layer(llama):
    """Layer 0 exact (it could crop everything), layers 1-3 ``default``: a crop past the lossy
    layers' hot window is refused before layer 0 changes."""
    cache = kvtier.TieredCache(llama.config, kvtier.get_policy("default").replace(layer_overrides={0: "exact"}))
    ids = token_ids(200)
    with kvtier.enable(llama):
        _forward(llama, cache, ids, torch.ones_like(ids))
        most = min(layer.croppable_tokens for layer in cache.tiered_layers)
        assert cache.tiered_layers[0].croppable_tokens == 200 > most
        before = _state(cache)
        with pytest.raises(KVTierError, match=rf"\(layer 1\) cannot crop {most + 1} tokens.*crop at most {most}$"):
            cache.crop(-(most + 1))
        _assert_same(_state(cache), before)
        assert cache.get_seq_length() == 200
        cache.crop(-3)
        assert cache.get_seq_length() == 197 and all(layer.seen == 197 for layer in cache.tiered_layers)


@pytest.mark.parametrize("name", ["exact", "default"])
def test_crop_then_decode_matches_dynamic_cache_with_left_padding(llama, name):
    """Batch 2, left padding: prefill, a 5-token draft call, crop(-3), then 2 more tokens. ``exact``
    gives DynamicCache's logits at every step; ``default`` stays close (its prompt has coded tokens)."""
    ids = token_ids(170, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    tol = dict(atol=1e-5, rtol=1e-5) if name == "exact" else dict(atol=0.5, rtol=0)
    dyn, cache = DynamicCache(), kvtier.TieredCache(llama.config, name)
    with kvtier.enable(llama):
        for a, b, crop in [(0, 160, 0), (160, 165, -3), (162, 164, 0)]:
            want = _forward(llama, dyn, ids[:, a:b], mask)
            got = _forward(llama, cache, ids[:, a:b], mask)
            torch.testing.assert_close(got, want, **tol)
            dyn.crop(crop)
            cache.crop(crop)
            assert cache.get_seq_length() == dyn.get_seq_length()
    assert cache.get_seq_length() == 164


def test_a_failed_call_after_a_crop_puts_the_cropped_cache_back(llama):
    """The crop is kept (no journal spans it); a call that fails after it is undone back to the
    cropped state at once (``kvtier.enable``'s wrapper), and the cache crops again."""
    cache = kvtier.TieredCache(llama.config, "default")
    ids = token_ids(200)
    mask = torch.ones_like(ids)

    def fail(module, args, output):
        raise RuntimeError("injected between two layers")

    with kvtier.enable(llama):
        _forward(llama, cache, ids[:, :190], mask)
        cache.crop(-4)
        after_crop = _state(cache)
        hook = llama.model.layers[2].register_forward_hook(fail)
        try:
            with pytest.raises(RuntimeError, match="injected"):
                _forward(llama, cache, ids[:, 186:192], mask)
        finally:
            hook.remove()
        _assert_same(_state(cache), after_crop)
        assert cache.get_seq_length() == 186
        cache.crop(-1)
        assert cache.get_seq_length() == 185


# --- assisted generation ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft():
    return tiny_llama(seed=7)  # another random Llama with the same vocabulary: many rejections


def _prompt() -> torch.Tensor:
    return token_ids(60, seed=3).repeat(1, 3)  # repeated text: prompt lookup finds candidates


@pytest.fixture
def crops(monkeypatch):
    """The arguments of every TieredCache.crop call."""
    seen: list[int] = []
    crop = kvtier.TieredCache.crop

    def spy(self, tokens_to_remove):
        seen.append(tokens_to_remove)
        return crop(self, tokens_to_remove)

    monkeypatch.setattr(kvtier.TieredCache, "crop", spy)
    return seen


def _generate(model, cache, **kw) -> torch.Tensor:
    with kvtier.enable(model), torch.no_grad():
        return model.generate(input_ids=_prompt(), cache=cache, max_new_tokens=24, do_sample=False, **kw)


@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
@pytest.mark.parametrize("name", ["exact", "default", "chat"])
def test_assisted_generation_gives_the_non_assisted_tokens(llama, draft, crops, name, how):
    kw = {"prompt_lookup_num_tokens": 5} if how == "prompt_lookup" else {"assistant_model": draft}
    out = _generate(llama, kvtier.TieredCache(llama.config, name), **kw)
    assert any(n < 0 for n in crops)  # draft tokens were rejected and rolled back
    plain = _generate(llama, kvtier.TieredCache(llama.config, name))
    assert torch.equal(out, plain)
    if name == "exact":
        with torch.no_grad():
            dyn = llama.generate(input_ids=_prompt(), cache=DynamicCache(), max_new_tokens=24, do_sample=False, **kw)
        assert torch.equal(out, dyn)
