"""``kvtier.enable`` always leaves the model on kvtier attention (nesting still counted); copies of a
cache work like the original: ``copy.deepcopy`` made outside ``enable``, a ``pickle`` round trip;
an offloading cache refuses ``pickle`` with a one-line error. Tiny random Llama, no files."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import kvtier
from conftest import tiny_llama
from kvtier.errors import KVTierError
from kvtier.offload.store import COPY_ERROR
from kvtier.testing import feed, random_ids


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=1)


def test_enable_after_a_bare_set_attn_implementation_switches_back_to_kvtier(llama):
    """enable, set_attn_implementation("sdpa"), enable: the model runs kvtier attention again; the
    enables are still counted, and the last disable restores what the model had before the first."""
    before = llama.config._attn_implementation
    assert before != "kvtier"
    ref = kvtier.TieredCache(llama.config, "default")
    with kvtier.enable(llama):
        want = feed(llama, ref, random_ids(300, seed=1))
    kvtier.enable(llama)
    try:
        llama.set_attn_implementation("sdpa")
        with kvtier.enable(llama):
            assert llama.config._attn_implementation == "kvtier"
            got = feed(llama, kvtier.TieredCache(llama.config, "default"), random_ids(300, seed=1))
        assert llama.config._attn_implementation == "kvtier"  # the first enable is still open
    finally:
        kvtier.disable(llama)
    assert llama.config._attn_implementation == before
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_deepcopy_made_outside_enable_continues_like_the_original_inside_enable(llama):
    cache = kvtier.TieredCache(llama.config, "default")
    with kvtier.enable(llama):
        feed(llama, cache, random_ids(1200, seed=2))
    twin = copy.deepcopy(cache)
    with kvtier.enable(llama):
        for part in (random_ids(64, seed=3), random_ids(1, seed=4)):
            torch.testing.assert_close(feed(llama, twin, part), feed(llama, cache, part), rtol=0, atol=0)
    assert twin.get_seq_length() == cache.get_seq_length() == 1265
    assert twin.config is cache.config  # the model's config, which enable switches


def test_pickle_round_trip_continues_like_the_original(llama):
    """Pickled (after prefill, outside enable) and loaded: the same logits as the original going on;
    the loaded cache still refuses a model that does not run kvtier attention."""
    cache = kvtier.TieredCache(llama.config, "default")
    with kvtier.enable(llama):
        feed(llama, cache, random_ids(1200, seed=5))
    loaded = pickle.loads(pickle.dumps(cache))
    assert all(layer.owner is loaded for layer in loaded.tiered_layers)
    with pytest.raises(KVTierError, match="kvtier.enable"):
        feed(llama, loaded, random_ids(4, seed=6))
    with kvtier.enable(llama):
        for part in (random_ids(64, seed=6), random_ids(1, seed=7)):
            torch.testing.assert_close(feed(llama, loaded, part), feed(llama, cache, part), rtol=0, atol=0)
    assert loaded.get_seq_length() == cache.get_seq_length() == 1265


def test_pickling_an_offloading_cache_is_refused_in_one_line(llama):
    cache = kvtier.TieredCache(llama.config, "offload-cpu")
    with kvtier.enable(llama):
        feed(llama, cache, random_ids(300, seed=8))
    with pytest.raises(KVTierError) as info:
        pickle.dumps(cache)
    assert str(info.value) == COPY_ERROR and "\n" not in COPY_ERROR
    cache.close()


def test_shallow_copy_is_refused_in_one_line(llama):
    """copy.copy would share the layers with the original (two caches moving one state)."""
    cache = kvtier.TieredCache(llama.config, "default")
    with pytest.raises(KVTierError, match="copy.deepcopy") as info:
        copy.copy(cache)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("policy", ["default:vq3/3", "adaptive@3:codes=vq", "adaptive"])
def test_pickle_round_trip_of_fp8_fields(llama, policy):
    """Tiers holding 1-byte floats (fp8 codes, fp8 parameters of the vq and adaptive codes) load
    back: torch pickles a float8 tensor that pickle.loads cannot read (torch 2.13), so they travel
    as bytes; the loaded cache goes on like the original, bit for bit."""
    cache = kvtier.TieredCache(llama.config, policy)
    with kvtier.enable(llama):
        feed(llama, cache, random_ids(1200, seed=9))
    held = [t.dtype for layer in cache.tiered_layers for ts in layer.tier_tensors().values() for t in ts]
    assert torch.float8_e4m3fn in held  # the case this covers
    loaded = pickle.loads(pickle.dumps(cache))
    with kvtier.enable(llama):
        for part in (random_ids(64, seed=10), random_ids(1, seed=11)):
            torch.testing.assert_close(feed(llama, loaded, part), feed(llama, cache, part), rtol=0, atol=0)
