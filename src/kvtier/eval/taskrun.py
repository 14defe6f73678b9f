"""Runs generated long-context task prompts (:mod:`kvtier.eval.tasks`) through caches and scores them.

Protocols (per prompt, each cache built fresh):

- ``one``: the kvpress leaderboard's question-agnostic protocol: the context (``context_ids``) is
  prefilled in **one** forward call (the cache compresses it: kvtier settles its tiers after the
  call), then the question and answer prefix (``question_ids``) in a second call, then greedy
  decoding of at most ``max_new_tokens`` tokens, stopped at the model's end-of-turn token.
- ``stream``: the context arrives in ``chunk``-token calls (512), so kvtier's tiers form while it
  reads, as long inputs arrive in practice; then the same question and decoding.

Per (cache, prompt) one row: the prediction, its score (``string_match_all``), the generated
tokens, the cache's measured bytes right after the context (:func:`kvtier.eval.caches.kv_bytes`:
sinks, scales, windows counted) and the fp16 bytes of a full cache of the same tokens, and the
seconds of prefill and decode. Rows are appended to a JSONL log as they finish; a rerun with the
same log skips what it holds (resumable), and refuses a log made from other prompts (each row
carries the prompt's sha256).

:func:`summarize` gives per (cache, length, protocol, task) the mean score with a bootstrap 95 %
interval, the paired sign-flip p-value against a reference cache on the same prompts, mean output
length and bytes; and per (cache, length, protocol) the mean over the RULER tasks and over the code
tasks.

Imports: torch, :mod:`kvtier.eval.tasks`, :mod:`kvtier.eval.caches`, :mod:`kvtier.eval.run`.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..inputs import read_input
from .caches import CacheSpec, kv_bytes
from .run import dense_fp16_bytes, progress
from .tasks import CODE_TASKS, RULER_TASKS, TaskSample, bootstrap_ci, paired_sign_flip, score

PROTOCOLS = ("one", "stream")


def prompt_sha(sample: TaskSample) -> str:
    """sha256 of the prompt's token ids (what a results row is tied to)."""
    data = json.dumps([sample.context_ids, sample.question_ids]).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _stop_ids(model, tok) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tok):
        eos = getattr(src, "eos_token_id", None)
        ids |= set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return ids


@torch.no_grad()
def answer(model, tok, sample: TaskSample, spec: CacheSpec, protocol: str = "one", chunk: int = 512) -> dict:
    """One prompt through a fresh cache of ``spec`` under ``protocol``: the row (see the module doc)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is not allowed: expected one of {PROTOCOLS}")
    device = next(model.parameters()).device
    ctx = torch.tensor([sample.context_ids], device=device)
    ids = torch.cat([ctx, torch.tensor([sample.question_ids], device=device)], dim=1)
    stop = _stop_ids(model, tok)
    cache = spec.build(model)
    with spec.context(model):
        t0 = time.perf_counter()
        step = ctx.shape[1] if protocol == "one" else chunk
        for s in range(0, ctx.shape[1], step):
            model(ctx[:, s : s + step], cache=cache, use_cache=True, logits_to_keep=1)
        t1 = time.perf_counter()
        nbytes = kv_bytes(cache)
        out = model.generate(
            ids,
            cache=cache,
            max_new_tokens=sample.max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=sorted(stop) or None,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else (min(stop) if stop else 0),
        )
        t2 = time.perf_counter()
    gen = [int(t) for t in out[0, ids.shape[1] :]]
    while gen and gen[-1] in stop:  # the end-of-turn token (and padding after it)
        gen.pop()
    prediction = tok.decode(gen, skip_special_tokens=True)
    fp16 = dense_fp16_bytes(model, ctx.shape[1])
    return {
        "cache": spec.name,
        "task": sample.task,
        "length": sample.length,
        "index": sample.index,
        "protocol": protocol,
        "score": score(prediction, sample.answers),
        "prediction": prediction,
        "new_tokens": len(gen),
        "hit_limit": len(gen) >= sample.max_new_tokens,
        "context_tokens": int(ctx.shape[1]),
        "kv_bytes": int(nbytes),
        "fp16_bytes": fp16,
        "ratio_fp16": nbytes / fp16,
        "prefill_s": round(t1 - t0, 3),
        "decode_s": round(t2 - t1, 3),
        "prompt_sha": prompt_sha(sample),
    }


def row_key(row: dict) -> tuple:
    return row["cache"], row["task"], row["length"], row["index"], row["protocol"]


def read_log(path: str | Path) -> list[dict]:
    """Rows of a results log (a missing file: none). A last line cut by an interruption is dropped."""
    path = Path(path)
    if not path.exists():
        return []
    lines = read_input(path, "task results log", limit=1 << 30).decode("utf-8").splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # cut short by an interruption: redone
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return rows


def run_tasks(
    model,
    tok,
    samples: list[TaskSample],
    specs: list[CacheSpec],
    protocols: Iterable[str] = ("one",),
    chunk: int = 512,
    log: str | Path | None = None,
    echo: Callable[[str], None] | None = None,
) -> list[dict]:
    """Every (prompt, protocol, cache) row, prompt by prompt (all caches side by side on one prompt
    before the next, so partial results stay comparable). With ``log``, rows already there are kept
    (resumed) and new ones appended as they finish. Returns every row of this set of prompts."""
    protocols = list(protocols)
    done: dict[tuple, dict] = {}
    shas = {s.key: prompt_sha(s) for s in samples}
    if log is not None:
        for r in read_log(log):
            key = (r["task"], r["length"], r["index"])
            if key in shas and r.get("prompt_sha") != shas[key]:
                raise ValueError(
                    f"{log} holds a row for {key} of another prompt (sha {r.get('prompt_sha')} != {shas[key]}): "
                    "made from other prompts; use another log"
                )
            done[row_key(r)] = r
    jobs = [(s, p) for s in samples for p in protocols]
    todo = [(s, p) for s, p in jobs if any((sp.name, *s.key, p) not in done for sp in specs)]
    if echo and len(todo) < len(jobs):
        echo(f"resuming: {len(jobs) - len(todo)} of {len(jobs)} prompt runs already in {log}")
    fh = open(log, "a", encoding="utf-8") if log is not None else None  # noqa: SIM115
    try:
        for sample, protocol in progress(todo, total=len(todo), desc="task prompts"):
            times = []
            for spec in specs:
                key = (spec.name, *sample.key, protocol)
                if key in done:
                    continue
                row = answer(model, tok, sample, spec, protocol, chunk)
                done[key] = row
                times.append(f"{spec.name} {row['score']:.2f} {row['prefill_s'] + row['decode_s']:.0f}s")
                if fh is not None:
                    fh.write(json.dumps(row, sort_keys=True) + "\n")
                    fh.flush()
            if echo:
                echo(f"{sample.task} {sample.length} #{sample.index} {protocol}: " + ", ".join(times))
    finally:
        if fh is not None:
            fh.close()
    wanted = {(sp.name, *s.key, p) for s in samples for p in protocols for sp in specs}
    return [r for k, r in done.items() if k in wanted]


def summarize(rows: list[dict], reference: str = "dynamic") -> list[dict]:
    """Per (cache, length, protocol, task) and per (cache, length, protocol) over the RULER tasks
    (``task = "ruler"``) and the code tasks (``"code"``): mean score x 100, bootstrap 95 %
    interval, samples, the paired sign-flip p-value against ``reference`` on the same prompts
    (the prompts both ran), mean generated tokens, mean bytes and ratio to fp16."""
    by: dict[tuple, dict[tuple, dict]] = {}
    for r in rows:
        by.setdefault((r["cache"], r["length"], r["protocol"], r["task"]), {})[(r["task"], r["index"])] = r
    out = []

    def add(cache, length, protocol, task, cell: dict[tuple, dict], per_task: bool) -> None:
        ref = {}
        for (c, ln, p, t), rs in by.items():
            if c == reference and ln == length and p == protocol and (t == task or not per_task):
                ref.update(rs)
        scores = [r["score"] for r in cell.values()]
        common = [k for k in cell if k in ref]
        if per_task:
            mean = statistics.fmean(scores)
            lo, hi = bootstrap_ci(scores)
        else:  # a suite: the mean of its task means (RULER's average)
            tasks: dict[str, list[float]] = {}
            for (t, _), r in cell.items():
                tasks.setdefault(t, []).append(r["score"])
            mean = statistics.fmean(statistics.fmean(v) for v in tasks.values())
            lo, hi = bootstrap_ci(list(tasks.values()))  # within each task
        p = (
            paired_sign_flip([cell[k]["score"] for k in common], [ref[k]["score"] for k in common])
            if common and cache != reference
            else None
        )
        out.append(
            {
                "cache": cache,
                "length": length,
                "protocol": protocol,
                "task": task,
                "score": 100 * mean,
                "ci_low": 100 * lo,
                "ci_high": 100 * hi,
                "samples": len(scores),
                "delta_vs_reference": (
                    100
                    * (
                        statistics.fmean(cell[k]["score"] for k in common)
                        - statistics.fmean(ref[k]["score"] for k in common)
                    )
                    if common and cache != reference
                    else None
                ),
                "p_vs_reference": p,
                "new_tokens": statistics.fmean(r["new_tokens"] for r in cell.values()),
                "kv_bytes": statistics.fmean(r["kv_bytes"] for r in cell.values()),
                "ratio_fp16": statistics.fmean(r["ratio_fp16"] for r in cell.values()),
            }
        )

    for (cache, length, protocol, task), cell in sorted(by.items()):
        add(cache, length, protocol, task, cell, True)
    suites: dict[tuple, dict[tuple, dict]] = {}
    for (cache, length, protocol, task), cell in by.items():
        suite = "ruler" if task in RULER_TASKS else "code" if task in CODE_TASKS else None
        if suite:
            suites.setdefault((cache, length, protocol, suite), {}).update(cell)
    for (cache, length, protocol, suite), cell in sorted(suites.items()):
        add(cache, length, protocol, suite, cell, False)
    return out


def print_summary(rows: list[dict], file=sys.stdout) -> None:
    """A table per (length, protocol): caches as rows, tasks as columns (score x 100)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["length"], r["protocol"]), []).append(r)
    for (length, protocol), rs in sorted(groups.items()):
        tasks = list(dict.fromkeys(r["task"] for r in rs))
        caches = list(dict.fromkeys(r["cache"] for r in rs))
        cell = {(r["cache"], r["task"]): r for r in rs}
        print(f"\n{length} tokens, protocol {protocol} (score x 100; bytes / fp16)", file=file)
        print(f"{'cache':>22} {'bytes':>6} " + " ".join(f"{t[:14]:>14}" for t in tasks), file=file)
        for c in caches:
            ratio = statistics.fmean(r["ratio_fp16"] for r in rs if r["cache"] == c)
            vals = [f"{cell[(c, t)]['score']:14.1f}" if (c, t) in cell else f"{'-':>14}" for t in tasks]
            print(f"{c:>22} {ratio:6.3f} " + " ".join(vals), file=file)
