"""The advice of a ``CacheFullError`` fits the cache's ``on_full`` (issue 33, item 8): a cache that
already evicts must not be told to "use on_full='evict'"."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier import CacheFullError, TieredCache, TierPolicy

POLICY = TierPolicy(
    hot_tokens=16, warm_tokens=16, block_tokens=8, value_group_size=8, sink_tokens=4, layer_overrides={}
)


def _overflow(model, on_full: str) -> str:
    """The message of a prompt that not even eviction fits: 40 exact tokens under a 1 KB cap."""
    cache = TieredCache(model.config, policy=POLICY, max_bytes=1024, on_full=on_full)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with kvtier.enable(model), torch.no_grad(), pytest.raises(CacheFullError) as err:
        model(ids, cache=cache, use_cache=True)
    assert cache.get_seq_length() == 0  # all-or-nothing: the cache is unchanged
    return str(err.value)


@pytest.mark.parametrize("on_full", ["evict", "degrade"])
def test_evicting_cache_that_cannot_fit_does_not_advise_eviction(model, on_full):
    message = _overflow(model, on_full)
    assert "even after evicting" in message and "max_bytes=1,024" in message
    assert "on_full=" not in message
    assert "\n" not in message


def test_erroring_cache_advises_eviction(model):
    assert "use on_full='evict'" in _overflow(model, "error")
