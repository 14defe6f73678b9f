"""Versioned results files: one JSON document per run, with the environment it ran in.

Schema ``kvtier.results/1``::

    {"schema": "kvtier.results/1", "kind": "ppl" | "recall" | "fidelity" | "tasks" | "bench",
     "created": ISO-8601, "command": str, "env": {...}, "config": {...}, "rows": [{...}, ...]}

Rows per kind (required keys): ``ppl``: cache, text, context, ppl, dppl_pct, kv_bytes,
dense_fp16_bytes, bytes_per_token; ``recall``: cache, context, depth, correct, total;
``fidelity``: cache, text, context, kl, top1; ``tasks`` (:func:`kvtier.eval.taskrun.summarize`):
cache, length, protocol, task, score, samples, ratio_fp16; ``bench``: cache, context, prefill_s,
decode_tok_s, ms_per_token, kv_bytes, peak_rss_mb, decode_tok_s_ratio.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

SCHEMA = "kvtier.results/1"
KINDS = {
    "ppl": ("cache", "text", "context", "ppl", "dppl_pct", "kv_bytes", "dense_fp16_bytes", "bytes_per_token"),
    "recall": ("cache", "context", "depth", "correct", "total"),
    "fidelity": ("cache", "text", "context", "kl", "top1"),
    "tasks": ("cache", "length", "protocol", "task", "score", "samples", "ratio_fp16"),
    "bench": (
        "cache",
        "context",
        "prefill_s",
        "decode_tok_s",
        "ms_per_token",
        "kv_bytes",
        "peak_rss_mb",
        "decode_tok_s_ratio",
    ),
}


def _kernel_threads() -> int:
    """Threads the C++ kernels run on (:func:`kvtier.kernels.parallel.threads`; 0: no kernels)."""
    from ..kernels import parallel

    return parallel.threads()


def environment() -> dict[str, Any]:
    """Versions, threads and device of this process."""
    import transformers

    from .. import __version__

    env = {
        "kvtier": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "kernel_threads": _kernel_threads(),
        "device": "cuda:" + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    from importlib.metadata import PackageNotFoundError, version

    try:
        env["optimum-quanto"] = version("optimum-quanto")
    except PackageNotFoundError:
        pass
    return env


def make_results(kind: str, rows: list[dict], config: dict, command: str | None = None) -> dict[str, Any]:
    validate_rows(kind, rows)
    return {
        "schema": SCHEMA,
        "kind": kind,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(["kvtier", *sys.argv[1:]]),
        "env": environment(),
        "config": config,
        "rows": rows,
    }


def validate_rows(kind: str, rows: list[dict]) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not allowed: expected one of {sorted(KINDS)}")
    for i, row in enumerate(rows):
        missing = [k for k in KINDS[kind] if k not in row]
        if missing:
            raise ValueError(f"{kind} row {i} lacks {missing}")


def validate(doc: dict[str, Any]) -> None:
    """Raise ValueError unless ``doc`` follows the schema."""
    for key in ("schema", "kind", "created", "command", "env", "config", "rows"):
        if key not in doc:
            raise ValueError(f"results lack {key!r}")
    if doc["schema"] != SCHEMA:
        raise ValueError(f"schema {doc['schema']!r} is not {SCHEMA!r}")
    validate_rows(doc["kind"], doc["rows"])


def save(doc: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def load(path: str | Path) -> dict[str, Any]:
    """The results document in ``path``, a regular file of at most ``kvtier.sizing.MAX_INPUT_BYTES``
    (else OSError or ValueError, in one line: a FIFO would hang, ``/dev/zero`` fill memory), checked."""
    from ..inputs import read_input

    return loads(read_input(path, "results file"))


def loads(data: bytes | str) -> dict[str, Any]:
    """The results document in ``data`` (JSON), checked (:func:`validate`)."""
    doc = json.loads(data)
    validate(doc)
    return doc
