"""Streamed perplexity of the adaptive cache at several budgets against the full cache, per book.

Same measurement as ``kvtier eval ppl`` (streamed, chunks of 64, NLL over the last half, KL and
top-1 against the full cache in lockstep), printing each book as soon as it is done (the shared
2-core machine made whole runs long) and the allocation each adaptive cache chose.

    python benchmarks/adaptive_ppl.py --length 4096 --caches dynamic,adaptive@2.5,adaptive@3.0 \
        --books dracula huckleberry_finn --out benchmarks/results/adaptive-4k.json

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvtier.eval.caches import cache_spec
from kvtier.eval.perplexity import book_windows, stream_compare
from kvtier.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--caches", default="dynamic,adaptive@2.5")
    ap.add_argument("--books", nargs="+", default=["dracula", "huckleberry_finn"])
    ap.add_argument("--data", default="../shared/data/pg")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    specs = [cache_spec(name) for name in args.caches.split(",")]
    L = args.length
    fp16 = None
    out: dict = {"length": L, "books": {}}
    for book in args.books:
        ids = book_windows(tok, Path(args.data, f"{book}.txt").read_text(), L)[0]
        t0 = time.time()
        caches: dict = {}
        scores = stream_compare(model, ids, specs, caches_out=caches)
        full = scores["dynamic"]
        rows = {}
        for name, s in scores.items():
            cache = caches[name]
            fp16 = 2 * len(model.model.layers) * model.config.num_key_value_heads * 64 * 2 * L
            row = {
                "ppl": s.ppl,
                "dppl": s.ppl / full.ppl - 1,
                "kl": s.mean_kl,
                "top1": s.top1,
                "kv_bytes": s.kv_bytes,
                "kv_vs_fp16": s.kv_bytes / fp16,
                "bits_per_element": 16 * s.kv_bytes / fp16,
            }
            if getattr(cache, "budgets", None):
                alloc = cache.allocation()["layers"]
                row["allocation"] = {str(i): [a["key_bits"], a["value_bits"]] for i, a in alloc.items()}
                rep = cache.memory_report()
                row["tokens"] = rep.tokens
            rows[name] = row
            print(
                f"{book} {L} {name:<14} ppl={s.ppl:.3f} dppl={100 * row['dppl']:+.2f}% kl={s.mean_kl:.4f} "
                f"top1={s.top1:.3f} kv/fp16={row['kv_vs_fp16']:.4f} bits={row['bits_per_element']:.2f}"
                + (
                    " alloc=" + " ".join(f"{k}{v}" for k, v in row["allocation"].values())
                    if "allocation" in row
                    else ""
                ),
                flush=True,
            )
        print(f"{book}: {time.time() - t0:.0f} s", flush=True)
        out["books"][book] = rows
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
    names = [s.name for s in specs]
    out["mean_dppl"] = {n: sum(b[n]["dppl"] for b in out["books"].values()) / len(out["books"]) for n in names}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({"length": L, "mean_dppl": out["mean_dppl"]}))


if __name__ == "__main__":
    main()
