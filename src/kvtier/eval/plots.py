"""PNG plots of results: KV bytes vs context, perplexity vs bytes per token (Pareto front),
recall heatmaps (depth x context) and long-context task scores vs bytes. matplotlib with the Agg
backend (no display needed)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _style(cache: str) -> dict:
    baseline = cache in ("dynamic", "quanto-int4", "quanto-int2", "kivi2", "sink-window", "exact")
    return {"linestyle": "--" if baseline else "-", "marker": "s" if baseline else "o"}


def bytes_vs_context(rows: list[dict], path: str | Path) -> Path:
    """KV MiB vs context per cache, from rows with ``cache, context, kv_bytes``."""
    series = defaultdict(dict)
    for r in rows:
        series[r["cache"]][r["context"]] = max(series[r["cache"]].get(r["context"], 0), r["kv_bytes"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cache, pts in sorted(series.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] / 2**20 for x in xs], label=cache, **_style(cache))
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KV cache (MiB, measured)")
    ax.set_title("KV bytes vs context")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def pareto(rows: list[dict], path: str | Path, context: int | None = None) -> Path:
    """Mean Δperplexity % vs bytes per token (one point per cache), Pareto front drawn."""
    ctxs = sorted({r["context"] for r in rows})
    context = context or ctxs[-1]
    acc = defaultdict(list)
    for r in rows:
        if r["context"] == context:
            acc[r["cache"]].append((r["bytes_per_token"], r["dppl_pct"]))
    pts = {c: (sum(b for b, _ in v) / len(v), sum(d for _, d in v) / len(v)) for c, v in acc.items()}
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    colors = plt.get_cmap("tab20").colors
    for i, (cache, (b, d)) in enumerate(pts.items()):
        ax.scatter(
            b / 1024,
            d,
            color=colors[i % len(colors)],
            label=f"{cache} ({d:+.2f} %)",
            s=36,
            marker=_style(cache)["marker"],
        )
    front, best = [], float("inf")
    for b, d in sorted(pts.values()):
        if d < best:
            front.append((b / 1024, d))
            best = d
    if front:
        ax.plot(*zip(*front), color="gray", alpha=0.6, linewidth=1, label="Pareto front")
    ax.set_xscale("log")
    # linear within +-1 %, logarithmic beyond: a +0.3 % preset and a +800 % baseline both stay legible
    ax.set_yscale("symlog", linthresh=1.0)
    ds = [d for _, d in pts.values()]
    ax.set_ylim(min(-0.5, 2 * min(ds)), max(2.0, 2 * max(ds)))
    kib = [b / 1024 for b, _ in pts.values()]
    ticks = [t for t in (0.5, 1, 2, 3, 4, 6, 8, 10, 15, 20, 30, 40, 60, 100) if min(kib) / 1.2 <= t <= max(kib) * 1.2]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("KV bytes per token (KiB, measured, log)")
    ax.set_ylabel("Δ perplexity vs full cache (%, symlog)")
    ax.set_title(f"Streamed perplexity vs memory, {context} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def recall_heatmap(rows: list[dict], path: str | Path) -> Path:
    """One panel per cache: accuracy by depth (rows) x context (columns)."""
    caches = sorted({r["cache"] for r in rows})
    ctxs = sorted({r["context"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    cols = min(4, len(caches))
    nrows = -(-len(caches) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 3.2 * nrows), squeeze=False)
    fig.subplots_adjust(hspace=0.55, wspace=0.4)  # titles clear of the row above's axis labels; blank cells: not run
    for ax in axes.flat[len(caches) :]:
        ax.axis("off")
    for ax, cache in zip(axes.flat, caches):
        grid = [[float("nan")] * len(ctxs) for _ in depths]
        for r in rows:
            if r["cache"] == cache:
                grid[depths.index(r["depth"])][ctxs.index(r["context"])] = r["correct"] / r["total"]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(ctxs)), [str(c) for c in ctxs], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(cache, fontsize=9)
        ax.set_xlabel("context", fontsize=7)
        ax.set_ylabel("depth", fontsize=7)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy")
    fig.suptitle("Long-range recall (secret number)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def tasks_vs_bytes(rows: list[dict], path: str | Path, suite: str = "ruler") -> Path:
    """Task score vs measured bytes (fraction of fp16), one panel per (length, protocol): one
    point per cache, the full cache (``dynamic``) as a line; from :func:`kvtier.eval.taskrun.summarize`
    rows of ``task == suite``."""
    rows = [r for r in rows if r["task"] == suite]
    panels = sorted({(r["length"], r["protocol"]) for r in rows})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.2 * max(1, len(panels)), 4.4), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    for ax, (length, protocol) in zip(axes[0], panels):
        for r in (r for r in rows if (r["length"], r["protocol"]) == (length, protocol)):
            color = colors[caches.index(r["cache"]) % len(colors)]
            if r["cache"] == "dynamic":
                ax.axhline(
                    r["score"], color="black", linestyle="--", linewidth=1, label=f"full cache ({r['score']:.1f})"
                )
                continue
            err = [[r["score"] - r["ci_low"]], [r["ci_high"] - r["score"]]] if "ci_low" in r else None
            ax.errorbar(
                r["ratio_fp16"],
                r["score"],
                yerr=err,
                fmt=_style(r["cache"])["marker"],
                color=color,
                capsize=3,
                label=f"{r['cache']} ({r['score']:.1f})",
            )
        ratios = [r["ratio_fp16"] for r in rows if (r["length"], r["protocol"]) == (length, protocol)]
        ax.set_xlim(0, 1.05 * max([1.0, *ratios]))  # the leaderboard's frame: bytes from 0, scores 0-100
        ax.set_ylim(-2, 102)
        ax.set_xlabel("KV bytes / fp16 (measured)")
        ax.set_ylabel(f"{suite} score (mean of tasks)")
        ax.set_title(f"{length} tokens, prefill {protocol}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plots_for(doc: dict, stem: str | Path) -> list[Path]:
    """The plots that fit a results document, written as ``<stem>-<plot>.png``."""
    stem = str(stem)
    kind, rows = doc["kind"], doc["rows"]
    if not rows:
        return []
    if kind == "ppl":
        return [pareto(rows, stem + "-pareto.png"), bytes_vs_context(rows, stem + "-bytes.png")]
    if kind == "bench":
        return [bytes_vs_context(rows, stem + "-bytes.png")]
    if kind == "recall":
        return [recall_heatmap(rows, stem + "-recall.png")]
    if kind == "tasks":
        suites = [s for s in ("ruler", "code") if any(r["task"] == s for r in rows)]
        return [tasks_vs_bytes(rows, f"{stem}-{s}.png", s) for s in suites]
    return []


def allocation_heatmap(per_layer: list[dict], path: str | Path, title: str = "adaptive allocation") -> Path:
    """Bits per layer (columns) for keys and values by age (rows: hot/sinks exact, warm, cold), from
    ``memory_report().per_layer`` entries (``widths`` and ``tokens``); cells name the token slots."""
    layers = [d for d in per_layer if d.get("widths")]
    rows = [("hot (exact)", None, None), ("warm K", "warm", 0), ("warm V", "warm", 1), ("cold K", "cold", 0)]
    rows.append(("cold V", "cold", 1))
    grid = [[float("nan")] * len(layers) for _ in rows]
    for j, d in enumerate(layers):
        for i, (_, tier, side) in enumerate(rows):
            if tier is None:
                grid[i][j] = 16.0
            elif d["widths"].get(tier) is not None and d["tokens"].get(tier, 0):
                grid[i][j] = float(d["widths"][tier][side])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(layers) + 2), 3.2))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=8)
    for i, row in enumerate(grid):
        for j, val in enumerate(row):
            if val == val and val < 16:
                ax.text(j, i, f"{val:.0f}", ha="center", va="center", color="white", fontsize=7)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xticks(range(len(layers)), [str(d["layer"]) for d in layers], fontsize=7)
    ax.set_xlabel("layer")
    warm = sum(d["tokens"].get("warm", 0) for d in layers) // max(1, len(layers))
    cold = sum(d["tokens"].get("cold", 0) for d in layers) // max(1, len(layers))
    ax.set_title(f"{title}: code bits (warm {warm} tokens, cold {cold} per layer; hot/sinks 16)", fontsize=9)
    fig.colorbar(im, ax=ax, label="bits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
