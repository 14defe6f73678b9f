"""vLLM's paged KV cache: its own bf16 / fp8 pages vs kvtier's packed pages (``kvtier.vllm.engine``).

One in-process engine per configuration (SmolLM2-135M bf16 on CPU, ``VLLM_CPU_KVCACHE_SPACE``
GiB of KV), built one after another in this process:

- ``vllm``: vLLM's own backend, bf16 pages; ``fp8``: ``kv_cache_dtype="fp8"``;
- ``exact``, ``default``, ``sinks``, ...: kvtier's backend with that page policy
  (:data:`kvtier.vllm.pages.policy.PAGE_POLICIES`), registered while the engine is built.

Parts (``--parts``):

- ``capacity``: vLLM's "KV cache size: N tokens" (``num_gpu_blocks * block_size``) and KV bytes
  per token (all layers);
- ``quality``: teacher-forced NLL of each book's next 64 tokens after a 3k prefix, and
  ``prompt_logprobs`` perplexity of 4k windows (all positions and the last half), both with
  chunked prefill of ``--chunk`` tokens so later chunks attend the pages of earlier ones
  (``--chunk 4``: every position through the decode kernel, sparse decode included; ``--ppl-len 0``
  skips the perplexity);
- ``speed``: one request of a 2k prompt + 64 new tokens, wall time (median of ``--reps``);
- ``agreement``: how far each configuration's outputs move from vLLM bf16's (``vllm`` runs first):
  ``--agree-prompts`` windows of ``--prompt`` tokens (:func:`agreement_prompts`: the books of
  ../shared/data/pg and the Python files of ../shared/data/code, round robin), each engine with
  chunked prefill of ``--chunk`` tokens and prefix caching off. *Greedy*: ``--continuation`` new
  tokens, batched; per prompt the first position that differs from bf16's continuation (the share
  of positions before it, the count of full matches). *Teacher-forced*: prompt + bf16's greedy
  continuation, one request at a time with ``prompt_logprobs=1``, so with ``--chunk`` dividing
  ``--prompt`` the continuation is one last chunk that reads every prompt token from the pages of
  earlier chunks (kvtier: packed); the share of continuation positions whose top-1 token is bf16's
  token there, and the mean NLL of those tokens minus bf16's. ``vllm``'s own teacher-forced share
  is the floor set by vLLM itself (its prefill path vs its decode path in bf16);
- ``load``: ``--requests`` requests of a 2k prompt + 128 new tokens submitted at once: wall time,
  total (prompt + new) tokens/s, the most requests running at once, and the seconds spent in steps
  that carry prompt tokens vs steps of decode rows only (``execute_model`` timed), for kvtier the
  prompt attention by kernel (its bf16 kernel over exact rows, the same over packed pages in place,
  vLLM's fp32 one over decoded pages: seconds, query-key pairs, the fp32 path's page decoding); with a
  sparse page policy, the share of packed tokens whose values its decode steps read.

``--paired N`` (load only): every configuration's engine built first and kept alive, then ``N``
rounds of one load run each, the order alternating per round (see BENCHMARKS.md for why its vLLM
times run slower than in sequential runs).

Prints ratios to ``vllm``; ends with one JSON line. Time alone on the machine:
``flock /tmp/kvtier-bench.lock python benchmarks/vllm_serve.py --parts speed,load``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
from pathlib import Path

for _k, _v in {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # kvtier's registration is per process
}.items():
    os.environ.setdefault(_k, _v)

BOOKS = ("dracula", "moby_dick")


def book_ids(tok, count: int, length: int) -> list[list[int]]:  # noqa: ANN001
    """``length`` tokens from each of the first ``count`` books in ../shared/data/pg (else the shipped one)."""
    pg = Path(__file__).resolve().parents[2] / "shared" / "data" / "pg"
    texts = [(pg / f"{b}.txt").read_text(encoding="utf-8")[20_000:120_000] for b in BOOKS if (pg / f"{b}.txt").exists()]
    if not texts:
        from kvtier.eval.texts import shipped_book

        (body,) = shipped_book().values()
        texts = [body[i * 100_000 : (i + 1) * 100_000] for i in range(count)]
    return [tok(t)["input_ids"][:length] for t in texts[:count]]


def agreement_prompts(tok, count: int, length: int) -> list[tuple[str, list[int]]]:  # noqa: ANN001
    """``count`` windows of ``length`` tokens, named ``source@char``: the books of ../shared/data/pg
    and the Python files of ../shared/data/code (sorted by name), round robin, the k-th window of a
    source at character ``20,000 + k * (len - 40,000) / windows per source``."""
    data = Path(__file__).resolve().parents[2] / "shared" / "data"
    sources = sorted((data / "pg").glob("*.txt")) + sorted((data / "code").glob("python_*.txt"))
    if not sources:
        raise SystemExit(f"agreement: no texts in {data}/pg or {data}/code")
    per = -(-count // len(sources))
    out = []
    for k in range(per):
        for src in sources:
            text = src.read_text(encoding="utf-8")
            at = 20_000 + k * (len(text) - 40_000) // per
            ids = tok(text[at : at + 16 * length])["input_ids"][:length]
            assert len(ids) == length, (src.name, at, len(ids))
            out.append((f"{src.stem}@{at}", ids))
    return out[:count]


def agreement(llm, prompts: list[tuple[str, list[int]]], args, ref: dict | None) -> tuple[dict, dict]:  # noqa: ANN001
    """Greedy and teacher-forced agreement with ``ref`` (bf16's raw outputs; ``None``: this is bf16).

    Returns the summary and this engine's raw outputs (continuations, continuation NLLs, top-1 tokens).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    n = args.continuation
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in prompts], sp, use_tqdm=False)
    greedy_s = time.perf_counter() - t
    conts = [list(o.outputs[0].token_ids) for o in outs]
    ref = ref or {"conts": conts}  # bf16: its own continuation is the reference
    first = [next((i for i, (a, b) in enumerate(zip(c, r)) if a != b), n) for c, r in zip(conts, ref["conts"])]
    # teacher-forced: prompt + bf16's continuation, one request at a time (chunks start at 0, --chunk apart)
    tf = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0, detokenize=False)
    nlls, tops = [], []
    t = time.perf_counter()
    for (_, ids), cont in zip(prompts, ref["conts"]):
        full = ids + cont
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=full)], tf, use_tqdm=False)
        lps = out.prompt_logprobs[len(ids) :]
        nlls.append([-lp[tok].logprob for lp, tok in zip(lps, cont)])
        tops.append([min(lp.items(), key=lambda kv: kv[1].rank)[0] for lp in lps])
    tf_s = time.perf_counter() - t
    ref_nll = ref.get("nlls", nlls)
    ref_top = ref.get("tops", tops)
    per_prompt = [
        {
            "prompt": name,
            "greedy_first_diff": f,
            "tf_top1_agree": statistics.fmean(a == b for a, b in zip(top, cont)),
            "tf_top1_agree_bf16_top1": statistics.fmean(a == b for a, b in zip(top, rtop)),
            "tf_dnll": statistics.fmean(x - y for x, y in zip(nll, rnll)),
        }
        for (name, _), f, top, cont, rtop, nll, rnll in zip(prompts, first, tops, ref["conts"], ref_top, nlls, ref_nll)
    ]
    summary = {
        "greedy_agree": statistics.fmean(f / n for f in first),
        "greedy_full_match": sum(f == n for f in first),
        "greedy_first_diff_mean": statistics.fmean(first),
        "tf_top1_agree": statistics.fmean(p["tf_top1_agree"] for p in per_prompt),
        "tf_top1_agree_bf16_top1": statistics.fmean(p["tf_top1_agree_bf16_top1"] for p in per_prompt),
        "tf_nll": statistics.fmean(x for row in nlls for x in row),
        "tf_dnll": statistics.fmean(p["tf_dnll"] for p in per_prompt),
        "agreement_greedy_s": greedy_s,
        "agreement_tf_s": tf_s,
        "agreement_prompts": per_prompt,
    }
    return summary, {"conts": ref["conts"], "nlls": nlls, "tops": tops}


def build(name: str, model: str, **kw):  # noqa: ANN003, ANN201
    """An engine of configuration ``name`` and its KV bytes per token."""
    from vllm import LLM

    from kvtier.vllm.engine import attention_backend, engine_kwargs

    seqs = kw.pop("max_num_seqs", None)
    base = dict(model=model, dtype="bfloat16", max_model_len=4608, enforce_eager=True, seed=0, **kw)
    if name in ("vllm", "fp8"):
        extra = {"kv_cache_dtype": "fp8"} if name == "fp8" else {}
        return LLM(**base, **extra, **({"max_num_seqs": seqs} if seqs else {}))
    with attention_backend(name):
        kwargs = engine_kwargs(name, max_num_seqs=seqs)
        kwargs.setdefault("max_num_seqs", seqs) if seqs else None
        return LLM(**base, **kwargs)


def close(llm) -> None:  # noqa: ANN001
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "engine_core"):
        engine.engine_core.shutdown()
    del llm
    gc.collect()


def capacity(llm) -> dict:  # noqa: ANN001
    cfg = llm.llm_engine.vllm_config
    blocks, bs = cfg.cache_config.num_gpu_blocks, cfg.cache_config.block_size
    space = float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * (1 << 30)
    tokens = blocks * bs
    return {"kv_tokens": tokens, "block_size": bs, "kv_bytes_per_token": space / tokens}


def prompt_nll(llm, ids: list[int]) -> list[float]:  # noqa: ANN001
    """NLL of each token of ``ids`` after the first, from vLLM's ``prompt_logprobs``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
    return [-out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]


def quality(llm, tok, args) -> dict:  # noqa: ANN001
    out = {}
    for i, ids in enumerate(book_ids(tok, 2, max(args.prefix + 64, args.ppl_len))):
        nll = prompt_nll(llm, ids[: args.prefix + 64])
        out[f"nll64_{BOOKS[i]}"] = statistics.fmean(nll[-64:])
        if not args.ppl_len:  # --ppl-len 0: the next-64 NLL only
            continue
        nll = prompt_nll(llm, ids[: args.ppl_len])
        out[f"ppl_{BOOKS[i]}"] = math.exp(statistics.fmean(nll))
        out[f"ppl_last_half_{BOOKS[i]}"] = math.exp(statistics.fmean(nll[len(nll) // 2 :]))
    return out


def speed(llm, tok, args) -> dict:  # noqa: ANN001
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    (ids,) = book_ids(tok, 1, args.prompt)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False)
    times = []
    for r in range(args.reps + 1):
        prompt = [(r * 7919 + 13) % 30000, *ids[1:]]  # a different first token: no prefix-cache hit
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return {"single_s": statistics.median(times[1:])}


def load(llm, tok, args, name: str, salt: int = 0) -> dict:  # noqa: ANN001
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    (ids,) = book_ids(tok, 1, args.prompt)
    prompts = [[(r * 7919 + 13) % 30000, *ids[1:]] for r in range(args.requests)]
    if salt:  # another run on the same engine: other first blocks, so no prefix-cache hit
        prompts = [[20000 + salt, *p[:-1]] for p in prompts]
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    seen = {"running": 0, "steps": 0}
    orig = sched.schedule

    def schedule(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = orig(*a, **k)
        seen["running"] = max(seen["running"], len(sched.running))
        seen["steps"] += 1
        return out

    sched.schedule = schedule
    # where the time goes: steps with prompt tokens vs steps of decode rows only
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    run_step = executor.execute_model
    phase = {"prefill_steps_s": 0.0, "decode_steps_s": 0.0, "decode_steps": 0}

    def execute_model(so, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = run_step(so, *a, **k)
        dt = time.perf_counter() - t0
        if so.num_scheduled_tokens and all(n == 1 for n in so.num_scheduled_tokens.values()):
            phase["decode_steps_s"] += dt
            phase["decode_steps"] += 1
        else:
            phase["prefill_steps_s"] += dt
        return out

    executor.execute_model = execute_model
    # kvtier: prompt attention by kernel (its bf16 kernel vs vLLM's fp32 one over decoded packed pages)
    # (query, key) pairs summed over layers; of the fp32 path's time, the pages' decoding to fp32 rows
    split = {
        "prefill_kvtier_kernel_s": 0.0,
        "prefill_kvtier_paged_s": 0.0,
        "prefill_vllm_fp32_s": 0.0,
        "prefill_vllm_fp32_decode_s": 0.0,
        "prefill_kvtier_kernel_pairs": 0,
        "prefill_kvtier_paged_pairs": 0,
        "prefill_vllm_fp32_pairs": 0,
    }
    prefill_cls = None
    if name not in ("vllm", "fp8"):
        from kvtier.vllm.pages import attention as attention_mod
        from kvtier.vllm.pages import prefill as prefill_mod

        prefill_cls, attend_orig, decode_orig = (
            prefill_mod.VllmPrefill,
            prefill_mod.VllmPrefill.attend,
            attention_mod.CppPages.decode,
        )

        def attend(self, fmt, p, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            attend_orig(self, fmt, p, *a, **k)
            path = "prefill_vllm_fp32" if not p.kvtier_kernel else "prefill_kvtier_kernel"
            path = "prefill_kvtier_paged" if p.pids is not None else path
            split[path + "_s"] += time.perf_counter() - t0
            n = p.req.qe - p.req.qs
            split[path + "_pairs"] += n * p.context + n * (n + 1) // 2

        def decode_rows(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            out = decode_orig(self, *a, **k)
            split["prefill_vllm_fp32_decode_s"] += time.perf_counter() - t0
            return out

        prefill_cls.attend, attention_mod.CppPages.decode = attend, decode_rows
    sp = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True, detokenize=False)
    counts0 = sparse_counts(name)
    t = time.perf_counter()
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    finally:
        sched.schedule = orig
        executor.execute_model = run_step
        if prefill_cls is not None:
            prefill_cls.attend, attention_mod.CppPages.decode = attend_orig, decode_orig
    wall = time.perf_counter() - t
    valued, scored = (a - b for a, b in zip(sparse_counts(name), counts0))
    new = sum(len(o.outputs[0].token_ids) for o in outs)
    side = 0
    if name not in ("vllm", "fp8"):
        from kvtier.vllm.pages.backend import side_buffer_bytes

        side = side_buffer_bytes()
    return {
        "side_buffer_bytes": side,
        "load_s": wall,
        "load_total_tok_s": (new + sum(map(len, prompts))) / wall,
        "load_new_tok_s": new / wall,
        "max_running": seen["running"],
        "steps": seen["steps"],
        **phase,
        **(split if prefill_cls is not None else {}),
        **({"sparse_valued_share": valued / scored} if scored else {}),
    }


def sparse_counts(name: str) -> tuple[int, int]:
    """(tokens valued, tokens scored) so far by kvtier's sparse decode in this process."""
    if name in ("vllm", "fp8"):
        return (0, 0)
    from kvtier.vllm.pages.backend import sparse_counts as counts

    return counts()


def paired(args) -> None:  # noqa: ANN001
    """``--paired N``: every engine alive at once, load runs interleaved, ratio to ``vllm`` per round."""
    from transformers import AutoTokenizer

    from kvtier.models import model_dir

    model = str(model_dir(args.model))
    tok = AutoTokenizer.from_pretrained(model)
    names = args.configs.split(",")
    engines = {name: build(name, model, max_num_seqs=args.max_num_seqs) for name in names}
    rounds = []
    for r in range(args.paired):
        order = names if r % 2 == 0 else names[::-1]
        res = {name: {**capacity(engines[name]), **load(engines[name], tok, args, name, salt=r)} for name in order}
        if "vllm" in res:
            for name in names:
                res[name]["ratio_tok_s"] = res[name]["load_total_tok_s"] / res["vllm"]["load_total_tok_s"]
        print(
            f"round {r} ({','.join(order)}):",
            {n: round(v.get("ratio_tok_s", 0), 4) for n, v in res.items()},
            flush=True,
        )
        rounds.append({"order": order, "results": res})
    for llm in engines.values():
        close(llm)
    summary = {
        name: {
            "ratios": [x["results"][name].get("ratio_tok_s") for x in rounds],
            "median_ratio": statistics.median(x["results"][name].get("ratio_tok_s", 0) for x in rounds),
        }
        for name in names
    }
    for name, v in summary.items():
        print(f"{name:>8} / vllm total tok/s per round:", v["ratios"], "median", round(v["median_ratio"], 4))
    print(
        json.dumps(
            {"bench": "vllm_serve", "args": vars(args), "load": os.getloadavg(), "rounds": rounds, "summary": summary}
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="vllm,fp8,exact,default")
    ap.add_argument("--parts", default="capacity,quality")
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens for the quality part")
    ap.add_argument("--prefix", type=int, default=3072)
    ap.add_argument("--ppl-len", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m", help="a kvtier model name or a local model folder")
    ap.add_argument("--agree-prompts", type=int, default=20, help="agreement: prompts of --prompt tokens")
    ap.add_argument("--continuation", type=int, default=64, help="agreement: greedy / teacher-forced tokens")
    ap.add_argument("--out", help="also write the final JSON line to this file")
    ap.add_argument(
        "--paired",
        type=int,
        default=0,
        help="load only: build every config's engine first, then N rounds of one load run each, "
        "alternating the order per round (engines side by side in time, not minutes apart)",
    )
    args = ap.parse_args()
    if args.paired:
        return paired(args)

    from transformers import AutoTokenizer

    from kvtier.models import model_dir

    model = str(model_dir(args.model))
    tok = AutoTokenizer.from_pretrained(model)
    parts = args.parts.split(",")
    names = args.configs.split(",")
    results: dict[str, dict] = {}
    if "agreement" in parts:
        if names[0] != "vllm":
            raise SystemExit("--parts agreement: --configs must start with vllm (the bf16 reference)")
        prompts, agree_ref = agreement_prompts(tok, args.agree_prompts, args.prompt), None
    for name in names:
        res: dict = {}
        if "agreement" in parts:
            seqs = min(args.max_num_seqs, args.chunk)
            llm = build(name, model, max_num_batched_tokens=args.chunk, enable_prefix_caching=False, max_num_seqs=seqs)
            res.update(capacity(llm))
            summary, raw = agreement(llm, prompts, args, agree_ref)
            agree_ref = agree_ref or raw
            res.update(summary)
            close(llm)
        if "quality" in parts:
            seqs = min(args.max_num_seqs, args.chunk)  # vLLM: max_num_batched_tokens >= max_num_seqs
            llm = build(name, model, max_num_batched_tokens=args.chunk, enable_prefix_caching=False, max_num_seqs=seqs)
            counts0 = sparse_counts(name)
            res.update(capacity(llm), **quality(llm, tok, args))
            valued, scored = (a - b for a, b in zip(sparse_counts(name), counts0))
            if scored:
                res["quality_sparse_valued_share"] = valued / scored
            close(llm)
        if {"capacity", "speed", "load"} & set(parts):
            llm = build(name, model, max_num_seqs=args.max_num_seqs)
            res.update(capacity(llm))
            if "speed" in parts:
                res.update(speed(llm, tok, args))
            if "load" in parts:
                res.update(load(llm, tok, args, name))
            close(llm)
        results[name] = res
        print(name, json.dumps(res), flush=True)
    base = results.get("vllm", {})
    for name, res in results.items():
        ratios = {
            k: res[k] / base[k]
            for k in res
            if k in base and isinstance(res[k], float | int) and base[k] and not k.startswith(("greedy_", "tf_"))
        }
        print(f"{name:>8} / vllm:", " ".join(f"{k}={v:.4g}" for k, v in ratios.items()))
        if "nll64_dracula" in res and "nll64_dracula" in base:
            print(f"{name:>8} - vllm nll64:", {b: res[f"nll64_{b}"] - base[f"nll64_{b}"] for b in BOOKS})
    if "agreement" in parts:
        print(f"agreement with vLLM bf16, {len(prompts)} prompts of {args.prompt} tokens, chunk {args.chunk}:")
        print(f"{'config':>8} {'KV tokens':>10} {'greedy':>7} {'full':>5} {'1st diff':>8} {'TF top-1':>8} {'dNLL':>8}")
        for name, res in results.items():
            print(
                f"{name:>8} {res['kv_tokens'] / base['kv_tokens']:>9.2f}x {res['greedy_agree']:>7.3f}"
                f" {res['greedy_full_match']:>2}/{len(prompts):<2} {res['greedy_first_diff_mean']:>8.1f}"
                f" {res['tf_top1_agree']:>8.4f} {res['tf_dnll']:>+8.4f}"
            )
    line = json.dumps({"bench": "vllm_serve", "args": vars(args), "load": os.getloadavg(), "results": results})
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
