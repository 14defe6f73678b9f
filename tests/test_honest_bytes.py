"""Honest bytes (issue 33, item 6): ``memory_report()`` equals every tensor byte reachable from the
cache, for every preset at every length, the adaptive budget's warm-up statistics included.

The walk is generic and independent of :mod:`kvtier.diagnostics`: it follows every object's
``__dict__`` and ``__slots__``, and dicts, lists, tuples and sets, from the cache down (layers, tiers,
budgets, stores, the offloader), dedups tensors by storage, and stops at the model and its config
(not cache memory). Disk stores hold their blocks in memory-mapped files, not tensors: the walk
counts each ``mmap`` it meets at its length, which is how the report counts them (``store``).
"""

from __future__ import annotations

import dataclasses
import mmap
import types

import pytest
import torch

import kvtier
from conftest import tiny_llama
from kvtier import PRESETS, TieredCache
from kvtier.stats import tensor_bytes

#: Calls of (batch 2) tokens: lengths 37, 137 (inside the adaptive preset's 512-token warm-up),
#: 138 (a decode step in it), 530 (past it: the allocation frees the statistics), 601, 602 - none a
#: multiple of the 64-token block.
CHUNKS = (37, 100, 1, 392, 71, 1)
_LEAVES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, str, bytes)


def reachable_bytes(root: object, stop: tuple[object, ...]) -> int:
    """Bytes of the distinct tensor storages and memory maps reachable from ``root`` (not via ``stop``)."""
    tensors, maps = [], {}
    stack, seen = [root], {id(s) for s in stop}
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, _LEAVES + (int, float, bool, complex)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
        elif isinstance(obj, mmap.mmap):
            maps[id(obj)] = 0 if obj.closed else len(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    stack.append(getattr(obj, name, None))
    return tensor_bytes(tensors) + sum(maps.values())


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_memory_report_equals_the_reachable_tensor_bytes_at_every_length(model, preset, tmp_path):
    policy = kvtier.get_policy(preset)
    if policy.offload is not None and policy.offload.backend == "disk":
        policy = policy.replace(offload=dataclasses.replace(policy.offload, path=str(tmp_path)))
    cache = TieredCache(model.config, policy)
    g = torch.Generator().manual_seed(1)
    seen, held = 0, []
    with kvtier.enable(model), torch.no_grad():
        for n in CHUNKS:
            model(torch.randint(3, 97, (2, n), generator=g), cache=cache)
            seen += n
            report = cache.memory_report()
            assert report.seq_len == seen
            assert report.total_bytes == reachable_bytes(cache, (model, model.config, cache.config)), (preset, seen)
            assert sum(report.per_tier.values()) == report.total_bytes
            held.append(report.per_tier.get("measure", 0))
    if kvtier.get_policy(preset).adaptive is not None:  # counted while it lives, gone after the warm-up
        assert all(b > 0 for b in held[:3]) and held[3:] == [0, 0, 0]
        assert cache.allocation()["allocated"]
    else:
        assert not any(held)
    cache.close()


def test_adaptive_cap_counts_the_warm_up_statistics(model):
    # max_bytes enforces what memory_report() counts: a cap just under the report of a run that
    # fits is refused during the warm-up, when the statistics are part of it
    ids = torch.randint(3, 97, (1, 150), generator=torch.Generator().manual_seed(2))
    with kvtier.enable(model), torch.no_grad():
        free = TieredCache(model.config, "adaptive")
        model(ids, cache=free)
        report = free.memory_report()
        assert report.per_tier["measure"] > 0
        capped = TieredCache(model.config, "adaptive", max_bytes=report.total_bytes - report.per_tier["measure"])
        with pytest.raises(kvtier.CacheFullError):
            model(ids, cache=capped)
        assert capped.get_seq_length() == 0
        exact_fit = TieredCache(model.config, "adaptive", max_bytes=report.total_bytes)
        model(ids, cache=exact_fit)
        assert exact_fit.memory_report().total_bytes == report.total_bytes


@pytest.mark.parametrize("seq", [1, 150, 600])
def test_plan_prices_the_adaptive_warm_up_statistics(seq):
    from kvtier.sizing import ModelShape, estimate

    m = tiny_llama(num_hidden_layers=3)
    cache = TieredCache(m.config, "adaptive")
    ids = torch.randint(3, 97, (1, seq), generator=torch.Generator().manual_seed(seq))
    with kvtier.enable(m), torch.no_grad():
        m(ids, cache=cache)
    report = cache.memory_report()
    planned = estimate(ModelShape("tiny", ("full_attention",) * 3, 2, 16), seq, "adaptive", 1, torch.float32)
    assert planned.per_tier.get("measure", 0) == report.per_tier.get("measure", 0)
    assert (report.per_tier.get("measure", 0) > 0) == (seq < 512)  # the preset's warmup_tokens
