"""Runners behind ``kvtier eval ppl|recall|fidelity`` and ``kvtier bench``: they take a model,
texts and cache names, run every cache side by side in one process, and return result rows
(see :mod:`kvtier.eval.results` for the schema)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..diagnostics import reachable_tensor_bytes
from .caches import CacheSpec, Unavailable, cache_spec, kv_bytes
from .perplexity import book_windows, stream_compare
from .recall import build_case, run_case


def progress(iterable: Iterable, total: int | None = None, desc: str = "") -> Iterable:
    """A tqdm bar on a terminal, silent otherwise."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, disable=not sys.stderr.isatty(), leave=False)


def usable_specs(model, names: list[str], log=print) -> list[CacheSpec]:
    """Specs for ``names``; caches that cannot run here are skipped with a message."""
    specs = []
    for name in names:
        spec = cache_spec(name)
        try:
            spec.build(model)
        except Unavailable as err:
            log(f"skipping {name}: {err}")
            continue
        specs.append(spec)
    return specs


def dense_fp16_bytes(model, tokens: int, batch: int = 1) -> int:
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * tokens * head_dim * 2


def run_stream(
    model,
    tok,
    texts: dict[str, str],
    contexts: list[int],
    specs: list[CacheSpec],
    windows: int = 1,
    chunk: int = 64,
    checkpoint: Callable[[list[dict], list[dict]], None] | None = None,
    score_chunk: int | None = None,
) -> tuple[list[dict], list[dict]]:
    """Streamed perplexity and fidelity rows, aggregated over windows per (cache, text, context).

    The scored half of each window streams in chunks of ``score_chunk`` (default ``chunk``).
    Contexts run shortest first; ``checkpoint(ppl_rows, fid_rows)`` is called after each
    (text, context) job so long runs leave usable partial results. Caches with sparse attention
    add their work counters (:class:`kvtier.diagnostics.SparseStats`) to their ppl rows."""
    from ..diagnostics import SparseStats

    ppl_rows, fid_rows = [], []
    jobs = [(name, text, ctx) for ctx in sorted(contexts) for name, text in texts.items()]
    for name, text, ctx in progress(jobs, desc="windows"):
        totals: dict[str, dict[str, float]] = {}
        sparse: dict[str, SparseStats] = {}
        for ids in book_windows(tok, text, ctx, count=windows):
            built: dict[str, Any] = {}
            scores = stream_compare(model, ids, specs, chunk=chunk, caches_out=built, score_chunk=score_chunk)
            for cache_name, cache in built.items():
                if getattr(getattr(cache, "policy", None), "sparse", None) is not None:
                    sparse.setdefault(cache_name, SparseStats()).add(cache.sparse_stats())
            _add_scores(totals, scores)
        ppl, fid = _stream_rows(totals, sparse, name, ctx, windows, dense_fp16_bytes(model, ctx - 1))
        ppl_rows += ppl
        fid_rows += fid
        if checkpoint is not None:
            checkpoint(ppl_rows, fid_rows)
    return ppl_rows, fid_rows


def _add_scores(totals: dict[str, dict[str, float]], scores: dict[str, Any]) -> None:
    """Add one window's scores per cache to the running totals (bytes: the largest seen)."""
    for cache, sc in scores.items():
        t = totals.setdefault(
            cache, {"nll": 0.0, "kl": 0.0, "top1": 0, "tokens": 0, "kv_bytes": 0, "resident_bytes": 0}
        )
        t["nll"] += sc.nll
        t["kl"] += sc.kl
        t["top1"] += sc.top1_agree
        t["tokens"] += sc.tokens
        t["kv_bytes"] = max(t["kv_bytes"], sc.kv_bytes)
        t["resident_bytes"] = max(t["resident_bytes"], sc.resident_bytes)


def _stream_rows(
    totals: dict[str, dict[str, float]], sparse: dict[str, Any], name: str, ctx: int, windows: int, fp16: int
) -> tuple[list[dict], list[dict]]:
    """Perplexity and fidelity rows of one (text, context) job, perplexity relative to ``dynamic``."""
    base = totals["dynamic"]
    base_ppl = float(torch.tensor(base["nll"] / base["tokens"]).exp())
    ppl_rows, fid_rows = [], []
    for cache, t in totals.items():
        ppl = float(torch.tensor(t["nll"] / t["tokens"]).exp())
        ppl_rows.append(
            {
                "cache": cache,
                "text": name,
                "context": ctx,
                "windows": windows,
                "tokens_scored": t["tokens"],
                "ppl": ppl,
                "dppl_pct": 100 * (ppl / base_ppl - 1),
                "kv_bytes": t["kv_bytes"],
                "dense_fp16_bytes": fp16,
                "bytes_per_token": t["kv_bytes"] / (ctx - 1),
                "kv_ratio_fp16": t["kv_bytes"] / fp16,
                "resident_bytes": t["resident_bytes"],
                "resident_ratio_fp16": t["resident_bytes"] / fp16,
                **({"sparse": sparse[cache].to_dict()} if cache in sparse else {}),
            }
        )
        fid_rows.append(
            {
                "cache": cache,
                "text": name,
                "context": ctx,
                "kl": t["kl"] / t["tokens"],
                "top1": t["top1"] / t["tokens"],
                "tokens_scored": t["tokens"],
            }
        )
    return ppl_rows, fid_rows


def run_recall(
    model,
    tok,
    texts: dict[str, str],
    contexts: list[int],
    depths: list[float],
    specs: list[CacheSpec],
    samples: int = 1,
    prefill_chunk: int = 512,
    checkpoint: Callable[[list[dict]], None] | None = None,
    needle: str = "auto",
) -> list[dict]:
    """Accuracy per (cache, context, depth) cell; every cache answers the same prompts.
    Sample ``s`` of a cell is built from text ``s % len(texts)``, with ``needle`` (``auto``: a code
    needle in source code, a number in prose; see :mod:`kvtier.eval.recall`).
    Rows carry the mean answer margin, the count per needle and the cases (text, needle, key,
    answer, margin). ``checkpoint(rows)`` gets the cells so far after every case."""
    text_list = list(texts.items())
    cells = [(ctx, d, s) for ctx in contexts for d in depths for s in range(samples)]
    cases: dict[tuple[str, int, float], list[dict]] = {}
    for ctx, depth, s in progress(cells, desc="recall cases"):
        name, text = text_list[s % len(text_list)]
        case = build_case(tok, text, ctx, depth, seed=1000 * s + ctx + int(100 * depth), needle=needle)
        for spec in specs:
            r = run_case(model, tok, case, spec, prefill_chunk=prefill_chunk)
            cases.setdefault((spec.name, ctx, depth), []).append({"text": name, "sample": s, **r})
        if checkpoint is not None:
            checkpoint(_recall_rows(cases))
    return _recall_rows(cases)


def _recall_rows(cases: dict[tuple[str, int, float], list[dict]]) -> list[dict]:
    rows = []
    for (cache, ctx, depth), done in cases.items():
        ok = sum(int(c["correct"]) for c in done)
        by_needle: dict[str, list[int]] = {}
        for c in done:
            tally = by_needle.setdefault(c.get("needle", "number"), [0, 0])
            tally[0] += int(c["correct"])
            tally[1] += 1
        rows.append(
            {
                "cache": cache,
                "context": ctx,
                "depth": depth,
                "correct": ok,
                "total": len(done),
                "accuracy": ok / len(done),
                "margin_mean": sum(c["margin"] for c in done) / len(done),
                "correct_by_needle": by_needle,
                "cases": done,
            }
        )
    return rows


class PeakRSS:
    """Samples the process RSS every few ms in a thread; ``peak_mb`` after ``stop()``."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                import os

                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # not Linux
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self.base = self.rss()
        self.peak = self.base
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20

    @property
    def delta_mb(self) -> float:
        return (self.peak - self.base) / 2**20


def build_cpu_kernels() -> dict[str, bool]:
    """Compile (or load from torch's extension cache) every C++ CPU kernel now; name -> available."""
    from ..kernels import cpu, fused_cpu, offload_cpu, parallel, prefill_cpu, sketch_cpu, vq_cpu

    return {
        m.__name__.rpartition(".")[2]: m.available()
        for m in (cpu, fused_cpu, offload_cpu, parallel, prefill_cpu, sketch_cpu, vq_cpu)
    }


class _Bench:
    """One cache under benchmark: prefilled once, then decoded in timed bursts."""

    def __init__(self, model, ids: torch.Tensor, spec: CacheSpec, prefill_chunk: int = 0):
        self.model, self.spec = model, spec
        self.cache = spec.build(model)
        self.cuda = torch.cuda.is_available() and ids.is_cuda
        self.decode_times: list[float] = []
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        with spec.context(model), PeakRSS() as mem, torch.no_grad():
            t0 = time.perf_counter()
            step = prefill_chunk or ids.shape[1]
            for s in range(0, ids.shape[1], step):
                out = model(ids[:, s : s + step], cache=self.cache, use_cache=True, logits_to_keep=1)
            self.next = out.logits[:, -1:].argmax(-1)
            self._sync()
            self.prefill_s = time.perf_counter() - t0
            self.decode(1)  # warm-up step (not timed into the rounds)
        self.decode_times.clear()
        self.mem = mem
        self.largest_alloc = self._largest_allocation() if not self.cuda else None

    def _largest_allocation(self) -> int:
        """Largest single CPU allocation any op makes during one decode step (torch.profiler): a
        dense copy of a layer's K/V would show up here as ``2 * kv_heads * tokens * head_dim * 4``."""
        with self.spec.context(self.model), torch.no_grad(), torch.profiler.profile(profile_memory=True) as prof:
            out = self.model(self.next, cache=self.cache, use_cache=True)
        self.next = out.logits[:, -1:].argmax(-1)
        return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def decode(self, new_tokens: int) -> None:
        with self.spec.context(self.model), torch.no_grad():
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                out = self.model(self.next, cache=self.cache, use_cache=True)
                self.next = out.logits[:, -1:].argmax(-1)
            self._sync()
            self.decode_times.append((time.perf_counter() - t0) / new_tokens)

    def row(self) -> dict[str, Any]:
        import statistics

        per_token = statistics.median(self.decode_times)
        row = {
            "cache": self.spec.name,
            "prefill_s": self.prefill_s,
            "decode_s": sum(self.decode_times) / len(self.decode_times),
            "decode_tok_s": 1 / per_token,
            "ms_per_token": 1000 * per_token,
            "kv_bytes": kv_bytes(self.cache),
            "reachable_bytes": reachable_tensor_bytes(self.cache),
            "peak_rss_mb": self.mem.peak_mb,
            "rss_delta_mb": self.mem.delta_mb,
        }
        if self.largest_alloc is not None:
            row["largest_alloc_bytes"] = self.largest_alloc
        if hasattr(self.cache, "memory_report"):
            report = self.cache.memory_report()
            row.update(resident_bytes=report.resident_bytes, offloaded_bytes=report.offloaded_bytes)
        if self.cuda:
            row["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
        return row


def run_bench(
    model,
    tok,
    text: str,
    contexts: list[int],
    specs: list[CacheSpec],
    new_tokens: int = 32,
    rounds: int = 2,
    prefill_chunk: int = 0,
    checkpoint: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Per context: every cache prefilled once (timed; peak RSS over its prefill; in calls of
    ``prefill_chunk`` tokens, 0: one call), then decode bursts of ``new_tokens`` interleaved
    round-robin over ``rounds``; median ms per token; ratios to ``dynamic``. ``checkpoint(rows)``
    gets the rows so far after each context."""
    rows = []
    if model.device.type == "cpu":
        build_cpu_kernels()  # compiled on first use: not inside the first kvtier cache's timed prefill
    for ctx in contexts:
        ids = book_windows(tok, text, ctx)[0].to(model.device)
        benches = [_Bench(model, ids, spec, prefill_chunk) for spec in progress(specs, desc=f"prefill {ctx}")]
        for _ in progress(range(rounds), desc=f"decode {ctx}"):
            for b in benches:
                b.decode(new_tokens)
        med = {}
        for b in benches:
            m = b.row()
            m.update(context=ctx, new_tokens=new_tokens, rounds=rounds)
            med[b.spec.name] = m
            if hasattr(b.cache, "close"):
                b.cache.close()
        benches = b = None  # the loop variable too: no cache of this context lives into the next one's prefill
        base = med.get("dynamic")
        for m in med.values():
            m["decode_tok_s_ratio"] = m["decode_tok_s"] / base["decode_tok_s"] if base else float("nan")
            m["kv_bytes_ratio"] = m["kv_bytes"] / base["kv_bytes"] if base else float("nan")
            m["dense_fp16_bytes"] = dense_fp16_bytes(model, ctx + new_tokens)
            m["kv_ratio_fp16"] = m["kv_bytes"] / m["dense_fp16_bytes"]
            rows.append(m)
        if checkpoint is not None:
            checkpoint(rows)
    return rows
