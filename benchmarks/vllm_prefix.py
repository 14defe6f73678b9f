"""Prefix reuse in vLLM: its own prefix cache alone vs kvtier's compressed offloading store.

N requests share long prefixes (book text). For each configuration (``vllm``: no connector;
``exact``, ``default``, ``compact``: kvtier store in host RAM; ``disk``: ``default`` with block
files) one in-process engine (SmolLM2-135M, bf16, CPU) runs, in this order:

1. stores the prefixes of W windows (one request each);
2. prompt time of a request sharing window 0's prefix after ``llm.reset_prefix_cache()`` (vLLM's
   own cache emptied: kvtier configs load from the store, ``vllm`` recomputes), median of 3, and
   the same request with vLLM's own prefix cache warm;
3. N concurrent requests sharing a prefix after a reset: tokens each took from a cache;
4. teacher-forced NLL of the book's next 64 tokens after each prefix: vLLM's own cache (exact
   bf16 KV) vs the store after a reset (``prompt_logprobs``, positions past the hit);
5. bytes per stored token (records in RAM; file sizes for ``disk``), store and load ms per block.

Then a new process with the ``disk`` folder measures restart hits, and a store without an engine
gives the capacity at a fixed ``cpu_bytes`` (default vs exact). Prints ratios; ends with one JSON
line. Take timings alone on the machine: ``flock /tmp/kvtier-bench.lock python benchmarks/vllm_prefix.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

for _k, _v in {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: the store's counters are readable
}.items():
    os.environ.setdefault(_k, _v)

BLOCK = 128
BOOKS = ("dracula", "moby_dick", "pride_and_prejudice", "middlemarch")


def book_windows(tok, prefix: int, count: int) -> list[list[int]]:  # noqa: ANN001
    """``count`` windows of ``prefix + 65`` tokens: from the books in ../shared/data/pg, else the shipped one."""
    pg = Path(__file__).resolve().parents[2] / "shared" / "data" / "pg"
    texts = []
    if pg.is_dir():
        texts = [
            (pg / f"{b}.txt").read_text(encoding="utf-8")[50_000:110_000] for b in BOOKS if (pg / f"{b}.txt").exists()
        ]
    if not texts:
        from kvtier.eval.texts import shipped_book

        (body,) = shipped_book().values()
        texts = [body[i * 60_000 : (i + 1) * 60_000] for i in range(count)]
    ids = [tok(t)["input_ids"] for t in texts]
    return [ids[i % len(ids)][(i // len(ids)) * 8000 :][: prefix + 65] for i in range(count)]


def engine(model: str, config):  # noqa: ANN001, ANN201
    from vllm import LLM

    return LLM(model=model, dtype="bfloat16", max_model_len=4096, enforce_eager=True, kv_transfer_config=config, seed=0)


def run(llm, prompts: list[list[int]], max_tokens: int = 1, **sp) -> list:  # noqa: ANN001
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, **sp)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def nll(llm, ids: list[int], scored: int = 64) -> tuple[float, int]:  # noqa: ANN001
    (out,) = run(llm, [ids], prompt_logprobs=0, skip_reading_prefix_cache=False)
    start = len(ids) - scored
    lps = out.prompt_logprobs
    return -sum(lps[i][ids[i]].logprob for i in range(start, len(ids))) / scored, out.num_cached_tokens or 0


def timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(name: str, model: str, windows: list[list[int]], args, disk: str | None) -> dict:  # noqa: ANN001
    from kvtier.vllm import kv_transfer_config
    from kvtier.vllm.store.spec import engine_store

    policy = {"disk": "default"}.get(name, name)
    cfg = None if name == "vllm" else kv_transfer_config(policy, cpu_bytes=args.cpu_bytes, disk_path=disk)
    llm = engine(model, cfg)
    store = None if cfg is None else engine_store(cfg.engine_id)
    P = args.prefix
    out: dict = {"config": name}
    run(llm, [[1, 2, 3]])  # warm-up
    for w in windows:  # 1. store the prefixes
        run(llm, [w[:P]], max_tokens=2)
    # 4 (first half). NLL with vLLM's own cache warm: exact bf16 KV of the prefix
    own = [nll(llm, w) for w in windows]
    # 2. prompt time: own cache warm, then after a reset (store hit, or recompute without a store)
    suffix = windows[0][P : P + 40]
    own_times = []
    for i in range(3):
        own_times.append(timed(lambda i=i: run(llm, [windows[0][:P] + suffix[i:]])))
    out["prompt_s_own_cache"] = statistics.median(own_times)
    times, cached = [], []
    for i in range(3):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        (o,) = run(llm, [windows[0][:P] + suffix[i + 3 :]])
        times.append(time.perf_counter() - t0)
        cached.append(o.num_cached_tokens or 0)
    out["prompt_s_after_reset"] = statistics.median(times)
    out["hit_tokens_after_reset"] = min(cached)
    # 3. N concurrent requests sharing window 1's prefix, after a reset
    llm.reset_prefix_cache()
    outs = run(llm, [windows[1][:P] + windows[0][i * 20 : i * 20 + 30] for i in range(args.requests)])
    out["concurrent_hit_tokens"] = [o.num_cached_tokens or 0 for o in outs]
    # 4. NLL from the store after a reset
    llm.reset_prefix_cache()
    hit = [nll(llm, w) for w in windows]
    out["nll_own_cache"] = statistics.fmean(x for x, _ in own)
    out["nll_after_reset"] = statistics.fmean(x for x, _ in hit)
    out["nll_delta"] = out["nll_after_reset"] - out["nll_own_cache"]
    out["nll_hit_tokens"] = [c for _, c in hit]
    if store is not None:  # 5. bytes and per-block times
        run(llm, [[4, 5, 6]], max_tokens=2)  # one more step: the last stores are submitted
        store.flush()
        st = store.stats()
        exact_per_token = store.fmt.exact_bytes / BLOCK
        out["stored_blocks"] = st.get("stored", 0)
        out["ram_bytes_per_token"] = st["ram_record_bytes"] / (st["stored"] * BLOCK)
        out["ram_ratio_bf16"] = out["ram_bytes_per_token"] / exact_per_token
        if disk:
            files = list(Path(disk).rglob("*.kvb"))
            out["disk_bytes_per_token"] = sum(f.stat().st_size for f in files) / (len(files) * BLOCK)
            out["disk_ratio_bf16"] = out["disk_bytes_per_token"] / exact_per_token
        out["store_ms_per_block_in_engine"] = st["store_ns"] / 1e6 / max(st["stored"], 1)
        out["load_ms_per_block_in_engine"] = st["load_ns"] / 1e6 / max(st.get("loaded", 0), 1)
        out["store_counters"] = {k: v for k, v in st.items() if isinstance(v, int)}
    llm.reset_prefix_cache()
    return out


def codec_times(policy: str, reps: int = 7, first: bool = False) -> dict:
    """Store (encode + record) and load (decode) ms per SmolLM2 block of 30 layers, isolated: medians
    of wall time and of this thread's CPU time (less sensitive to other jobs on the machine).
    ``first``: the block is a sequence's first (its first ``sink_tokens`` stay exact)."""
    import torch

    from kvtier.vllm import BlockFormat, PrefixStore, get_store_policy

    fmt = BlockFormat(30, 3, BLOCK, 64, torch.bfloat16)
    store = PrefixStore(get_store_policy(policy), fmt, cpu_bytes=1 << 30)
    sink = get_store_policy(policy).sink_tokens if first else 0
    kv = torch.randn(fmt.shape).to(fmt.dtype)
    wall: dict[str, list[float]] = {"put": [], "read": []}
    cpu: dict[str, list[float]] = {"put": [], "read": []}

    def clocked(name: str, fn) -> None:  # noqa: ANN001
        w, c = time.perf_counter(), time.thread_time()
        fn()
        cpu[name].append(time.thread_time() - c)
        wall[name].append(time.perf_counter() - w)

    for i in range(reps + 1):  # the first round allocates the scratch buffers: not counted
        key = i.to_bytes(36, "big")
        (k,) = store.reserve([key], [sink])
        clocked("put", lambda k=k: store.put(k, kv))
        store.pin([key])
        clocked("read", lambda key=key: store.read(key))
        store.unpin([key])
    store.close()
    p, r = (statistics.median(wall[n][1:]) * 1e3 for n in ("put", "read"))
    pc, rc = (statistics.median(cpu[n][1:]) * 1e3 for n in ("put", "read"))
    return {"store_ms": p, "load_ms": r, "store_plus_load_ms": p + r, "store_cpu_ms": pc, "load_cpu_ms": rc}


def codec_only(reps: int) -> None:
    """``--codec-only``: store and load ms per block of each policy's first codec (one thread)."""
    import torch

    torch.set_num_threads(1)
    out = {}
    for name, policy, first in [("exact", "exact", False), ("default", "default", False), ("compact", "compact", False),
                               ("compact-first-block", "compact", True)]:  # fmt: skip
        out[name] = c = codec_times(policy, reps, first)
        print(
            f"codec {name:20} store {c['store_ms']:5.2f} ms + load {c['load_ms']:5.2f} ms = "
            f"{c['store_plus_load_ms']:5.2f} ms/block (CPU {c['store_cpu_ms']:5.2f} + {c['load_cpu_ms']:5.2f} ms)",
            flush=True,
        )
    print(json.dumps({"bench": "vllm_prefix_codec", "reps": reps, "load": os.getloadavg(), "codec": out}))


def capacity(cpu_blocks: int = 48) -> dict:
    """Blocks held at a fixed cpu_bytes (``cpu_blocks`` exact SmolLM2 blocks), default vs exact."""
    import torch

    from kvtier.vllm import BlockCodec, BlockFormat, PrefixStore, get_store_policy

    fmt = BlockFormat(30, 3, BLOCK, 64, torch.bfloat16)
    budget = cpu_blocks * BlockCodec(fmt).record_bytes(None, False, 0)
    held = {}
    for policy, n in (("exact", cpu_blocks + 4), ("default", 5 * cpu_blocks)):
        store = PrefixStore(get_store_policy(policy), fmt, cpu_bytes=budget)
        kv = torch.randn(fmt.shape).to(fmt.dtype)
        for i in range(n):
            for k in store.reserve([i.to_bytes(36, "big")], [0]):
                store.put(k, kv)
            store.maintain()
            store.flush()
        blocks = store.stats()["blocks"]
        held[policy] = {"blocks": sum(blocks.values()), "by_level": blocks, "ram_bytes": store.ram_bytes}
        store.close()
    return {"cpu_bytes": budget, **held, "ratio": held["default"]["blocks"] / held["exact"]["blocks"]}


def restart_child(model: str, disk: str, prompt: list[int]) -> dict:
    from kvtier.vllm import kv_transfer_config
    from kvtier.vllm.store.spec import engine_store

    cfg = kv_transfer_config("default", cpu_bytes=1 << 30, disk_path=disk)
    llm = engine(model, cfg)
    run(llm, [[1, 2, 3]])
    t0 = time.perf_counter()
    (o,) = run(llm, [prompt])
    return {"restart_hit_tokens": o.num_cached_tokens or 0, "restart_prompt_s": time.perf_counter() - t0,
            "restart_disk_hits": engine_store(cfg.engine_id).stats().get("disk_hits", 0)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="vllm,exact,default,compact,disk")
    ap.add_argument("--prefix", type=int, default=23 * BLOCK, help="shared prefix tokens (a multiple of 128)")
    ap.add_argument("--windows", type=int, default=4, help="book windows for the NLL")
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests sharing a prefix")
    ap.add_argument("--cpu-bytes", type=int, default=1 << 30)
    ap.add_argument("--codec-only", type=int, metavar="REPS", help="only the store/load ms per block, REPS rounds")
    ap.add_argument("--restart-child", nargs=2, metavar=("DISK", "PROMPT_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.codec_only:
        codec_only(args.codec_only)
        return
    from kvtier.models import model_dir

    model = str(model_dir())
    if args.restart_child:
        print(json.dumps(restart_child(model, args.restart_child[0], json.loads(args.restart_child[1]))))
        return
    from transformers import AutoTokenizer

    windows = book_windows(AutoTokenizer.from_pretrained(model), args.prefix, args.windows)
    results, disk_dir = {}, tempfile.mkdtemp(prefix="kvtier-vllm-bench-")
    for name in args.configs.split(","):
        results[name] = measure(name, model, windows, args, disk_dir if name == "disk" else None)
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "store_counters"}), flush=True)
    if "disk" in results:
        prompt = windows[0][: args.prefix] + windows[0][args.prefix : args.prefix + 10]
        proc = subprocess.run(
            [sys.executable, __file__, "--restart-child", disk_dir, json.dumps(prompt)],
            capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        results["disk"].update(json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {})
    codec = {p: codec_times(p) for p in ("exact", "default", "compact")}
    cap = capacity()
    base = results.get("vllm", {}).get("prompt_s_after_reset")
    print("\nconfig   prompt s after reset (x recompute)  hit tokens  8 concurrent min  NLL delta vs exact  bytes/bf16")
    for name, r in results.items():
        ratio = r["prompt_s_after_reset"] / base if base else float("nan")
        bytes_ratio = r.get("disk_ratio_bf16", r.get("ram_ratio_bf16", 1.0))
        print(
            f"{name:8} {r['prompt_s_after_reset']:8.3f} ({ratio:5.2f}x){r['hit_tokens_after_reset']:22d}"
            f" {min(r['concurrent_hit_tokens']):16d} {r['nll_delta']:+19.4f} {bytes_ratio:11.3f}"
        )
    for p, c in codec.items():
        print(
            f"codec {p:8} store {c['store_ms']:.1f} ms + load {c['load_ms']:.1f} ms"
            f" = {c['store_plus_load_ms']:.1f} ms/block"
        )
    print(f"capacity at {cap['cpu_bytes'] >> 20} MiB: default {cap['default']['blocks']} blocks vs exact "
          f"{cap['exact']['blocks']}: {cap['ratio']:.2f}x")  # fmt: skip
    if "disk" in results and "restart_hit_tokens" in results["disk"]:
        r = results["disk"]
        print(
            f"restart (new process, same disk_path): {r['restart_hit_tokens']} hit tokens,"
            f" {r['restart_prompt_s']:.2f} s"
        )
    print(
        json.dumps({"bench": "vllm_prefix", "prefix": args.prefix, "results": results, "codec": codec, "capacity": cap})
    )


if __name__ == "__main__":
    main()
