"""A new process for the restart test: an exact-policy engine over the same ``disk_path``.

Reads ``{"model", "disk", "prompts"}`` as JSON on stdin, prints one JSON line:
``{"outputs": [[tokens, num_cached_tokens], ...], "stats": store counters}``.
"""

import json
import sys

from vllm_helpers import generate, make_llm

from kvtier.vllm import kv_transfer_config
from kvtier.vllm.store.spec import engine_store

if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    cfg = kv_transfer_config("exact", cpu_bytes=1 << 30, disk_path=job["disk"])
    llm = make_llm(job["model"], cfg)
    outputs = [generate(llm, [p], 16)[0] for p in job["prompts"]]
    print(json.dumps({"outputs": outputs, "stats": engine_store(cfg.engine_id).stats()}))
