"""Offload faults (issue 13): a truncated block file raises a kvtier error instead of SIGBUS, a full
disk raises OffloadError and changes nothing, ``OffloadTier.push`` is all or nothing, offloading
caches refuse copy and pickle, nothing stays on disk after any exit, and no worker thread after close.

Tests that could kill the interpreter with a signal if a fix regressed run in a subprocess, so a
regression fails the test instead of pytest.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import gc
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import kvtier
from builders import off_policy, offload_layer, token_ids
from kvtier import OffloadError, TieredCache
from kvtier.offload.records import RecordLayout
from kvtier.offload.sketch import KeySketch
from kvtier.offload.store import COPY_ERROR, BlockStore, slab_sizes

TESTS = Path(__file__).resolve().parent
PRESETS = ("offload-cpu", "offload-disk")


def preset(name: str, path) -> kvtier.TierPolicy:  # noqa: ANN001 - str or Path
    """A preset with its disk store under ``path`` (the host-RAM preset unchanged)."""
    pol = kvtier.get_policy(name)
    if pol.offload.backend != "disk":
        return pol
    return dataclasses.replace(pol, offload=dataclasses.replace(pol.offload, path=str(path)))


def run_isolated(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh interpreter (tests/ importable): a signal kills it, not pytest."""
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=900, check=False
    )


def assert_no_signal(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode != -signal.SIGBUS, f"killed by SIGBUS; stderr: {proc.stderr[-2000:]}"
    assert proc.returncode == 0, f"exit status {proc.returncode}; stderr: {proc.stderr[-2000:]}"


def prefetch_threads() -> set[threading.Thread]:
    names = ("kvtier-prefetch", "kvtier-readahead")
    return {t for t in threading.enumerate() if t.name.startswith(names) and t.is_alive()}


def tier_state(cache: TieredCache) -> list[tuple]:
    """What a failed call must leave unchanged in each offloading tier: fields, table, live records."""
    out = []
    for layer in cache.tiered_layers:
        tier = layer.cold
        fields = {name: t.clone() for name, t in tier.fields.items()}
        table = None if tier.table is None else tier.table.clone()
        out.append((layer.seen, fields, table, tier.store.live))
    return out


def assert_same_state(a: list[tuple], b: list[tuple]) -> None:
    for (seen_a, fields_a, table_a, live_a), (seen_b, fields_b, table_b, live_b) in zip(a, b, strict=True):
        assert seen_a == seen_b and live_a == live_b
        assert fields_a.keys() == fields_b.keys() and all(torch.equal(fields_a[n], fields_b[n]) for n in fields_a)
        assert (table_a is None and table_b is None) or torch.equal(table_a, table_b)


def greedy(model, cache: TieredCache, logits: torch.Tensor, steps: int = 6) -> torch.Tensor:
    """``steps`` greedy tokens continuing from ``logits`` (the last call's): ``[B, steps]``."""
    toks = []
    tok = logits[:, -1:].argmax(-1)
    for _ in range(steps):
        toks.append(tok)
        tok = model(tok, cache=cache).logits[:, -1:].argmax(-1)
    return torch.cat(toks, 1)


# --- 1. a truncated block file: a kvtier error naming the file, never SIGBUS --------------------------
STORE_TRUNCATED = r"""
import os, sys, torch
from kvtier.offload.store import BlockStore, OffloadError, RecordError

store = BlockStore(4096, "disk", sys.argv[1], name="t")
ids = store.allocate(40)  # slabs of 16 records: 64 KiB files, several pages each
data = torch.arange(40 * 4096).remainder(251).to(torch.uint8).reshape(40, 4096)
store.write(ids, data)
os.truncate(store.files()[1], 0)  # records 16..31: their mapped pages are backed by nothing now
print("FILE", store.files()[1])
for what, call in [
    ("read", lambda: store.read(ids)),
    ("write", lambda: store.write(ids[16:18], data[:2])),
    ("drop", store.drop_page_cache),
]:
    try:
        call()
        print(what, "NO ERROR")
    except RecordError as err:
        print(what, "RecordError", err.records[0], err.records[-1], err)
    except OffloadError as err:
        print(what, "OffloadError", err)
print("intact", torch.equal(store.read(ids[:16]), data[:16]), torch.equal(store.read(ids[32:]), data[32:]))
store.close()
"""


def test_truncated_store_file_raises_record_error_not_sigbus(tmp_path):
    proc = run_isolated(STORE_TRUNCATED, str(tmp_path))
    assert_no_signal(proc)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    path = lines["FILE"]
    assert lines["read"].startswith("RecordError 16 31 record(s) [16, 17, ")
    assert f"offload file {path!r} was truncated to 0 of 65536 bytes" in lines["read"]
    assert lines["write"].startswith("OffloadError cannot write 2 record(s)") and path in lines["write"]
    assert lines["drop"].startswith("OffloadError") and path in lines["drop"]
    assert lines["intact"] == "True True"  # the other slabs still read back
    assert list(tmp_path.iterdir()) == []


GENERATE_TRUNCATED = r"""
import dataclasses, os, sys
import torch
import kvtier
from conftest import tiny_llama

directory, mode = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
model = tiny_llama()
policy = kvtier.get_policy("offload-disk")
policy = dataclasses.replace(policy, offload=dataclasses.replace(policy.offload, path=directory))
cache = kvtier.TieredCache(model.config, policy)
ids = torch.randint(3, 97, (1, 300), generator=torch.Generator().manual_seed(0))
with kvtier.enable(model):
    out = model.generate(input_ids=ids, cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.layers[1].cold.nblocks > 0
    path = cache.layers[1].cold.store.files()[0]
    os.truncate(path, 0)
    print("FILE", path, flush=True)
    for attempt in range(2):
        try:
            model.generate(input_ids=out, cache=cache, max_new_tokens=4, do_sample=False)
            print("NO ERROR", flush=True)
        except kvtier.OffloadError as err:
            print("OFFLOAD_ERROR", err, flush=True)
if mode == "close":
    cache.close()
    print("LEFT", os.listdir(directory), flush=True)
"""


@pytest.mark.parametrize("mode", ["close", "exit"])
def test_truncated_file_during_generate_raises_offload_error(tmp_path, mode):
    """A block file truncated while the cache is alive: generating raises OffloadError naming the
    layer, block and file (each time: the data is gone), the process is not killed, and the
    directory is gone after close() or, without close, after the interpreter exits."""
    proc = run_isolated(GENERATE_TRUNCATED, str(tmp_path), mode)
    assert_no_signal(proc)
    lines = proc.stdout.splitlines()
    path = lines[0].split(" ", 1)[1]
    assert "layer001-" in path
    errors = [line for line in lines if line.startswith("OFFLOAD_ERROR")]
    assert len(errors) == 2, proc.stdout
    for line in errors:
        assert line.startswith("OFFLOAD_ERROR layer 1: cold block ")
        assert f"offload file {path!r} was truncated to 0 of" in line
    if mode == "close":
        assert lines[-1] == "LEFT []"
    assert list(tmp_path.iterdir()) == []


def test_corrupted_record_during_generate_is_named_and_changes_nothing(model, tmp_path):
    """The corrupted-record contract in a real generation: OffloadError naming layer, block and
    record; the failed call changes nothing, so the next one fails the same way (the record is
    still bad) instead of running on a half-updated cache; close() leaves no file."""
    cache = TieredCache(model.config, preset("offload-disk", tmp_path))
    with kvtier.enable(model), torch.no_grad():
        model(token_ids(300), cache=cache)
        tier = cache.layers[1].cold
        rid = int(tier.table[0, 1, 2])
        with open(tier.store.files()[0], "r+b") as f:  # flip one byte of record rid
            f.seek(rid * tier.store.record_bytes + 11)
            byte = f.read(1)
            f.seek(rid * tier.store.record_bytes + 11)
            f.write(bytes([byte[0] ^ 0xFF]))
        before = tier_state(cache)
        for _ in range(2):
            with pytest.raises(OffloadError, match=rf"layer 1: cold block 2 \(row 0, KV head 1\), record {rid}.*crc32"):
                model(token_ids(1, seed=1), cache=cache)
            assert_same_state(tier_state(cache), before)
    cache.close()
    assert list(tmp_path.iterdir()) == []


# --- 2. a full disk ---------------------------------------------------------------------------------
def first_slab_bytes(name: str = "offload-disk", head_dim: int = 16, dtype: torch.dtype = torch.float16) -> int:
    """Bytes of a store's first slab for the tiny model (head_dim 16, fp16 storage) under a preset."""
    record = RecordLayout(kvtier.get_policy(name).block_tokens, head_dim, dtype).record_bytes
    return slab_sizes(1, record)[0] * record


SLAB_BYTES = first_slab_bytes()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs with room for five first slabs of the tiny model's offload-disk stores (4 layers)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={5 * SLAB_BYTES}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        pytest.skip(f"this container does not allow mounting a tmpfs: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def fallocate_fails_after(monkeypatch, allowed: int) -> None:
    """Make ``os.posix_fallocate`` succeed ``allowed`` more times, then fail with ENOSPC."""
    real = os.posix_fallocate
    left = [allowed]

    def fallocate(fd, offset, size):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        left[0] -= 1
        return real(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)


@pytest.mark.parametrize("how", ["fallocate", "tmpfs"])
def test_full_disk_during_generate(model, tmp_path, monkeypatch, request, how):
    """The offload directory fills up in the middle of a forward call: OffloadError naming the
    directory (never a signal or a raw OSError), the call changes nothing, and after close()
    nothing is left. With the fault removed the cache goes on and decodes the same tokens as a
    cache that never failed; on a still-full tmpfs it refuses each call with the same error."""
    ids = token_ids(900)
    (tmp_path / "control").mkdir()
    control = TieredCache(model.config, preset("offload-disk", tmp_path / "control"))
    with kvtier.enable(model), torch.no_grad():
        model(ids[:, :300], cache=control)
        expected = greedy(model, control, model(ids[:, 300:], cache=control).logits)
    control.close()

    root = request.getfixturevalue("small_tmpfs") if how == "tmpfs" else tmp_path / "full"
    root.mkdir(exist_ok=True)
    cache = TieredCache(model.config, preset("offload-disk", root))
    with kvtier.enable(model), torch.no_grad():
        model(ids[:, :300], cache=cache)  # one slab per layer
        stores = [layer.cold.store for layer in cache.tiered_layers]
        assert all(s.nbytes == SLAB_BYTES and len(s.files()) == 1 for s in stores)
        before = tier_state(cache)
        files = [s.files() for s in stores]
        if how == "fallocate":
            fallocate_fails_after(monkeypatch, 1)  # layer 0 gets its second slab, layer 1 does not
        full = rf"no space left for offloaded KV blocks in '{re.escape(str(root))}.*layer001-0001\.kv"
        with pytest.raises(OffloadError, match=full):
            model(ids[:, 300:], cache=cache)
        assert_same_state(tier_state(cache), before)
        assert stores[1].nbytes == SLAB_BYTES and stores[1].files() == files[1]  # nothing grown, no file left
        if how == "fallocate":
            monkeypatch.undo()
            assert torch.equal(greedy(model, cache, model(ids[:, 300:], cache=cache).logits), expected)
        else:
            with pytest.raises(OffloadError, match="no space left"):
                model(ids[:, 300:], cache=cache)
            assert_same_state(tier_state(cache), before)
    cache.close()
    assert list(root.iterdir()) == []
    if how == "tmpfs":  # nothing holds a file open (no mapping left): the tmpfs unmounts
        assert subprocess.run(["umount", str(root)], check=False).returncode == 0


# --- 3. OffloadTier.push is all or nothing ---------------------------------------------------------
def _boom(*args, **kwargs):
    raise RuntimeError("injected")


#: Where a push can fail: each step it takes, and (disk) at its first or second new slab file.
STEPS = [
    *[
        (step, b)
        for step in ("sketch.encode", "layout.encode", "store.allocate", "store.write")
        for b in ("cpu", "disk")
    ],
    ("grow", "disk"),
    ("second grow", "disk"),
]


@pytest.mark.parametrize("step,backend", STEPS)
def test_push_is_all_or_nothing(step, backend, tmp_path, monkeypatch):
    """A push that fails at any step leaves fields, table, live records, capacity and files as
    they were (slabs grown for it are released), and the same push then succeeds."""
    layer, *_ = offload_layer(off_policy(backend=backend, path=str(tmp_path) if backend == "disk" else None))
    tier, store = layer.cold, layer.cold.store
    before = (dict(tier.fields), tier.table.clone(), store.live, store.capacity, store.files())
    assert store.capacity - store.live < 40  # the push below grows the store by two slabs or more
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(3, 2, 70, 12, generator=g), torch.randn(3, 2, 70, 12, generator=g)
    valid = torch.ones(3, 70, dtype=torch.bool)
    if step == "sketch.encode":
        monkeypatch.setattr(KeySketch, "encode", _boom)
    elif step == "layout.encode":
        monkeypatch.setattr(RecordLayout, "encode", _boom)
    elif step == "store.allocate":
        monkeypatch.setattr(store, "allocate", _boom)
    elif step == "store.write":  # after the store grew for the push
        monkeypatch.setattr(store, "write", _boom)
    else:
        fallocate_fails_after(monkeypatch, 0 if step == "grow" else 1)
    expected = (OffloadError, "no space left") if "grow" in step else (RuntimeError, "injected")
    with pytest.raises(expected[0], match=expected[1]):
        tier.push(k, v, valid)
    fields, table, live, capacity, files = before
    assert tier.fields.keys() == fields.keys() and all(tier.fields[n] is fields[n] for n in fields)
    assert torch.equal(tier.table, table)
    assert (store.live, store.capacity, store.files()) == (live, capacity, files)
    if backend == "disk":
        left = sorted(p.name for p in next(tmp_path.iterdir()).iterdir() if p.name != "owner.lock")  # the owner's lock
        assert left == [Path(f).name for f in files]
    monkeypatch.undo()  # the same push now succeeds, and reads back
    old_k = tier.dense(torch.float32)[0]
    tier.push(k, v, valid)
    new_k = tier.dense(torch.float32)[0]
    assert torch.equal(new_k[:, :, : old_k.shape[2]], old_k) and torch.equal(new_k[:, :, old_k.shape[2] :], k)
    layer.cold.close()


@pytest.mark.parametrize("backend", ["cpu", "disk"])
def test_undone_push_keeps_the_slabs_earlier_calls_grew(backend, tmp_path):
    """Fuzzer seed 8330: undoing a push released every empty trailing slab, those grown by earlier
    kept calls (their records freed since) too, so after a refused call the store reserved fewer
    bytes than one that never ran it. The undo now releases only the slabs grown since the journal
    began (``OffloadTier.state``/``restore``)."""
    layer, *_ = offload_layer(off_policy(backend=backend, path=str(tmp_path) if backend == "disk" else None))
    tier, store = layer.cold, layer.cold.store
    B, H, T = tier.table.shape[0], tier.table.shape[1], tier.block_tokens
    g = torch.Generator().manual_seed(3)

    def kv(blocks):
        k, v = torch.randn(B, H, blocks * T, 12, generator=g), torch.randn(B, H, blocks * T, 12, generator=g)
        return k, v, torch.ones(B, blocks * T, dtype=torch.bool)

    tier.push(*kv(10))
    tier.release(tier.drop_front(tier.nblocks))  # a kept move: every record freed, the slabs stay
    capacity, files = store.capacity, store.files()
    assert store.live == 0 and store.capacity > slab_sizes(1, store.record_bytes)[0]  # two slabs or more
    for blocks in (2, capacity // (B * H) + 1):  # fits the slabs held; grows past them
        state, before = tier.state(), tier.nblocks
        tier.push(*kv(blocks))
        assert store.live == B * H * blocks
        tier.truncate(before)  # the journal's undo, then its restore
        tier.restore(state)
        assert (store.live, store.capacity, store.files()) == (0, capacity, files)
    layer.cold.close()


def test_store_put_releases_grown_slabs(tmp_path, monkeypatch):
    store = BlockStore(64, "disk", str(tmp_path), name="p")
    store.put(torch.zeros(10, 64, dtype=torch.uint8))
    state = (store.live, store.capacity, store.files(), store.tensors()[0].clone())
    fallocate_fails_after(monkeypatch, 1)  # 30 more records need two new slabs: the second fails
    with pytest.raises(OffloadError, match="no space left"):
        store.put(torch.ones(30, 64, dtype=torch.uint8))
    assert (store.live, store.capacity, store.files()) == state[:3]
    assert torch.equal(store.tensors()[0], state[3]) and sorted(os.listdir(tmp_path)) == ["p-0000.kv"]
    monkeypatch.undo()
    monkeypatch.setattr(store, "write", _boom)
    with pytest.raises(RuntimeError, match="injected"):
        store.put(torch.ones(30, 64, dtype=torch.uint8))
    assert (store.live, store.capacity, store.files()) == state[:3]
    monkeypatch.undo()
    ids = store.put(torch.ones(30, 64, dtype=torch.uint8))
    assert ids.tolist() == list(range(10, 40)) and bool((store.read(ids) == 1).all())
    store.close()
    assert list(tmp_path.iterdir()) == []


# --- 4. copy and pickle ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PRESETS)
def test_copy_and_pickle_are_refused_and_the_cache_keeps_working(model, tmp_path, name):
    ids = token_ids(300)
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with kvtier.enable(model):
        control = TieredCache(model.config, preset(name, tmp_path))
        expected = model.generate(input_ids=model.generate(input_ids=ids, cache=control, **kw), cache=control, **kw)
        control.close()
        cache = TieredCache(model.config, preset(name, tmp_path))
        out = model.generate(input_ids=ids, cache=cache, **kw)
        tier = cache.layers[0].cold
        assert tier.nblocks > 0
        for obj in (cache, tier, tier.store, cache.offloader):
            for action in (copy.deepcopy, pickle.dumps, copy.copy):
                if action is copy.copy and obj is cache:
                    continue  # a shallow copy of the cache shares its layers: nothing is duplicated
                with pytest.raises(OffloadError) as err:
                    action(obj)
                assert str(err.value) == COPY_ERROR
        assert torch.equal(model.generate(input_ids=out, cache=cache, **kw), expected)
    cache.close()
    assert list(tmp_path.iterdir()) == []


# --- 5 and 6. nothing on disk and no worker thread after any exit ---------------------------------
@pytest.mark.parametrize("end", ["close", "gc"])
def test_no_files_after_an_exception_during_generate(model, tmp_path, end):
    """An exception in the middle of a generate, then close() or garbage collection without
    close(): the offload directory is gone either way."""

    def fail(module, args, output):
        raise RuntimeError("injected between two layers")

    cache = TieredCache(model.config, preset("offload-disk", tmp_path))
    with kvtier.enable(model), torch.no_grad():
        model.generate(input_ids=token_ids(300), cache=cache, max_new_tokens=2, do_sample=False)
        assert any(p.is_file() for p in tmp_path.rglob("*"))
        hook = model.model.layers[2].register_forward_hook(fail)
        try:
            with pytest.raises(RuntimeError, match="injected") as err:
                model.generate(input_ids=token_ids(400), cache=cache, max_new_tokens=2, do_sample=False)
        finally:
            hook.remove()
        del err  # its traceback holds frames that hold the cache
    if end == "close":
        cache.close()
    else:
        del cache
        # The offloader's finalizer runs once nothing holds it: a prefetch read that the exception
        # left in flight holds it until the read ends (milliseconds; seconds on a loaded machine, where
        # a single collection right away failed this test twice), and the next collection frees it.
        deadline = time.monotonic() + 30
        while True:
            gc.collect()
            if not list(tmp_path.iterdir()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", PRESETS)
def test_close_leaves_no_prefetch_thread(model, tmp_path, name):
    """close() waits for the prefetch worker: no kvtier-prefetch thread of this cache is left."""
    before = prefetch_threads()
    pol = preset(name, tmp_path)
    pol = dataclasses.replace(pol, offload=dataclasses.replace(pol.offload, prefetch=True))
    cache = TieredCache(model.config, pol)
    with kvtier.enable(model):
        model.generate(input_ids=token_ids(300), cache=cache, max_new_tokens=4, do_sample=False)
    assert cache.offload_stats().prefetched > 0 and prefetch_threads() - before  # a worker ran
    cache.close()
    assert not prefetch_threads() - before
    assert list(tmp_path.iterdir()) == []
