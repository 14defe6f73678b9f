"""A new process for the restart tests: an engine over the same ``disk_path`` (store policy
``"policy"``, default exact; with ``"pages"``, on kvtier's packed pages of that page policy).

Reads ``{"model", "disk", "prompts"[, "policy", "pages"]}`` as JSON on stdin, prints one JSON line:
``{"outputs": [[tokens, num_cached_tokens], ...], "stats": store counters}``. ``"kwargs"``: more
engine arguments (e.g. ``disable_hybrid_kv_cache_manager``).
"""

import json
import sys

from vllm_helpers import generate, make_llm

from kvtier.vllm import attention_backend, engine_kwargs, kv_transfer_config
from kvtier.vllm.store.spec import engine_store

if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    cfg = kv_transfer_config(job.get("policy", "exact"), cpu_bytes=1 << 30, disk_path=job["disk"])
    if job.get("pages"):
        with attention_backend(job["pages"]):
            llm = make_llm(job["model"], cfg, **engine_kwargs(job["pages"]), **job.get("kwargs", {}))
    else:
        llm = make_llm(job["model"], cfg, **job.get("kwargs", {}))
    outputs = [generate(llm, [p], 16)[0] for p in job["prompts"]]
    print(json.dumps({"outputs": outputs, "stats": engine_store(cfg.engine_id).stats()}))
