"""Helpers of the vLLM adapter tests: engines, greedy generation, teacher-forced NLL, block files.

vLLM is imported inside the helpers only.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

#: tokens per vLLM block on the CPU platform (its default block_size)
BLOCK = 128
#: the shared prefix: 23 blocks (~3k tokens)
PREFIX = 23 * BLOCK


def make_llm(model_path: str, config, **kwargs):  # noqa: ANN001, ANN201
    from vllm import LLM

    return LLM(
        model=model_path,
        dtype="bfloat16",
        max_model_len=4096,
        enforce_eager=True,
        kv_transfer_config=config,
        seed=0,
        **kwargs,
    )


def close_llm(llm) -> None:  # noqa: ANN001
    engine = getattr(llm, "llm_engine", None)
    if engine is not None and hasattr(engine, "engine_core"):
        engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm, prompts: list[list[int]], max_tokens: int = 8, max_load_tokens: int | None = None):  # noqa: ANN001, ANN201
    """Greedy ``(tokens, num_cached_tokens)`` per prompt, all submitted at once; ``max_load_tokens``
    caps what vLLM's offloading connector loads (its per-request ``kv_transfer_params``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None if max_load_tokens is None else {"kv_transfer_params": {"max_load_tokens": max_load_tokens}}
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, extra_args=extra)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]


def teacher_nll(llm, ids: list[int], scored: int = 64, *, recompute: bool = False) -> tuple[float, int]:  # noqa: ANN001
    """Mean NLL (nats/token) of the last ``scored`` tokens of ``ids`` given everything before,
    and the tokens vLLM took from a cache. Positions up to the cache hit carry no logprobs, so
    the prompt must leave at least one uncached token before the scored ones."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        max_tokens=1, prompt_logprobs=0, skip_reading_prefix_cache=recompute, detokenize=False, temperature=0.0
    )
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
    cached = out.num_cached_tokens or 0
    start = len(ids) - scored
    assert cached < start, f"{cached} cached tokens leave no logprobs for position {start}"
    lps = out.prompt_logprobs
    return -sum(lps[i][ids[i]].logprob for i in range(start, len(ids))) / scored, cached


def block_files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.kvb"))


def run_child(script: str, job: dict, env: dict[str, str] | None = None, *, fails: bool = False) -> dict:
    """Run ``tests/vllm/<script>`` in a new process with ``job`` as JSON on stdin (and ``env`` added
    to this environment); its last stdout line that is a JSON object, parsed (a restart, or an
    engine build that must not leave vLLM's state in this process). ``fails``: the child must exit
    non-zero; returns ``{"output": its stdout and stderr}``."""
    here = Path(__file__).parent
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    proc = subprocess.run(
        [sys.executable, str(here / script)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    if fails:
        assert proc.returncode != 0, proc.stdout[-2000:]
        return {"output": proc.stdout + proc.stderr}
    assert proc.returncode == 0, proc.stderr[-4000:]
    # vLLM's shutdown may log to stdout after the child's JSON line
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
