"""A forward call is all-or-nothing over every layer of the cache (hybrid models' sliding-window layers
included) and is kept when the model's forward returns (issue 51: K1, K2, K3, K9-K12, K8's ``bits``).
Tiny random models built in code, no files."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

import kvtier
from conftest import kvtier_attention_by_hand
from kvtier.errors import CacheFullError, KVTierError, StorageRangeError
from kvtier.hf import attention as hf_attention
from kvtier.hf import cache as hf_cache
from kvtier.testing import random_ids, tiny_gemma3, tiny_llama


class Injected(Exception):
    pass


def _feed(model, cache, ids: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    out = None
    for s in range(0, ids.shape[1], chunk):
        with torch.no_grad():
            out = model(ids[:, s : s + chunk], cache=cache, use_cache=True).logits
    return out


def _lengths(cache) -> list[int]:
    return [layer.get_seq_length() for layer in cache.layers]


def _sliding(cache) -> list[tuple]:
    """The sliding layers' tensors and counters, for exact comparison."""
    return [
        (layer.cumulative_length, layer.keys.clone(), layer.values.clone())
        for layer in cache.layers
        if not isinstance(layer, kvtier.hf.layer.TieredLayer) and layer.is_initialized
    ]


def _same_sliding(a: list[tuple], b: list[tuple]) -> None:
    assert len(a) == len(b)
    for (n, k, v), (m, k2, v2) in zip(a, b):
        assert n == m and torch.equal(k, k2) and torch.equal(v, v2)


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3(seed=2)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=1)


def _raise_from(module, err: BaseException):
    def hook(*args):
        raise err

    return module.register_forward_hook(hook)


# --- K1: hybrid models ---------------------------------------------------------------------------------
def test_a_byte_cap_on_a_hybrid_model_leaves_the_sliding_layers_unchanged(gemma):
    """The repro of K1: a cap refused at the full layer (layer 3) used to leave the three sliding
    layers holding the call's 200 tokens ([200, 200, 200, 0]) under a "cache is unchanged" message."""
    with kvtier.enable(gemma):
        cache = kvtier.TieredCache(gemma.config, "default", max_bytes=30_000)
        with pytest.raises(CacheFullError, match="unchanged"):
            _feed(gemma, cache, random_ids(200))
        assert _lengths(cache) == [0, 0, 0, 0]
        big = kvtier.TieredCache(gemma.config, "default", max_bytes=10**9)
        _feed(gemma, big, random_ids(100))
        before = _sliding(big)
        big.max_bytes = 30_000
        with pytest.raises(CacheFullError, match="unchanged"):
            _feed(gemma, big, random_ids(200, seed=1))
        assert _lengths(big) == [100] * 4
        _same_sliding(before, _sliding(big))


@pytest.mark.parametrize("where", ["layer0", "layer1", "norm", "lm_head"])
@pytest.mark.parametrize("err", [Injected("boom"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_an_exception_anywhere_in_a_hybrid_forward_puts_every_layer_back(gemma, where, err):
    """K1 and K3: an exception in a sliding layer before any tiered one, between layers, after the
    last layer (final norm, lm_head), Ctrl-C included: the cache is back at once, and the same call
    again gives bit for bit the logits of a cache that never failed."""
    module = {
        "layer0": gemma.model.layers[0],
        "layer1": gemma.model.layers[1],
        "norm": gemma.model.norm,
        "lm_head": gemma.lm_head,
    }[where]
    with kvtier.enable(gemma):
        ref, cache = (kvtier.TieredCache(gemma.config, "default") for _ in range(2))
        for c in (ref, cache):
            _feed(gemma, c, random_ids(300), chunk=128)
        before = _sliding(cache)
        handle = _raise_from(module, err)
        try:
            with pytest.raises(type(err)):
                _feed(gemma, cache, random_ids(50, seed=1))
        finally:
            handle.remove()
        assert _lengths(cache) == [300] * 4
        _same_sliding(before, _sliding(cache))
        got = _feed(gemma, cache, random_ids(50, seed=1))
        torch.testing.assert_close(got, _feed(gemma, ref, random_ids(50, seed=1)), rtol=0, atol=0)
        assert _lengths(cache) == [350] * 4


def test_a_range_error_on_a_hybrid_model_leaves_the_sliding_layers_unchanged(gemma, monkeypatch):
    with kvtier.enable(gemma):
        cache = kvtier.TieredCache(gemma.config, "default")
        _feed(gemma, cache, random_ids(100))
        before = _sliding(cache)
        layer = cache.layers[3]

        def out_of_range(*args):
            raise StorageRangeError("injected: out of range")

        monkeypatch.setattr(layer, "check_exact_range", out_of_range)
        with pytest.raises(StorageRangeError):
            _feed(gemma, cache, random_ids(30, seed=1))
        monkeypatch.undo()
        assert _lengths(cache) == [100] * 4
        _same_sliding(before, _sliding(cache))


def test_a_hybrid_model_without_the_wrapper_opens_the_call_at_its_first_layer(gemma):
    """kvtier attention selected by hand (no forward wrapper): the call opens at layer 0 (a sliding
    layer) and an interruption between two layers is undone at the next call, which asks to call
    again (it used to leave [400, 400, 350, 350])."""
    hf_attention.register()
    previous = gemma.config._attn_implementation
    gemma.set_attn_implementation("kvtier")
    try:
        cache = kvtier.TieredCache(gemma.config, "default")
        _feed(gemma, cache, random_ids(300), chunk=128)
        handle = _raise_from(gemma.model.layers[1], KeyboardInterrupt())
        try:
            with pytest.raises(KeyboardInterrupt):
                _feed(gemma, cache, random_ids(50, seed=1))
        finally:
            handle.remove()
        with pytest.raises(KVTierError, match="call again"):
            _feed(gemma, cache, random_ids(50, seed=1))
        assert _lengths(cache) == [300] * 4
        _feed(gemma, cache, random_ids(50, seed=1))
        assert _lengths(cache) == [350] * 4
    finally:
        gemma.set_attn_implementation(previous)


# --- K3: kept when the forward returns -----------------------------------------------------------------
@pytest.mark.parametrize("where", ["last_mlp", "norm", "lm_head"])
def test_an_exception_after_the_last_kvtier_layer_undoes_the_call(llama, where):
    """K3: the call used to be kept once the last tiered layer settled, so a failure in the last
    MLP, the final norm or lm_head left it kept and a retry fed the chunk twice."""
    module = {"last_mlp": llama.model.layers[-1].mlp, "norm": llama.model.norm, "lm_head": llama.lm_head}[where]
    with kvtier.enable(llama):
        ref, cache = (kvtier.TieredCache(llama.config, "default") for _ in range(2))
        for c in (ref, cache):
            _feed(llama, c, random_ids(700), chunk=128)
        handle = _raise_from(module, Injected(where))
        try:
            with pytest.raises(Injected):
                _feed(llama, cache, random_ids(40, seed=1))
        finally:
            handle.remove()
        assert cache.get_seq_length() == 700
        got = _feed(llama, cache, random_ids(40, seed=1))
        torch.testing.assert_close(got, _feed(llama, ref, random_ids(40, seed=1)), rtol=0, atol=0)


def test_generate_keeps_each_step_and_an_exception_in_a_step_undoes_only_that_step(llama):
    with kvtier.enable(llama):
        cache = kvtier.TieredCache(llama.config, "default")
        calls = []

        def fail_on_third(module, args, output):
            calls.append(1)
            if len(calls) == 3:
                raise Injected("step 3")

        handle = llama.lm_head.register_forward_hook(fail_on_third)
        try:
            with pytest.raises(Injected):
                llama.generate(random_ids(20), cache=cache, max_new_tokens=5, do_sample=False)
        finally:
            handle.remove()
        assert cache.get_seq_length() == 21  # the prompt and the first generated token: steps 1 and 2


def test_the_base_model_inside_the_causal_lm_joins_the_outer_call(llama):
    """The wrapper is on the *ForCausalLM and its base model: calling the base model directly is
    one call too, and inside the outer one it joins it (one call, not two)."""
    with kvtier.enable(llama):
        assert isinstance(llama.__dict__["forward"], hf_attention._ForwardWrapper)
        assert isinstance(llama.model.__dict__["forward"], hf_attention._ForwardWrapper)
        cache = kvtier.TieredCache(llama.config, "default")
        with torch.no_grad():
            llama.model(random_ids(30), cache=cache, use_cache=True)
        assert cache.get_seq_length() == 30
        _feed(llama, cache, random_ids(10, seed=1))
        assert cache.get_seq_length() == 40
    assert "forward" not in llama.__dict__ and "forward" not in llama.model.__dict__


def test_a_copied_or_pickled_enabled_model_runs_itself_not_the_original(llama):
    import copy

    with kvtier.enable(llama):
        half = copy.deepcopy(llama).to(torch.bfloat16)
        assert half.forward.module() is half
        again = pickle.loads(pickle.dumps(llama))
        assert again.forward.module() is again and again.model.forward.module() is again.model
        with kvtier.enable(half):
            cache = kvtier.TieredCache(half.config, "default")
            out = _feed(half, cache, random_ids(20))
            assert out.dtype == torch.bfloat16


def test_the_wrapper_keeps_the_forward_signature(llama):
    import inspect

    plain = inspect.signature(llama.forward)
    with kvtier.enable(llama):
        assert inspect.signature(llama.forward) == plain
        assert llama.forward.__name__ == "forward"


# --- K2, K10, K11: a cache of another model -------------------------------------------------------------
def test_a_cache_built_for_more_layers_is_refused_at_the_first_call():
    small = tiny_llama(num_hidden_layers=2)
    with kvtier.enable(small):
        cache = kvtier.TieredCache(tiny_llama().config, "default")
        for _ in range(2):
            with pytest.raises(KVTierError, match="built for 4 layers; the model has 2"):
                _feed(small, cache, random_ids(10))
        assert cache.get_seq_length() == 0


def test_a_cache_of_other_layer_kinds_is_refused_in_one_line():
    """K11: a Gemma 3 cache (sliding + full) used by a Llama of the same head shape raised a raw
    torch size mismatch."""
    llama4 = tiny_llama(num_hidden_layers=4, num_key_value_heads=1, head_dim=32, num_attention_heads=2)
    with kvtier.enable(llama4):
        cache = kvtier.TieredCache(tiny_gemma3().config, "default")
        with pytest.raises(KVTierError, match="other layer kinds.*layer 0: 'sliding_attention'"):
            _feed(llama4, cache, random_ids(10))


def test_a_cache_from_another_models_config_says_so():
    """K10: it used to blame the model ("the model uses 'sdpa': run it inside kvtier.enable")."""
    a, b = tiny_llama(), tiny_llama(seed=1)
    cache = kvtier.TieredCache(a.config, "default")
    with kvtier.enable(b):
        with pytest.raises(KVTierError, match="another model's config"):
            _feed(b, cache, random_ids(10))


# --- K9: two threads -----------------------------------------------------------------------------------
def test_a_refused_thread_is_told_of_the_other_thread(llama):
    """K9: the thread that lost the race sometimes got "this forward call did not build kvtier's
    mask". With the wrapper the call opens before the mask is built, so the loser sees the open call."""
    with kvtier.enable(llama):
        cache = kvtier.TieredCache(llama.config, "default")
        started, release = threading.Event(), threading.Event()

        def hold(module, args, output):
            started.set()
            release.wait(10)

        handle = llama.model.layers[1].register_forward_hook(hold)
        t = threading.Thread(target=_feed, args=(llama, cache, random_ids(16)), name="first")
        t.start()
        try:
            assert started.wait(10)
            handle.remove()
            with pytest.raises(KVTierError, match="in use by a forward call in thread 'first'"):
                _feed(llama, cache, random_ids(16, seed=1))
        finally:
            release.set()
            t.join()
        assert cache.get_seq_length() == 16


def test_a_call_that_started_during_another_threads_call_names_it(llama, monkeypatch):
    """Without the wrapper the mask ids decide: a call whose mask is older than the last kept
    call's, when that call was another thread's, is concurrent use (not a missing mask)."""
    with kvtier_attention_by_hand(llama):
        cache = kvtier.TieredCache(llama.config, "default")
        _feed(llama, cache, random_ids(8))
        cache._last_thread = "other"  # the last kept call was another thread's, after this one's mask
        monkeypatch.setattr(hf_cache, "forward_epoch", lambda: cache._epoch - 1)
        with pytest.raises(KVTierError, match="thread 'other'.*concurrent use"):
            _feed(llama, cache, random_ids(8, seed=1))
        assert cache.get_seq_length() == 8


# --- K12: pickles carry a format version ---------------------------------------------------------------
def test_a_pickle_of_another_format_is_refused_in_one_line(llama, monkeypatch):
    with kvtier.enable(llama):
        cache = kvtier.TieredCache(llama.config, "default")
        _feed(llama, cache, random_ids(100))
        data = pickle.dumps(cache)
        assert _lengths(pickle.loads(data)) == [100] * 4
        monkeypatch.setattr(hf_cache, "STATE_VERSION", hf_cache.STATE_VERSION + 1)
        with pytest.raises(KVTierError, match="incompatible kvtier version"):
            pickle.loads(data)


def test_the_version_is_checked_before_the_state_is_read(llama):
    """A future layout may move classes: the version is read first, so such a pickle is refused in
    one line instead of a ModuleNotFoundError."""
    cache = kvtier.TieredCache(llama.config, "default")
    data = pickle.dumps(cache).replace(b"kvtier.cache.tiers", b"kvtier.cache.gone_")
    with pytest.raises(ModuleNotFoundError):  # the state alone would fail on the moved class
        pickle.loads(data)
    future = data.replace(pickle.dumps(hf_cache.STATE_VERSION)[2:-1], pickle.dumps(hf_cache.STATE_VERSION + 1)[2:-1], 1)
    with pytest.raises(KVTierError, match="incompatible kvtier version"):
        pickle.loads(future)


def test_a_pickle_without_a_version_is_refused(llama):
    cache = kvtier.TieredCache(llama.config, "default")
    state = cache.__getstate__()
    state.pop("_state_version")
    new = kvtier.TieredCache.__new__(kvtier.TieredCache)
    with pytest.raises(KVTierError, match="incompatible kvtier version"):
        new.__setstate__(state)


# --- K8: bits named twice ------------------------------------------------------------------------------
def test_bits_that_contradict_the_policy_name_are_refused(llama):
    with pytest.raises(ValueError, match="names a budget of 2.5 bits"):
        kvtier.TieredCache(llama.config, "adaptive@2.5", bits=3.0)
    assert kvtier.TieredCache(llama.config, "adaptive@2.5", bits=2.5).policy.adaptive.bits == 2.5
    assert kvtier.TieredCache(llama.config, "adaptive", bits=3.0).policy.adaptive.bits == 3.0


def test_a_hybrid_cache_cropped_to_nothing_takes_a_batch_change(gemma):
    """Found by scripts/fuzz_model.py (seed 2980): a sliding layer cropped to no token skipped
    ``batch_select_indices`` (transformers' layers do when empty) and kept an empty tensor of the old
    batch, so the next call raised a raw torch size mismatch."""
    with kvtier.enable(gemma):
        cache = kvtier.TieredCache(gemma.config, "exact")
        _feed(gemma, cache, random_ids(2, batch=3))
        cache.crop(-2)
        cache.batch_select_indices(torch.tensor([0, 2]))
        _feed(gemma, cache, random_ids(5, batch=2))
        assert _lengths(cache) == [5] * 4


def test_a_byte_cap_counts_sliding_layers_that_run_after_the_last_tiered_one():
    """Found by scripts/fuzz_model.py (seed 4404): the cap was checked at each tiered layer's settle,
    so a sliding layer after the last full one grew past ``max_bytes`` unchecked; the call now ends
    within the cap or is refused whole."""
    model = tiny_gemma3(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"])
    with kvtier.enable(model):
        ref = kvtier.TieredCache(model.config, "default")
        _feed(model, ref, random_ids(20))
        _feed(model, ref, random_ids(12, seed=1))
        need = ref.memory_report().total_bytes
        cache = kvtier.TieredCache(model.config, "default", max_bytes=need - 1)
        _feed(model, cache, random_ids(20))
        before = _lengths(cache)
        with pytest.raises(CacheFullError, match="unchanged"):
            _feed(model, cache, random_ids(12, seed=1))
        assert _lengths(cache) == before
        assert cache.memory_report().total_bytes <= need - 1
