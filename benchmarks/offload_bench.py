"""Offload presets at decode time: tokens/s with prefetch on and off, hit rate, stall time, bytes
moved, and resident vs offloaded bytes, side by side with the full cache and the default preset.

Every cache gets the same prompt (prefilled in one call with --prefill-threads, as ``kvtier bench``
does), then decodes greedily with --threads (default 1); caches are interleaved round-robin over
--rounds and the median is reported. Block traffic is counted over the decode steps only. The
prefetch worker needs a core of its own: run it on an otherwise idle machine.

``--drop-page-cache``: before every decode step of a disk cache, its files are written back and
dropped from the OS page cache (outside the timing), so every block read comes from the device -
what reads cost when the offloaded blocks do not fit in RAM.

    python benchmarks/offload_bench.py --tokens 8192 --new-tokens 16 --rounds 2

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from kvtier import get_policy
from kvtier.eval.caches import CacheSpec, cache_spec
from kvtier.eval.perplexity import book_windows
from kvtier.eval.texts import load_texts
from kvtier.models import load_model


def offload_spec(preset: str, prefetch: bool) -> CacheSpec:
    pol = get_policy(preset)
    name = f"{preset}{'' if prefetch else ' (no prefetch)'}"
    return CacheSpec(name, pol.replace(offload=dataclasses.replace(pol.offload, prefetch=prefetch), name=name))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill-threads", type=int, default=2)
    ap.add_argument("--presets", nargs="+", default=["offload-cpu", "offload-disk"])
    ap.add_argument("--drop-page-cache", action="store_true", help="disk caches read every block from the device")
    args = ap.parse_args()
    model, tok = load_model()
    ids = book_windows(tok, next(iter(load_texts(limit=1).values())), args.tokens)[0]
    specs = [cache_spec("dynamic"), cache_spec("default")] + [
        offload_spec(p, on) for p in args.presets for on in (True, False)
    ]
    states = {}
    for spec in specs:
        cache = spec.build(model)
        torch.set_num_threads(args.prefill_threads)
        with spec.context(model), torch.no_grad():
            out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        states[spec.name] = {"cache": cache, "next": out.logits[:, -1:].argmax(-1), "times": []}
        print(f"prefilled {spec.name}", flush=True)
    torch.set_num_threads(args.threads)
    before = {n: dataclasses.asdict(s["cache"].offload_stats()) for n, s in states.items() if "offload" in n}
    for _ in range(args.rounds):
        for spec in specs:
            st = states[spec.name]
            layers = getattr(st["cache"], "tiered_layers", [])
            stores = [layer.cold.store for layer in layers if layer.offloaded]
            with spec.context(model), torch.no_grad():
                busy = 0.0
                for _ in range(args.new_tokens):
                    if args.drop_page_cache:
                        for store in stores:
                            store.drop_page_cache()
                    t0 = time.perf_counter()
                    st["next"] = model(st["next"], cache=st["cache"], use_cache=True).logits[:, -1:].argmax(-1)
                    busy += time.perf_counter() - t0
                st["times"].append(busy / args.new_tokens)
    rows = []
    steps = args.rounds * args.new_tokens
    for spec in specs:
        st = states[spec.name]
        cache = st["cache"]
        ms = 1000 * statistics.median(st["times"])
        row = {"cache": spec.name, "ms_per_token": ms, "tok_s": 1000 / ms}
        if hasattr(cache, "memory_report"):
            r = cache.memory_report()
            row.update(
                resident_bytes=r.resident_bytes,
                offloaded_bytes=r.offloaded_bytes,
                dense_fp16_bytes=r.dense_fp16_bytes,
                resident_vs_fp16=r.resident_bytes / r.dense_fp16_bytes,
            )
        if spec.name in before:
            now = dataclasses.asdict(cache.offload_stats())
            d = {k: now[k] - before[spec.name][k] for k in now}
            row.update(
                hit_rate=d["hits"] / d["needed"] if d["needed"] else 1.0,
                needed=d["needed"],
                misses=d["misses"],
                stall_ms_per_token=1000 * d["stall_s"] / steps,
                mb_moved_per_token=d["bytes_moved"] / steps / 2**20,
            )
            cache.close()
        rows.append(row)
    base = rows[0]["tok_s"]
    cold = ", page cache dropped before every step (disk)" if args.drop_page_cache else ""
    print(f"\n{args.tokens} tokens, decode with {args.threads} thread(s){cold}")
    print(
        f"{'cache':<28}{'ms/tok':>8}{'vs full':>8}{'resident/fp16':>14}{'hit rate':>9}{'stall ms/tok':>13}"
        f"{'MB moved/tok':>13}"
    )
    for r in rows:
        r["vs_dynamic"] = r["tok_s"] / base
        print(
            f"{r['cache']:<28}{r['ms_per_token']:>8.1f}{r['vs_dynamic']:>8.2f}"
            f"{r.get('resident_vs_fp16', float('nan')):>14.3f}{r.get('hit_rate', float('nan')):>9.3f}"
            f"{r.get('stall_ms_per_token', float('nan')):>13.1f}{r.get('mb_moved_per_token', float('nan')):>13.2f}"
        )
    config = {"tokens": args.tokens, "threads": args.threads, "drop_page_cache": args.drop_page_cache}
    print(json.dumps({**config, "rows": rows}))


if __name__ == "__main__":
    main()
