"""Misuse is caught at the call where it happens; faults leave the cache as it was (or unusable,
with a kvtier error); byte caps; inference mode. Tiny random Llama, no files."""

from __future__ import annotations

import copy

import pytest
import torch

import kvtier
from conftest import kvtier_attention_by_hand, tiny_llama, tiny_llama_config
from kvtier.attention import interface
from kvtier.errors import CacheFullError, KVTierError
from kvtier.hf.layer import TieredLayer

PRESETS_MOVING = ["default", "max-compression", "kivi2", "sink-window", "chat", "offload-cpu", "offload-disk"]


def _ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (batch, n), generator=g)


def _feed(model, cache, ids: torch.Tensor, chunk: int = 256, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``ids`` through ``model`` in chunks with ``cache``; logits of the last chunk."""
    out = None
    seen = cache.get_seq_length()
    for s in range(0, ids.shape[1], chunk):
        part = ids[:, s : s + chunk]
        kw = {} if mask is None else {"attention_mask": mask[:, : seen + s + part.shape[1]]}
        with torch.no_grad():
            out = model(part, cache=cache, use_cache=True, **kw).logits
    return out


def _state(cache) -> dict:
    """Everything a tiered cache holds, copied: counts, every tier tensor, offload tables."""
    out = {"seq": cache.get_seq_length()}
    for layer in cache.tiered_layers:
        i = layer.layer_idx
        out[i, "counts"] = (layer.seen, layer.hot_start, layer.evicted, layer.token_counts())
        if layer.is_initialized:
            k, v = layer.hot.view()
            out[i, "hot"] = (k.clone(), v.clone())
        # a store's checksums of free slots may keep stale values: its records are compared below
        sums = {id(t) for t in layer.cold.store.tensors()} if layer.offloaded else set()
        for name, ts in layer.tier_tensors().items():
            if name != "hot":
                out[i, name] = [t.clone() for t in ts if id(t) not in sums]
        if layer.offloaded and layer.cold.table is not None:
            out[i, "table"] = layer.cold.table.clone()
            out[i, "live"] = layer.cold.store.live
            out[i, "records"] = layer.cold.store.read(layer.cold.table.flatten()).clone()
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
            assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y)), key
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        else:
            assert x == y, key


def _cache(model, preset: str, tmp_path=None, **kw) -> kvtier.TieredCache:
    policy = kvtier.get_policy(preset)
    if policy.cold == "offload" and policy.offload.backend == "disk" and tmp_path is not None:
        policy = policy.replace(offload=policy.offload.__class__(backend="disk", path=str(tmp_path)))
    return kvtier.TieredCache(model.config, policy, **kw)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=1)


# --- misuse caught at the call --------------------------------------------------------------------
def test_cache_from_other_config_without_enable_raises(llama):
    """A cache built from a config that is not model.config, enable forgotten: an error, not 10% tokens."""
    ids = _ids(200)
    cache = kvtier.TieredCache(tiny_llama_config(), "exact")
    with pytest.raises(KVTierError, match="kvtier.enable"):
        llama.generate(ids, max_new_tokens=5, do_sample=False, cache=cache)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("from_model", [True, False])
def test_generation_after_leaving_enable_raises(llama, from_model):
    ids = _ids(150)
    config = llama.config if from_model else tiny_llama_config()
    cache = kvtier.TieredCache(config, "default")
    with kvtier.enable(llama):
        out = llama.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    seen = cache.get_seq_length()
    before = _state(cache)
    with pytest.raises(KVTierError, match="kvtier.enable"):  # a new multi-token turn, not an SDPA size error
        llama.generate(torch.cat([out, _ids(20, 5)], 1), max_new_tokens=4, do_sample=False, cache=cache)
    with pytest.raises(KVTierError, match="kvtier.enable"):  # a plain decode step
        with torch.no_grad():
            llama(out[:, -1:], cache=cache, use_cache=True)
    assert cache.get_seq_length() == seen
    _assert_same(before, _state(cache))


def test_nested_enable_is_counted(llama):
    before = llama.config._attn_implementation
    with kvtier.enable(llama):
        with kvtier.enable(llama):
            assert llama.config._attn_implementation == "kvtier"
        assert llama.config._attn_implementation == "kvtier"  # the outer block is still open
        cache = kvtier.TieredCache(llama.config, "default")
        llama.generate(_ids(100), max_new_tokens=3, do_sample=False, cache=cache)
    assert llama.config._attn_implementation == before
    kvtier.disable(llama)  # an extra disable is harmless
    assert llama.config._attn_implementation == before


def test_cache_used_with_another_model_shape_raises(llama):
    other = tiny_llama(seed=2, num_key_value_heads=4)
    cache = kvtier.TieredCache(llama.config, "default")
    with kvtier.enable(llama), kvtier.enable(other):
        _feed(llama, cache, _ids(80))
        before = _state(cache)
        with pytest.raises(ValueError, match="KV heads"):
            _feed(other, cache, _ids(10))
        _assert_same(before, _state(cache))
        _feed(llama, cache, _ids(10))  # still usable with its own model


def test_cache_with_fewer_layers_than_the_model_raises(llama):
    small = kvtier.TieredCache(tiny_llama_config(num_hidden_layers=2), "default")
    with kvtier.enable(llama), pytest.raises(KVTierError, match="built for 2 layers"):
        _feed(llama, small, _ids(20))


def test_batch_and_dtype_mismatch_raise(llama):
    cache = kvtier.TieredCache(llama.config, "default")
    with kvtier.enable(llama):
        _feed(llama, cache, _ids(40))
        with pytest.raises(ValueError, match="2 sequences|holds 1 sequences"):
            _feed(llama, cache, _ids(4, batch=2))
        half = copy.deepcopy(llama).to(torch.bfloat16)
        with kvtier.enable(half), pytest.raises(TypeError, match="bfloat16"):
            _feed(half, cache, _ids(4))


def test_hot_buffer_holds_only_what_its_tokens_need(llama):
    policy = kvtier.get_policy("default").replace(hot_tokens=1 << 20)
    cache = kvtier.TieredCache(llama.config, policy)
    with kvtier.enable(llama):
        _feed(llama, cache, _ids(21))
    report = cache.memory_report()
    # 21 tokens x 2 KV heads x 16 dims x K and V in fp16 = 2,688 bytes a layer; growth may double it
    assert report.per_tier["hot"] <= 4 * 2 * 21 * 2 * 16 * 2 * 2


# --- inference mode --------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["default", "offload-cpu", "offload-disk", "exact"])
def test_prefill_under_inference_mode_then_generate(llama, preset, tmp_path):
    ids = _ids(300)
    ref = _cache(llama, preset, tmp_path)
    cache = _cache(llama, preset, tmp_path)
    with kvtier.enable(llama):
        _feed(llama, ref, ids)
        want = llama.generate(ids, max_new_tokens=70, do_sample=False, cache=ref)  # crosses a block
        with torch.inference_mode():
            _feed(llama, cache, ids)
        got = llama.generate(ids, max_new_tokens=70, do_sample=False, cache=cache)
    assert torch.equal(got, want)
    ref.close()
    cache.close()


# --- all-or-nothing calls --------------------------------------------------------------------------
class Injected(Exception):
    pass


def _tier_steps(layer: TieredLayer) -> dict[str, tuple[object, str]]:
    """(object, method) of every step of a tier move of ``layer`` that exists for its policy."""
    steps = {"hot.take_front": (layer.hot, "take_front"), "sinks.capture": (layer.sinks, "capture")}
    steps["warm.drop_front"] = (layer.warm, "drop_front")
    steps["warm.push"] = (layer.warm, "push")
    steps["warm.encode"] = (layer.warm.codec, "encode")
    if layer.cold is not None:
        steps["cold.push"] = (layer.cold, "push")
        if layer.offloaded:
            steps["store.write"] = (layer.cold.store, "write")
            steps["store.allocate"] = (layer.cold.store, "allocate")
        else:
            steps["cold.encode"] = (layer.cold.codec, "encode")
    return steps


STEPS = [
    "hot.take_front",
    "sinks.capture",
    "warm.drop_front",
    "warm.push",
    "warm.encode",
    "cold.push",
    "cold.encode",
    "store.write",
    "store.allocate",
    "attention",
    "hot.append",
]


def _inject(monkeypatch, layer: TieredLayer, step: str, exc: BaseException | None) -> list[int]:
    """Make ``step`` of ``layer`` raise ``exc`` (``None``: only count its calls); returns the counter."""
    calls = [0]

    def wrap(real):
        def step_fn(*args, **kwargs):
            calls[0] += 1
            if exc is not None:
                raise exc
            return real(*args, **kwargs)

        return step_fn

    if step == "attention":
        real = interface.tiered_attention
        hooked = wrap(real)
        monkeypatch.setattr(
            interface, "tiered_attention", lambda lay, *a, **k: (hooked if lay is layer else real)(lay, *a, **k)
        )
        return calls
    obj, name = (layer.hot, "append") if step == "hot.append" else _tier_steps(layer)[step]
    if name == "encode":  # codecs are frozen dataclasses: patch the class, for this instance only
        real = getattr(type(obj), name)
        hooked = wrap(real)
        monkeypatch.setattr(type(obj), name, lambda self, *a, **k: (hooked if self is obj else real)(self, *a, **k))
    else:
        monkeypatch.setattr(obj, name, wrap(getattr(obj, name)))
    return calls


@pytest.mark.parametrize("preset", PRESETS_MOVING)
@pytest.mark.parametrize("step", STEPS)
def test_fault_in_a_tier_move_leaves_the_cache_as_before(llama, preset, step, tmp_path, monkeypatch):
    """An exception at each step of a move, in the third of four layers (two layers have already
    moved their blocks in that call): the call raises, the cache equals its state before the call,
    and calling again gives the logits of a cache that never failed."""
    hot = kvtier.get_policy(preset).hot_tokens or 0
    prefix = _ids(hot + 40 if step == "sinks.capture" else 1200, seed=3)  # sinks fill in the first move
    nxt = _ids(64, seed=4)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    ref, cache = _cache(llama, preset, tmp_path / "a"), _cache(llama, preset, tmp_path / "b")
    with kvtier.enable(llama):
        for c in (ref, cache):
            _feed(llama, c, prefix, chunk=128)
        layer = cache.tiered_layers[2]
        if step not in _tier_steps(layer) and step not in ("attention", "hot.append"):
            pytest.skip(f"{preset} has no step {step}")
        before = _state(cache)
        with monkeypatch.context() as mp:  # the same call on the twin cache: is the step reached?
            reached = _inject(mp, ref.tiered_layers[2], step, None)
            want = _feed(llama, ref, nxt)
        if not reached[0]:
            pytest.skip(f"{preset} does not reach {step} in this call")
        with monkeypatch.context() as mp:
            _inject(mp, layer, step, Injected(step))
            with pytest.raises(Injected):
                _feed(llama, cache, nxt)
        _assert_same(before, _state(cache))
        got = _feed(llama, cache, nxt)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        _assert_same(_state(ref), _state(cache))
    ref.close()
    cache.close()


def test_ctrl_c_in_a_move_is_undone(llama, monkeypatch):
    ref, cache = kvtier.TieredCache(llama.config, "default"), kvtier.TieredCache(llama.config, "default")
    with kvtier.enable(llama):
        for c in (ref, cache):
            _feed(llama, c, _ids(1200, seed=3), chunk=128)
        before = _state(cache)
        with monkeypatch.context() as mp:
            _inject(mp, cache.tiered_layers[3], "cold.push", KeyboardInterrupt())
            with pytest.raises(KeyboardInterrupt):
                _feed(llama, cache, _ids(64, seed=4))
        _assert_same(before, _state(cache))
        torch.testing.assert_close(_feed(llama, cache, _ids(64, 4)), _feed(llama, ref, _ids(64, 4)), rtol=0, atol=0)


@pytest.mark.parametrize("wrapper", [True, False], ids=["enable", "by-hand"])
def test_call_interrupted_outside_kvtier_is_undone(llama, wrapper):
    """An exception between two layers (in the model's MLP). Under ``kvtier.enable`` the forward
    wrapper undoes the call before the exception reaches the caller; with kvtier attention selected
    by hand kvtier cannot see it, and the next call puts the cache back and asks to call again. Either
    way the call after that gives the logits of a cache that never failed."""
    ref, cache = kvtier.TieredCache(llama.config, "default"), kvtier.TieredCache(llama.config, "default")
    with kvtier.enable(llama) if wrapper else kvtier_attention_by_hand(llama):
        for c in (ref, cache):
            _feed(llama, c, _ids(1200, seed=3), chunk=128)
        before = _state(cache)

        def boom(*args):
            raise Injected("mlp")

        handle = llama.model.layers[2].mlp.register_forward_hook(boom)
        try:
            with pytest.raises(Injected):
                _feed(llama, cache, _ids(64, seed=4))
        finally:
            handle.remove()
        if not wrapper:
            with pytest.raises(KVTierError, match="call again"):
                _feed(llama, cache, _ids(64, seed=4))
        _assert_same(before, _state(cache))
        torch.testing.assert_close(_feed(llama, cache, _ids(64, 4)), _feed(llama, ref, _ids(64, 4)), rtol=0, atol=0)


def test_failed_undo_makes_the_cache_refuse_use(llama, monkeypatch):
    cache = kvtier.TieredCache(llama.config, "default")
    with kvtier.enable(llama):
        _feed(llama, cache, _ids(1200, seed=3), chunk=128)
        with monkeypatch.context() as mp:
            _inject(mp, cache.tiered_layers[2], "cold.push", Injected("first fault"))
            mp.setattr(cache.tiered_layers[1].warm, "put_front", lambda old: (_ for _ in ()).throw(OSError("undo")))
            with pytest.raises(KVTierError, match="first fault"):
                _feed(llama, cache, _ids(64, seed=4))
        for _ in range(2):
            with pytest.raises(KVTierError, match="unusable.*first fault"):
                _feed(llama, cache, _ids(4, seed=5))


# --- byte caps ---------------------------------------------------------------------------------------
def _need(model, preset: str, n: int) -> int:
    cache = kvtier.TieredCache(model.config, preset)
    with kvtier.enable(model):
        _feed(model, cache, _ids(n, seed=7))
    return cache.memory_report().total_bytes


def test_cap_error_raises_before_changing_anything(llama):
    cap = _need(llama, "default", 4096) // 2
    cache = kvtier.TieredCache(llama.config, "default", max_bytes=cap, on_full="error")
    ids = _ids(4096, seed=7)
    with kvtier.enable(llama):
        with pytest.raises(CacheFullError, match="max_bytes"):
            for s in range(0, 4096, 256):
                seen = cache.get_seq_length()
                before = _state(cache)
                _feed(llama, cache, ids[:, s : s + 256])
                assert cache.memory_report().total_bytes <= cap
        assert cache.get_seq_length() == seen  # unchanged by the failing call
        _assert_same(before, _state(cache))
        assert cache.memory_report().total_bytes <= cap
        _feed(llama, cache, ids[:, seen : seen + 1])  # still usable for a call that fits
        assert cache.get_seq_length() == seen + 1


def test_cap_evict_stays_under_the_cap_and_keeps_the_sinks(llama):
    cap = _need(llama, "default", 4096) // 2
    cache = kvtier.TieredCache(llama.config, "default", max_bytes=cap, on_full="evict")
    ids = _ids(16384, seed=8)
    with kvtier.enable(llama):
        _feed(llama, cache, ids[:, :512], chunk=256)
        sinks = [lay.sinks.k.clone() for lay in cache.tiered_layers]
        for s in range(512, 16384, 512):
            _feed(llama, cache, ids[:, s : s + 512], chunk=512)
            assert cache.memory_report().total_bytes <= cap
        nxt = ids[:, -1:]
        for _ in range(8):  # keeps generating
            with torch.no_grad():
                nxt = llama(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            assert cache.memory_report().total_bytes <= cap
    report = cache.memory_report()
    assert report.total_bytes <= cap and report.tokens["evicted"] > 0
    assert cache.get_seq_length() == 16384 + 8
    assert all(torch.equal(a, lay.sinks.k) for a, lay in zip(sinks, cache.tiered_layers))


def test_cap_arguments_are_checked(llama):
    with pytest.raises(ValueError, match="max_bytes"):
        kvtier.TieredCache(llama.config, "default", max_bytes=-1)
    with pytest.raises(ValueError, match="on_full"):
        kvtier.TieredCache(llama.config, "default", max_bytes=1 << 20, on_full="drop")
    with pytest.raises(ValueError, match="offload"):
        kvtier.TieredCache(llama.config, "offload-cpu", max_bytes=1 << 20, on_full="evict")


def test_planner_prices_the_cap(llama):
    """``kvtier plan --max-bytes``: the tokens a capped cache takes before CacheFullError, exactly."""
    from kvtier.sizing import ModelShape, capped_tokens

    cfg = llama.config
    shape = ModelShape("tiny", ("full_attention",) * cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    cap = 600_000
    fits = capped_tokens(shape, cap, "default", dtype=torch.float32)
    cache = kvtier.TieredCache(cfg, "default", max_bytes=cap)
    ids = _ids(fits + 64, seed=9)
    with kvtier.enable(llama):
        _feed(llama, cache, ids[:, :fits], chunk=64)
        assert cache.memory_report().total_bytes <= cap
        with pytest.raises(CacheFullError):
            for s in range(fits, fits + 64):
                _feed(llama, cache, ids[:, s : s + 1])
    assert cache.get_seq_length() == fits
