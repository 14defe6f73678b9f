"""Long-context tasks (kvtier.eval.tasks, kvtier.eval.taskrun, ``kvtier eval tasks``): the generator
(every family at 4k, 8k and 16k, reproducible byte for byte from the seed, answers planted, the
longest prompt that fits), the scorer against hand-made answers, the JSONL round trip, the runner
(rows, resume, a log of other prompts refused) and the summary statistics. A byte tokenizer stands in
for a real one (``kvtier.testing.ByteTokenizer``); one test runs the SmolLM2 tokenizer."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from kvtier.eval import taskrun
from kvtier.eval import tasks as T
from kvtier.testing import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def hay():
    return T.Haystacks()


@pytest.mark.parametrize("length", [4 * n for n in T.LENGTHS])  # bytes: ~4 per token of a real tokenizer
@pytest.mark.parametrize("task", list(T.FAMILIES))
def test_every_family_fits_its_length_with_its_answers_planted(task, length, hay):
    s = T.generate_sample(TOK, task, length, 0, seed=0, haystacks=hay)
    assert s.prompt_tokens + s.max_new_tokens <= length  # the answer budget fits too
    assert s.prompt_tokens + s.max_new_tokens > 0.9 * length  # and the haystack fills the rest
    assert s.context_ids == list(s.context.encode()) and s.question_ids == list(s.question.encode())
    assert s.context.startswith("<user>") and "</user><assistant>" in s.question  # the question ends the turn
    assert s.answers and all(a for a in s.answers)
    body = s.context
    if task.startswith("niah"):
        kind = "uuids" if task.rstrip("@code").endswith(("_3",)) or "multikey_3" in task else "numbers"
        for a in s.answers:  # each value sits in a needle naming it
            assert re.search(rf"One of the special magic {kind} for \S+ is: {re.escape(a)}\.", body), a
        asked = 4 if "multiquery" in task else 1
        assert len(s.answers) == (4 if "multivalue" in task or "multiquery" in task else 1)
        assert s.question.count(",") >= asked - 1
        if task.endswith("@code"):
            assert f"# One of the special magic {kind}" in body and "def " in body
    elif task == "vt":
        value = re.search(r"assigned the value (\d+)", s.question).group(1)
        chain = re.findall(r"VAR (\w+) = (VAR \w+|\d+)", body.split("Question:")[-1])
        holders = {value}
        for name, src in chain:  # follow the chain in the real context (after the worked example)
            if src in holders or src.removeprefix("VAR ") in holders:
                holders.add(name)
        assert sorted(holders - {value}) == sorted(s.answers) and len(s.answers) == 5
    elif task == "cwe":
        listed = re.findall(r"\d+\. ([a-z]+)", body.split(T._CWE_INSTRUCTION)[-1])
        counts = Counter(listed)
        assert sorted(w for w, _ in counts.most_common(10)) == sorted(s.answers)
        assert {counts[a] for a in s.answers} == {30} and max(c for w, c in counts.items() if w not in s.answers) == 3
    else:  # fwe
        text = body.split("Answer:")[-1].split("\n", 1)[-1]
        counts = Counter(text.split()).most_common(4)
        assert [w for w, _ in counts[:3]] == s.answers and counts[2][1] > counts[3][1]


def test_the_prompt_is_the_longest_that_fits(hay):
    s = T.generate_sample(TOK, "niah_single_2", 4096, 3, haystacks=hay)
    fam = T.FAMILIES["niah_single_2"]
    import random

    longer = fam.build(random.Random("0:niah_single_2:4096:3"), s.meta["units"] + 1, hay)
    assert T._count(TOK, longer) > 4096 - fam.max_new_tokens


def test_prompts_are_reproducible_byte_for_byte_and_seeds_differ(tmp_path, hay):
    tasks = ["niah_multikey_2", "vt", "fwe", "niah_multiquery@code"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert T.write_jsonl(T.generate(TOK, tasks, [4096], 2, seed=7, haystacks=hay), a) == 8
    T.write_jsonl(T.generate(TOK, tasks, [4096], 2, seed=7, haystacks=T.Haystacks()), b)
    assert a.read_bytes() == b.read_bytes()
    back = T.read_jsonl(a)
    assert [T.to_json(s) for s in back] == a.read_text().splitlines()
    other = list(T.generate(TOK, tasks, [4096], 2, seed=8, haystacks=hay))
    assert all(x.answers != y.answers for x, y in zip(back, other))
    assert len({tuple(s.answers) for s in back}) == 8  # indices differ too


def test_reading_prompts_of_another_format_is_refused(tmp_path, hay):
    s = T.generate_sample(TOK, "vt", 4096, 0, haystacks=hay)
    d = json.loads(T.to_json(s)) | {"format": 99}
    (tmp_path / "p.jsonl").write_text(json.dumps(d) + "\n")
    with pytest.raises(ValueError, match="format 99"):
        T.read_jsonl(tmp_path / "p.jsonl")


def test_bad_task_and_length_are_refused_in_one_line(hay):
    with pytest.raises(ValueError, match="task 'niah_single_9' is not allowed"):
        T.task_names("ruler,niah_single_9")
    assert T.task_names("code,vt") == [*T.CODE_TASKS, "vt"] and len(T.task_names("all")) == 16
    with pytest.raises(ValueError, match="too short for cwe"):
        T.generate_sample(TOK, "cwe", 2048, 0, haystacks=hay)
    with pytest.raises(ValueError, match="length=100 is not allowed"):
        T.generate_sample(TOK, "vt", 100, 0, haystacks=hay)


def test_score_is_the_fraction_of_expected_strings_found():
    assert T.score("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert T.score("The numbers are 1234567 and 765432.", ["1234567", "7654321"]) == 0.5
    assert T.score("ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO", "pqrst"]) == 0.5  # case-insensitive
    assert T.score("", ["x"]) == 0.0
    with pytest.raises(ValueError, match="without expected answers"):
        T.score("x", [])


def test_bootstrap_interval_and_paired_test():
    lo, hi = T.bootstrap_ci([1.0] * 10)
    assert lo == hi == 1.0
    lo, hi = T.bootstrap_ci([0.0, 1.0] * 10)
    assert 0.2 < lo < 0.5 < hi < 0.8
    lo, hi = T.bootstrap_ci([[1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])  # a suite: the mean of task means
    assert lo == hi == 0.5
    assert T.paired_sign_flip([1, 0, 1], [1, 0, 1]) == 1.0
    assert T.paired_sign_flip([1.0] * 12, [0.0] * 12) < 0.001
    assert T.paired_sign_flip([1, 0] * 6, [0, 1] * 6) == pytest.approx(1.0, abs=0.05)


@pytest.mark.model
@pytest.mark.parametrize("length", T.LENGTHS)
def test_every_family_on_a_real_tokenizer(length, hay):
    from transformers import AutoTokenizer

    from kvtier.models import model_dir

    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    for task in T.FAMILIES:
        s = T.generate_sample(tok, task, length, 0, haystacks=hay)
        assert 0.9 * length < s.prompt_tokens + s.max_new_tokens <= length
        assert s.context.startswith("<|im_start|>system") and "<|im_start|>assistant\n" in s.question
        assert tok(s.context + s.question, add_special_tokens=False).input_ids[-5:] == s.question_ids[-5:]


# --- the runner -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from kvtier.testing import tiny_llama

    return tiny_llama(vocab_size=256, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def samples(hay):
    import dataclasses

    made = [T.generate_sample(TOK, t, 2048, i, haystacks=hay) for t in ("niah_single_1", "vt") for i in range(2)]
    return [dataclasses.replace(s, max_new_tokens=6) for s in made]  # a short answer budget: a fast test


def test_rows_resume_and_refuse_a_log_of_other_prompts(tiny, samples, tmp_path):
    from kvtier.eval.caches import cache_spec

    specs = [cache_spec("dynamic"), cache_spec("default")]
    log = tmp_path / "rows.jsonl"
    rows = taskrun.run_tasks(tiny, TOK, samples[:3], specs, ["one", "stream"], chunk=256, log=log)
    assert len(rows) == 3 * 2 * 2 and len(log.read_text().splitlines()) == 12
    for r in rows:
        assert 0 <= r["score"] <= 1 and 0 <= r["new_tokens"] <= 6
        assert r["kv_bytes"] > 0 and r["fp16_bytes"] == 2 * 2 * 4 * 2 * 16 * r["context_tokens"]
    by = {taskrun.row_key(r): r for r in rows}
    assert all(
        by[("default", *s.key, "one")]["ratio_fp16"] < by[("dynamic", *s.key, "one")]["ratio_fp16"] for s in samples[:3]
    )
    seen = []
    again = taskrun.run_tasks(tiny, TOK, samples, specs, ["one", "stream"], chunk=256, log=log, echo=seen.append)
    assert "resuming: 6 of 8" in seen[0] and len(again) == 16 and len(log.read_text().splitlines()) == 16
    assert [r for r in again if taskrun.row_key(r) in by] == [
        by[taskrun.row_key(r)] for r in again if taskrun.row_key(r) in by
    ]
    with log.open("a") as f:
        f.write('{"cache": "dyn')  # a line cut by an interruption: dropped, redone
    assert len(taskrun.read_log(log)) == 16
    other = [T.generate_sample(TOK, "vt", 2048, 0, seed=5)]
    with pytest.raises(ValueError, match="made from other prompts"):
        taskrun.run_tasks(tiny, TOK, other, specs, ["one"], log=log)


def test_summary_per_task_and_suite(tiny, samples):
    rows = []
    for s, got in zip(samples, (1.0, 0.0, 0.5, 1.0)):
        for cache, score in (("dynamic", got), ("default", got)):
            rows.append(
                {
                    "cache": cache,
                    "task": s.task,
                    "length": s.length,
                    "index": s.index,
                    "protocol": "one",
                    "score": score,
                    "new_tokens": 3,
                    "kv_bytes": 10,
                    "ratio_fp16": 0.5,
                }
            )
    out = {(r["cache"], r["task"]): r for r in taskrun.summarize(rows)}
    assert out[("default", "niah_single_1")]["score"] == 50.0 and out[("default", "vt")]["score"] == 75.0
    assert out[("default", "ruler")]["score"] == 62.5 and out[("default", "ruler")]["samples"] == 4
    assert out[("default", "ruler")]["delta_vs_reference"] == 0 and out[("default", "vt")]["p_vs_reference"] == 1.0
    assert out[("dynamic", "ruler")]["p_vs_reference"] is None


def test_cli_generate_only_writes_the_prompts(tmp_path, monkeypatch):
    """``kvtier eval tasks --generate-only`` writes the prompts JSONL; a bad task name is one line."""
    from kvtier import cli

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: TOK)
    monkeypatch.setattr("kvtier.models.model_dir", lambda name="x": tmp_path)
    out = tmp_path / "r.json"
    code = cli.main(
        [
            "eval",
            "tasks",
            "--tasks",
            "vt,niah_single_3",
            "--lengths",
            "4k",
            "--samples",
            "2",
            "--out",
            str(out),
            "--generate-only",
        ]
    )
    assert code == 0
    got = T.read_jsonl(tmp_path / "r.prompts.jsonl")
    assert [(s.task, s.index) for s in got] == [("vt", 0), ("vt", 1), ("niah_single_3", 0), ("niah_single_3", 1)]
    assert got == [T.generate_sample(TOK, s.task, 4096, s.index) for s in got]
