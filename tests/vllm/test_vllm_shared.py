"""Two vLLM engines in two processes sharing one real redis-server (issue 37's acceptance).

Engine A computes ~3k-token prefixes; engine B (another process, its own empty RAM, no disk)
takes them from the pool: ``exact`` greedy tokens identical to B's own recompute; ``default``'s
teacher-forced NLL of the next 64 tokens within +0.05 nats/token of B's own exact prefix (mean of
three windows); a request salted for another tenant never hits; the pool holds ``default``'s
records at <= 0.32 of the bf16 KV bytes. Server faults, keys and passwords are tested without vLLM
in ``tests/test_store_remote.py``.
"""

import pytest

# "vllm.v1", not "vllm": without vLLM, tests/vllm itself would import as a namespace package "vllm"
pytest.importorskip("vllm.v1")

from vllm_helpers import BLOCK, PREFIX, run_child  # noqa: E402

from redis_server import RedisServer  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("redis"))
    yield s
    s.kill()


def both(model_path: str, url: str, policy: str, windows: list[list[int]]) -> dict:
    job = {"model": model_path, "remote": url, "policy": policy, "windows": windows}
    a = run_child("shared_child.py", {**job, "role": "a"})
    assert a["stats"]["remote_writes"] == a["stats"]["stored"] >= (len(windows) + 1) * (PREFIX // BLOCK), a
    return run_child("shared_child.py", {**job, "role": "b"})


def test_exact_blocks_from_another_engine_give_its_own_greedy_tokens(model_path, book_ids, server):
    windows = [book_ids[1000 : 1000 + PREFIX + 65]]
    b = both(model_path, server.url, "exact", windows)
    tokens, cached = b["greedy"]
    assert cached >= 2048, b["stats"]
    assert tokens == b["recomputed"]
    assert b["stats"]["remote_hits"] >= 2048 // BLOCK
    assert b["salted"] == {"tenant-a": PREFIX, "tenant-b": 0}  # A's salted blocks serve tenant-a only


def test_default_blocks_from_another_engine_nll_and_bytes(model_path, book_ids, server):
    windows = [book_ids[s : s + PREFIX + 65] for s in (1000, 9000, 17000)]
    before = server.used_memory()
    keys_before = len(server.client().keys("kvtier:*:0"))  # a record's first part
    b = both(model_path, server.url, "default", windows)
    assert [(c, own) for _, c, _, own in b["nll"]] == [(PREFIX, PREFIX)] * 3, b["stats"]
    delta = sum(hit - exact for hit, _, exact, _ in b["nll"]) / 3
    assert delta <= 0.05, b["nll"]
    assert b["salted"]["tenant-b"] == 0
    # bytes in Redis per stored token vs bf16 KV: SmolLM2 = 30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes
    stored = len(server.client().keys("kvtier:*:0")) - keys_before
    assert stored == 4 * PREFIX // BLOCK  # three windows + the salted copy of the first
    bf16 = stored * BLOCK * 30 * 3 * 64 * 2 * 2
    assert (server.used_memory() - before) <= 0.32 * bf16


def test_redis_killed_mid_run_no_request_fails_writes_resume(model_path, book_ids, tmp_path):
    import os
    import signal

    server = RedisServer(tmp_path)
    windows = [book_ids[s : s + PREFIX + 65] for s in (30_000, 34_000, 38_000)]
    job = {"model": model_path, "remote": server.url, "policy": "default", "windows": windows}
    try:
        b = run_child(
            "shared_child.py", {**job, "role": "fault", "redis_pid": server.proc.pid, "redis_argv": server.argv}
        )
    finally:
        server.kill()
    try:
        assert [len(tokens) for tokens, _ in b["down"]] == [4, 4] and len(b["up"][0]) == 4  # every request served
        assert b["errors_down"] >= 1, b["stats"]
        assert b["writes_up"] >= PREFIX // BLOCK  # the third prefix reached the restarted server
        assert len(server.client().keys("kvtier:*:0")) >= PREFIX // BLOCK
    finally:
        os.kill(b["redis_pid"], signal.SIGKILL)
