"""Planner: the llama-2-13b headline number, agreement with memory_report() of real runs, CLI."""

from __future__ import annotations

import json

import pytest
import torch

import kvtier
from conftest import tiny_llama
from kvtier import PRESETS, TierPolicy
from kvtier.cli import main
from kvtier.sizing import ModelShape, estimate


def test_llama2_13b_fp16():
    p = estimate("llama-2-13b", 32768, "exact")
    assert p.fp16_bytes == 2 * 40 * 40 * 128 * 32768 * 2  # 26.84 GB
    assert round(p.fp16_bytes / 1e9, 2) == 26.84
    assert p.total_bytes == p.fp16_bytes


@pytest.mark.parametrize(
    "policy",
    [
        *PRESETS,
        TierPolicy(
            hot_tokens=20,
            warm_tokens=48,
            block_tokens=8,
            sink_tokens=5,
            cold="quant",
            cold_bits=3,
            value_group_size=8,
            layer_overrides={1: "kivi2"},
        ),
    ],
)
@pytest.mark.parametrize("seq", [1, 150, 1000, 1801])
@pytest.mark.parametrize("batch", [1, 2])
def test_plan_matches_memory_report(policy, seq, batch):
    model = tiny_llama(num_hidden_layers=3)
    hf = pytest.importorskip("kvtier.hf", reason="needs the transformers adapter (kvtier[hf])", exc_type=ImportError)
    cache = hf.TieredCache(model.config, policy)
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(3, 97, (batch, seq), generator=g)
    with kvtier.enable(model), torch.no_grad():
        for s in range(0, seq, 700):  # a long prefill, then chunks
            model(ids[:, s : s + 700], cache=cache)
    report = cache.memory_report()
    shape = ModelShape("tiny", ["full_attention"] * 3, 2, 16)
    planned = estimate(shape, seq, policy, batch, torch.float32)
    assert planned.fp16_bytes == report.dense_fp16_bytes
    # adaptive: cold codes are planned at the allocation's budget, which the greedy rule spends to
    # within one width step (one more bit per element of one side of one layer: D / 8 bytes per head)
    slack = 0 if kvtier.get_policy(policy).adaptive is None else report.tokens["cold"] // 3 * batch * 2 * 16 // 8
    assert abs(planned.total_bytes - report.total_bytes) <= 0.02 * report.total_bytes + slack
    for tier, b in report.per_tier.items():
        assert abs(planned.per_tier.get(tier, 0) - b) <= 0.02 * max(b, 1) + 16 * batch + slack


def test_plan_cli_json(capsys, tmp_path):
    assert main(["plan", "--model", "llama-2-13b", "--seq-len", "32768", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    data = json.loads(out[-1])
    assert data["fp16_bytes"] == 26843545600
    assert set(data["policies"]) == set(PRESETS)
    assert "26.84 GB" in "\n".join(out)
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256})
    )
    assert main(["plan", "--model", str(cfg), "--seq-len", "100", "--policy", "exact", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["fp16_bytes"] == 2 * 2 * 2 * 32 * 100 * 2


def test_plan_cli_bad_model(capsys):
    assert main(["plan", "--model", "gpt-9", "--seq-len", "10"]) == 2
    assert "gpt-9" in capsys.readouterr().err
