"""A new process that builds one engine and reports how the build went (for the build-time refusals:
a failed build leaves vLLM's process state behind, so it runs apart from the test's engines).

Reads ``{"model", "pages", "store"[, "kwargs"]}`` as JSON on stdin (``pages``/``store``: a policy name
or null), prints one JSON line: ``{"error": "Type: first line"}`` or ``{"tokens": KV tokens}``.
"""

import contextlib
import json
import sys

from vllm_helpers import close_llm, make_llm

from kvtier.vllm import attention_backend, engine_kwargs, kv_transfer_config

if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    cfg = None if job["store"] is None else kv_transfer_config(job["store"], cpu_bytes=64 << 20)
    kwargs = dict(job.get("kwargs", {}))
    pages = job["pages"]
    try:
        with attention_backend(pages) if pages else contextlib.nullcontext():
            llm = make_llm(job["model"], cfg, **(engine_kwargs(pages) if pages else {}), **kwargs)
    except Exception as err:  # noqa: BLE001 - the refusal is the result
        print(json.dumps({"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}))
    else:
        c = llm.llm_engine.vllm_config.cache_config
        print(json.dumps({"tokens": c.num_gpu_blocks * c.block_size}))
        close_llm(llm)
