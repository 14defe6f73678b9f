"""Transfer slots of the vLLM prefix store (``kvtier.vllm.store.slots``): a shared-memory file that
another process maps and writes, its pointer, its refusals, and the scheduler's slot bookkeeping.
No vLLM needed."""

import errno
import os
import subprocess
import sys

import pytest
import torch

from kvtier.errors import KVTierError
from kvtier.vllm.store.blocks import BlockFormat
from kvtier.vllm.store.slots import QUARANTINE_STEPS, SlotArea, SlotPool, pointer_path

FMT = BlockFormat(3, 2, 16, 8, torch.bfloat16)


def test_another_process_writes_a_slot_this_one_reads(tmp_path):
    area = SlotArea.create(FMT, 5 * FMT.exact_bytes + 7, {"pages": None}, directory=tmp_path)
    assert area.count == 5 and area.slot(4).shape == FMT.shape and area.slot(4).dtype == torch.bfloat16
    pointer = pointer_path(tmp_path, "engine/1 x")
    area.publish(pointer)
    assert pointer.parent == tmp_path and "/" not in pointer.name[len("kvtier-") :]
    code = (
        "import sys, torch\n"
        "from kvtier.vllm.store.slots import SlotArea\n"
        "a = SlotArea.open(sys.argv[1])\n"
        "a.slot(3)[:, 1].fill_(2.5)\n"  # rank 1's head of every layer
        "print(a.count, a.info)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(pointer)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "5" and "pages" in out.stdout
    assert area.slot(3)[:, 1].eq(2.5).all() and area.slot(3)[:, 0].eq(0).all() and area.slot(2).eq(0).all()
    SlotArea.unlink(pointer, area.path)
    assert not pointer.exists() and not area.path.exists()
    area.slot(0).fill_(1)  # the mapping outlives the names
    assert area.slot(0).eq(1).all()


def test_refusals_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(KVTierError, match="at least two blocks"):
        SlotArea.create(FMT, FMT.exact_bytes, {}, directory=tmp_path)
    with pytest.raises(KVTierError, match="found no transfer area"):
        SlotArea.open(tmp_path / "kvtier-nothing.slots")
    bad = tmp_path / "kvtier-bad.slots"
    bad.write_bytes(b"{}" + bytes(100))
    with pytest.raises(KVTierError, match="not one kvtier wrote"):
        SlotArea.open(bad)

    def full(fd, offset, size):  # noqa: ANN001
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(KVTierError, match="shm-size") as err:
        SlotArea.create(FMT, 4 * FMT.exact_bytes, {}, directory=tmp_path)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.glob("kvtier-slots-*"))  # nothing left behind


def test_files_of_dead_creators_and_dangling_pointers_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"kvtier-slots-{int(dead.stdout)}-abc123.slots"
    stale.write_bytes(b"x")
    dangling = tmp_path / "kvtier-old-engine.slots"
    os.symlink(tmp_path / "gone", dangling)
    live = SlotArea.create(FMT, 2 * FMT.exact_bytes, {}, directory=tmp_path)
    assert not stale.exists() and not os.path.lexists(dangling) and live.path.exists()
    SlotArea.create(FMT, 2 * FMT.exact_bytes, {}, directory=tmp_path)
    assert live.path.exists()  # this process is alive


def test_pool_promises_loads_reserve_and_quarantine():
    pool = SlotPool(6)
    stores = pool.take_store(10)
    assert len(stores) == 3  # half is held back for loads
    assert [pool.promise() for _ in range(4)] == [True, True, True, False]  # 3 free: the 4th hit is a miss
    assert pool.take_store(1) == []  # promised slots are not the stores'
    loads = [pool.take_load() for _ in range(3)]
    assert pool.free == 0 and len(set(loads + stores)) == 6
    with pytest.raises(KVTierError, match="no transfer slot"):
        pool.take_load()
    pool.end_step()
    pool.release(loads)
    pool.retire(stores)  # a reset discarded their jobs
    for _ in range(QUARANTINE_STEPS - 1):
        pool.end_step()
        assert pool.free == 3
    pool.end_step()
    assert pool.free == 6
    assert pool.promise() and pool.promise()
    pool.end_step()  # promises lapse with the step
    assert len(pool.take_store(6)) == 3
