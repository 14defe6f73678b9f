"""Dynamic sparse attention: attention work skipped vs perplexity, streamed at 8k.

For the default preset with and without sparse attention (several thresholds), run the streamed
evaluation (context in chunks of 64, the scored last half in decode-sized chunks of
``--score-chunk`` tokens, where sparse attention applies) on each book in lockstep with the full
cache, and report Δperplexity against the *same preset without sparsity*, KL to the full cache,
and the exact work counters (kvtier.diagnostics.SparseStats: score and value FLOP units, bytes
read) of the scored half.

    python benchmarks/sparse_work.py --length 8192 --books dracula huckleberry_finn

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvtier import get_policy
from kvtier.diagnostics import SparseStats
from kvtier.eval.caches import CacheSpec
from kvtier.eval.perplexity import book_windows, stream_compare
from kvtier.eval.texts import load_texts
from kvtier.models import load_model
from kvtier.policy import SparsePolicy

BASE = get_policy("default").replace(sparse=None)
VARIANTS = {
    "no-sparse": BASE,
    **{
        f"tokens-mass{level}": BASE.replace(sparse=SparsePolicy(64, "tokens", "mass", level))
        for level in (0.999, 0.995, 0.99, 0.98, 0.97, 0.95)
    },
    "tokens-quantile0.2": BASE.replace(sparse=SparsePolicy(64, "tokens", "quantile", 0.2)),
    "blocks-bound0.99": BASE.replace(sparse=SparsePolicy(64, "blocks", "bound", 0.99)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--books", nargs="+", default=["dracula", "huckleberry_finn"])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=64, help="chunk of the unscored context")
    ap.add_argument("--score-chunk", type=int, default=4, help="chunk of the scored half (decode-sized)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    texts = load_texts()
    specs = [CacheSpec(name, VARIANTS[name].replace(name=name)) for name in args.variants]
    rows = []
    for book in args.books:
        ids = book_windows(tok, texts[book], args.length)[0]
        t0 = time.time()
        built: dict = {}
        scores = stream_compare(model, ids, specs, chunk=args.chunk, score_chunk=args.score_chunk, caches_out=built)
        base = scores["no-sparse"]
        for spec in specs:
            sc = scores[spec.name]
            stats = built[spec.name].sparse_stats() if spec.policy.sparse else SparseStats()
            row = {
                "book": book,
                "variant": spec.name,
                "ppl": sc.ppl,
                "dppl_vs_no_sparse_pct": 100 * (sc.ppl / base.ppl - 1),
                "dppl_vs_full_pct": 100 * (sc.ppl / scores["dynamic"].ppl - 1),
                "kl_vs_full": sc.mean_kl,
                "top1_vs_full": sc.top1,
                **stats.to_dict(),
            }
            rows.append(row)
            print(
                f"{book:<18}{spec.name:<20} ppl {sc.ppl:8.3f}  vs no-sparse {row['dppl_vs_no_sparse_pct']:+.2f}%  "
                f"vs full {row['dppl_vs_full_pct']:+.2f}%  work skipped {row['skipped_fraction']:.1%}  "
                f"values skipped {row['value_skipped_fraction']:.1%}  "
                f"bytes skipped {row['bytes_skipped_fraction']:.1%}",
                flush=True,
            )
        print(f"  ({time.time() - t0:.0f} s)", flush=True)
    config = {"length": args.length, "threads": args.threads, "chunk": args.chunk, "score_chunk": args.score_chunk}
    print(json.dumps({**config, "rows": rows}))


if __name__ == "__main__":
    main()
