"""Sweep candidate policies for the `default` preset: streamed perplexity vs bytes.

For each candidate: streamed perplexity (chunks of 64, NLL over the last half) of SmolLM2-135M
on 4k-token windows of the given books, as a change against the full cache, and the planned
bytes at 8k relative to fp16 (the planner matches memory_report() of a real run, see tests).

    python benchmarks/sweep_policies.py --books dracula huckleberry_finn --length 4096

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvtier import TierPolicy, get_policy
from kvtier.eval.caches import cache_spec
from kvtier.eval.perplexity import book_windows, streamed_nll
from kvtier.eval.texts import load_texts
from kvtier.models import load_model
from kvtier.policy import SparsePolicy
from kvtier.sizing import estimate

D = get_policy("default")
CANDIDATES = {
    "int4-b128-hot128 (default)": D,
    "int4-b64-hot128": D.replace(block_tokens=64),
    "int4-b256-hot128": D.replace(block_tokens=256),
    "int4-b128-hot64": D.replace(hot_tokens=64),
    "int4-b128-sinks4": D.replace(sink_tokens=4),
    "int3-b128": D.replace(warm_bits=3),
    "w1024int4+cold-int3": D.replace(warm_tokens=1024, cold="quant", cold_bits=3),
    "w1024int4+cold-int2": D.replace(warm_tokens=1024, cold="quant", cold_bits=2),
    "max-compression (sign)": get_policy("max-compression"),
    "max-compression (sign+hadamard)": get_policy("max-compression").replace(cold_rotation=True),
    "kivi4-b32-nosinks": TierPolicy(
        hot_tokens=128,
        warm_tokens=None,
        warm_bits=4,
        sink_tokens=0,
        block_tokens=32,
        value_group_size=32,
        layer_overrides={},
    ),
}


B64 = D.replace(block_tokens=64, hot_tokens=64)
SPARSE = {
    "b64-hot64 +blocks-topk0.5": B64.replace(sparse=SparsePolicy(64, "blocks", "topk", 0.5)),
    "b64-hot64 +tokens-mass0.99": B64.replace(sparse=SparsePolicy(64, "tokens", "mass", 0.99)),
    "b64-hot64 +tokens-mass0.995": B64.replace(sparse=SparsePolicy(64, "tokens", "mass", 0.995)),
    "b64-hot64 +tokens-quantile0.3": B64.replace(sparse=SparsePolicy(64, "tokens", "quantile", 0.3)),
}
# the shipped default (4-bit beyond the hot window) against a 3-bit cold tier beyond a 4-bit warm
# window, with and without the Hadamard rotation before the cold code, sparse decode attention in
# all: what it takes to hold <= 0.30 of fp16 bytes at 4k
_C3 = D.replace(cold="quant", cold_bits=3)
BYTES = {
    "default (4-bit everywhere)": D,
    "warm 2560 4-bit + cold 3-bit": _C3.replace(warm_tokens=2560, cold_rotation=False),
    "warm 2048 4-bit + cold 3-bit": _C3.replace(warm_tokens=2048, cold_rotation=False),
    "warm 1024 4-bit + cold 3-bit": _C3.replace(warm_tokens=1024, cold_rotation=False),
    "warm 2560 4-bit + cold 3-bit rotated": _C3.replace(warm_tokens=2560),
    "warm 2048 4-bit + cold 3-bit rotated": _C3.replace(warm_tokens=2048),
    "warm 1024 4-bit + cold 3-bit rotated": _C3.replace(warm_tokens=1024),
}
GROUPS = {"first": CANDIDATES, "sparse": SPARSE, "bytes": BYTES}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--books", nargs="+", default=["dracula", "huckleberry_finn"])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--only", nargs="*", help="substring filter on candidate names")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group", choices=sorted(GROUPS), default="first")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    texts = load_texts()
    windows = {b: book_windows(tok, texts[b], args.length)[0] for b in args.books}
    base = {b: streamed_nll(model, w, cache_spec("dynamic")) for b, w in windows.items()}
    print("full cache:", {b: round(r.ppl, 3) for b, r in base.items()}, flush=True)
    rows = []
    for name, pol in GROUPS[args.group].items():
        if args.only and not any(s in name for s in args.only):
            continue
        t0 = time.time()
        deltas = {}
        for b, w in windows.items():
            r = streamed_nll(model, w, cache_spec(pol.replace(name=name)))
            deltas[b] = 100 * (r.ppl / base[b].ppl - 1)
        ratio8k = estimate("smollm2-135m", 8192, pol, 1, torch.float32).ratio
        ratio_len = estimate("smollm2-135m", args.length, pol, 1, torch.float32).ratio
        row = {
            "policy": name,
            "dppl_pct": deltas,
            "mean_dppl_pct": sum(deltas.values()) / len(deltas),
            "bytes_vs_fp16_8k": ratio8k,
            f"bytes_vs_fp16_{args.length}": ratio_len,
            "seconds": time.time() - t0,
        }
        rows.append(row)
        print(
            f"{name:<34} dppl {row['mean_dppl_pct']:+6.2f}%  "
            + " ".join(f"{b}:{d:+.2f}%" for b, d in deltas.items())
            + f"  bytes@{args.length} {ratio_len:.3f}  bytes@8k {ratio8k:.3f}",
            flush=True,
        )
    print(
        json.dumps(
            {
                "length": args.length,
                "threads": args.threads,
                "full_ppl": {b: r.ppl for b, r in base.items()},
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
