"""KV bytes of every preset on SmolLM2-135M after an 8,192-token prompt, three ways:

* ``memory_report().total_bytes`` (the cache's own accounting),
* the bytes of all tensor storages reachable from the cache object (an independent walk),
* ``kvtier plan`` for the same model, length and dtype.

    python benchmarks/memory_8k.py [--tokens 8192]

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json

import torch

import kvtier
from kvtier import PRESETS, TieredCache
from kvtier.diagnostics import reachable_tensor_bytes
from kvtier.eval.perplexity import book_windows
from kvtier.eval.texts import load_texts
from kvtier.models import load_model
from kvtier.sizing import estimate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--presets", nargs="*", default=[p for p in PRESETS if p != "exact"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    ids = book_windows(tok, next(iter(load_texts(limit=1).values())), args.tokens)[0]
    rows = []
    print(f"{'preset':<16}{'report MiB':>11}{'reachable MiB':>14}{'plan MiB':>10}{'vs fp16':>9}{'plan err':>9}")
    for name in args.presets:
        cache = TieredCache(model.config, name)
        with kvtier.enable(model), torch.no_grad():
            for s in range(0, args.tokens, args.chunk):
                model(ids[:, s : s + args.chunk], cache=cache, logits_to_keep=1)
        r = cache.memory_report()
        reach = reachable_tensor_bytes(cache)
        planned = estimate("smollm2-135m", args.tokens, name, 1, torch.float32)
        row = {
            "preset": name,
            "tokens": args.tokens,
            "total_bytes": r.total_bytes,
            "reachable_bytes": reach,
            "planned_bytes": planned.total_bytes,
            "dense_fp16_bytes": r.dense_fp16_bytes,
            "ratio_fp16": r.ratio,
            "plan_rel_err": planned.total_bytes / r.total_bytes - 1,
            "per_tier": r.per_tier,
        }
        rows.append(row)
        mib = 2**20
        print(
            f"{name:<16}{r.total_bytes / mib:>11.2f}{reach / mib:>14.2f}{planned.total_bytes / mib:>10.2f}"
            f"{r.ratio:>9.3f}{row['plan_rel_err']:>+9.4f}",
            flush=True,
        )
    print(json.dumps({"tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
