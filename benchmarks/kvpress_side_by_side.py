"""Side by side: kvtier's caches against NVIDIA kvpress presses (optionally on transformers' int4
``QuantizedCache``) on the same token ids, the same model and the same protocol.

Protocol, per window of ``context + continuation`` tokens (default 4,096 + 256) from a book: the
context is prefilled in one forward call through the cache (kvpress: with the press hooked in, which
compresses each layer's cache right after that layer's prefill attention; kvtier: the cache settles
its tiers after the call), then the continuation is teacher-forced in one forward call through the
compressed cache (position ids continue at ``context``). Scored: the NLL of every continuation token
(the first one from the prefill's last position, the same for every cache since prefill attention
is exact everywhere). Per book: ppl over all its windows' continuation tokens, and Δppl against
the full (uncompressed) cache of the same side on the same windows. Bytes: what the cache holds
right after the context, against fp16 bytes (2 bytes x K,V x layers x KV heads x head dim x
context tokens). The model runs in fp32 by default (``--dtype bfloat16``: as users run it, fast on
CPUs with AVX-512 BF16 / AMX): with fp32 a transformers cache holds fp32 tensors (a DynamicCache is
2.0 of fp16; quanto's scales and shifts are fp32), so ``fp16_equiv`` also counts every floating
tensor at 2 bytes per element (what the same cache holds with an fp16 / bf16 model); kvtier stores
its exact tokens in fp16 whatever the model dtype (its ``dynamic`` baseline is the exception).
``--model-dir`` names the model (SmolLM2 by default; ``~/.cache/kvtier/models/qwen2.5-coder-1.5b-instruct``
after ``kvtier models install qwen2.5-coder-1.5b`` and a first load); ``--books`` takes book names
in ``--data`` or paths to any text (source code too).

Three steps, two virtual environments (kvpress pins transformers < 5.3; kvtier needs newer):

    # 1. kvpress side (its own venv, no kvtier there; makes the ids file if it is missing)
    /work/kvpress-venv/bin/python benchmarks/kvpress_side_by_side.py --side kvpress \
        --ids-file benchmarks/results/kvpress-side-by-side-ids.pt \
        --out benchmarks/results/kvpress-side-by-side-kvpress.json
    # 2. kvtier side (the project's venv), the same ids
    python benchmarks/kvpress_side_by_side.py --side kvtier \
        --ids-file benchmarks/results/kvpress-side-by-side-ids.pt \
        --out benchmarks/results/kvpress-side-by-side-kvtier.json
    # 3. one markdown table
    python benchmarks/kvpress_side_by_side.py --table benchmarks/results/kvpress-side-by-side-kvpress.json \
        benchmarks/results/kvpress-side-by-side-kvtier.json

kvpress cache names: ``full``, ``<press>-<ratio>`` with press ``snapkv``, ``expected`` (Expected
Attention), ``streaming`` (StreamingLLM), ``knorm``; a suffix ``+int4`` / ``+int2`` puts the press on
transformers' ``QuantizedCache`` (quanto backend, group 64, residual 128); ``int4`` / ``int2`` alone.
kvtier cache names: anything :func:`kvtier.eval.caches.cache_spec` accepts.

This file imports kvtier only in ``--side kvtier`` (the kvpress venv has no kvtier). Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import time
import warnings
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

DEFAULT_MODEL_DIR = os.path.expanduser("~/.cache/kvtier/models/smollm2-135m-instruct")
KVPRESS_CACHES = "full,snapkv-0.5,snapkv-0.75,snapkv-0.5+int4,int4,expected-0.5,streaming-0.5"
KVTIER_CACHES = "dynamic,adaptive@2.5,adaptive@3.0,default,max-compression"


def make_ids(model_dir: str, data: str, books: list[str], windows: int, context: int, continuation: int) -> dict:
    """``windows`` windows of ``context + continuation`` tokens per book, spread evenly after 2,000
    tokens of front matter (the same rule as ``kvtier.eval.perplexity.book_windows``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    length, offset = context + continuation, 2000
    out = {"context": context, "continuation": continuation, "books": {}}
    for book in books:
        path = Path(book) if book.endswith(".txt") else Path(data, f"{book}.txt")
        text = path.read_text()
        book = path.stem
        ids = tok(text, add_special_tokens=False).input_ids
        room = len(ids) - offset - length
        if room < 0:
            raise ValueError(f"{book}: {len(ids)} tokens, too few for one window")
        starts = [offset + (room * i // (windows - 1) if windows > 1 else 0) for i in range(windows)]
        out["books"][book] = torch.tensor([ids[s : s + length] for s in starts])  # [windows, length]
    return out


def held_bytes(cache) -> tuple[int, int, dict]:
    """``(bytes, fp16_equiv, dtypes)`` of the distinct tensors a transformers cache's layers hold,
    through tensor-subclass wrappers (quanto's packed tensors: data, scale, shift)."""
    found: dict[int, torch.Tensor] = {}
    stack, seen = list(cache.layers), set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
                names, _ = obj.__tensor_flatten__()
                stack.extend(getattr(obj, n) for n in names)
            else:
                found[obj.untyped_storage().data_ptr() or id(obj)] = obj
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("transformers", "optimum")):
            stack.extend(vars(obj).values())
    total = equiv = 0
    dtypes: dict[str, int] = {}
    for t in found.values():
        n = t.numel() * t.element_size()
        total += n
        equiv += t.numel() * min(t.element_size(), 2) if t.is_floating_point() else n
        dtypes[str(t.dtype)] = dtypes.get(str(t.dtype), 0) + n
    return total, equiv, dtypes


@torch.no_grad()
def window_nll(
    model, ids: torch.Tensor, context: int, cache, prefill_ctx, after_prefill, chunk: int = 0
) -> tuple[float, int]:
    """Prefill ``ids[:, :context]`` in one call (or calls of ``chunk`` tokens) under ``prefill_ctx()``,
    call ``after_prefill()``, then teacher-force the rest in one call; returns ``(nll sum, tokens)``.
    Plain torch and transformers."""
    ctx_ids, cont = ids[:, :context], ids[:, context:]
    step = chunk or context
    with prefill_ctx():
        for s in range(0, context, step):
            pos = torch.arange(s, min(s + step, context))[None]
            hidden = model.model(
                input_ids=ctx_ids[:, s : s + step], past_key_values=cache, position_ids=pos, use_cache=True
            ).last_hidden_state
    after_prefill()
    first = model.lm_head(hidden[:, -1:]).float()
    del hidden
    pos = torch.arange(context, ids.shape[1])[None]
    logits = model(input_ids=cont, past_key_values=cache, position_ids=pos, use_cache=True).logits.float()
    logits = torch.cat([first, logits[:, :-1]], dim=1)  # predicts cont[0 .. n-1]
    return F.cross_entropy(logits[0], cont[0], reduction="sum").item(), cont.shape[1]


def kvpress_runner(model, name: str):
    """``(make_cache, ctx)`` for a kvpress cache name (see the module doc)."""
    from transformers import DynamicCache, QuantizedCache

    base, _, quant = name.partition("+")
    if base in ("int4", "int2"):
        base, quant = "full", base
    press = None
    if base != "full":
        import kvpress

        kind, _, ratio_s = base.rpartition("-")
        ratio = float(ratio_s)
        cls = {
            "snapkv": kvpress.SnapKVPress,
            "expected": kvpress.ExpectedAttentionPress,
            "streaming": kvpress.StreamingLLMPress,
            "knorm": kvpress.KnormPress,
        }[kind]
        press = cls(compression_ratio=ratio)

    def make_cache():
        if quant:
            return QuantizedCache(backend="quanto", config=model.config, nbits=int(quant.removeprefix("int")))
        return DynamicCache(config=model.config)

    prefill_ctx = (lambda: press(model)) if press is not None else contextlib.nullcontext
    return make_cache, prefill_ctx, contextlib.nullcontext


def kvtier_runner(model, name: str):
    from kvtier.eval.caches import cache_spec

    spec = cache_spec(name)
    return (lambda: spec.build(model)), contextlib.nullcontext, (lambda: spec.context(model))


def cache_bytes(side: str, cache) -> tuple[int, int, dict]:
    if side == "kvtier":
        from kvtier.eval.caches import kv_bytes
        from kvtier.hf import TieredCache

        if isinstance(cache, TieredCache):
            n = kv_bytes(cache)
            return n, n, {"kvtier": n}
    return held_bytes(cache)


def versions(side: str) -> dict:
    extra = ["kvpress", "optimum-quanto", "accelerate"] if side == "kvpress" else ["kvtier"]
    names = ["torch", "transformers", *extra]
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    out["python"] = platform.python_version()
    return out


def run_side(args) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    ids_path = Path(args.ids_file)
    if ids_path.exists():
        data = torch.load(ids_path)
    else:
        data = make_ids(args.model_dir, args.data, args.books, args.windows, args.context, args.continuation)
        ids_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, ids_path)
        print(f"wrote {ids_path}", flush=True)
    context = data["context"]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    fp16 = 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * context
    names = (args.caches or (KVPRESS_CACHES if args.side == "kvpress" else KVTIER_CACHES)).split(",")
    runner = kvpress_runner if args.side == "kvpress" else kvtier_runner
    out = {
        "side": args.side,
        "versions": versions(args.side),
        "context": context,
        "continuation": data["continuation"],
        "fp16_bytes": fp16,
        "ids_file": str(ids_path),
        "threads": args.threads,
        "dtype": args.dtype,
        "model_dir": args.model_dir,
        "prefill_chunk": args.prefill_chunk or context,
        "caches": {},
    }
    for name in names:
        make_cache, prefill_ctx, window_ctx = runner(model, name)
        row = {"books": {}}
        for book, windows in data["books"].items():
            nll = tokens = 0
            per_window, held, equiv = [], [], []
            for w in range(windows.shape[0]):
                t0 = time.time()
                cache = make_cache()
                ids = windows[w : w + 1]
                measured = {}  # right after the prefill (before the continuation)

                def after_prefill(cache=cache, measured=measured):
                    measured["bytes"], measured["equiv"], measured["dtypes"] = cache_bytes(args.side, cache)

                with window_ctx():
                    n, k = window_nll(model, ids, context, cache, prefill_ctx, after_prefill, args.prefill_chunk)
                nll += n
                tokens += k
                per_window.append(n / k)
                held.append(measured["bytes"])
                equiv.append(measured["equiv"])
                print(
                    f"{name:<18} {book:<16} w{w} nll/tok={n / k:.4f} bytes/fp16={measured['bytes'] / fp16:.4f} "
                    f"equiv={measured['equiv'] / fp16:.4f} {time.time() - t0:.0f}s",
                    flush=True,
                )
                row["dtypes"] = measured["dtypes"]
                del cache
            row["books"][book] = {
                "nll_per_token": per_window,
                "ppl": math.exp(nll / tokens),
                "tokens": tokens,
                "bytes": held,
                "bytes_vs_fp16": sum(held) / len(held) / fp16,
                "fp16_equiv_vs_fp16": sum(equiv) / len(equiv) / fp16,
            }
        out["caches"][name] = row
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
    full = "full" if args.side == "kvpress" else "dynamic"
    if full in out["caches"]:
        for row in out["caches"].values():
            for book, b in row["books"].items():
                b["dppl"] = b["ppl"] / out["caches"][full]["books"][book]["ppl"] - 1
            row["mean_dppl"] = sum(b["dppl"] for b in row["books"].values()) / len(row["books"])
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({n: r.get("mean_dppl") for n, r in out["caches"].items()}))


def table(paths: list[str]) -> str:
    """One markdown row per cache of each result file; Δppl against the full cache of the same file
    (``full`` / ``dynamic``), recomputed here so a partial file (a run cut short) still reads."""
    rows, books = [], None
    for p in paths:
        d = json.loads(Path(p).read_text())
        caches = d["caches"]
        full = caches.get("full") or caches.get("dynamic")
        chunk = d.get("prefill_chunk", d["context"])
        side = d["side"] + (f" (prefill in {chunk}-token calls)" if chunk != d["context"] else "")
        for name, r in caches.items():
            books = books or list(r["books"])
            if full is None or set(r["books"]) != set(full["books"]):
                continue
            dppl = [r["books"][b]["ppl"] / full["books"][b]["ppl"] - 1 for b in books]
            rows.append((side, name, r, dppl))
    head = "| side | cache | bytes vs fp16 (held) | fp16-model equiv. | "
    head += " | ".join(f"Δppl {b}" for b in books) + " | mean Δppl | ppl per book |\n"
    head += "|" + "---|" * (6 + len(books)) + "\n"
    lines = []
    for side, name, r, dppl in rows:
        b0 = r["books"][books[0]]
        ppl = " / ".join(f"{r['books'][b]['ppl']:.3f}" for b in books)
        lines.append(
            f"| {side} | {name} | {b0['bytes_vs_fp16']:.3f} | {b0['fp16_equiv_vs_fp16']:.3f} | "
            + " | ".join(f"{100 * x:+.2f} %" for x in dppl)
            + f" | {100 * sum(dppl) / len(dppl):+.2f} % | {ppl} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["kvpress", "kvtier"])
    ap.add_argument("--table", nargs="+", metavar="JSON", help="merge result files into a markdown table")
    ap.add_argument("--ids-file", default="benchmarks/results/kvpress-side-by-side-ids.pt")
    ap.add_argument("--caches", default=None)
    ap.add_argument(
        "--books",
        nargs="+",
        default=["dracula", "huckleberry_finn"],
        help="names of books in --data, or paths to .txt files (e.g. ../shared/data/code/python_stdlib_a.txt)",
    )
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--data", default="../shared/data/pg")
    ap.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's weights")
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        help="kvtier side: prefill the context in calls of this many tokens (0: one call); kvpress presses "
        "compress a one-call prefill only",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore", message=".*past_key_values.*is deprecated", category=FutureWarning)
    if args.table:
        md = table(args.table)
        print(md)
        print(json.dumps({"table": args.table}))
        return
    if args.side is None:
        ap.error("--side or --table is required")
    if args.side == "kvpress" and args.prefill_chunk:
        ap.error("--prefill-chunk: kvpress presses compress a one-call prefill only")
    run_side(args)


if __name__ == "__main__":
    main()
