"""A byte cap over a long stream: ``max_bytes`` with ``on_full="degrade"`` against ``"evict"``.

One book window (default 16,384 tokens) is streamed in chunks of 64 through the full cache and
through capped kvtier caches in lockstep (one process, same tokens). After every call each capped
cache's ``memory_report().total_bytes`` is read and its largest value kept: the cap must hold at
every step. Perplexity of the second half, KL and top-1 against the full cache as in
``kvtier eval ppl``; tokens held per tier at the end.

``degrade`` steps a layer's oldest warm blocks down to its cold code before evicting anything;
``evict`` drops the oldest non-sink blocks (StreamingLLM-style). SmolLM2-135M is trained to 8,192
positions: past that its own perplexity is not meaningful, the comparison with its full cache is.

    python benchmarks/degrade_stream.py --length 16384 --cap-mb 29.5 \\
        --caches adaptive@2.5:degrade adaptive@2.5:evict default:degrade default:evict

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

import kvtier
from kvtier.eval.caches import CacheSpec, cache_spec
from kvtier.eval.perplexity import book_windows, stream_compare
from kvtier.models import load_model


@dataclasses.dataclass
class CappedSpec(CacheSpec):
    """A kvtier cache spec built with ``max_bytes`` and ``on_full``."""

    max_bytes: int = 0
    on_full: str = "error"

    def build(self, model):
        return kvtier.TieredCache(model.config, self.policy, max_bytes=self.max_bytes, on_full=self.on_full)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--cap-mb", type=float, default=29.5, help="max_bytes in MB (1e6 bytes)")
    ap.add_argument("--caches", nargs="+", default=["adaptive@2.5:degrade", "adaptive@2.5:evict"])
    ap.add_argument("--book", default="dracula")
    ap.add_argument("--data", default="../shared/data/pg")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    ids = book_windows(tok, Path(args.data, f"{args.book}.txt").read_text(), args.length)[0]
    cap = int(args.cap_mb * 1e6)
    specs = []
    for name in args.caches:
        base, _, on_full = name.rpartition(":")
        specs.append(CappedSpec(name, cache_spec(base).policy, max_bytes=cap, on_full=on_full))
    peak = {n: 0 for n in args.caches}
    calls = [0]
    t0 = time.time()

    def after_call(name: str, cache) -> None:
        if name in peak:  # the cap must hold after every call
            peak[name] = max(peak[name], cache.memory_report().total_bytes)
        elif name == "dynamic":
            calls[0] += 1
            if calls[0] % 32 == 1:
                print(f"{calls[0] * args.chunk} tokens, {time.time() - t0:.0f} s", flush=True)

    caches: dict = {}
    scores = stream_compare(model, ids, specs, chunk=args.chunk, caches_out=caches, after_call=after_call)
    W, full = ids.shape[1], scores["dynamic"].ppl
    rows = []
    print(f"\n{args.book}, {W} tokens streamed, max_bytes={cap:,} (scored: the second half)")
    print(f"{'cache':<24}{'ppl':>9}{'dppl':>9}{'KL':>8}{'top-1':>7}{'peak / cap':>11}  tokens held (end)")
    for name, sc in scores.items():
        row = {"cache": name, "ppl": sc.ppl, "dppl": sc.ppl / full - 1, "kl": sc.mean_kl, "top1": sc.top1}
        if name in peak:
            tokens = caches[name].memory_report().tokens
            row.update(peak_bytes=peak[name], cap=cap, under_cap=peak[name] <= cap, tokens=tokens)
        rows.append(row)
        print(
            f"{name:<24}{sc.ppl:>9.3f}{100 * row['dppl']:>+8.2f}%{row['kl']:>8.4f}{row['top1']:>7.3f}"
            + (f"{peak[name] / cap:>11.4f}  {row['tokens']}" if name in peak else ""),
            flush=True,
        )
    result = {"book": args.book, "length": W, "cap": cap, "chunk": args.chunk, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
