"""Head dims that are not powers of two (80, 96, 112: Phi-2, Phi-3-mini): every preset runs on them.

A layer's value group is the largest divisor of its head dim not above the policy's
``value_group_size`` (:func:`kvtier.codecs.value_group`), so no preset refuses such a head dim.
Whole tiny Llamas with these head dims run every preset, shrunk so a short prompt crosses every
tier (the codecs, value groups, sparse and offload settings stay the preset's), and the ``"fast"``
path gives the logits of ``attention="reference"``; the planner counts the bytes the cache holds.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import kvtier
from kvtier import PRESETS, TierPolicy, get_policy
from kvtier.codecs import value_group
from kvtier.sizing import ModelShape, estimate
from kvtier.testing import feed_chunks, tiny_llama

HEAD_DIMS = [80, 96, 112]


@functools.cache
def _model(head_dim: int):  # noqa: ANN202
    return tiny_llama(head_dim=head_dim)


def _small(name: str) -> TierPolicy:
    """Preset ``name`` with tiers a ~100-token prompt crosses (hot 16, warm 16, 8-token blocks)."""
    p = get_policy(name)
    if p.is_exact:
        return p
    changes: dict[str, object] = {"hot_tokens": 16, "sink_tokens": min(p.sink_tokens, 4)}
    if p.block_tokens > 1:
        changes["block_tokens"] = 8
        changes["warm_tokens"] = None if p.warm_tokens is None else min(p.warm_tokens, 16)
    if p.sparse is not None:
        changes["sparse"] = dataclasses.replace(p.sparse, local_window=8)
    if p.adaptive is not None:
        changes["adaptive"] = dataclasses.replace(p.adaptive, warmup_tokens=24, fit_tokens=512)
    return p.replace(**changes)


@pytest.mark.parametrize(
    "group,head_dim,expected",
    [(64, 64, 64), (64, 80, 40), (64, 96, 48), (64, 112, 56), (64, 128, 64), (32, 80, 20), (1024, 80, 80), (7, 12, 6)],
)
def test_value_group_is_the_largest_divisor_of_the_head_dim_within_the_group(group, head_dim, expected):
    """It refused every head dim the group did not divide (80, 96, 112 at 64), naming a field the
    user never set."""
    assert value_group(TierPolicy(value_group_size=group), head_dim) == expected


#: every preset at 80; the presets with the most codecs (grouped values, rotation, vq-free adaptive
#: widths) at 96 and 112 too
CASES = [(name, 80) for name in sorted(PRESETS)] + [
    (name, d) for name in ("default", "max-compression", "adaptive") for d in HEAD_DIMS[1:]
]


@pytest.mark.parametrize("name,head_dim", CASES)
def test_every_preset_runs_at_head_dims_80_96_112_and_fast_matches_reference(name, head_dim):
    """Batch 2 left-padded, a prompt in uneven chunks then decode steps: every preset ran into a
    ``value_group_size=64`` refusal at these head dims, ``exact``, ``sink-window`` and the offload
    presets (no grouped values) included."""
    model = _model(head_dim)
    policy = _small(name)
    ids = torch.randint(3, 97, (2, 104), generator=torch.Generator().manual_seed(head_dim))
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    chunks = [61, 37, 3, 1, 1, 1]
    logits = {}
    with kvtier.enable(model):
        for attention in ("reference", "fast"):
            with kvtier.TieredCache(model.config, policy, attention=attention) as cache:
                logits[attention] = feed_chunks(model, cache, ids, mask, chunks)
    real = mask.bool()
    assert torch.isfinite(logits["fast"][real]).all()
    assert (logits["fast"] - logits["reference"])[real].abs().max() < 1e-3


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_plan_at_head_dim_80_counts_what_the_cache_holds(name):
    """``kvtier plan`` (sizing.estimate) refused head dim 80 like the cache; now both use the same
    value group and agree on the bytes (within test_sizing's tolerance)."""
    model = _model(80)
    policy = _small(name)
    seq = 150
    ids = torch.randint(3, 97, (1, seq), generator=torch.Generator().manual_seed(1))
    with kvtier.enable(model), torch.no_grad(), kvtier.TieredCache(model.config, policy) as cache:
        model(ids, cache=cache)
        report = cache.memory_report()
    planned = estimate(ModelShape("phi-like", ["full_attention"] * 4, 2, 80), seq, policy, 1, torch.float32)
    slack = 0 if policy.adaptive is None else report.tokens["cold"] // 4 * 2 * 80 // 8
    assert planned.fp16_bytes == report.dense_fp16_bytes
    assert abs(planned.total_bytes - report.total_bytes) <= 0.02 * report.total_bytes + slack
