"""One vLLM engine of the shared-pool tests (``test_vllm_shared.py``), in a process of its own.

Reads ``{"model", "remote", "policy", "role", "windows"}`` as JSON on stdin (``windows``: token
ids, each a ``PREFIX``-token prefix and 65 more), builds an engine whose prefix store has no disk
and shares ``remote`` (Redis), and prints one JSON line.

- ``role="a"`` computes every window's prefix (and window 0's under the cache salt ``tenant-a``),
  lets the stores run and waits for the Redis writes: ``{"stats"}``.
- ``role="b"`` (another engine, its own empty RAM) asks for the same prefixes:
  ``{"greedy": [tokens, cached], "recomputed": tokens, "nll": [[hit, cached, exact, cached], ...],
  "salted": {salt: cached}, "stats"}``; ``exact``: the same window over B's own exact prefix
  (computed here, then read from vLLM's own prefix cache), the reference of the NLL as in
  test_vllm_default.
- ``role="fault"`` kills Redis (``redis_pid``), serves two prefixes, starts Redis again
  (``redis_argv``), waits out the retry interval and serves a third: ``{"down", "up",
  "errors_down", "writes_up", "redis_pid"}`` (the new server's pid: the test stops it).
"""

import json
import sys

from vllm_helpers import PREFIX, generate, make_llm, teacher_nll

from kvtier.vllm import kv_transfer_config
from kvtier.vllm.store.spec import engine_store


def salted(llm, ids: list[int], salt: str) -> int:  # noqa: ANN001
    """Tokens vLLM took from a cache for ``ids`` under ``salt``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids, cache_salt=salt)], sp, use_tqdm=False)
    return out.num_cached_tokens or 0


def greedy(llm, ids: list[int], recompute: bool) -> tuple[list[int], int]:  # noqa: ANN001
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False, skip_reading_prefix_cache=recompute)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    cfg = kv_transfer_config(job["policy"], cpu_bytes=1 << 30, remote=job["remote"])
    llm = make_llm(job["model"], cfg)
    store = engine_store(cfg.engine_id)
    windows = job["windows"]
    out = {}
    if job["role"] == "a":
        for ids in windows:
            generate(llm, [ids[:PREFIX]], 1)
        salted(llm, windows[0][:PREFIX], "tenant-a")
        generate(llm, [[1, 2, 3]], 1)  # one more step: the last stores are submitted
    elif job["role"] == "fault":  # Redis killed mid-run, then started again (``redis_argv``) on its port
        import os
        import signal
        import subprocess
        import time

        from kvtier.vllm.store import remote

        os.kill(job["redis_pid"], signal.SIGKILL)
        out["down"] = [generate(llm, [ids[:PREFIX]], 4)[0] for ids in windows[:2]]  # served: RAM only
        store.flush()
        out["errors_down"] = store.counters["remote_errors"]
        server = subprocess.Popen(job["redis_argv"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(remote.RETRY_S + 1)
        out["up"] = generate(llm, [windows[2][:PREFIX]], 4)[0]
        generate(llm, [[1, 2, 3]], 1)  # one more step: the last stores are submitted
        store.flush()
        out["writes_up"] = store.counters["remote_writes"]
        out["redis_pid"] = server.pid
    else:
        prompt = windows[0][: PREFIX + 40]
        out["greedy"] = greedy(llm, prompt, recompute=False)  # its prefix from the pool
        out["recomputed"] = greedy(llm, prompt, recompute=True)[0]
        out["nll"] = []
        for ids in windows:
            llm.reset_prefix_cache()  # vLLM's own cache emptied: the prefix from the pool
            hit, cached = teacher_nll(llm, ids)
            llm.reset_prefix_cache()
            greedy(llm, ids[:PREFIX], recompute=True)  # computed here, exact, into vLLM's own cache
            exact, own = teacher_nll(llm, ids)
            out["nll"].append([hit, cached, exact, own])
        llm.reset_prefix_cache()
        out["salted"] = {salt: salted(llm, windows[0][:PREFIX], salt) for salt in ("tenant-a", "tenant-b")}
    store.flush()
    out["stats"] = store.stats()
    print(json.dumps(out))
