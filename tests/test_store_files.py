"""The prefix store's block files on a folder that cannot be written (no vLLM needed).

A pre-filled, read-only cache volume must serve the blocks it holds, keep new blocks in RAM and
never leave a block pending (vLLM's scheduler would wait on it forever); a failed write is counted
and said once. Tested on a real read-only tmpfs where this process may mount one (root), and with
the file calls failing as a read-only file system fails them everywhere.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvtier.vllm.store.blocks import BlockFormat
from kvtier.vllm.store.policy import get_store_policy
from kvtier.vllm.store.prefix import PrefixStore

FMT = BlockFormat(layers=2, heads=2, tokens=16, head_dim=128, dtype=torch.bfloat16)


def block(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(FMT.shape, generator=g).to(FMT.dtype)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def store_blocks(store: PrefixStore, ids) -> None:
    for i in ids:
        for k in store.reserve([key(i)], [0]):
            store.put(k, block(i))


def prefill(folder: Path, ids) -> dict[int, torch.Tensor]:
    """Blocks written by one engine; returns what a load of each gives."""
    store = PrefixStore(get_store_policy("default"), FMT, cpu_bytes=1 << 22, disk_path=folder, namespace="ns")
    try:
        store_blocks(store, ids)
        return {i: store.read(key(i)).clone() for i in ids}
    finally:
        store.close()


def check_read_only_store(folder: Path, expected: dict[int, torch.Tensor], caplog) -> None:
    files = sorted(p.name for p in (folder / "ns").iterdir())
    caplog.clear()
    store = PrefixStore(get_store_policy("default"), FMT, cpu_bytes=1 << 22, disk_path=folder, namespace="ns")
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.vllm.store.prefix"):
            for i, kv in expected.items():  # the volume's blocks are served
                assert store.lookup(key(i)) == "hit"
                store.pin([key(i)])
                assert torch.equal(store.read(key(i)), kv)
                store.unpin([key(i)])
            store_blocks(store, range(10, 14))  # new prefixes: stored in RAM, never left pending
            assert [store.lookup(key(i)) for i in range(10, 14)] == ["hit"] * 4
            store.reset()  # removes nothing it cannot
        assert store.read_only
        said = [r for r in caplog.records if "read-only" in r.getMessage() or "cannot be written" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]  # once, not per block
        assert sorted(p.name for p in (folder / "ns").iterdir()) == files
    finally:
        store.close()


def test_read_only_volume_serves_its_blocks_and_keeps_new_ones_in_ram(tmp_path, caplog):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a read-only tmpfs needs root")
    mnt = tmp_path / "volume"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("this process may not mount a tmpfs")
    try:
        expected = prefill(mnt, range(3))
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True, capture_output=True)
        with pytest.raises(OSError):
            (mnt / "probe").write_bytes(b"")
        check_read_only_store(mnt, expected, caplog)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_writes_failing_as_on_a_read_only_file_system(tmp_path, monkeypatch, caplog):
    """Writable at construction, read-only from the first write on (a volume remounted read-only)."""
    expected = prefill(tmp_path, range(3))
    corrupt = tmp_path / "ns" / (key(2).hex() + ".kvb")
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 1
    corrupt.write_bytes(bytes(data))
    del expected[2]

    real_open, real_unlink = open, Path.unlink

    def ro_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
        return real_open(file, mode, *args, **kwargs)

    def ro_unlink(self, missing_ok=False):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr("builtins.open", ro_open)
    monkeypatch.setattr(Path, "unlink", ro_unlink)
    store = PrefixStore(get_store_policy("default"), FMT, cpu_bytes=1 << 22, disk_path=tmp_path, namespace="ns")
    try:
        assert not store.read_only
        assert store.lookup(key(2)) == "miss"  # a bad file is a miss even where it cannot be removed
    finally:
        store.close()
    monkeypatch.setattr(Path, "unlink", real_unlink)
    monkeypatch.setattr("builtins.open", real_open)
    corrupt.unlink()

    monkeypatch.setattr("builtins.open", ro_open)
    monkeypatch.setattr(Path, "unlink", ro_unlink)
    check_read_only_store(tmp_path, expected, caplog)


def test_a_failing_file_write_never_leaves_a_block_pending(tmp_path, monkeypatch):
    store = PrefixStore(get_store_policy("default"), FMT, cpu_bytes=1 << 22, disk_path=tmp_path, namespace="ns")

    def broken(*args, **kwargs):
        raise RuntimeError("disk driver fault")

    monkeypatch.setattr(store, "_write_file", broken)
    try:
        store_blocks(store, [1])
        assert store.lookup(key(1)) == "hit"  # in RAM
        assert store.stats()["disk_errors"] == 1
    finally:
        store.close()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.kvb"))


def record_size() -> int:
    return PrefixStore(get_store_policy("default"), FMT, cpu_bytes=1).record_bytes(0, 0)


def test_a_block_hit_from_disk_is_promoted_to_ram_where_the_budget_has_room(tmp_path):
    expected = prefill(tmp_path, range(2))
    store = PrefixStore(get_store_policy("default"), FMT, cpu_bytes=1 << 22, disk_path=tmp_path, namespace="ns")
    tight = PrefixStore(
        get_store_policy("default"), FMT, cpu_bytes=record_size() - 1, disk_path=tmp_path, namespace="ns"
    )
    try:
        for s in (store, tight):
            for _ in range(2):  # the second hit reads RAM where the first was promoted
                assert s.lookup(key(0)) == "hit"
                s.pin([key(0)])
                assert torch.equal(s.read(key(0)), expected[0])
                s.unpin([key(0)])
                s.maintain()
        assert store.stats()["disk_hits"] == 1 and store.stats()["disk_promoted"] == 1
        assert store.ram_bytes == record_size() and store.stats()["blocks"] == {"int4": 1}
        assert tight.stats()["disk_hits"] == 2 and "disk_promoted" not in tight.stats()  # no room: read each time
        assert tight.ram_bytes == 0
    finally:
        store.close()
        tight.close()


def test_disk_budget_removes_the_least_recently_used_files(tmp_path):
    size = record_size()
    budget = 5 * size + size // 2
    store = PrefixStore(
        get_store_policy("default"), FMT, cpu_bytes=1 << 22, disk_path=tmp_path, namespace="ns", disk_bytes=budget
    )
    folder = tmp_path / "ns"
    try:
        for i in range(5):
            store_blocks(store, [i])
            os.utime(store.path(key(i)), (1000 + i, 1000 + i))  # written in this order
        store.close()
        again = PrefixStore(
            get_store_policy("default"), FMT, cpu_bytes=1 << 22, disk_path=tmp_path, namespace="ns", disk_bytes=budget
        )
        assert again.lookup(key(0)) == "hit"  # a hit from disk makes block 0 the most recently used file
        for i in range(5, 8):
            store_blocks(again, [i])
            assert folder_bytes(folder) <= budget
        names = {p.name for p in folder.glob("*.kvb")}
        assert again.path(key(0)).name in names and again.path(key(1)).name not in names
        assert again.path(key(7)).name in names
        assert again.stats()["disk_evicted"] >= 3
        again.maintain()
        assert [again.lookup(key(i)) for i in (0, 1, 7)] == ["hit", "miss", "hit"]
        again.close()
    finally:
        store.close()


def test_disk_budget_holds_with_two_engines_sharing_the_folder(tmp_path):
    size = record_size()
    budget = 8 * size
    a, b = (
        PrefixStore(
            get_store_policy("default"), FMT, cpu_bytes=1 << 22, disk_path=tmp_path, namespace="ns", disk_bytes=budget
        )
        for _ in range(2)
    )
    try:
        worst = 0
        for i in range(40):  # a writes 3 blocks for each of b's
            store_blocks(b if i % 4 == 3 else a, [i])
            worst = max(worst, folder_bytes(tmp_path / "ns"))
        assert worst <= budget * (1 + 2 * 0.1) + 2 * size
        assert a.stats().get("disk_evicted", 0) + b.stats().get("disk_evicted", 0) >= 40 - 8
    finally:
        a.close()
        b.close()


def test_disk_budget_validation():
    from kvtier.vllm.store.config import StoreConfig

    with pytest.raises(ValueError, match=r"disk_bytes=0 is not allowed"):
        PrefixStore(get_store_policy("default"), FMT, cpu_bytes=1, disk_bytes=0)
    with pytest.raises(ValueError, match=r"disk_bytes is not allowed without disk_path"):
        StoreConfig("default", 1 << 20, None, 1 << 20)
    cfg = StoreConfig("default", 1 << 20, "/tmp/kv", 1 << 30)
    assert StoreConfig.from_extra(cfg.to_extra()) == cfg


def test_describe_says_codecs_capacity_and_the_folder(tmp_path):
    prefill(tmp_path, range(3))
    store = PrefixStore(
        get_store_policy("default"), FMT, cpu_bytes=1 << 20, disk_path=tmp_path, namespace="ns", disk_bytes=1 << 30
    )
    try:
        line = store.describe()
        ratio = store.record_bytes(0, 0) / FMT.exact_bytes
        assert "\n" not in line and "kvtier " in line
        assert f"4-bit ({ratio:.3f} of bfloat16), stepping down to 3-bit rotated" in line
        assert f"holds {(1 << 20) // store.record_bytes(0, 0) * FMT.tokens:,} tokens" in line
        assert "3 blocks found" in line and "budget 1.00 GiB" in line
    finally:
        store.close()
    assert PrefixStore(get_store_policy("exact"), FMT, cpu_bytes=1 << 20).describe().endswith("; no disk")
