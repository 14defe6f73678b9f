"""``vllm serve`` support: kvtier's ``vllm.general_plugins`` entry point registers a per-engine
backend selector for ``CPU_ATTN`` (``kvtier.vllm.plugin``): an engine naming a kvtier policy in
its ``additional_config`` gets kvtier's backend, any other engine vLLM's own class; an
``attention_backend`` block leaves it in place; a real ``vllm serve`` process serves from kvtier's
packed pages with the flags of ``serve_args``."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm.v1")

from kvtier.vllm import engine, serve_args  # noqa: E402
from kvtier.vllm.pages.policy import CONFIG_KEY, get_page_policy, policy_name  # noqa: E402


@pytest.fixture
def registry():
    """CPU_ATTN's override and kvtier's plugin state, restored after the test."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    member = AttentionBackendEnum.CPU_ATTN
    saved, plugin = _ATTN_OVERRIDES.get(member), engine._plugin_path
    member.clear_override()
    engine._plugin_path = None
    yield member
    engine._plugin_path = plugin
    if saved is None:
        member.clear_override()
    else:
        _ATTN_OVERRIDES[member] = saved


def _config(additional: dict | None):  # noqa: ANN202
    from vllm.config import VllmConfig

    return VllmConfig(additional_config=additional or {})


def test_selector_gives_kvtier_only_to_engines_that_ask() -> None:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from kvtier.vllm.pages.backend import backend_class, selected_backend

    with set_current_vllm_config(_config({CONFIG_KEY: policy_name(get_page_policy("default"))})):
        assert selected_backend() is backend_class("default")
    with set_current_vllm_config(_config(None)):
        assert selected_backend() is CPUAttentionBackend
    assert selected_backend() is CPUAttentionBackend  # outside any engine's config
    with set_current_vllm_config(_config({CONFIG_KEY: "KVTierAttention_bogus"})):
        with pytest.raises(ValueError, match="names no kvtier policy"):
            selected_backend()


def test_plugin_registers_the_selector_and_attention_backend_restores_it(registry) -> None:  # noqa: ANN001
    from kvtier.vllm.engine import attention_backend
    from kvtier.vllm.plugin import register

    register()
    assert registry.get_path() == engine.SELECT_PATH
    with attention_backend("default") as cls:  # the explicit block wins while it lasts
        assert registry.get_path() == f"{cls.__module__}.{cls.__qualname__}"
    assert registry.get_path() == engine.SELECT_PATH
    register()  # idempotent
    assert registry.get_path() == engine.SELECT_PATH


def test_plugin_loaded_inside_an_attention_backend_block_takes_over_after_it(registry) -> None:  # noqa: ANN001
    from kvtier.vllm.engine import attention_backend
    from kvtier.vllm.plugin import register

    with attention_backend("default") as cls:
        register()  # vLLM loads plugins while the first engine is built: keeps the block's choice
        assert registry.get_path() == f"{cls.__module__}.{cls.__qualname__}"
    assert registry.get_path() == engine.SELECT_PATH


def test_entry_point_is_installed() -> None:
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvtier"]
    assert ep.value == "kvtier.vllm.plugin:register"


def test_serve_args_are_engine_kwargs_as_flags() -> None:
    args = serve_args("default")
    kw = engine.engine_kwargs("default")
    assert json.loads(args[args.index("--additional-config") + 1]) == kw["additional_config"]
    assert args[args.index("--block-size") + 1] == str(kw["block_size"])
    assert args[args.index("--max-num-seqs") + 1] == str(kw["max_num_seqs"])
    assert args[args.index("--attention-backend") + 1] == "CPU_ATTN"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vllm_serve_runs_on_packed_pages(model_path: str, book_ids: list[int], tmp_path) -> None:  # noqa: ANN001
    """A real ``vllm serve`` started by ``kvtier serve --pages default`` (engine core in a spawned
    process, no registration by this process, the flags of ``serve_args("default")``): its KV cache
    holds kvtier's packed capacity, and it serves the same greedy tokens as an in-process kvtier
    engine."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.vllm.engine import attention_backend, engine_kwargs

    port, log = _free_port(), tmp_path / "serve.log"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    # `kvtier serve` (kernels built first, then vLLM's OpenAI server module with serve_args's flags)
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", model_path, "--pages", "default", "--port", str(port)]
    cmd += ["--dtype", "bfloat16", "--max-model-len", "4608", "--seed", "0"]
    prompt = book_ids[:300]
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        body = {"model": model_path, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
        served = _post(f"http://127.0.0.1:{port}/v1/completions", body)["choices"][0]["text"]
    finally:
        server.terminate()
        server.wait(60)
    text = log.read_text()
    assert "kvtier serve: C++ kernel vllm_paged_cpu" in text and "--block-size 128" in text
    tokens = [int(m.replace(",", "")) for m in _kv_cache_sizes(text)]
    assert tokens, text[-3000:]
    with attention_backend("default"):
        llm = LLM(model=model_path, dtype="bfloat16", max_model_len=4608, enforce_eager=True, seed=0,
                  **engine_kwargs("default"))  # fmt: skip
    try:
        cfg = llm.llm_engine.vllm_config.cache_config
        assert tokens[-1] == cfg.num_gpu_blocks * cfg.block_size  # kvtier's packed capacity
        sp = SamplingParams(max_tokens=16, temperature=0.0)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        assert served == out.outputs[0].text
    finally:
        from vllm_helpers import close_llm

        close_llm(llm)


def _kv_cache_sizes(log: str) -> list[str]:
    import re

    return re.findall(r"KV cache size: ([\d,]+) tokens", log)
