"""Hybrid models (a tiny Gemma 3: three sliding-window layers, window 64, beside one full-attention
layer): the transformers layers a ``TieredCache`` keeps for the sliding layers are counted whole."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier import TieredCache
from kvtier.diagnostics import reachable_tensor_bytes, tensor_bytes, untiered_tensors
from kvtier.testing import random_ids, tiny_gemma3


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3()


@pytest.mark.parametrize("policy", ["default", "exact"])
def test_memory_report_counts_every_tensor_of_sliding_layers(gemma, policy):
    """Not only the sliding layers' keys and values: transformers' ``DynamicSlidingWindowLayer``
    also holds its window as an 8-byte tensor, before any call too."""
    cache = TieredCache(gemma.config, policy)
    sliding = [i for i, layer in enumerate(cache.layers) if getattr(layer, "is_sliding", False)]
    assert sliding == [0, 1, 2]
    assert cache.memory_report().total_bytes == reachable_tensor_bytes(cache) > 0
    with kvtier.enable(gemma), torch.no_grad():
        gemma(random_ids(100, batch=2), cache=cache)  # past the window: the layers keep 63 tokens
        gemma(random_ids(1, seed=1, batch=2), cache=cache)
    report = cache.memory_report()
    assert report.total_bytes == reachable_tensor_bytes(cache)
    for i in sliding:
        layer = cache.layers[i]
        assert report.per_layer[i]["bytes"] == {"other": tensor_bytes(untiered_tensors(layer))}
        assert report.per_layer[i]["bytes"]["other"] > tensor_bytes([layer.keys, layer.values])


def test_byte_cap_counts_what_memory_report_counts_on_hybrids(gemma):
    """``max_bytes`` bounds what ``memory_report()`` counts, the sliding layers' every tensor
    included: a cap one byte below what a call leaves refuses it, the exact cap takes it."""
    ids = random_ids(100, batch=2)
    with kvtier.enable(gemma), torch.no_grad():
        free = TieredCache(gemma.config, "default")
        gemma(ids, cache=free)
        held = free.memory_report().total_bytes
        tight = TieredCache(gemma.config, "default", max_bytes=held - 1)
        with pytest.raises(kvtier.CacheFullError):
            gemma(ids, cache=tight)
        exact = TieredCache(gemma.config, "default", max_bytes=held)
        gemma(ids, cache=exact)
    assert exact.memory_report().total_bytes == held
