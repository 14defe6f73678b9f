"""An engine under vLLM's default multiprocessing (the worker in a process of its own; with
``"tp": 2`` two worker processes) with kvtier's prefix store over ``"disk"``.

Reads ``{"model", "disk", "policy", "prompts", "steps"[, "tp", "kwargs"]}`` as JSON on stdin; each
step is ``["gen", i]`` (greedy 16 tokens of prompt ``i``) or ``["reset"]`` (``reset_prefix_cache``).
Prints one JSON line: ``{"outputs": [[tokens, num_cached_tokens], ...], "metrics": {name: value}}``
(kvtier's counters as vLLM's frontend sees them; the store itself is in the engine-core process).
"""

import json
import sys

from vllm_helpers import generate, make_llm

from kvtier.vllm import kv_transfer_config

if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    cfg = kv_transfer_config(job.get("policy", "exact"), cpu_bytes=1 << 30, disk_path=job["disk"])
    kwargs = {"tensor_parallel_size": job.get("tp", 1), "disable_log_stats": False, **job.get("kwargs", {})}
    llm = make_llm(job["model"], cfg, **kwargs)
    outputs = []
    for step in job["steps"]:
        if step[0] == "reset":
            assert llm.reset_prefix_cache()
        else:
            outputs += generate(llm, [job["prompts"][step[1]]], 16)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "kvtier" in m.name}
    print(json.dumps({"outputs": outputs, "metrics": metrics}))
