"""Offload directories left behind by dead processes (issue 33, item 7), and ``OffloadPolicy(path="")``.

A disk offloader keeps an ``flock``-ed owner lock file in its private ``kvtier-*`` directory; a
process killed with ``SIGKILL`` leaves the directory but the kernel drops its lock, so the next
offloader created in the same parent directory removes it. Live owners' directories, directories
without the lock file, symbolic links and other entries are left alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.offload import prefetch
from kvtier.offload.prefetch import Offloader
from kvtier.offload.store import BlockStore, OffloadError, check_directory
from kvtier.policy import OffloadPolicy

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="owner locks need POSIX flock")

#: The owner lock file in each private directory (``kvtier.offload.prefetch.OWNER_LOCK``).
OWNER_LOCK = "owner.lock"

#: A child that makes a disk offloader in argv[1], writes a few records there, prints its private
#: directory and waits to be killed.
CHILD = """
import sys, time
import torch
from kvtier.offload.prefetch import Offloader
from kvtier.offload.store import BlockStore
from kvtier.policy import OffloadPolicy
policy = OffloadPolicy(backend="disk", path=sys.argv[1])
off = Offloader([policy])
store = BlockStore(64, "disk", off.directory(policy), name="t")
store.put(torch.zeros(4, 64, dtype=torch.uint8))
print(off.directories[0], flush=True)
time.sleep(600)
"""


@pytest.fixture
def children():
    """Start children with ``spawn(parent)`` -> (process, its private directory); all are killed at the end."""
    procs: list[subprocess.Popen] = []

    def spawn(parent: Path) -> tuple[subprocess.Popen, Path]:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(parent)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        procs.append(proc)
        line = proc.stdout.readline().strip()
        assert line, f"the child failed: {proc.communicate(timeout=60)[1]}"
        return proc, Path(line)

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def disk(path: Path) -> OffloadPolicy:
    return OffloadPolicy(backend="disk", path=str(path))


def orphan(parent: Path, name: str = "kvtier-dead") -> Path:
    """A private directory as a dead process leaves it: a slab file and an unlocked owner lock file."""
    d = parent / name
    d.mkdir()
    (d / OWNER_LOCK).write_text("12345\n")
    (d / "t-0000.kv").write_bytes(bytes(64))
    return d


def test_directory_of_a_killed_process_is_removed_by_the_next_offloader(tmp_path, children):
    proc, dead = children(tmp_path)
    assert (dead / "t-0000.kv").is_file()
    kill9(proc)
    assert dead.is_dir()  # SIGKILL runs no cleanup: the files stay

    off = Offloader([disk(tmp_path)])
    try:
        assert not dead.exists()
        assert [p.name for p in tmp_path.iterdir()] == [Path(off.directories[0]).name]
    finally:
        off.close()
    assert list(tmp_path.iterdir()) == []


def test_directory_of_a_live_process_is_left_alone(tmp_path, children):
    proc, live = children(tmp_path)
    off = Offloader([disk(tmp_path)])
    try:
        assert (live / OWNER_LOCK).is_file() and (live / "t-0000.kv").is_file()
        assert prefetch.reclaim_orphans(str(tmp_path)) == []
        kill9(proc)
        assert prefetch.reclaim_orphans(str(tmp_path)) == [str(live)]
        assert [p.name for p in tmp_path.iterdir()] == [Path(off.directories[0]).name]
    finally:
        off.close()


def test_a_second_offloader_in_the_same_process_keeps_the_first_ones_directory(tmp_path):
    first = Offloader([disk(tmp_path)])
    second = Offloader([disk(tmp_path)])
    try:
        assert {p.name for p in tmp_path.iterdir()} == {Path(o.directories[0]).name for o in (first, second)}
        assert Path(first.directories[0]).name.startswith(f"kvtier-{os.getpid()}-")  # the owner's pid, for humans
        assert (Path(first.directories[0]) / OWNER_LOCK).stat().st_size == 0  # no page of a small tmpfs
    finally:
        first.close()
        second.close()
    assert list(tmp_path.iterdir()) == []


def test_entries_that_are_not_dead_kvtier_directories_are_left_alone(tmp_path):
    nolock = tmp_path / "kvtier-nolock"  # no owner lock: not ours (or an older kvtier's): keep
    nolock.mkdir()
    (nolock / "t-0000.kv").write_bytes(bytes(64))
    other = orphan(tmp_path, "other-dir")  # looks dead, but not a kvtier- name
    (tmp_path / "elsewhere").mkdir()
    target = orphan(tmp_path / "elsewhere", "kvtier-target")  # looks dead, reached only through a link
    (tmp_path / "kvtier-link").symlink_to(target, target_is_directory=True)  # never followed
    (tmp_path / "kvtier-file").write_text("x")
    dead = orphan(tmp_path)

    off = Offloader([disk(tmp_path)])
    try:
        assert not dead.exists()
        assert (nolock / "t-0000.kv").is_file()
        assert (other / OWNER_LOCK).is_file()
        assert (target / OWNER_LOCK).is_file() and (tmp_path / "kvtier-link").is_symlink()
        assert (tmp_path / "kvtier-file").is_file()
    finally:
        off.close()


def test_reclaim_tolerates_vanished_entries_and_never_raises(tmp_path, monkeypatch):
    dead = orphan(tmp_path)
    assert prefetch.reclaim_orphans(str(tmp_path)) == [str(dead)]
    assert prefetch.reclaim_orphans(str(tmp_path)) == []  # a second (concurrent) reclaimer finds nothing
    assert prefetch.reclaim_orphans(str(tmp_path / "missing")) == []

    dead = orphan(tmp_path)
    monkeypatch.setattr("kvtier.offload.prefetch.shutil.rmtree", lambda path, ignore_errors=False: None)
    with pytest.warns(UserWarning, match="could not remove 1 offload directory left by a process that is gone"):
        assert prefetch.reclaim_orphans(str(tmp_path)) == []
    assert dead.is_dir()


@pytest.mark.parametrize("path", ["", "   "])
def test_empty_offload_path_is_refused_not_read_as_the_current_directory(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"path='\s*' is not allowed: expected a directory path \(a non-empty str\)"):
        OffloadPolicy(backend="disk", path=path)
    with pytest.raises(OffloadError, match="is not allowed: name a directory"):
        check_directory(path)
    with pytest.raises(OffloadError, match="is not allowed: name a directory"):
        BlockStore(64, "disk", path)
    with pytest.raises(OffloadError, match="is not allowed: name a directory"):
        BlockStore(64, "disk")
    assert list(tmp_path.iterdir()) == []
    store = BlockStore(64, "disk", str(tmp_path))  # a named directory still works
    store.put(torch.zeros(1, 64, dtype=torch.uint8))
    store.close()
