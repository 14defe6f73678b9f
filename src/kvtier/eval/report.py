"""``kvtier report``: results files -> one markdown report with tables and plots.

Every results file is read and checked before anything is written, and a report that fails while
being written leaves nothing behind (no half-filled ``<out>_assets/`` folder, no folder created for it).
"""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

from ..inputs import read_input
from .plots import plots_for
from .results import loads


def _table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _ppl_section(doc: dict) -> str:
    rows = doc["rows"]
    ctxs = sorted({r["context"] for r in rows})
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    texts = list(dict.fromkeys(r["text"] for r in rows))
    parts = []
    for ctx in ctxs:
        header = ["cache", *[f"ppl {t}" for t in texts], "mean Δppl %", "KV ratio vs fp16", "KiB/token"]
        table = []
        for c in caches:
            rs = [r for r in rows if r["cache"] == c and r["context"] == ctx]
            by_text = {r["text"]: r for r in rs}
            table.append(
                [
                    c,
                    *[f"{by_text[t]['ppl']:.3f}" if t in by_text else "" for t in texts],
                    f"{sum(r['dppl_pct'] for r in rs) / len(rs):+.2f}",
                    f"{sum(r['kv_bytes'] / r['dense_fp16_bytes'] for r in rs) / len(rs):.3f}",
                    f"{sum(r['bytes_per_token'] for r in rs) / len(rs) / 1024:.2f}",
                ]
            )
        parts.append(
            f"**{ctx} tokens** (streamed, chunks of {doc['config'].get('chunk', 64)}, scored half in chunks of "
            f"{doc['config'].get('score_chunk', doc['config'].get('chunk', 64))})\n\n" + _table(header, table)
        )
    return "\n\n".join(parts)


def _recall_section(doc: dict) -> str:
    rows = doc["rows"]
    ctxs = sorted({r["context"] for r in rows})
    acc = defaultdict(lambda: [0, 0, 0.0])
    for r in rows:
        for key in ((r["cache"], r["context"]), (r["cache"], "all")):
            acc[key][0] += r["correct"]
            acc[key][1] += r["total"]
            acc[key][2] += r.get("margin_mean", float("nan")) * r["total"]
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    table = [
        [
            c,
            *[f"{acc[(c, x)][0]}/{acc[(c, x)][1]}" for x in ctxs],
            f"{acc[(c, 'all')][0] / acc[(c, 'all')][1]:.0%}",
            f"{acc[(c, 'all')][2] / acc[(c, 'all')][1]:+.2f}",
        ]
        for c in caches
    ]
    note = (
        "Margin: logit of the right token minus the best other, minimum along the key up to the first "
        "wrong token (negative = answered wrong there), averaged over cases.\n\n"
    )
    return note + _table(["cache", *[f"{c} tok" for c in ctxs], "all", "mean margin"], table)


def _fidelity_section(doc: dict) -> str:
    rows = doc["rows"]
    table = [[r["cache"], r["text"], r["context"], f"{r['kl']:.4f}", f"{r['top1']:.3f}"] for r in rows]
    return _table(["cache", "text", "context", "KL(full‖cache) nats/token", "top-1 agreement"], table)


def _bench_section(doc: dict) -> str:
    rows = doc["rows"]
    table = [
        [
            r["cache"],
            r["context"],
            f"{r['prefill_s']:.2f}",
            f"{r['decode_tok_s']:.2f}",
            f"{r['ms_per_token']:.1f}",
            f"{r['decode_tok_s_ratio']:.2f}",
            f"{r['kv_bytes'] / 2**20:.1f}",
            f"{r.get('kv_bytes_ratio', float('nan')):.3f}",
            f"{r['peak_rss_mb']:.0f}",
        ]
        for r in rows
    ]
    return _table(
        [
            "cache",
            "context",
            "prefill s",
            "decode tok/s",
            "ms/token",
            "tok/s vs full",
            "KV MiB",
            "KV vs full",
            "peak RSS MiB",
        ],
        table,
    )


def _tasks_section(doc: dict) -> str:
    rows = doc["rows"]
    parts = []
    for length, protocol in sorted({(r["length"], r["protocol"]) for r in rows}):
        rs = [r for r in rows if (r["length"], r["protocol"]) == (length, protocol)]
        tasks = list(dict.fromkeys(r["task"] for r in rs))
        caches = list(dict.fromkeys(r["cache"] for r in rs))
        cell = {(r["cache"], r["task"]): r for r in rs}
        table = []
        for c in caches:
            ratio = sum(r["ratio_fp16"] for r in rs if r["cache"] == c) / sum(1 for r in rs if r["cache"] == c)
            table.append(
                [c, f"{ratio:.3f}", *[f"{cell[(c, t)]['score']:.1f}" if (c, t) in cell else "" for t in tasks]]
            )
        parts.append(
            f"**{length} tokens, prefill {protocol}** (score x 100: fraction of expected strings found; "
            f"samples per task: {max(r['samples'] for r in rs)})\n\n" + _table(["cache", "bytes / fp16", *tasks], table)
        )
    return "\n\n".join(parts)


SECTIONS = {
    "ppl": ("Streamed perplexity", _ppl_section),
    "recall": ("Long-range recall", _recall_section),
    "fidelity": ("Logit fidelity vs the full cache", _fidelity_section),
    "tasks": ("Long-context tasks (RULER's families)", _tasks_section),
    "bench": ("Speed and memory", _bench_section),
}


def merge_docs(docs: list[dict]) -> list[dict]:
    """One document per kind: rows of runs of the same kind are concatenated (a row already seen
    for the same cache, text and context - e.g. the full-cache reference every run includes - is
    kept once); commands and configs are listed."""
    merged: dict[str, dict] = {}
    for doc in docs:
        kind = doc["kind"]
        if kind not in merged:
            merged[kind] = {**doc, "rows": [], "commands": []}
        m = merged[kind]
        m["commands"].append(doc["command"])
        seen = {_row_key(r) for r in m["rows"]}
        m["rows"] += [r for r in doc["rows"] if _row_key(r) not in seen]
    return list(merged.values())


def _row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ("cache", "text", "context", "depth", "length", "protocol", "task"))


def _load_all(paths: list[str | Path]) -> list[dict]:
    """Every results file, checked; an OSError or ValueError naming the file otherwise."""
    docs = []
    for p in paths:
        data = read_input(p, "results file")  # missing, a folder, a FIFO, a device, too large: says so
        try:
            docs.append(loads(data))
        except ValueError as err:  # not JSON (json.JSONDecodeError), or not the schema
            raise ValueError(f"{p}: {err}") from None
        except (TypeError, KeyError, AttributeError) as err:  # JSON, but not an object of the schema's shape
            raise ValueError(f"{p}: not a results document ({type(err).__name__}: {err})") from None
    return docs


def _render(docs: list[dict], out: Path, assets: Path) -> list[str]:
    lines = ["# kvtier report", ""]
    for i, doc in enumerate(merge_docs(docs)):
        title, fn = SECTIONS[doc["kind"]]
        try:
            env = doc["env"]
            lines += [
                f"## {title}",
                "",
                f"`{doc['command']}` — {doc['created']}, torch {env['torch']}, transformers "
                f"{env['transformers']}, {env['threads']} threads, {env['device']}",
                "",
                fn(doc),
                "",
            ]
        except (KeyError, TypeError) as err:
            raise ValueError(f"{doc['kind']} results lack a field the report needs: {err}") from None
        for png in plots_for(doc, assets / f"{i}-{doc['kind']}"):
            lines += [f"![{png.stem}]({png.relative_to(out.parent)})", ""]
    return lines


def build_report(paths: list[str | Path], out: str | Path) -> Path:
    """Write ``out`` (markdown): one section per kind of result (runs of a kind merged into one
    table), with plots beside it in ``<out stem>_assets/``.

    Raises
    ------
    FileNotFoundError : a results file is missing. ValueError : one is not valid results, not a
    regular file (a FIFO, a device) or over ``kvtier.sizing.MAX_INPUT_BYTES``.
    OSError : ``out`` cannot be written. Nothing is left behind in either case.
    """
    out = Path(out)
    assets = out.parent / (out.stem + "_assets")
    docs = _load_all(paths)
    created = next((d for d in reversed([assets, *assets.parents]) if not d.exists()), None)
    before = set(assets.iterdir()) if assets.is_dir() else set()
    try:
        assets.mkdir(parents=True, exist_ok=True)
        text = "\n".join(_render(docs, out, assets))
        out.write_text(text)
    except BaseException:
        if created is not None:  # the first folder this call made, with everything in it
            shutil.rmtree(created, ignore_errors=True)
        elif assets.is_dir():
            for path in set(assets.iterdir()) - before:
                path.unlink(missing_ok=True)
        raise
    if created is not None and assets.is_dir() and not any(assets.iterdir()):
        assets.rmdir()  # no plots: no empty folder
    return out
