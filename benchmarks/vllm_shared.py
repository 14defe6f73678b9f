"""Two vLLM servers' engines sharing compressed prefix blocks through one Redis (issue 37).

A real ``redis-server`` on loopback (free port, temp dir). Engine A (a process of its own, its own
RAM, no disk) computes W + 2R prefixes of ``--prefix`` tokens (book and code windows, alternating) and
writes their blocks through to Redis. Engine B (another process, its own empty RAM, no disk)
then, per window, alternating in one process:

- time to first token (one output token, wall time of ``generate``) of the prefix plus 40 new
  tokens, its prefix from the pool, then the same prompt recomputed (``skip_reading_prefix_cache``:
  neither vLLM's cache nor the store); tokens taken from a cache;
- teacher-forced NLL of the next 64 tokens over the pool's blocks vs over B's own exact prefix
  (computed in B, read from vLLM's own prefix cache: the reference of tests/vllm/test_vllm_default);

and the throughput of ``--requests`` requests (each a prefix A computed and B never read, a
40-token suffix, 16 greedy tokens; submitted together) with the pool vs recomputed, alternating
twice (two sets of R prefixes, one per pool round, so every pool round reads Redis; each
recompute round recomputes the set its pool round read). Redis memory (``INFO memory``
``used_memory`` before/after A, and the records' own bytes, ``STRLEN``) per stored token vs the
bf16 KV bytes of the model. Prints ratios; ends with one JSON line. Take timings alone on the
machine (``--threads`` torch threads in each engine).

    python benchmarks/vllm_shared.py --model smollm2-135m --policy default
    python benchmarks/vllm_shared.py --model qwen2.5-coder-1.5b --policy default --windows 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _k, _v in {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in the child's process: the store's counters are readable
}.items():
    os.environ.setdefault(_k, _v)

BLOCK = 128
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TEXTS = ("pg/dracula.txt", "code/python_stdlib_a.txt", "pg/huckleberry_finn.txt", "code/python_stdlib_b.txt")


def windows(model: str, prefix: int, count: int) -> list[list[int]]:
    """``count`` windows of ``prefix + 65`` tokens, cycling over two books and two code texts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = [tok(((DATA / t).read_text(encoding="utf-8"))[40_000:440_000])["input_ids"] for t in TEXTS]
    return [ids[i % len(ids)][(i // len(ids)) * 8000 :][: prefix + 65] for i in range(count)]


def start_redis(folder: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*cmd, "--dir", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def child(job: dict) -> dict:
    """One engine (role ``a`` or ``b``, see the module docstring)."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.vllm import kv_transfer_config
    from kvtier.vllm.store.spec import engine_store

    torch.set_num_threads(job["threads"])
    cfg = kv_transfer_config(job["policy"], cpu_bytes=4 << 30, remote=job["remote"])
    llm = LLM(model=job["model"], dtype="bfloat16", max_model_len=job["prefix"] + 512, enforce_eager=True,
              kv_transfer_config=cfg, seed=0)  # fmt: skip
    store = engine_store(cfg.engine_id)

    def run(prompts, max_tokens=1, **sp):  # noqa: ANN001, ANN003, ANN202
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, **sp)
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    wins, prefix, out = job["windows"], job["prefix"], {}
    if job["role"] == "a":
        t0 = time.perf_counter()
        for w in wins:
            run([w[:prefix]])
        run([[1, 2, 3]])  # one more step: the last stores are submitted
        store.flush()
        out["seconds"] = time.perf_counter() - t0
    else:
        rows = []
        for w in wins[: job["timed"]]:
            prompt = w[: prefix + 40]
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            (hit,) = run([prompt])
            t_hit = time.perf_counter() - t0
            t0 = time.perf_counter()
            (re,) = run([prompt], skip_reading_prefix_cache=True)
            t_re = time.perf_counter() - t0
            llm.reset_prefix_cache()
            # (prompt_logprobs turns cache reads off unless told otherwise)
            (a,) = run([w], prompt_logprobs=0, skip_reading_prefix_cache=False)  # the pool's blocks (in B's RAM now)
            llm.reset_prefix_cache()
            run([w[:prefix]], skip_reading_prefix_cache=True)  # computed here, exact, into vLLM's own cache
            (b,) = run([w], prompt_logprobs=0, skip_reading_prefix_cache=False)
            row = {"cached": hit.num_cached_tokens, "ttft_hit": t_hit, "ttft_recompute": t_re}
            row |= {"nll_pool": nll(a, w), "nll_exact": nll(b, w)}
            rows.append(row | {"nll_cached": [a.num_cached_tokens, b.num_cached_tokens]})
        out["rows"] = rows
        n = job["requests"]
        for i, mode in enumerate(("pool", "recompute", "pool", "recompute")):
            # prefixes B never read: each pool round takes all of them from Redis
            reqs = [w[:prefix] + [1000 + j] * 40 for j, w in enumerate(wins[job["timed"] + n * (i // 2) :][:n])]
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = run(reqs, 16, skip_reading_prefix_cache=mode == "recompute")
            dt = time.perf_counter() - t0
            toks = sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) + len(o.outputs[0].token_ids) for o in outs)
            out.setdefault("throughput", {}).setdefault(mode, []).append(
                {"seconds": dt, "requests_per_s": len(reqs) / dt, "computed_tokens": toks}
            )
    store.flush()
    out["stats"] = {k: v for k, v in store.stats().items() if not isinstance(v, dict)}
    return out


def nll(out, ids: list[int], scored: int = 64) -> float:  # noqa: ANN001
    """Mean NLL of the last ``scored`` tokens of ``ids`` from a request's prompt logprobs."""
    return -sum(out.prompt_logprobs[i][ids[i]].logprob for i in range(len(ids) - scored, len(ids))) / scored


def spawn(job: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(job), capture_output=True,
                          text=True, timeout=3600)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policy", default="default")
    ap.add_argument("--prefix", type=int, default=23 * BLOCK, help="shared prefix tokens (a multiple of 128)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(sys.stdin.read()))))
        return
    import redis
    from transformers import AutoConfig

    from kvtier.models import model_dir

    model = str(model_dir(args.model))
    cfg = AutoConfig.from_pretrained(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bf16_per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * 2
    wins = windows(model, args.prefix, args.windows + 2 * args.requests)
    with tempfile.TemporaryDirectory() as folder:
        proc, port = start_redis(folder)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            r = redis.Redis.from_url(url)
            job = {"model": model, "remote": url, "policy": args.policy, "prefix": args.prefix, "windows": wins,
                   "requests": args.requests, "threads": args.threads, "timed": args.windows}  # fmt: skip
            before = int(r.info("memory")["used_memory"])
            a = spawn({**job, "role": "a"})
            used = int(r.info("memory")["used_memory"]) - before
            parts = r.keys("kvtier:*")
            record_bytes = sum(r.strlen(k) for k in parts)
            keys = [k for k in parts if k.endswith(b":0")]  # one per block
            b = spawn({**job, "role": "b"})
        finally:
            proc.kill()
    tokens = len(keys) * BLOCK
    rows = b["rows"]
    ttft_hit = statistics.median(x["ttft_hit"] for x in rows)
    ttft_re = statistics.median(x["ttft_recompute"] for x in rows)
    dnll = statistics.mean(x["nll_pool"] - x["nll_exact"] for x in rows)
    tp = {m: statistics.median(x["requests_per_s"] for x in v) for m, v in b["throughput"].items()}
    print(f"{args.model} policy {args.policy}: A stored {len(keys)} blocks ({tokens} tokens) in {a['seconds']:.1f} s")
    print(f"Redis: used_memory +{used / 2**20:.1f} MiB = {used / (tokens * bf16_per_token):.3f} of bf16 KV; "
          f"records {record_bytes / (tokens * bf16_per_token):.3f}")  # fmt: skip
    for i, x in enumerate(rows):
        print(f"  window {i}: B took {x['cached']} tokens from the pool; TTFT {x['ttft_hit']:.2f} s vs recompute "
              f"{x['ttft_recompute']:.2f} s ({x['ttft_hit'] / x['ttft_recompute']:.3f}x); next-64 NLL "
              f"{x['nll_pool']:.4f} vs exact {x['nll_exact']:.4f}")  # fmt: skip
    print(f"TTFT median {ttft_hit:.2f} s vs {ttft_re:.2f} s: {ttft_hit / ttft_re:.3f}x; mean dNLL {dnll:+.4f}")
    print(f"throughput ({args.requests} requests): pool {tp['pool']:.2f} req/s vs recompute {tp['recompute']:.2f} "
          f"({tp['pool'] / tp['recompute']:.2f}x)")  # fmt: skip
    result = {
        "bench": "vllm_shared", "model": args.model, "policy": args.policy, "prefix": args.prefix,
        "threads": args.threads, "blocks": len(keys), "redis_used_vs_bf16": used / (tokens * bf16_per_token),
        "records_vs_bf16": record_bytes / (tokens * bf16_per_token), "ttft_hit_s": ttft_hit,
        "ttft_recompute_s": ttft_re, "ttft_ratio": ttft_hit / ttft_re, "dnll": dnll,
        "hit_tokens": [x["cached"] for x in rows], "rows": rows, "throughput": b["throughput"],
        "throughput_ratio": tp["pool"] / tp["recompute"], "stats_a": a["stats"], "stats_b": b["stats"],
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
