"""Decode speed and decode-time memory on SmolLM2-135M after a long prompt, side by side:
transformers' DynamicCache (SDPA), kvtier's default preset (fast path: fused kernel on packed
tiers) and the same preset through kvtier's reference path (every tier decoded to dense K/V),
and transformers' QuantizedCache int4 (optimum-quanto).

Each cache gets the same prompt (prefilled in chunks with --prefill-threads), then decodes
greedily with --threads (default 1, for stable timings); caches are interleaved round-robin and
the median over rounds is reported, with ratios to DynamicCache.

Memory: one decode step per cache runs under ``torch.profiler`` with ``profile_memory=True``; the
largest single allocation any op makes is reported. A dense copy of one layer's K/V at this
length would be ``2 * kv_heads * tokens * head_dim * 4`` bytes (fp32) - an allocation that large
during decode means the layer was materialized.

    python benchmarks/decode_speed.py --tokens 8192 --new-tokens 16 --rounds 2

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvtier.eval.caches import Unavailable, cache_spec, kv_bytes
from kvtier.eval.perplexity import book_windows
from kvtier.eval.texts import load_texts
from kvtier.models import load_model


def largest_allocation(model, cache, spec, token) -> int:
    with spec.context(model), torch.no_grad(), torch.profiler.profile(profile_memory=True) as prof:
        model(token, cache=cache, use_cache=True)
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill-threads", type=int, default=2)
    ap.add_argument("--caches", default="dynamic,default,default:reference,quanto-int4")
    args = ap.parse_args()
    model, tok = load_model()
    ids = book_windows(tok, next(iter(load_texts(limit=1).values())), args.tokens)[0]
    cfg = model.config
    dense_layer = 2 * cfg.num_key_value_heads * args.tokens * cfg.head_dim * 4
    specs, states = [], {}
    for name in args.caches.split(","):
        spec = cache_spec(name)
        try:
            cache = spec.build(model)
        except Unavailable as err:
            print(f"skipping {name}: {err}")
            continue
        torch.set_num_threads(args.prefill_threads)
        t0 = time.perf_counter()
        with spec.context(model), torch.no_grad():
            for s in range(0, args.tokens, 1024):
                out = model(ids[:, s : s + 1024], cache=cache, use_cache=True, logits_to_keep=1)
        specs.append(spec)
        states[name] = {
            "cache": cache,
            "next": out.logits[:, -1:].argmax(-1),
            "times": [],
            "prefill_s": time.perf_counter() - t0,
        }
        print(f"prefilled {name} in {states[name]['prefill_s']:.1f} s", flush=True)
    torch.set_num_threads(args.threads)
    for _ in range(args.rounds):
        for spec in specs:
            st = states[spec.name]
            with spec.context(model), torch.no_grad():
                t0 = time.perf_counter()
                for _ in range(args.new_tokens):
                    out = model(st["next"], cache=st["cache"], use_cache=True)
                    st["next"] = out.logits[:, -1:].argmax(-1)
                st["times"].append((time.perf_counter() - t0) / args.new_tokens)
    rows = []
    for spec in specs:
        st = states[spec.name]
        ms = 1000 * statistics.median(st["times"])
        rows.append(
            {
                "cache": spec.name,
                "ms_per_token": ms,
                "tok_s": 1000 / ms,
                "kv_bytes": kv_bytes(st["cache"]),
                "largest_alloc_bytes": largest_allocation(model, st["cache"], spec, st["next"]),
                "prefill_s": st["prefill_s"],
            }
        )
    base = next(r for r in rows if r["cache"] == "dynamic")
    q4 = next((r for r in rows if r["cache"] == "quanto-int4"), None)
    print(
        f"\n{args.tokens} tokens, {args.threads} thread(s) for decode; dense fp32 K/V of one layer: "
        f"{dense_layer / 2**20:.1f} MiB"
    )
    print(f"{'cache':<20}{'ms/token':>9}{'tok/s':>7}{'vs full':>8}{'vs int4':>8}{'KV MiB':>8}{'max alloc MiB':>14}")
    for r in rows:
        r["vs_dynamic"] = r["tok_s"] / base["tok_s"]
        r["vs_quanto_int4"] = r["tok_s"] / q4["tok_s"] if q4 else None
        print(
            f"{r['cache']:<20}{r['ms_per_token']:>9.1f}{r['tok_s']:>7.2f}{r['vs_dynamic']:>8.2f}"
            f"{(r['vs_quanto_int4'] or float('nan')):>8.2f}{r['kv_bytes'] / 2**20:>8.1f}"
            f"{r['largest_alloc_bytes'] / 2**20:>14.2f}"
        )
    print(
        json.dumps(
            {"tokens": args.tokens, "threads": args.threads, "dense_layer_fp32_bytes": dense_layer, "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
