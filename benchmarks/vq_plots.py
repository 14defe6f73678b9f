"""KL vs stored bits of the real caches with scalar (affine) and vector (vq) cold codes (issue 38's
bits-vs-KL curve, measured on the cache's own tiers; the simulated curve of every format, Lloyd-Max
included, is ``benchmarks/codes_per_bit.py``'s ``codes-per-bit.png``).

Reads ``kvtier eval ppl`` result pairs (``*-ppl.json`` with ``*-fidelity.json`` beside it) and
plots, per model and text, each cache's KL against the full cache (nats per token) over its stored
bits per K/V element (``16 x`` the measured bytes over fp16's): markers by the cold codes' family
(affine, vq, both), filled when every token is kept. Writes ``--out`` and ends with one JSON line.

    python benchmarks/vq_plots.py benchmarks/results/vq-smollm2-4k-*-ppl.json \\
        --out benchmarks/results/vq-bits-vs-kl.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def family(cache: str) -> str:
    if "affine+vq" in cache:
        return "affine+vq"
    return "vq" if ":vq" in cache or "codes=vq" in cache else "affine"


def keeps_all(cache: str) -> bool:
    """Whether the cache keeps every token (the adaptive preset evicts half unless ``keep=1``)."""
    return not cache.startswith("adaptive") or "keep=1" in cache


def points(ppl_paths: list[str]) -> list[dict]:
    """One point per (model, text, cache) but the full cache (a later file's run replaces an
    earlier one's): bits, KL, Δppl."""
    out = {}
    for p in ppl_paths:
        ppl = json.loads(Path(p).read_text())
        fid = json.loads(Path(p.replace("-ppl.json", "-fidelity.json")).read_text())
        kl = {(r["cache"], r["text"]): r["kl"] for r in fid["rows"]}
        model = ppl["config"]["model"]
        for r in ppl["rows"]:
            if r["cache"] == "dynamic":
                continue
            out[(model, r["text"], r["cache"])] = {
                "model": model,
                "text": r["text"],
                "cache": r["cache"],
                "bits": 16 * r["kv_ratio_fp16"],
                "kl": kl[(r["cache"], r["text"])],
                "dppl_pct": r["dppl_pct"],
            }
    return list(out.values())


def plot(pts: list[dict], path: str | Path) -> Path:
    panels = sorted({(p["model"], p["text"]) for p in pts})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    colors = {"affine": "tab:blue", "vq": "tab:orange", "affine+vq": "tab:green"}
    lo, hi = min(p["bits"] for p in pts), max(p["bits"] for p in pts)
    for ax, (model, text) in zip(axes.flat, panels):
        for p in pts:
            if (p["model"], p["text"]) != (model, text):
                continue
            f = family(p["cache"])
            full = keeps_all(p["cache"])
            ax.scatter(
                p["bits"],
                p["kl"],
                color=colors[f],
                facecolors=colors[f] if full else "none",
                marker="o" if full else "s",
                s=40,
            )
            ax.annotate(p["cache"], (p["bits"], p["kl"]), fontsize=6, xytext=(4, 2), textcoords="offset points")
        ax.set_xlim(lo - 0.15, hi + 0.35)  # one bits axis for every panel
        ax.set_yscale("log")
        ax.set_xlabel("stored bits per K/V element (measured)")
        ax.set_ylabel("KL vs the full cache (nats/token, log)")
        ax.set_title(f"{model}, {text}", fontsize=9)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], color=c, marker="o", linestyle="", label=f) for f, c in colors.items()]
    handles.append(
        plt.Line2D([], [], color="gray", marker="s", markerfacecolor="none", linestyle="", label="half evicted")
    )
    axes.flat[-1].legend(handles=handles, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ppl", nargs="+", help="kvtier eval ppl results (*-ppl.json, the fidelity file beside each)")
    ap.add_argument("--out", default="benchmarks/results/vq-bits-vs-kl.png")
    args = ap.parse_args()
    pts = points(args.ppl)
    for p in sorted(pts, key=lambda p: (p["model"], p["text"], p["bits"])):
        print(f"{p['model']:>20} {p['text']:>16} {p['cache']:>52}: {p['bits']:5.2f} bits  KL {p['kl']:.4f}")
    print(json.dumps({"plot": str(plot(pts, args.out)), "points": pts}))


if __name__ == "__main__":
    main()
