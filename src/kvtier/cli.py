"""The ``kvtier`` command: ``plan`` (bytes before running) and ``demo`` (a real model, side by side)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from .policy import PRESETS


def _dtype(name: str) -> torch.dtype:
    table = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if name not in table:
        raise argparse.ArgumentTypeError(f"--dtype {name!r}: expected one of {sorted(table)}")
    return table[name]


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


# --- plan -------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    from .plan import format_plans, model_shape, plan

    try:
        shape = model_shape(args.model)
    except (ValueError, KeyError) as err:
        print(f"kvtier plan: {err}", file=sys.stderr)
        return 2
    names = list(PRESETS) if args.policy == "all" else [args.policy]
    plans = [plan(shape, args.seq_len, name, args.batch, args.dtype) for name in names]
    print(format_plans(shape, plans))
    if args.json:
        chosen = plans[0] if args.policy != "all" else plans[names.index("default")]
        out: dict[str, Any] = {
            "model": shape.name,
            "seq_len": args.seq_len,
            "batch": args.batch,
            "dtype": str(args.dtype).removeprefix("torch."),
            "fp16_bytes": chosen.fp16_bytes,
            "total_bytes": chosen.total_bytes,
            "policy": chosen.policy,
            "policies": {p.policy: p.to_dict() for p in plans},
        }
        print(json.dumps(out))
    return 0


# --- demo -------------------------------------------------------------------------------------
def _dynamic_bytes(cache: Any) -> int:
    from .diagnostics import tensor_bytes

    return tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def cmd_demo(args: argparse.Namespace) -> int:
    from transformers import DynamicCache

    from . import TieredCache, enable
    from .eval.recall import build_case, is_correct
    from .eval.texts import load_texts
    from .models import load_model

    torch.set_num_threads(args.threads)
    print(f"loading {args.model} (offline) ...", flush=True)
    model, tok = load_model(args.model)
    texts = load_texts(args.text, limit=1)
    name, text = next(iter(texts.items()))
    case = build_case(tok, text, args.tokens, args.depth, seed=args.seed)
    n = case.input_ids.shape[1]
    print(f"prompt: {n} tokens from {name!r}, secret number planted at {case.depth:.0%} depth", flush=True)
    rows = []
    for label in ("full", args.policy):
        if label == "full":
            cache: Any = DynamicCache(config=model.config)
            ctx = None
        else:
            cache = TieredCache(model.config, label)
            ctx = enable(model)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(case.input_ids, max_new_tokens=args.new_tokens, do_sample=False, cache=cache)
        elapsed = time.perf_counter() - t0
        if ctx is not None:
            ctx.__exit__(None, None, None)
        answer = tok.decode(out[0, n:], skip_special_tokens=True).strip()
        if label == "full":
            nbytes, fp16 = _dynamic_bytes(cache), None
        else:
            report = cache.memory_report()
            nbytes, fp16 = report.total_bytes, report.dense_fp16_bytes
        rows.append(
            {
                "cache": label,
                "kv_bytes": nbytes,
                "fp16_bytes": fp16,
                "seconds": elapsed,
                "answer": answer,
                "correct": is_correct(answer, case.key),
            }
        )
    fp16 = rows[1]["fp16_bytes"]
    print()
    print(f"{'cache':<16}{'KV MiB':>9}{'vs fp16':>9}{'vs full':>9}{'time s':>8}  answer (key {case.key})")
    for r in rows:
        print(
            f"{r['cache']:<16}{r['kv_bytes'] / 2**20:>9.2f}{r['kv_bytes'] / fp16:>9.3f}"
            f"{r['kv_bytes'] / rows[0]['kv_bytes']:>9.3f}{r['seconds']:>8.1f}  "
            f"{'OK ' if r['correct'] else 'NO '}{r['answer']!r}"
        )
    print(json.dumps({"prompt_tokens": n, "key": case.key, "rows": rows}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV cache for transformers")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="bytes per tier for a model, sequence length and policy")
    p.add_argument("--model", required=True, help="built-in name or path to config.json")
    p.add_argument("--seq-len", type=_positive, required=True)
    p.add_argument("--policy", default="all", choices=["all", *PRESETS])
    p.add_argument("--batch", type=_positive, default=1)
    p.add_argument("--dtype", type=_dtype, default=torch.float16, help="model dtype (default float16)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.set_defaults(fn=cmd_plan)

    d = sub.add_parser("demo", help="SmolLM2 offline: full cache vs a preset on a long recall prompt")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--policy", default="default", choices=list(PRESETS))
    d.add_argument("--tokens", type=_positive, default=3000, help="context length of the prompt")
    d.add_argument("--depth", type=float, default=0.1, help="where the fact is planted (0..1)")
    d.add_argument("--new-tokens", type=_positive, default=12)
    d.add_argument("--text", nargs="*", help="text files (default: ../shared/data/pg books)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=_positive, default=max(1, min(2, torch.get_num_threads())))
    d.set_defaults(fn=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
