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
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kvtier
from kvtier.eval.caches import cache_spec
from kvtier.eval.perplexity import book_windows
from kvtier.models import load_model


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
    names = ["dynamic", *args.caches]
    caches: dict = {"dynamic": cache_spec("dynamic").build(model)}
    for name in args.caches:
        base, _, on_full = name.rpartition(":")
        caches[name] = kvtier.TieredCache(model.config, cache_spec(base).policy, max_bytes=cap, on_full=on_full)
    peak = {n: 0 for n in args.caches}
    nll = {n: 0.0 for n in names}
    kl = {n: 0.0 for n in names}
    top1 = {n: 0 for n in names}
    scored = 0
    W, half = ids.shape[1], ids.shape[1] // 2
    t0 = time.time()
    bounds = [*range(0, W - 1, args.chunk), W - 1]
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        need = max(0, e - max(s, half))
        target = ids[0, e - need + 1 : e + 1]
        ref = None
        for name in names:
            cache = caches[name]
            if name == "dynamic":
                out = model(ids[:, s:e], cache=cache, use_cache=True, logits_to_keep=max(need, 1))
            else:
                with kvtier.enable(model):
                    out = model(ids[:, s:e], cache=cache, use_cache=True, logits_to_keep=max(need, 1))
                peak[name] = max(peak[name], cache.memory_report().total_bytes)
            if not need:
                continue
            logp = F.log_softmax(out.logits[0, -need:].float(), -1)
            nll[name] += -float(logp.gather(1, target[:, None]).sum())
            if ref is None:
                ref = logp
            else:
                kl[name] += float(F.kl_div(logp, ref, log_target=True, reduction="sum"))
                top1[name] += int((logp.argmax(-1) == ref.argmax(-1)).sum())
        scored += need
        if i % 32 == 0:
            print(f"{e} tokens, {time.time() - t0:.0f} s", flush=True)
    full = math.exp(nll["dynamic"] / scored)
    rows = []
    print(f"\n{args.book}, {W} tokens streamed, max_bytes={cap:,} (scored tokens {half + 1}..{W - 1})")
    print(f"{'cache':<24}{'ppl':>9}{'dppl':>9}{'KL':>8}{'top-1':>7}{'peak / cap':>11}  tokens held (end)")
    for name in names:
        ppl = math.exp(nll[name] / scored)
        row = {"cache": name, "ppl": ppl, "dppl": ppl / full - 1, "kl": kl[name] / scored, "top1": top1[name] / scored}
        if name != "dynamic":
            rep = caches[name].memory_report()
            row.update(peak_bytes=peak[name], cap=cap, under_cap=peak[name] <= cap, tokens=rep.tokens)
            row["top1"] = top1[name] / scored
        else:
            row["top1"] = 1.0
        rows.append(row)
        print(
            f"{name:<24}{ppl:>9.3f}{100 * row['dppl']:>+8.2f}%{row['kl']:>8.4f}{row['top1']:>7.3f}"
            + (f"{peak[name] / cap:>11.4f}  {row['tokens']}" if name != "dynamic" else ""),
            flush=True,
        )
    result = {"book": args.book, "length": W, "cap": cap, "chunk": args.chunk, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
