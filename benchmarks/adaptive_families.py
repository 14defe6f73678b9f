"""What an adaptive budget allocated, per layer: code family (``codes="affine+vq"``), key and value
widths, and the distortions it chose from (issue 38: the allocator choosing affine or vq per layer).

Streams ``--tokens`` tokens of a text through one ``kvtier eval`` cache name in ``--chunk``-token
calls (past the budget's warm-up, so the allocation is made), then prints each layer's choice, the
family counts, and one JSON line with the budget's report.

    python benchmarks/adaptive_families.py --model smollm2-135m --cache adaptive@2.5:codes=affine+vq \\
        --text ../shared/data/pg/dracula.txt
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

import kvtier
from kvtier.eval.caches import cache_spec
from kvtier.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cache", default="adaptive@2.5:codes=affine+vq")
    ap.add_argument("--text", default="../shared/data/pg/dracula.txt")
    ap.add_argument("--offset", type=int, default=200_000, help="characters skipped at the start of the text")
    ap.add_argument("--tokens", type=int, default=2600)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    with open(args.text, encoding="utf-8") as f:
        text = f.read()[args.offset : args.offset + 20 * args.tokens]
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
    with kvtier.enable(model), torch.no_grad():
        cache = kvtier.TieredCache(model.config, cache_spec(args.cache).policy)
        for s in range(0, ids.shape[1], args.chunk):
            model(ids[:, s : s + args.chunk], past_key_values=cache, use_cache=True)
    reports = [b.report() for b in cache.budgets.values()]
    for rep in reports:
        layers = rep["layers"]
        print(f"{args.cache}: {len(layers)} layers, {ids.shape[1]} tokens of {args.text}")
        print(
            "  "
            + " ".join(
                f"{i}:{(info['codes'] or '?')[0]}{info['key_bits']}/{info['value_bits']}" for i, info in layers.items()
            )
        )
        counts = collections.Counter((info["codes"], info["key_bits"], info["value_bits"]) for info in layers.values())
        for (codes, kb, vb), n in counts.most_common():
            print(f"  {n:3d} layers {codes} keys {kb} bits, values {vb} bits")
    print(json.dumps({"bench": "adaptive_families", "model": args.model, "cache": args.cache, "tokens": ids.shape[1],
                      "budgets": reports}, default=str))  # fmt: skip


if __name__ == "__main__":
    main()
