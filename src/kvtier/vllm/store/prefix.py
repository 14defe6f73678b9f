"""The prefix store: compressed KV blocks keyed by vLLM block hashes, in host RAM, on disk and in Redis.

:class:`PrefixStore` owns every offloaded block of one vLLM engine. Blocks are records of
:mod:`kvtier.vllm.store.blocks` (``kv: [L, H, 2, T, D]`` encoded, header + crc32), keyed by opaque
``bytes`` (vLLM's ``OffloadKey``: block hash + KV-cache group). Host RAM has a byte budget
(``cpu_bytes``); when it runs short the least recently used blocks *step down* instead of only
being evicted: first every block is re-encoded to the policy's colder codec (4-bit -> 3-bit
after the Hadamard rotation), then the oldest leave RAM (to disk when there is one, else out).

With ``disk_path`` every stored block is also written through to a file of its own
(``<namespace>/<key hex>.kvb``, written to a temporary name and renamed, so a reader sees a whole
file or none), so a new process with the same ``disk_path`` hits. A block only on disk is read
and fully checked (header, length, crc32) at :meth:`PrefixStore.lookup`, and its checked bytes
stay in RAM (promoted, counted in ``cpu_bytes``, where the budget has room; otherwise held until
the load that pinned them completes): a missing, truncated or corrupted file
is a miss at lookup (and the file is removed), never a failed load, because vLLM's offloading
worker cannot report a failed load after lookup said hit. ``disk_bytes`` bounds the folder
(least recently used files removed; safe with several engines sharing it). A folder that cannot be written (a
read-only, pre-filled volume; found at construction or at the first failed write) serves the
blocks it holds, keeps new blocks in RAM only and removes nothing, said once in the log; a block
whose store fails is never left pending (the scheduler would wait on it).

With ``remote`` (:class:`kvtier.vllm.store.remote.RemoteTier`, a Redis server shared by many
engines) every stored record is also written to the shared pool, on the remote tier's own thread;
a block in neither RAM nor a file is looked up there, checked like a file (header, length,
crc32) and promoted to RAM the same way. A block that leaves RAM is then evicted (the pool may
still hold it). Order of a lookup: RAM, disk, remote, else a miss (vLLM computes it).

Threads: bookkeeping (lookup, pin, reserve, eviction) runs on the caller's thread (vLLM's
scheduler); encoding, decoding and file writes run on one worker thread owned by the store
(:meth:`submit`), so compression does not stall the engine step. Only the scheduler's thread
removes a block or drops its RAM copy, so a block that lookup reported as a hit stays loadable
until it is pinned. Imports torch, ``kvtier.vllm.store.blocks``/``policy``/``remote`` and ``kvtier.errors``; never
vLLM, transformers or ``kvtier.hf``.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import KVTierError
from .blocks import BlockCodec, BlockFormat, RecordCorrupt
from .policy import StorePolicy
from .remote import RemoteTier

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
DISK_LOW_WATER = 0.9  # a trim of the block files goes down to this share of ``disk_bytes``


@dataclass(eq=False)
class _Entry:
    level: int  # index into policy.levels of the codec of `record` (or the one a pending store uses)
    sink: int  # exact leading tokens
    budget: int  # bytes this entry counts against cpu_bytes (projected after a scheduled step down)
    record: torch.Tensor | None = None  # None: not stored yet, or only on disk
    ready: bool = False
    busy: bool = True  # a store or step-down job is in flight
    pins: int = 0
    on_disk: bool = False
    transient: bool = False  # `record` was read from disk for a load; not counted in the budget


class PrefixStore:
    """Blocks of one engine: a RAM budget with step-down LRU, optional write-through block files.

    Parameters
    ----------
    policy : codecs and sink tokens (:class:`kvtier.vllm.store.policy.StorePolicy`).
    fmt : shape and dtype of a block, ``kv: [L, H, 2, T, D]``.
    cpu_bytes : budget of the records held in host RAM.
    disk_path : folder for block files (created); ``None`` keeps blocks in RAM only.
    namespace : subfolder of ``disk_path``: records of another model or policy never mix.
    disk_bytes : budget of the namespace's block files, shared by every engine that uses the
        folder, or None (no limit). When this engine's count of the folder passes it, the folder is
        read again (also after every ``1 - DISK_LOW_WATER`` of the budget it wrote) and its least
        recently used files (by modification time: written, last hit from disk, or last left RAM)
        are removed down to :data:`DISK_LOW_WATER` of the budget. One engine keeps the folder within
        the budget; ``n`` engines writing one folder keep it under ``1 + n * (1 - DISK_LOW_WATER)``
        times the budget plus a record each.
    """

    def __init__(
        self,
        policy: StorePolicy,
        fmt: BlockFormat,
        cpu_bytes: int,
        disk_path: str | os.PathLike | None = None,
        namespace: str = "blocks",
        disk_bytes: int | None = None,
        remote: RemoteTier | None = None,
    ):
        if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int) or cpu_bytes < 0:
            raise ValueError(f"cpu_bytes={cpu_bytes!r} is not allowed: expected an int >= 0")
        if disk_bytes is not None and (
            isinstance(disk_bytes, bool) or not isinstance(disk_bytes, int) or disk_bytes <= 0
        ):
            raise ValueError(
                f"disk_bytes={disk_bytes!r} is not allowed: expected an int > 0 (bytes of block files) or None"
            )
        self.policy = policy
        self.fmt = fmt
        self.cpu_bytes = cpu_bytes
        self.codec = BlockCodec(fmt, policy.value_group)
        self.levels = policy.levels
        self.dir: Path | None = None
        if disk_path is not None:
            self.dir = Path(disk_path) / namespace
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise KVTierError(f"disk_path={str(disk_path)!r} cannot be used for block files: {err}") from None
        # A folder this process cannot write (a read-only, pre-filled volume): its blocks are served,
        # new blocks stay in RAM, and nothing is removed from it. Also set at the first failed write.
        self.read_only = self.dir is not None and not os.access(self.dir, os.W_OK)
        if self.read_only:
            logger.warning(
                "kvtier: block folder %s is read-only: the blocks it holds are served, new blocks are kept in RAM only",
                self.dir,
            )
        self.disk_bytes = disk_bytes
        self._disk_used = self._scan_disk()[0] if disk_bytes is not None and self.dir is not None else 0
        self._since_scan = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._ram = 0
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm")
        self._closed = False
        self.counters: Counter[str] = Counter()
        self.remote = remote
        if remote is not None:
            remote.counters = self.counters
            remote.ping()

    # --- sizes ------------------------------------------------------------------------------
    def record_bytes(self, level: int, sink: int) -> int:
        bits, rotate, kg = self.levels[level]
        return self.codec.record_bytes(bits, rotate, sink, kg)

    @property
    def ram_bytes(self) -> int:
        """Bytes counted against ``cpu_bytes`` (records in RAM, stores in flight at their size)."""
        return self._ram

    def counter_snapshot(self) -> dict[str, int]:
        """A copy of :attr:`counters` (the store's thread may add a key meanwhile: copied again)."""
        while True:
            try:
                return dict(self.counters)
            except RuntimeError:  # dictionary changed size during iteration
                continue

    def stats(self) -> dict[str, Any]:
        """Counters, bytes and blocks per level (a snapshot)."""
        with self._lock:
            levels: Counter[str] = Counter()
            held = 0
            for e in self._entries.values():
                if e.record is not None and not e.transient:
                    bits, rotate, _ = self.levels[e.level]
                    levels["exact" if bits is None else f"int{bits}" + ("-rot" if rotate else "")] += 1
                    held += e.record.numel()
                elif e.ready:
                    levels["disk"] += 1
            return {
                **self.counters,
                "ram_bytes": self._ram,
                "ram_record_bytes": held,
                "blocks": dict(levels),
                "exact_block_bytes": self.fmt.exact_bytes,
            }

    def describe(self) -> str:
        """One line for the engine's start: codecs and their bytes vs the exact block, what RAM
        holds, the folder (blocks found, budget, read-only)."""
        from ... import __version__

        exact = self.fmt.dense_bytes
        dtype = str(self.fmt.dtype).removeprefix("torch.")
        steps = []
        for i, (bits, rotate, _) in enumerate(self.levels):
            name = "exact" if bits is None else f"{bits}-bit" + (" rotated" if rotate else "")
            name = "as the engine's packed pages" if self.fmt.page_bytes else name
            steps.append(f"{name} ({self.record_bytes(i, 0) / exact:.3f} of {dtype})")
        first = self.record_bytes(0, 0)
        tokens = self.cpu_bytes // first * self.fmt.tokens
        line = (
            f"kvtier {__version__} prefix store: blocks of {self.fmt.tokens} tokens stored "
            + ", stepping down to ".join(steps)
            + f", {self.policy.sink_tokens} sink tokens exact; RAM {self.cpu_bytes / (1 << 30):.2f} GiB holds "
            f"{tokens:,} tokens ({tokens / max(1, self.cpu_bytes // exact * self.fmt.tokens):.2f}x {dtype})"
        )
        remote = "" if self.remote is None else "; " + self.remote.describe()
        if self.dir is None:
            return line + "; no disk" + remote
        found, files = self._scan_disk()
        budget = "no budget" if self.disk_bytes is None else f"budget {self.disk_bytes / (1 << 30):.2f} GiB"
        state = ", read-only" if self.read_only else ""
        disk = f"; disk {self.dir}: {len(files):,} blocks found ({found / (1 << 30):.2f} GiB), {budget}{state}"
        return line + disk + remote

    # --- worker thread ----------------------------------------------------------------------
    def submit(self, fn, *args) -> Future:  # noqa: ANN001
        """Run ``fn(*args)`` on the store's worker thread (in submission order)."""
        if self._closed:
            raise KVTierError("the kvtier prefix store is closed")
        return self._pool.submit(fn, *args)

    # --- files ------------------------------------------------------------------------------
    def path(self, key: bytes) -> Path:
        assert self.dir is not None
        return self.dir / (key.hex() + SUFFIX)

    def _read_file(self, key: bytes) -> torch.Tensor | None:
        """The checked record of a block file, or None (missing or bad: a bad file is removed)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            logger.warning("kvtier: block file %s cannot be read (%s): a miss", path, err)
            self.counters["disk_errors"] += 1
            return None
        record, err = self._checked(data)
        if err is not None:
            self.counters["corrupt"] += 1
            removed = self._unlink(path)
            logger.warning("kvtier: block file %s fails its checks (%s): a miss%s", path, err, ", removed" * removed)
        return record

    def _checked(self, data: bytes) -> tuple[torch.Tensor | None, RecordCorrupt | None]:
        """``(record, None)`` when ``data`` is a whole record of this store's format, else ``(None, why)``."""
        record = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        try:
            self.codec.verify(record)
        except RecordCorrupt as err:
            return None, err
        return record, None

    def _unlink(self, path: Path) -> bool:
        """Remove a block file if this process may (True when it did); a failure is counted, never raised."""
        if self.read_only:
            return False
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            self._disk_failed(path, err)
            return False
        return True

    def _disk_failed(self, path: Path, err: OSError) -> None:
        """Count a failed write or removal; a read-only folder turns writes off (said once)."""
        self.counters["disk_errors"] += 1
        if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            if not self.read_only:
                self.read_only = True
                logger.warning(
                    "kvtier: block folder %s cannot be written (%s): the blocks it holds are served, "
                    "new blocks are kept in RAM only",
                    self.dir,
                    err,
                )
        else:
            logger.warning("kvtier: block file %s cannot be written (%s): kept in RAM only", path, err)

    def _write_file(self, key: bytes, record: torch.Tensor) -> bool:
        """Write a block file (temporary name, then rename); False, counted and said, when it fails."""
        if self.read_only or (self.disk_bytes is not None and record.numel() > self.disk_bytes):
            return False
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(record.numpy().tobytes())
            os.replace(tmp, path)
        except OSError as err:
            self._disk_failed(path, err)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # nothing was created where nothing can be written
            return False
        self.counters["disk_writes"] += 1
        self.counters["disk_bytes_written"] += record.numel()
        if self.disk_bytes is not None:
            self._disk_used += record.numel()
            self._since_scan += record.numel()
            # other engines write the folder too: read it again every (1 - DISK_LOW_WATER) of the budget
            if self._disk_used > self.disk_bytes or self._since_scan > (1 - DISK_LOW_WATER) * self.disk_bytes:
                self._trim_disk()
        return True

    def _scan_disk(self) -> tuple[int, list[tuple[float, int, Path]]]:
        """Bytes of the namespace's block files (every engine's) and ``(mtime, size, path)`` of each."""
        files = []
        total = 0
        assert self.dir is not None
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return 0, []
        for entry in entries:
            if not entry.name.endswith(SUFFIX) or entry.name.startswith("."):
                continue
            try:
                st = entry.stat()
            except OSError:  # removed meanwhile (another engine's trim)
                continue
            files.append((st.st_mtime, st.st_size, Path(entry.path)))
            total += st.st_size
        return total, files

    def _trim_disk(self) -> None:
        """Read the folder; over ``disk_bytes``, remove the least recently used block files down to
        DISK_LOW_WATER of it (worker thread)."""
        assert self.disk_bytes is not None
        total, files = self._scan_disk()
        self._since_scan = 0
        target = int(self.disk_bytes * DISK_LOW_WATER) if total > self.disk_bytes else total
        gone = []
        for _, size, path in sorted(files, key=lambda f: (f[0], f[2].name)):
            if total <= target:
                break
            if self._unlink(path):
                total -= size
                gone.append(path)
                self.counters["disk_evicted"] += 1
        self._disk_used = total
        if gone:
            with self._lock:  # a block whose file is gone is evicted, not dropped to disk, when it leaves RAM
                for path in gone:
                    e = self._entries.get(bytes.fromhex(path.name[: -len(SUFFIX)]))
                    if e is not None and e.record is not None:
                        e.on_disk = False

    def _touch_file(self, key: bytes) -> None:
        """Mark a block file as recently used (the disk budget's LRU order)."""
        if self.disk_bytes is None or self.read_only:
            return
        try:
            os.utime(self.path(key))
        except OSError:
            pass  # removed by a trim: a later lookup is a miss

    # --- scheduler side ---------------------------------------------------------------------
    def lookup(self, key: bytes) -> str:
        """``"hit"`` (loadable now), ``"pending"`` (a store in flight) or ``"miss"``."""
        with self._lock:
            e = self._entries.get(key)
            if e is not None and not e.ready:
                return "pending"
            if e is not None and e.record is not None:
                if not e.transient:
                    self._entries.move_to_end(key)
                self.counters["lookup_hits"] += 1
                return "hit"
            # only on disk or in the shared pool, or never seen by this process
            record = None if self.dir is None else self._read_file(key)
            source = "disk"
            if record is None and self.remote is not None:
                record, source = self._read_remote(key), "remote"
            if record is None:
                if e is not None:
                    del self._entries[key]
                self.counters["lookup_misses"] += 1
                return "miss"
            sink = self.codec.info(record)[2]
            if e is None:
                e = self._entries[key] = _Entry(level=0, sink=sink, budget=0, ready=True, busy=False)
            e.record, e.level, e.on_disk = record, self._level_of(record), source == "disk"
            if self._ram + record.numel() <= self.cpu_bytes:  # promoted: the next hit reads RAM
                e.transient, e.budget = False, record.numel()
                self._ram += e.budget
                self._entries.move_to_end(key)
                self.counters[source + "_promoted"] += 1
            else:  # held for the load that pins it, then dropped; disk-only blocks are the coldest
                e.transient = True
                self._entries.move_to_end(key, last=False)
            if source == "disk":
                self._touch_file(key)
            self.counters["lookup_hits"] += 1
            self.counters[source + "_hits"] += 1
            return "hit"

    def _read_remote(self, key: bytes) -> torch.Tensor | None:
        """The checked record of a block in the shared pool, or None (absent, unreachable, or bad)."""
        assert self.remote is not None
        data = self.remote.get(key)
        if data is None:
            self.counters["remote_misses"] += 1
            return None
        record, err = self._checked(data)
        if err is not None:
            self.counters["remote_rejected"] += 1
            self.remote.warn_once(
                "corrupt", "kvtier: a record in Redis %s fails its checks (%s): a miss", self.remote.shown, err
            )
        return record

    def _level_of(self, record: torch.Tensor) -> int:
        bits, rotate, _, kg = self.codec.info(record)
        for i, lv in enumerate(self.levels):
            if lv == (bits, rotate, kg):
                return i
        return 0  # a record of another level of the same policy family: decodes all the same

    def pin(self, keys: list[bytes]) -> None:
        """Protect hit blocks from step-down, eviction and dropping until :meth:`unpin`."""
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None or not e.ready or e.record is None:
                    raise KVTierError(f"block {key.hex()[:16]}... was not a hit: pin only what lookup returned as hit")
                e.pins += 1
                if not e.transient:
                    self._entries.move_to_end(key)

    def unpin(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.pins == 0:
                    continue
                e.pins -= 1
                if e.pins == 0 and e.transient:
                    e.record, e.transient = None, False

    def touch(self, keys: list[bytes]) -> None:
        """Mark blocks as recently used."""
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is not None and e.record is not None and not e.transient:
                    self._entries.move_to_end(key)

    def reserve(self, keys: list[bytes], sinks: list[int]) -> list[bytes]:
        """Start storing the blocks not held yet; returns those keys (stores then run :meth:`put`).

        ``sinks[i]``: exact leading tokens of block ``i`` (non-zero for a sequence's first block).
        """
        out = []
        with self._lock:
            for key, sink in zip(keys, sinks):
                if key in self._entries:
                    continue
                size = self.record_bytes(0, sink)
                if size > self.cpu_bytes:  # a record must pass through RAM
                    self.counters["store_refused"] += 1
                    continue
                self._entries[key] = _Entry(level=0, sink=sink, budget=size)
                self._ram += size
                out.append(key)
            self._make_room()
        return out

    def abort(self, keys: list[bytes]) -> None:
        """Forget blocks whose store did not happen."""
        with self._lock:
            for key in keys:
                e = self._entries.get(key)
                if e is not None and not e.ready:
                    self._remove(key)

    def maintain(self) -> None:
        """Drop read-for-load copies no load pinned, and bring RAM back within the budget."""
        with self._lock:
            for e in self._entries.values():
                if e.transient and e.pins == 0:
                    e.record, e.transient = None, False
            self._make_room()

    def _remove(self, key: bytes) -> None:
        e = self._entries.pop(key)
        self._ram -= e.budget

    def _movable(self, e: _Entry) -> bool:
        return e.ready and not e.busy and e.pins == 0 and e.record is not None and not e.transient

    def _make_room(self) -> None:
        over = self._ram - self.cpu_bytes
        if over <= 0:
            return
        # 1. step down, least recently used first, until every block is at its coldest RAM level
        for key, e in self._entries.items():
            if over <= 0:
                break
            if self._movable(e) and e.level + 1 < len(self.levels):
                new = self.record_bytes(e.level + 1, e.sink)
                over -= e.budget - new
                self._ram -= e.budget - new
                e.budget, e.busy = new, True
                self.counters["step_downs"] += 1
                self.submit(self._step_down, key, e)
        # 2. leave RAM, least recently used first: to disk (already written through) or out
        for key, e in list(self._entries.items()):
            if over <= 0:
                break
            if not self._movable(e):
                continue
            over -= e.budget
            if e.on_disk:
                self._ram -= e.budget
                e.record, e.budget = None, 0
                self._touch_file(key)
                self.counters["to_disk"] += 1
            else:
                self._remove(key)
                self.counters["evicted"] += 1

    def reset(self) -> None:
        """Forget every block (RAM and, with a disk, this namespace's block files)."""
        with self._lock:
            self._entries.clear()
            self._ram = 0
            if self.dir is not None:
                for path in self.dir.glob("*" + SUFFIX):
                    self._unlink(path)

    # --- worker side ------------------------------------------------------------------------
    def put(self, key: bytes, kv: torch.Tensor) -> None:
        """Encode and keep a reserved block ``kv: [L, H, 2, T, D]`` (worker thread)."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.ready:  # reset or aborted meanwhile
                return
            bits, rotate, kg = self.levels[e.level]
            sink = e.sink
        t0 = time.perf_counter()
        try:
            record = self.codec.encode(kv, bits, rotate, sink, kg)
        except Exception:
            with self._lock:
                if self._entries.get(key) is e:
                    self._remove(key)
            raise
        try:
            on_disk = self.dir is not None and self._write_file(key, record)
        except Exception:  # never leave a reserved block pending: the scheduler would wait on it forever
            logger.exception("kvtier: block file %s could not be written: kept in RAM only", self.path(key))
            self.counters["disk_errors"] += 1
            on_disk = False
        if self.remote is not None:  # queued on the remote tier's own thread
            self.remote.put(key, record.numpy().tobytes())
        with self._lock:
            if self._entries.get(key) is e:
                e.record, e.ready, e.busy, e.on_disk = record, True, False, on_disk
                self._ram += record.numel() - e.budget
                e.budget = record.numel()
        self.counters["stored"] += 1
        self.counters["store_ns"] += int((time.perf_counter() - t0) * 1e9)

    def _step_down(self, key: bytes, e: _Entry) -> None:
        with self._lock:
            record = e.record
        if record is None or e.level + 1 >= len(self.levels):
            return
        bits, rotate, kg = self.levels[e.level + 1]
        try:
            new = self.codec.step_down(record, bits, rotate, kg)
        except Exception:
            logger.exception("kvtier: a block could not be stepped down; it stays as it was")
            new = None
        with self._lock:
            if self._entries.get(key) is e and e.record is record:
                if new is not None:
                    e.record, e.level = new, e.level + 1
                    self._ram += new.numel() - e.budget
                else:
                    self._ram += record.numel() - e.budget
                e.budget = e.record.numel()
            e.busy = False

    def read(self, key: bytes, out: torch.Tensor | None = None) -> torch.Tensor:
        """``kv: [L, H, 2, T, D]`` of a pinned block (worker thread)."""
        with self._lock:
            e = self._entries.get(key)
            record = None if e is None else e.record
        if record is None:
            raise KVTierError(f"block {key.hex()[:16]}... is not held: load only pinned blocks")
        t0 = time.perf_counter()
        kv = self.codec.decode(record, out)
        self.counters["loaded"] += 1
        self.counters["load_ns"] += int((time.perf_counter() - t0) * 1e9)
        return kv

    def flush(self) -> None:
        """Wait until every job submitted so far has run."""
        if not self._closed:
            try:
                self._pool.submit(lambda: None).result()
                if self.remote is not None:
                    self.remote.flush()
            except RuntimeError:  # the interpreter is shutting down its thread pools
                pass

    def close(self) -> None:
        """Stop the worker thread (after the jobs already submitted), then the remote tier's
        writes; block files and the shared pool's records stay."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
            if self.remote is not None:
                self.remote.close()

    def remove_files(self) -> None:
        """Delete this store's namespace folder (tests and benchmarks)."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
