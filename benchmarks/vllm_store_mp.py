"""kvtier's prefix store as vLLM is deployed: its default multiprocessing and tensor parallelism (issue 36).

Per ``--tp`` value, one server (a process of its own, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``: the
engine core and one worker process per rank) over a fresh ``disk_path``, per window (prefix of
``--prefix`` tokens + 40, books and code alternating): greedy 16 tokens computed (and stored),
again from vLLM's own prefix cache, then after ``reset_prefix_cache`` from kvtier's store only,
each with its wall time; then a restarted server over the same folder (from the block files),
and a server with ``--cross-tp`` over the folder the first one wrote (records hold every KV head).
Reports tokens taken from a cache, whether the store's greedy tokens equal vLLM's own prefix hit
(``exact``: they must), and the time of a store hit vs a recompute. Ends with one JSON line.

    python benchmarks/vllm_store_mp.py --model qwen2.5-coder-1.5b --tp 1,2 --cross-tp 1 --windows 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _k, _v in {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_k, _v)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TEXTS = ("pg/dracula.txt", "code/python_stdlib_a.txt")


def windows(model: str, prefix: int, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = [tok(((DATA / t).read_text(encoding="utf-8"))[40_000:240_000])["input_ids"] for t in TEXTS]
    return [ids[i % 2][(i // 2) * 8000 :][: prefix + 40] for i in range(count)]


def child(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.vllm import kv_transfer_config

    cfg = kv_transfer_config(job["policy"], cpu_bytes=4 << 30, disk_path=job["disk"])
    llm = LLM(
        model=job["model"],
        dtype="bfloat16",
        max_model_len=8192,
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=job["tp"],
        kv_transfer_config=cfg,
    )
    sp = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False)

    def gen(p: list[int]) -> dict:
        t0 = time.perf_counter()
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
        s = time.perf_counter() - t0
        return {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0, "s": s}

    out = []
    for p in job["prompts"]:
        row = {"first": gen(p)}
        if job["fresh"]:
            row["own"] = gen(p)
            llm.reset_prefix_cache()
            row["store"] = gen(p)
        out.append(row)
    return {"rows": out}


def run(job: dict) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child"], input=json.dumps(job), capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        sys.exit(f"server child failed:\n{proc.stderr[-3000:]}")
    res = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"rows"')][-1])
    res["wall_s"] = time.perf_counter() - t0
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policy", default="exact")
    ap.add_argument("--tp", default="1,2", help="tensor parallel sizes, comma-separated")
    ap.add_argument("--cross-tp", type=int, default=None, help="also read the first server's folder at this TP")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=2944)
    ap.add_argument("--out", help="also write the final JSON line to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(sys.stdin.read()))), flush=True)
        return
    from kvtier.models import MODELS, model_dir

    path = str(model_dir(args.model)) if args.model in MODELS else args.model
    prompts = windows(path, args.prefix, args.windows)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-mp-") as tmp:
        disks = {}
        for tp in [int(t) for t in args.tp.split(",")]:
            disks[tp] = disk = str(Path(tmp) / f"tp{tp}")
            job = {"model": path, "policy": args.policy, "disk": disk, "tp": tp, "prompts": prompts}
            a = run({**job, "fresh": True})
            b = run({**job, "fresh": False})
            rows = []
            for ra, rb in zip(a["rows"], b["rows"]):
                row = {
                    "own_cached": ra["own"]["cached"],
                    "store_cached": ra["store"]["cached"],
                    "store_equals_own": ra["store"]["tokens"] == ra["own"]["tokens"],
                    "restart_cached": rb["first"]["cached"],
                    "restart_equals_own": rb["first"]["tokens"] == ra["own"]["tokens"],
                    "recompute_s": ra["first"]["s"],
                    "store_s": ra["store"]["s"],
                    "restart_s": rb["first"]["s"],
                }
                rows.append(row)
                print(
                    f"TP={tp}: store {row['store_cached']}/{args.prefix} cached (own {row['own_cached']}), "
                    f"equal to vLLM's own hit: {row['store_equals_own']}; restart {row['restart_cached']} "
                    f"(equal: {row['restart_equals_own']}); time store/recompute "
                    f"{row['store_s'] / row['recompute_s']:.3f}, "
                    f"restart/recompute {row['restart_s'] / row['recompute_s']:.3f}"
                )
            results[f"tp{tp}"] = rows
        if args.cross_tp is not None:  # the folder of a server with another TP
            first = next(tp for tp in disks if tp != args.cross_tp)
            job = {"model": path, "policy": args.policy, "disk": disks[first], "tp": args.cross_tp, "prompts": prompts}
            c = run({**job, "fresh": False})
            cached = [r["first"]["cached"] for r in c["rows"]]
            print(f"TP={args.cross_tp} server over TP={first}'s block files: cached {cached}")
            results[f"tp{args.cross_tp}_reads_tp{first}"] = cached
    line = json.dumps({"benchmark": "vllm_store_mp", "model": args.model, "policy": args.policy, "results": results})
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
