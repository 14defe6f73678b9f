"""``kvtier serve`` with the prefix store: a real OpenAI server started by the command (kernels,
flags and environment from :func:`kvtier.vllm.serve.plan_serve`) serves completions, and its
``/metrics`` carry kvtier's store series, moving after requests. (``kvtier serve --pages`` is
started in test_vllm_plugin.py, against an in-process engine's tokens.)"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm.v1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode()


def _series(metrics: str, name: str) -> float:
    """Sum of the samples of ``vllm:kvtier_store_<name>`` (a counter's ``_total`` included)."""
    pattern = rf"^vllm:kvtier_store_{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$"
    values = [float(v) for v in re.findall(pattern, metrics, flags=re.M)]
    assert values, f"no vllm:kvtier_store_{name} series in /metrics"
    return sum(values)


def test_kvtier_serve_store_serves_and_exports_its_metrics(model_path: str, book_ids: list[int], tmp_path) -> None:  # noqa: ANN001
    port, log = _free_port(), tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", model_path, "--store", "default", "--cpu-bytes", "1G"]
    cmd += ["--disk", str(tmp_path / "blocks"), "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4608"]
    cmd += ["--seed", "0"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # kvtier serve sets it
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 400
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                _get(f"{base}/health")
                break
            except OSError:
                time.sleep(2)
        before = _get(f"{base}/metrics")  # declared at start; a series has samples from its first report
        assert "# TYPE vllm:kvtier_store_blocks_stored_total counter" in before
        assert "# TYPE vllm:kvtier_store_ram_bytes gauge" in before
        assert not re.search(r"^vllm:kvtier_store_blocks_stored_total\{", before, flags=re.M)
        from openai import OpenAI  # a vLLM dependency: the client the README shows

        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        for n in (1100, 1300):  # the second request's step submits the first one's stores
            done = client.completions.create(model=model_path, prompt=book_ids[:n], max_tokens=4, temperature=0.0)
            assert done.choices[0].text
        deadline = time.monotonic() + 60
        while "vllm:kvtier_store_blocks_stored_total{" not in _get(f"{base}/metrics"):  # the store's thread
            assert time.monotonic() < deadline, "no block stored 60 s after two requests"
            time.sleep(1)
        after = _get(f"{base}/metrics")
        assert _series(after, "blocks_stored") >= 8  # 1,100 tokens: 8 full blocks of 128
        assert _series(after, "lookup_misses") > 0
        assert _series(after, "ram_bytes") > 0
        assert _series(after, "disk_bytes_written") > 0
    finally:
        server.terminate()
        server.wait(60)
    text = log.read_text()
    assert "kvtier serve: vLLM's OpenAI server with prefix store (default" in text
    assert "kvtier" in text and "prefix store: blocks of" in text, text[-3000:]  # the store's startup line
