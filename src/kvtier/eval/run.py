"""Runners behind ``kvtier eval ppl|recall|fidelity`` and ``kvtier bench``: they take a model,
texts and cache names, run every cache side by side in one process, and return result rows
(see :mod:`kvtier.eval.results` for the schema)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

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
    model, tok, texts: dict[str, str], contexts: list[int], specs: list[CacheSpec], windows: int = 1, chunk: int = 64
) -> tuple[list[dict], list[dict]]:
    """Streamed perplexity and fidelity rows, aggregated over windows per (cache, text, context)."""
    ppl_rows, fid_rows = [], []
    jobs = [(name, text, ctx) for name, text in texts.items() for ctx in contexts]
    for name, text, ctx in progress(jobs, desc="windows"):
        totals: dict[str, dict[str, float]] = {}
        for ids in book_windows(tok, text, ctx, count=windows):
            scores = stream_compare(model, ids, specs, chunk=chunk)
            for cache, sc in scores.items():
                t = totals.setdefault(cache, {"nll": 0.0, "kl": 0.0, "top1": 0, "tokens": 0, "kv_bytes": 0})
                t["nll"] += sc.nll
                t["kl"] += sc.kl
                t["top1"] += sc.top1_agree
                t["tokens"] += sc.tokens
                t["kv_bytes"] = max(t["kv_bytes"], sc.kv_bytes)
        base = totals["dynamic"]
        base_ppl = float(torch.tensor(base["nll"] / base["tokens"]).exp())
        fp16 = dense_fp16_bytes(model, ctx - 1)
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
) -> list[dict]:
    """Accuracy per (cache, context, depth) cell; every cache answers the same prompts."""
    rows = []
    text_list = list(texts.items())
    cells = [(ctx, d, s) for ctx in contexts for d in depths for s in range(samples)]
    counts: dict[tuple[str, int, float], list[int]] = {}
    for ctx, depth, s in progress(cells, desc="recall cases"):
        name, text = text_list[s % len(text_list)]
        case = build_case(tok, text, ctx, depth, seed=1000 * s + ctx + int(100 * depth))
        for spec in specs:
            r = run_case(model, tok, case, spec, prefill_chunk=prefill_chunk)
            c = counts.setdefault((spec.name, ctx, depth), [0, 0])
            c[0] += int(r["correct"])
            c[1] += 1
    for (cache, ctx, depth), (ok, total) in counts.items():
        rows.append(
            {"cache": cache, "context": ctx, "depth": depth, "correct": ok, "total": total, "accuracy": ok / total}
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


@torch.no_grad()
def bench_one(model, ids: torch.Tensor, spec: CacheSpec, new_tokens: int) -> dict[str, Any]:
    """Prefill ``ids`` in one call, then decode ``new_tokens`` greedily; times and bytes."""
    cache = spec.build(model)
    cuda = torch.cuda.is_available() and ids.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with spec.context(model), PeakRSS() as mem:
        t0 = time.perf_counter()
        out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
    row = {
        "cache": spec.name,
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "decode_tok_s": new_tokens / (t2 - t1),
        "ms_per_token": 1000 * (t2 - t1) / new_tokens,
        "kv_bytes": kv_bytes(cache),
        "peak_rss_mb": mem.peak_mb,
        "rss_delta_mb": mem.delta_mb,
    }
    if cuda:
        row["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return row


def run_bench(
    model, tok, text: str, contexts: list[int], specs: list[CacheSpec], new_tokens: int = 32, rounds: int = 2
) -> list[dict]:
    """Caches interleaved round-robin per context; median over rounds; ratios to ``dynamic``."""
    import statistics

    rows = []
    for ctx in contexts:
        ids = book_windows(tok, text, ctx)[0].to(model.device)
        runs: dict[str, list[dict]] = {}
        for _ in progress(range(rounds), desc=f"bench {ctx}"):
            for spec in specs:
                runs.setdefault(spec.name, []).append(bench_one(model, ids, spec, new_tokens))
        med = {}
        for name, rs in runs.items():
            m = dict(rs[0])
            for key in ("prefill_s", "decode_s", "decode_tok_s", "ms_per_token", "peak_rss_mb", "rss_delta_mb"):
                m[key] = statistics.median(r[key] for r in rs)
            m["context"] = ctx
            m["new_tokens"] = new_tokens
            m["rounds"] = rounds
            med[name] = m
        base = med.get("dynamic")
        for m in med.values():
            m["decode_tok_s_ratio"] = m["decode_tok_s"] / base["decode_tok_s"] if base else float("nan")
            m["kv_bytes_ratio"] = m["kv_bytes"] / base["kv_bytes"] if base else float("nan")
            m["dense_fp16_bytes"] = dense_fp16_bytes(model, ctx + new_tokens)
            rows.append(m)
    return rows
