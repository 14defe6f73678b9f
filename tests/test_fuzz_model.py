"""A few seeded cases of ``scripts/fuzz_model.py``: drawn models (Llama, Qwen2 with biases, hybrid
Gemma 3), presets and variants, call sequences (chunks, decode, crop, reorder, batch select,
reset, copies) and faults (an exception or Ctrl-C from a hook on any module, a byte cap, values out
of range, a failing offload write); after every step the cache must equal a reference fed only the
calls that returned. The script runs hundreds; these keep it working, and show that its
comparison catches a rollback that skips a layer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvtier import TierPolicy
from kvtier.cache.state import Journal, LayerState

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_model.py"


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("block", range(4))
def test_drawn_faults_leave_the_cache_as_the_reference(fuzz, block):
    for seed in range(block * 10, block * 10 + 10):
        result = fuzz.run_case(fuzz.draw_case(seed))
        assert result.ok, result.text


def _capped_call_case(fuzz):
    """A Llama whose tokens reach the cold tier, then a call refused by a byte cap (CacheFullError,
    raised inside kvtier after layer 0 has moved blocks: its journal undoes them)."""
    policy = TierPolicy(
        hot_tokens=8, warm_tokens=16, block_tokens=8, sink_tokens=2, cold="quant", cold_bits=3,
        value_group_size=16, layer_overrides={}, name="small",
    )  # fmt: skip
    steps = [{"op": "prefill", "n": 64}, {"op": "prefill", "n": 33, "fault": {"kind": "cap"}}, {"op": "decode"}]
    return fuzz.Case(7, "llama", torch.float32, {}, policy, "small", "fast", None, "error", 2, steps)


def test_the_comparison_catches_a_rollback_that_skips_a_layer(fuzz, monkeypatch):
    case = _capped_call_case(fuzz)
    result = fuzz.run_case(case)
    assert result.ok and [r.split()[0] for r in result.refusals] == ["CacheFullError"], result.text
    real = Journal.rollback

    def skip_layer_0(self, *args, **kwargs):  # the injected bug: layer 0 keeps the failed call's changes
        layer = next((a for a in (*args, *kwargs.values()) if isinstance(a, LayerState)), None)
        if layer is not None and layer.layer_idx == 0:
            return None
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Journal, "rollback", skip_layer_0)
    result = fuzz.run_case(case)
    assert not result.ok, "the comparison missed a layer that kept a failed call's changes"
    assert result.cls == "llama | prefill | cap (in kvtier) | state differs after a failed prefill", result.text
    assert "layer 0:" in result.text and "seed=7" in result.text


def test_the_comparison_catches_sliding_layers_left_as_the_failed_call_made_them(fuzz, monkeypatch):
    """The hybrid Gemma 3 (3 sliding layers, then the full one): a byte cap refuses the call at its
    last layer, after the sliding layers took the call's tokens; they must be put back too."""
    import kvtier.hf.cache as cache_module

    steps = [{"op": "prefill", "n": 16}, {"op": "prefill", "n": 16, "fault": {"kind": "cap"}}, {"op": "decode"}]
    case = fuzz.Case(8, "gemma3", torch.float32, {}, "default", "default", "fast", None, "error", 1, steps)
    result = fuzz.run_case(case)
    assert result.ok and [r.split()[0] for r in result.refusals] == ["CacheFullError"], result.text
    monkeypatch.setattr(cache_module._Saved, "restore", lambda self, layer: None)  # the injected bug
    result = fuzz.run_case(case)
    assert result.cls == "gemma3 hybrid | prefill | cap (in kvtier) | state differs after a failed prefill", result.text
    assert "layer 0: got (32," in result.text


def test_the_cli_ends_with_one_json_line_and_resumes_from_its_log(fuzz, tmp_path, capsys):
    import json

    log = tmp_path / "cases.jsonl"
    fuzz.main(["--cases", "2", "--seed", "3", "--log", str(log)])
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["seeds"] == [3, 4] and first["passed"] + first["failed"] == 2 and first["next_seed"] == 5
    assert [json.loads(line)["seed"] for line in log.read_text().splitlines()] == [3, 4]
    fuzz.main(["--cases", "2", "--seed", "3", "--log", str(log)])  # both from the log: nothing rerun
    out = capsys.readouterr().out
    assert "2 from the log" in out and json.loads(out.strip().splitlines()[-1])["classes"] == first["classes"]
    assert len(log.read_text().splitlines()) == 2
