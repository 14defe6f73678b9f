"""The prefix store's remote tier against a real redis-server (no vLLM needed).

Two stores on one server stand for two engines (the two-process vLLM test is
``tests/vllm/test_vllm_shared.py``): a block one stored is a checked hit for the other; another
namespace, a wrong password, a wrong or missing key, a tampered or garbage record are misses with
one warning; a server killed, slow or full never raises and never stalls a lookup past its timeout;
hits resume when it is back.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

from kvtier.errors import KVTierError
from kvtier.vllm.store import remote as remote_mod
from kvtier.vllm.store.blocks import BlockFormat
from kvtier.vllm.store.config import StoreConfig
from kvtier.vllm.store.policy import get_store_policy
from kvtier.vllm.store.prefix import PrefixStore
from kvtier.vllm.store.remote import RemoteTier, load_key, redact, split_sizes
from redis_server import RedisServer, redis_server  # noqa: F401

FMT = BlockFormat(layers=2, heads=2, tokens=16, head_dim=128, dtype=torch.bfloat16)
KEY1, KEY2 = "11" * 32, "22" * 32
LOGGERS = ("kvtier.vllm.store.remote", "kvtier.vllm.store.prefix")


def block(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(FMT.shape, generator=g).to(FMT.dtype)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def make_store(url: str, namespace: str = "ns", *, key_hex: str | None = None, disk=None, **kw) -> PrefixStore:  # noqa: ANN001
    tier = RemoteTier(url, namespace, key=None if key_hex is None else bytes.fromhex(key_hex), **kw)
    return PrefixStore(
        get_store_policy("default"), FMT, cpu_bytes=1 << 22, disk_path=disk, namespace=namespace, remote=tier
    )


def store_blocks(store: PrefixStore, ids) -> dict[int, torch.Tensor]:  # noqa: ANN001
    for i in ids:
        for k in store.reserve([key(i)], [0]):
            store.put(k, block(i))
    store.flush()
    return {i: store.read(key(i)).clone() for i in ids}


def load(store: PrefixStore, i: int) -> torch.Tensor | None:
    if store.lookup(key(i)) != "hit":
        return None
    store.pin([key(i)])
    try:
        return store.read(key(i)).clone()
    finally:
        store.unpin([key(i)])


def warnings(caplog, text: str) -> int:  # noqa: ANN001
    return sum(text in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def raw(r, store: PrefixStore, i: int) -> bytes:  # noqa: ANN001
    """The value stored for block ``i`` (its parts joined)."""
    return b"".join(v for v in r.mget(store.remote.part_names(store.remote.name(key(i)))) if v is not None)


def put_raw(r, store: PrefixStore, i: int, value: bytes) -> None:  # noqa: ANN001
    first, *rest = store.remote.part_names(store.remote.name(key(i)))
    r.delete(*rest)
    r.set(first, value)


@pytest.fixture(autouse=True)
def _loud(caplog):  # noqa: ANN001, ANN202
    for name in LOGGERS:
        caplog.set_level(logging.INFO, logger=name)


def test_a_block_one_engine_stored_is_a_checked_hit_for_another(redis_server):  # noqa: F811, ANN001
    a, b = make_store(redis_server.url), make_store(redis_server.url)
    try:
        expected = store_blocks(a, range(3))
        assert a.counters["remote_writes"] == 3
        for i, kv in expected.items():
            assert torch.equal(load(b, i), kv)  # the same bytes decode to the same tensor
        assert (b.counters["remote_hits"], b.counters["remote_promoted"]) == (3, 3)
        assert load(b, 0) is not None and b.counters["remote_hits"] == 3  # promoted: the second hit reads RAM
        assert load(b, 99) is None and b.counters["remote_misses"] == 1
        other = make_store(redis_server.url, "another-model")  # another namespace never reads these records
        assert load(other, 0) is None
        other.close()
        assert "127.0.0.1" in b.describe() and "not sealed" in b.describe()
    finally:
        a.close()
        b.close()


def test_order_ram_then_disk_then_remote(redis_server, tmp_path):  # noqa: F811, ANN001
    a = make_store(redis_server.url, disk=tmp_path / "a")
    b = make_store(redis_server.url, disk=tmp_path / "b")
    try:
        expected = store_blocks(a, [1])
        redis_server.client().flushall()  # the pool lost it: a's own disk still has it
        a2 = make_store(redis_server.url, disk=tmp_path / "a")
        assert torch.equal(load(a2, 1), expected[1]) and a2.counters["disk_hits"] == 1
        a2.close()
        assert load(b, 1) is None  # b has no file and the pool is empty
    finally:
        a.close()
        b.close()


def test_records_in_redis_are_the_stores_records_with_a_ttl(redis_server):  # noqa: F811, ANN001
    a = make_store(redis_server.url, ttl=100)
    try:
        store_blocks(a, [5])
        r = redis_server.client()
        record = a._entries[key(5)].record.numpy().tobytes()
        names = sorted(r.keys("kvtier:ns:*"))
        assert names == a.remote.part_names(a.remote.name(key(5)))[: len(split_sizes(len(record)))]
        assert raw(r, a, 5) == record
        assert [r.strlen(n) for n in names] == split_sizes(len(record))
        assert all(0 < r.ttl(n) <= 100 for n in names)
    finally:
        a.close()


def test_sealed_records_open_only_with_their_key(redis_server, caplog):  # noqa: F811, ANN001
    a = make_store(redis_server.url, key_hex=KEY1)
    try:
        expected = store_blocks(a, range(4))
        r = redis_server.client()
        assert a._entries[key(0)].record.numpy().tobytes()[64:4096] not in raw(r, a, 0)  # not readable in Redis
        same = make_store(redis_server.url, key_hex=KEY1)
        assert torch.equal(load(same, 0), expected[0])
        same.close()
        for other in (KEY2, None):  # another key, or none: misses, one warning each, never an error
            caplog.clear()
            c = make_store(redis_server.url, key_hex=other)
            assert [load(c, i) for i in range(4)] == [None] * 4
            assert c.counters["remote_rejected"] == 4
            assert warnings(caplog, "a miss") == 1
            c.close()
        # tampered: one byte of the ciphertext flipped, or the record moved under another block's key
        value = bytearray(raw(r, a, 1))
        value[-40] ^= 1
        put_raw(r, a, 1, bytes(value))
        put_raw(r, a, 2, raw(r, a, 3))
        d = make_store(redis_server.url, key_hex=KEY1)
        assert load(d, 1) is None and load(d, 2) is None and torch.equal(load(d, 3), expected[3])
        assert d.counters["remote_rejected"] == 2
        d.close()
    finally:
        a.close()


def test_garbage_and_damaged_plain_records_are_misses(redis_server, caplog):  # noqa: F811, ANN001
    a = make_store(redis_server.url)
    try:
        store_blocks(a, range(4))
        r = redis_server.client()
        value = bytearray(raw(r, a, 0))
        value[100] ^= 0xFF
        put_raw(r, a, 0, bytes(value))  # crc32 fails
        put_raw(r, a, 1, b"not a record")
        r.delete(a.remote.part_names(a.remote.name(key(2)))[1])  # a part evicted by Redis
        b = make_store(redis_server.url)
        assert load(b, 0) is None and load(b, 1) is None and load(b, 2) is None and load(b, 3) is not None
        assert b.counters["remote_rejected"] == 3 and warnings(caplog, "fails its checks") == 1
        b.close()
    finally:
        a.close()


def test_a_wrong_password_is_a_miss_said_once_and_never_logged(tmp_path, caplog, monkeypatch):  # noqa: ANN001
    server = RedisServer(tmp_path, "--requirepass", "s3cret-pw")
    try:
        wrong = server.url.replace("redis://", "redis://:wrong-pw@")
        a = make_store(wrong)
        for i in range(3):
            for k in a.reserve([key(i)], [0]):
                a.put(k, block(i))
        a.flush()
        assert [load(a, 100 + i) for i in range(5)] == [None] * 5  # also after RETRY_S: misses, no error
        assert warnings(caplog, "refused the credentials") == 1
        text = caplog.text + a.describe()
        assert "wrong-pw" not in text and ":***@" in text
        a.close()
        monkeypatch.setenv(remote_mod.PASSWORD_ENV, "s3cret-pw")  # the password from the environment
        b, c = make_store(server.url), make_store(server.url)
        expected = store_blocks(b, [7])
        assert torch.equal(load(c, 7), expected[7])
        assert "s3cret-pw" not in caplog.text
        b.close()
        c.close()
    finally:
        server.kill()


def test_killed_mid_run_then_restarted_hits_resume(redis_server, caplog, monkeypatch):  # noqa: F811, ANN001
    monkeypatch.setattr(remote_mod, "RETRY_S", 0.2)
    a, b = make_store(redis_server.url), make_store(redis_server.url)
    try:
        store_blocks(a, [1])
        redis_server.kill()
        store_blocks(a, [2, 3])  # stores go on: RAM only
        assert [load(b, i) for i in (1, 2, 3)] == [None] * 3
        assert warnings(caplog, "cannot be reached") >= 1
        said = warnings(caplog, "cannot be reached")
        assert [load(b, i) for i in (1, 2, 3)] == [None] * 3 and warnings(caplog, "cannot be reached") == said
        redis_server.start()  # empty (no persistence): new blocks go to the pool again
        time.sleep(0.3)
        expected = store_blocks(a, [4])
        time.sleep(0.3)
        expected = store_blocks(a, [5]) | expected
        got = load(b, 5)
        assert got is not None and torch.equal(got, expected[5])
        assert warnings(caplog, "is back") >= 1
        assert a.counters["remote_errors"] >= 1 and b.counters["remote_errors"] >= 1
    finally:
        a.close()
        b.close()


def test_down_at_start_serves_local_tiers(tmp_path, caplog):  # noqa: ANN001
    from redis_server import free_port, need_redis

    need_redis()
    a = make_store(f"redis://127.0.0.1:{free_port()}/0", disk=tmp_path)
    try:
        expected = store_blocks(a, [1])
        assert torch.equal(load(a, 1), expected[1])
        assert load(a, 2) is None
        assert "cannot be reached" in a.describe() or a.remote.state == "down"
        assert warnings(caplog, "cannot be reached") == 1
    finally:
        a.close()


def test_a_slow_server_costs_a_lookup_its_timeout_not_the_stall(tmp_path):  # noqa: ANN001
    server = RedisServer(tmp_path, "--enable-debug-command", "local")
    a = make_store(server.url, timeout=0.2)
    b = make_store(server.url, timeout=0.2)
    try:
        store_blocks(a, [1])
        sleeper = threading.Thread(target=lambda: server.client().execute_command("DEBUG", "SLEEP", 3))
        sleeper.start()
        time.sleep(0.2)
        assert load(b, 1) is None  # timed out, a miss ...
        assert sleeper.is_alive()  # ... returned while the server still stalls
        assert b.counters["remote_errors"] == 1
        sleeper.join()
    finally:
        a.close()
        b.close()
        server.kill()


def test_a_full_server_refuses_writes_reads_go_on(tmp_path, caplog):  # noqa: ANN001
    server = RedisServer(tmp_path, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    try:
        a = make_store(server.url)
        store_blocks(a, range(40))  # records of ~5 KiB: all fit
        server.client().config_set("maxmemory", "1")  # now full: every write is refused
        store_blocks(a, range(40, 44))
        assert a.counters["remote_errors"] >= 1 and warnings(caplog, "is full") == 1
        b = make_store(server.url)
        assert load(b, 0) is not None and load(b, 43) is None
        a.close()
        b.close()
    finally:
        server.kill()


def test_tls(tmp_path):  # noqa: ANN001
    from redis_server import need_redis

    need_redis()
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make the test's certificate")
    ca, crt, pem = tmp_path / "ca.crt", tmp_path / "server.crt", tmp_path / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(pem), "-out", str(crt)],
        check=True, capture_output=True,
    )  # fmt: skip
    ca.write_bytes(crt.read_bytes())
    server = RedisServer(
        tmp_path, "--tls-cert-file", str(crt), "--tls-key-file", str(pem), "--tls-ca-cert-file", str(ca),
        "--tls-auth-clients", "no", tls=True,
    )  # fmt: skip
    try:
        url = server.url + f"?ssl_ca_certs={ca}"
        a, b = make_store(url), make_store(url)
        expected = store_blocks(a, [3])
        assert torch.equal(load(b, 3), expected[3])
        plain = make_store(server.url.replace("rediss://", "redis://"))  # a plain client gets nothing
        assert load(plain, 3) is None
        for s in (a, b, plain):
            s.close()
    finally:
        server.kill()


def test_config_checks_and_keys(tmp_path, monkeypatch):  # noqa: ANN001
    for bad in ("http://x", "redis://", 5):
        with pytest.raises(ValueError, match="remote="):
            StoreConfig(remote=bad)
    with pytest.raises(ValueError, match="without remote"):
        StoreConfig(remote_ttl=10)
    with pytest.raises(ValueError, match="never the key itself"):
        StoreConfig(remote="redis://h:1/0", remote_key=KEY1)
    with pytest.raises(ValueError, match="remote_timeout"):
        StoreConfig(remote="redis://h:1/0", remote_timeout=0)
    cfg = StoreConfig(remote="redis://u:pw@h:1/0", remote_ttl=60, remote_key="env:K")
    assert StoreConfig.from_extra(cfg.to_extra()) == cfg
    monkeypatch.setenv("K", KEY1)
    assert load_key("env:K") == bytes.fromhex(KEY1)
    (tmp_path / "k").write_text("ESIiM0RVZneImaq7zN3u/wARIjNEVWZ3iJmqu8zd7v8=\n")
    assert len(load_key(f"file:{tmp_path / 'k'}")) == 32
    with pytest.raises(KVTierError, match="not set"):
        load_key("env:NOT_SET_ANYWHERE")
    with pytest.raises(KVTierError, match="cannot be read"):
        load_key(f"file:{tmp_path / 'missing'}")
    (tmp_path / "short").write_text("abcd")
    with pytest.raises(KVTierError, match="32-byte"):
        load_key(f"file:{tmp_path / 'short'}")
    assert redact("redis://user:pw@host:1/0") == "redis://user:***@host:1/0"
    assert "pw" not in str(os.environ.get("KVTIER_REDIS_PASSWORD", ""))


def test_records_split_at_the_allocators_size_classes():
    for n in [1, 100, 4086, 4087, 5000, 645_168, 806_448, 1_543_728, 3 << 20, 10**7 + 1]:
        sizes = split_sizes(n)
        assert sum(sizes) == n and 1 <= len(sizes) <= remote_mod.MAX_PARTS and min(sizes) > 0
        for size in sizes[:-1]:  # every part but the last fills a jemalloc size class (4 per doubling)
            total = size + 10
            step = (1 << (total.bit_length() - 1)) >> 2
            assert total % step == 0
