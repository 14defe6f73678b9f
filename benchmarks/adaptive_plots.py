"""Results and plots of the adaptive-budget runs (``benchmarks/adaptive_ppl.py``).

Converts the runs named in ``SOURCES`` (4k: ``adaptive-4k-v3-*.json``; 8k: ``adaptive-8k-v2.json``)
into kvtier's results schema (``ppl-{4k,8k}-adaptive.json`` and ``fidelity-...``, which
``kvtier report`` reads), draws the Pareto plot (Δppl vs KV bytes per token) of the adaptive cache
next to every preset and baseline measured on the same windows earlier (the full cache's
perplexity is the same in every run: 30.270 / 25.665 at 4k, 22.028 / 19.903 at 8k), and the
allocation heat map of each adaptive cache.

    python benchmarks/adaptive_plots.py

Ends with one JSON line.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.eval import plots
from kvtier.eval.results import load, make_results, save

RES = Path(__file__).parent / "results"
# earlier runs on the same windows (BENCHMARKS.md "4,096 tokens" / "8,192 tokens")
EARLIER = {
    4096: ["ppl-4k-d3.json", "ppl-4k-2026-11-30.json"],
    8192: [
        "ppl-8k-d3.json",
        "ppl-8k-dracula-a.json",
        "ppl-8k-dracula-b.json",
        "ppl-8k-huck-a.json",
        "ppl-8k-huck-b.json",
    ],
}
LAYERS = 30
# runs of the shipped configuration (4k: v3, a 3-bit rotated warm window and fit_tokens 2,048, one file
# per book and budget; 8k: the v2 configuration, 4-bit warm window, fit_tokens 8,192), and its warm width
SOURCES = {
    4096: (
        [
            "adaptive-4k-v3-dracula.json",
            "adaptive-4k-v3-huckleberry_finn.json",
            "adaptive-4k-v3-3.3-dracula.json",
            "adaptive-4k-v3-3.3-huckleberry_finn.json",
        ],
        3,
    ),
    8192: (["adaptive-8k-v2.json"], 4),
}


def merged(files: list[str]) -> dict | None:
    """The runs of ``files`` (``benchmarks/adaptive_ppl.py`` outputs) as one ``{"books": {book: {cache: row}}}``."""
    books: dict = {}
    for f in files:
        if (RES / f).exists():
            for book, caches in json.loads((RES / f).read_text())["books"].items():
                books.setdefault(book, {}).update(caches)
    return {"books": books} if books else None


def main() -> None:
    summary = {}
    for L, tag in ((4096, "4k"), (8192, "8k")):
        files, warm_bits = SOURCES[L]
        doc = merged(files)
        if doc is None:
            continue
        rows, fid = [], []
        for book, caches in doc["books"].items():
            dense = caches["dynamic"]["kv_bytes"] / 2  # the full cache holds fp32: fp16 is half
            for name, r in caches.items():
                rows.append(
                    {
                        "cache": name,
                        "text": book,
                        "context": L,
                        "windows": 1,
                        "ppl": r["ppl"],
                        "dppl_pct": 100 * r["dppl"],
                        "kv_bytes": r["kv_bytes"],
                        "dense_fp16_bytes": dense,
                        "bytes_per_token": r["kv_bytes"] / L,
                        "kv_ratio_fp16": r["kv_bytes"] / dense,
                    }
                )
                fid.append({"cache": name, "text": book, "context": L, "kl": r["kl"], "top1": r["top1"]})
                if "allocation" in r:
                    tokens = r["tokens"]
                    per_layer = [
                        {
                            "layer": int(i),
                            "widths": {"warm": [warm_bits, warm_bits], "cold": kv},
                            "tokens": {t: tokens.get(t, 0) // LAYERS for t in ("warm", "cold")},
                        }
                        for i, kv in r["allocation"].items()
                    ]
                    plots.allocation_heatmap(
                        per_layer, RES / f"adaptive-{tag}-{name.replace('@', '')}-{book}-alloc.png", f"{name}, {book}"
                    )
        cmd = f"python benchmarks/adaptive_ppl.py --length {L} (converted by benchmarks/adaptive_plots.py)"
        save(make_results("ppl", rows, {"length": L}, cmd), RES / f"ppl-{tag}-adaptive.json")
        save(make_results("fidelity", fid, {"length": L}, cmd), RES / f"fidelity-{tag}-adaptive.json")
        earlier = [r for f in EARLIER[L] if (RES / f).exists() for r in load(RES / f)["rows"] if r["context"] == L]
        names = {r["cache"] for r in rows}
        both = [r for r in earlier if r["cache"] not in names] + rows
        plots.pareto(both, RES / f"adaptive-{tag}-pareto.png", L)
        summary[tag] = {
            n: sum(r["dppl_pct"] for r in rows if r["cache"] == n) / len(doc["books"])
            for n in sorted(names)
            if all(n in c for c in doc["books"].values())
        }
    print(json.dumps({"mean_dppl_pct": summary}))


if __name__ == "__main__":
    main()
