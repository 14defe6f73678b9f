"""Combine results files (ppl, fidelity, recall, bench) into the per-context tables of BENCHMARKS.md.

    python benchmarks/summarize.py results/ppl-*.json results/fidelity-*.json results/recall-*.json \
        results/bench-*.json[:OLD=NEW,...]

``FILE.json:OLD=NEW`` relabels a cache of that file (runs made under an earlier preset definition);
``OLD=`` with nothing after it leaves that cache out.

One table per context length: perplexity per book, mean Δperplexity vs the full cache, KL and
top-1 agreement with the full cache, recall accuracy (cases of 90-100% of that context: the 8k
table takes the 7,600-token recall cases, the longest that fit the model's 8,192 positions with
the prompt; split by needle, prose number / code definition, where a run planted both), KV bytes
vs fp16, resident bytes vs fp16 (an offloading cache's bytes in this process) and KV bytes vs the
full cache, decode tokens/s vs the full cache. Then recall
by depth with mean answer margins, and the decode table of the bench runs (the tables of
BENCHMARKS.md). Prints markdown, then the commands of the runs.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from kvtier.eval.report import merge_docs
from kvtier.eval.results import load


def _recall_cell(rows: list[dict]) -> str:
    """``correct/cases``, split by needle where a run planted more than one kind (prose number / code)."""
    if not rows:
        return ""
    ok, total = sum(r["correct"] for r in rows), sum(r["total"] for r in rows)
    kinds: dict[str, list[int]] = {}
    for r in rows:
        for kind, (c, t) in r.get("correct_by_needle", {}).items():
            kinds.setdefault(kind, [0, 0])
            kinds[kind][0] += c
            kinds[kind][1] += t
    if len(kinds) < 2:
        return f"{ok}/{total}"
    return f"{ok}/{total} (" + ", ".join(f"{k} {c}/{t}" for k, (c, t) in sorted(kinds.items())) + ")"


def main(paths: list[str]) -> None:
    loaded = []
    for arg in paths:  # FILE.json[:OLD=NEW,...] relabels caches of runs made under an earlier preset definition
        path, _, spec = arg.partition(".json:")
        doc = load(path if not spec else path + ".json")
        renames = dict(pair.split("=", 1) for pair in spec.split(",")) if spec else {}
        for row in doc["rows"]:
            row["cache"] = renames.get(row["cache"], row["cache"])
        doc["rows"] = [r for r in doc["rows"] if r["cache"]]  # OLD= (empty) drops a cache
        loaded.append(doc)
    docs = {d["kind"]: d for d in merge_docs(loaded)}
    ppl = docs.get("ppl", {"rows": []})["rows"]
    fid = docs.get("fidelity", {"rows": []})["rows"]
    rec = docs.get("recall", {"rows": []})["rows"]
    bench = docs.get("bench", {"rows": []})["rows"]
    contexts = sorted({r["context"] for r in ppl})
    texts = list(dict.fromkeys(r["text"] for r in ppl))
    caches = list(dict.fromkeys(r["cache"] for r in ppl + bench))
    for ctx in contexts:
        print(f"\n### {ctx} tokens\n")
        head = [
            "cache",
            *[f"ppl {t}" for t in texts],
            "Δppl %",
            "KL nats/tok",
            "top-1",
            "recall",
            "KV vs fp16",
            "resident vs fp16",
            "KV vs full",
            "decode tok/s vs full",
        ]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for c in caches:
            prow = {r["text"]: r for r in ppl if r["cache"] == c and r["context"] == ctx}
            if not prow:
                continue
            frow = [r for r in fid if r["cache"] == c and r["context"] == ctx]
            recall = [r for r in rec if r["cache"] == c and 0.9 * ctx <= r["context"] <= ctx]
            brow = [r for r in bench if r["cache"] == c and r["context"] == ctx]
            full = [r for r in ppl if r["cache"] == "dynamic" and r["context"] == ctx]
            mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
            kv_full = mean([r["kv_bytes"] for r in full])
            cells = [
                c,
                *[f"{prow[t]['ppl']:.3f}" if t in prow else "" for t in texts],
                f"{mean([r['dppl_pct'] for r in prow.values()]):+.2f}",
                f"{mean([r['kl'] for r in frow]):.4f}" if frow else "",
                f"{mean([r['top1'] for r in frow]):.3f}" if frow else "",
                _recall_cell(recall),
                f"{mean([r['kv_bytes'] / r['dense_fp16_bytes'] for r in prow.values()]):.3f}",
                f"{mean([r.get('resident_bytes', r['kv_bytes']) / r['dense_fp16_bytes'] for r in prow.values()]):.3f}",
                f"{mean([r['kv_bytes'] for r in prow.values()]) / kv_full:.3f}",
                f"{brow[0]['decode_tok_s_ratio']:.2f}" if brow else "",
            ]
            print("| " + " | ".join(cells) + " |")
    if rec:
        print("\n### Recall by depth (correct / cases; mean answer margin in logits)\n")
        ctxs = sorted({r["context"] for r in rec})
        depths = sorted({r["depth"] for r in rec})
        cells = defaultdict(lambda: [0, 0, 0.0])
        for r in rec:
            c = cells[(r["cache"], r["context"], r["depth"])]
            c[0] += r["correct"]
            c[1] += r["total"]
            c[2] += r.get("margin_mean", float("nan")) * r["total"]
        for x in ctxs:
            head = ["cache", *[f"{x} @{d:.0%}" for d in depths if cells.get(("dynamic", x, d))], "all", "margin"]
            print("| " + " | ".join(head) + " |")
            print("|" + "---|" * len(head))
            for c in dict.fromkeys(r["cache"] for r in rec):
                mine = [cells[(c, x, d)] for d in depths if cells.get(("dynamic", x, d))]
                if not any(m[1] for m in mine):
                    continue
                ok, tot, mar = (sum(m[i] for m in mine) for i in range(3))
                row = [f"{m[0]}/{m[1]}" for m in mine] + [f"{ok}/{tot}", f"{mar / tot:+.2f}"]
                print("| " + " | ".join([c, *row]) + " |")
            print()
    if bench:
        print("\n### Decode speed and bytes (kvtier bench)\n")
        print(
            "| cache | context | prefill s | decode ms/token | decode tok/s | vs full | KV vs fp16 | resident vs fp16 "
            "| reachable = reported | largest alloc in a decode step | peak RSS MiB |"
        )
        print("|" + "---|" * 11)
        for r in bench:
            resident = r.get("resident_bytes", r["kv_bytes"]) / r["dense_fp16_bytes"]
            reach = "yes" if r.get("reachable_bytes") == r["kv_bytes"] else "no"
            if reach == "no" and r.get("offloaded_bytes"):
                reach = "resident only"  # disk blocks are files, not tensors
            cells = [
                r["cache"],
                str(r["context"]),
                f"{r['prefill_s']:.1f}",
                f"{1000 / r['decode_tok_s']:.1f}",
                f"{r['decode_tok_s']:.2f}",
                f"{r['decode_tok_s_ratio']:.2f}",
                f"{r['kv_ratio_fp16']:.4f}",
                f"{resident:.4f}",
                reach,
                f"{r['largest_alloc_bytes'] / 2**20:.2f} MiB",
                f"{r['peak_rss_mb']:.0f}",
            ]
            print("| " + " | ".join(cells) + " |")
    print("\nCommands:\n")
    for doc in docs.values():
        for cmd in doc["commands"]:
            print(f"- `{cmd}`")


if __name__ == "__main__":
    main(sys.argv[1:])
