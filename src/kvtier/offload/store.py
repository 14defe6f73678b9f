"""Block store: a pool of fixed-size records in host RAM or in memory-mapped files on disk.

An offloading layer writes each cold block of each (row, KV head) as one *record* of
``record_bytes`` bytes and keeps only the record id (in its block table, see
:mod:`kvtier.offload.tier`). Records are immutable once written: beam search permutes table rows
and several rows may then share a record, so nothing is rewritten in place; records no row
refers to any more are freed and their ids reused, lowest first.

Storage grows in *slabs* of records whose sizes follow :func:`slab_sizes` (``SLAB_MIN_RECORDS``,
or an eighth of the capacity so far, up to ``SLAB_MAX_BYTES`` per slab: at most ~12% unused
slots, few files), so the planner can price a store exactly (:func:`store_capacity`) and nothing
is ever copied when the pool grows.

Backends
--------
``"cpu"``: slabs are host tensors (pinned when CUDA is available, so copies to the GPU can run
asynchronously). ``"disk"``: each slab is a file in a caller-chosen directory, its space
reserved up front with ``posix_fallocate`` (so a full disk fails with a clear error at the
write that needs the space, never later through a ``SIGBUS`` on a mapped page), then mapped
with ``mmap``. Every disk record carries a crc32 checksum, kept next to the compute and checked
on every read. Files are removed by :meth:`BlockStore.close` or, at the latest, when the store
is garbage-collected (``weakref.finalize``); after a crash, with the private directory the
offloader made for them (:func:`kvtier.offload.prefetch.reclaim_orphans`). A read of several
runs first asks the OS to read all of them (:func:`readahead`, ``POSIX_FADV_WILLNEED``), so the
device serves them in parallel rather than one page fault at a time;
:meth:`BlockStore.file_ranges` gives the ranges for reading ahead of need
(:mod:`kvtier.offload.prefetch`).

Failures
--------
Every failure is an :class:`OffloadError`, never a signal or a raw ``OSError``:

* a slab file that shrank behind the store's back (truncated by another process) would raise
  ``SIGBUS`` at the first read of a mapped page it no longer backs, before any checksum runs. So
  each read and write first compares the size of every slab file it touches with its mapping
  (``mmap.size()``: one ``fstat`` of the descriptor the mapping keeps, per slab and call) and
  raises :class:`RecordError` / :class:`OffloadError` naming the file. Only a truncation racing
  the copy itself, within microseconds, could still fault. (Reading with ``os.preadv`` instead
  cannot fault at all, but costs ~1.7x the mapped copy for a read of 30 runs of 8-32 KiB.)
* :meth:`BlockStore.put` (allocate and write) is all or nothing: on failure no record stays
  allocated and slabs grown for it are released (their files deleted).
* stores, tiers and offloaders refuse ``copy`` and ``pickle`` (:class:`NotCopyable`): their
  records live in files and memory owned by this process.
"""

from __future__ import annotations

import errno
import heapq
import mmap
import os
import weakref
import zlib
from collections.abc import Iterable
from typing import NoReturn

import numpy as np
import torch

from ..errors import KVTierError

BACKENDS = ("cpu", "disk")
#: A slab holds at least this many records, else an eighth of the capacity so far ...
SLAB_MIN_RECORDS = 16
#: ... up to this many bytes per slab.
SLAB_MAX_BYTES = 8 << 20


class OffloadError(KVTierError):
    """An offloading failure kvtier can name: a directory that cannot be used, a full disk, or
    a block whose record is missing or fails its checksum."""


class RecordError(OffloadError):
    """Records that cannot be read back; ``records`` lists their ids (the caller names the block)."""

    def __init__(self, message: str, records: list[int]):
        super().__init__(message)
        self.records = records


COPY_ERROR = (
    "an offloading cache cannot be copied or pickled: its blocks live in a store owned by this process; "
    "build a new TieredCache"
)


class NotCopyable:
    """Refuses ``copy.copy``, ``copy.deepcopy`` and ``pickle`` with an :class:`OffloadError`: a copy
    would share (or lose) the records, files and worker thread of the original."""

    def __copy__(self) -> NoReturn:
        raise OffloadError(COPY_ERROR)

    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise OffloadError(COPY_ERROR)

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        raise OffloadError(COPY_ERROR)


def slab_sizes(records: int, record_bytes: int) -> list[int]:
    """Records per slab of a store holding ``records`` records (the growth rule, for planning)."""
    cap = max(1, SLAB_MAX_BYTES // max(1, record_bytes))
    sizes: list[int] = []
    total = 0
    while total < records:
        size = min(cap, max(SLAB_MIN_RECORDS, total // 8))
        sizes.append(size)
        total += size
    return sizes


def store_capacity(records: int, record_bytes: int) -> int:
    """Records a store allocates to hold ``records`` records."""
    return sum(slab_sizes(records, record_bytes))


def readahead(ranges: list[tuple[str, int, int]]) -> None:
    """Ask the OS to start reading file ``ranges`` ``(path, offset, length)`` into the page cache
    (``POSIX_FADV_WILLNEED``: the reads are queued together, so the device serves them in parallel
    instead of one page fault at a time). Advice only: a file that is gone is skipped. The call
    may block while the device's queue is full, so a caller that must not wait runs it on a thread
    (it releases the GIL)."""
    by_path: dict[str, list[tuple[int, int]]] = {}
    for path, off, length in ranges:
        by_path.setdefault(path, []).append((off, length))
    for path, spans in by_path.items():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            for off, length in spans:
                os.posix_fadvise(fd, off, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def check_directory(path: str | None) -> str:
    """The absolute directory ``path`` if it exists and is writable; else an :class:`OffloadError`
    (an empty path too: it is not taken to mean the current directory)."""
    if path is None or not str(path).strip():
        raise OffloadError(f"offload directory {path!r} is not allowed: name a directory")
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isdir(path):
        raise OffloadError(f"offload directory {path!r} does not exist (or is not a directory)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OffloadError(f"offload directory {path!r} is not writable")
    return path


def _close_maps(maps: list[mmap.mmap], paths: list[str]) -> None:
    """Finalizer of a disk store: unmap and delete its files (never references the store). Keeps
    going past a file it cannot delete (the offloader removes its whole directory afterwards)."""
    for mm in maps:
        try:
            mm.close()
        except BufferError:  # a view is still alive: the mapping goes when it does
            pass
    for p in paths:
        try:
            os.unlink(p)
        except OSError:  # already gone, or its directory was made unwritable
            pass
    maps.clear()
    paths.clear()


def _reserve(fd: int, size: int) -> None:
    """Give the open file ``fd`` ``size`` bytes of real disk space (ENOSPC now, not at a page fault)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)
        return
    zeros = bytes(1 << 20)
    left = size
    while left > 0:  # no fallocate (macOS): write zeros
        left -= os.write(fd, zeros[: min(left, len(zeros))])


class BlockStore(NotCopyable):
    """A pool of ``record_bytes``-byte records addressed by int64 ids.

    Parameters
    ----------
    record_bytes : size of one record.
    backend : ``"cpu"`` (host RAM) or ``"disk"`` (memory-mapped files in ``directory``).
    directory : where disk slabs go (must exist and be writable).
    name : file-name prefix of this store's slabs (one store per layer shares a directory).
    pin : allocate ``"cpu"`` slabs in pinned memory (set when the compute runs on CUDA).
    """

    def __init__(
        self, record_bytes: int, backend: str = "cpu", directory: str | None = None, name: str = "store", pin=False
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not allowed: expected one of {BACKENDS}")
        if not isinstance(record_bytes, int) or record_bytes <= 0:
            raise ValueError(f"record_bytes={record_bytes!r} is not allowed: expected an int > 0")
        self.record_bytes = record_bytes
        self.backend = backend
        self.name = name
        self.pin = bool(pin) and backend == "cpu"
        self.directory = None if backend == "cpu" else check_directory(directory)
        self._slabs: list[torch.Tensor] = []  # cpu backend: uint8 [S, record_bytes]
        self._maps: list[mmap.mmap] = []  # disk backend
        self._paths: list[str] = []
        self._starts: list[int] = []  # first id of each slab
        self._crc: torch.Tensor | None = None  # disk: int32 [capacity], crc32 of each record
        self._free: list[int] = []  # heap of free ids below capacity
        self._live = bytearray()  # 1 where a record is allocated
        self.capacity = 0
        self.version = 0  # bumped whenever slabs are added or released (record addresses change)
        self._finalizer = weakref.finalize(self, _close_maps, self._maps, self._paths)

    # --- bookkeeping ------------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Records currently allocated."""
        return self.capacity - len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes the store holds (RAM slabs or disk files): its offloaded bytes."""
        return self.capacity * self.record_bytes

    def tensors(self) -> list[torch.Tensor]:
        """Tensors kept next to the compute (the disk checksums); slabs are not among them."""
        return [] if self._crc is None else [self._crc]

    def _grow(self) -> None:
        """Add one slab (all or nothing: a slab that cannot be made leaves no file behind)."""
        size = slab_sizes(self.capacity + 1, self.record_bytes)[-1]
        if self.backend == "cpu":
            self._slabs.append(torch.empty(size, self.record_bytes, dtype=torch.uint8, pin_memory=self.pin))
        else:
            with torch.inference_mode(False):  # written in place later, maybe outside inference mode
                crc = torch.zeros(size, dtype=torch.int32)
                crc = crc if self._crc is None else torch.cat([self._crc, crc])
            mm, path = self._new_file(size)
            self._maps.append(mm)
            self._paths.append(path)
            self._crc = crc
        self._starts.append(self.capacity)
        self._free.extend(range(self.capacity, self.capacity + size))
        heapq.heapify(self._free)
        self._live.extend(bytes(size))
        self.capacity += size
        self.version += 1

    def _release_slabs(self, keep: int) -> None:
        """Drop the slabs after the first ``keep`` (all their records free), deleting their files:
        undoes growth for an allocation that failed."""
        if len(self._starts) <= keep:
            return
        cap = self._starts[keep]
        assert not any(self._live[cap:]), "releasing slabs that hold live records"
        del self._slabs[keep:]
        for mm, path in zip(self._maps[keep:], self._paths[keep:]):
            try:
                mm.close()
            except BufferError:  # a view is still alive: the mapping goes when it does
                pass
            try:
                os.unlink(path)
            except OSError:
                pass
        del self._maps[keep:], self._paths[keep:], self._starts[keep:]
        if self._crc is not None:
            with torch.inference_mode(False):
                self._crc = self._crc[:cap].clone() if cap else None
        self._free = [i for i in self._free if i < cap]
        heapq.heapify(self._free)
        del self._live[cap:]
        self.capacity = cap
        self.version += 1

    @property
    def slabs(self) -> int:
        """Slabs the store holds (a mark for :meth:`trim`)."""
        return len(self._starts)

    def trim(self, keep: int = 0) -> None:
        """Release trailing slabs beyond the first ``keep`` that hold no live record (their files
        too): a store whose records were freed after an undone push gives back the slabs that push
        grew, and only those (``keep``: the slab count before it)."""
        n = len(self._starts)
        while n > keep and not any(self._live[self._starts[n - 1] :]):
            n -= 1
        self._release_slabs(n)

    def _new_file(self, size: int) -> tuple[mmap.mmap, str]:
        assert self.directory is not None
        path = os.path.join(self.directory, f"{self.name}-{len(self._maps):04d}.kv")
        nbytes = size * self.record_bytes
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileNotFoundError as err:
            raise OffloadError(f"offload directory {self.directory!r} disappeared: cannot create {path!r}") from err
        except OSError as err:
            raise OffloadError(f"cannot create {path!r} in offload directory {self.directory!r}: {err}") from err
        try:
            _reserve(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        except OSError as err:
            os.close(fd)
            os.unlink(path)
            if err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OffloadError(
                    f"no space left for offloaded KV blocks in {self.directory!r} "
                    f"(needed {nbytes} more bytes for {path!r})"
                ) from err
            raise OffloadError(f"cannot write {path!r} in offload directory {self.directory!r}: {err}") from err
        os.close(fd)  # the mapping keeps the file open (a descriptor of its own: mmap.size() stats it)
        return mm, path

    def allocate(self, n: int) -> torch.Tensor:
        """``n`` free record ids (lowest first), growing the pool as needed: int64 ``[n]``.
        All or nothing: if a slab cannot be added, those added for this call are released."""
        self._check_open()
        slabs = len(self._starts)
        try:
            while len(self._free) < n:
                self._grow()
        except BaseException:
            self._release_slabs(slabs)
            raise
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for i in ids:
            self._live[i] = 1
        return torch.tensor(ids, dtype=torch.long)

    def put(self, data: torch.Tensor) -> torch.Tensor:
        """Allocate and write records ``data`` (uint8 ``[n, record_bytes]``): their ids, int64 ``[n]``.

        All or nothing: on failure no record stays allocated and slabs grown for the call are
        released, so the store is as before (``live``, ``capacity``, files).
        """
        slabs = len(self._starts)
        ids = self.allocate(data.shape[0])
        try:
            self.write(ids, data)
        except BaseException:
            self.free(ids)
            self._release_slabs(slabs)
            raise
        return ids

    def free(self, ids: torch.Tensor) -> None:
        """Return records to the pool (ids that are not allocated are ignored)."""
        for i in ids.tolist():
            if 0 <= i < self.capacity and self._live[i]:
                self._live[i] = 0
                heapq.heappush(self._free, i)

    def _runs(self, ids: torch.Tensor) -> list[tuple[int, int, int, int]]:
        """``(start, end, slab, first_slot)`` of each run of consecutive ids (in the given order)
        within one slab: records are moved a run at a time (one memcpy). Plain numpy: these are a
        few hundred integers, not worth torch's thread pool."""
        x = ids.numpy()
        slab = np.searchsorted(np.asarray(self._starts), x, side="right") - 1
        brk = np.ones(x.size, dtype=bool)
        brk[1:] = (x[1:] != x[:-1] + 1) | (slab[1:] != slab[:-1])
        starts = np.flatnonzero(brk)
        ends = np.append(starts[1:], x.size)
        first = x[starts] - np.asarray(self._starts)[slab[starts]]
        return list(zip(starts.tolist(), ends.tolist(), slab[starts].tolist(), first.tolist()))

    def _unbacked(self, slabs: Iterable[int]) -> list[int]:
        """Disk: the slabs among ``slabs`` whose file is now shorter than its mapping (truncated
        behind our back), whose mapped pages would raise ``SIGBUS`` when touched. One ``fstat`` per
        slab: ``mmap.size()`` is the size of the file, ``len()`` that of the mapping."""
        if self.backend != "disk":
            return []
        return [s for s in sorted(set(slabs)) if self._maps[s].size() < len(self._maps[s])]

    def _shrunk(self, slabs: list[int]) -> str:
        """What is wrong with the files of ``slabs`` (see :meth:`_unbacked`), for messages."""
        return ", ".join(
            f"offload file {self._paths[s]!r} was truncated to {self._maps[s].size()} of {len(self._maps[s])} bytes"
            for s in slabs
        )

    def _slab_view(self, s: int) -> np.ndarray:
        """uint8 ``[S, record_bytes]`` array over slab ``s`` (a view of the mapping for disk: drop it
        soon). Copies go through numpy: one single-threaded memcpy per run, which is what moving
        records needs (torch would split each copy over its intra-op threads, which only costs
        when the cores are busy with the model)."""
        if self.backend == "cpu":
            return self._slabs[s].numpy()
        return np.frombuffer(self._maps[s], dtype=np.uint8).reshape(-1, self.record_bytes)

    def drop_page_cache(self) -> None:
        """Disk backend: write this store's pages back and drop its files from the OS page cache,
        so that the next reads come from the device - what reads cost when the offloaded blocks do
        not fit in RAM (benchmarks/offload_bench.py --drop-page-cache). No-op for ``"cpu"``."""
        if self.backend != "disk":
            return
        bad = self._unbacked(range(len(self._maps)))
        if bad:  # msync of pages a file no longer backs
            raise OffloadError(f"cannot write back the {self.name!r} store: {self._shrunk(bad)}")
        for mm, path in zip(self._maps, self._paths):
            try:
                mm.flush()
                if hasattr(mm, "madvise"):
                    mm.madvise(mmap.MADV_DONTNEED)  # unmap our pages, else the kernel keeps them cached
                fd = os.open(path, os.O_RDONLY)
            except OSError as err:
                raise OffloadError(f"cannot write back offload file {path!r}: {err}") from err
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def file_ranges(self, ids: torch.Tensor) -> list[tuple[str, int, int]]:
        """Disk backend: ``(path, offset, length)`` of the file bytes holding records ``ids`` (any
        order; sorted, adjacent records merged), for :func:`readahead`. ``[]`` for ``"cpu"``."""
        if self.backend != "disk" or ids.numel() == 0 or self.closed:
            return []
        x = ids.reshape(-1).to("cpu", torch.long).unique()  # sorted
        x = x[(x >= 0) & (x < self.capacity)]
        return self._file_ranges(self._runs(x))

    def _file_ranges(self, runs: list[tuple[int, int, int, int]]) -> list[tuple[str, int, int]]:
        """``(path, offset, length)`` of each run of :meth:`_runs` (disk backend)."""
        return [(self._paths[s], lo * self.record_bytes, (b - a) * self.record_bytes) for a, b, s, lo in runs]

    def addresses(self, ids: torch.Tensor) -> torch.Tensor:
        """``"cpu"`` backend: the memory address of each record ``ids`` (int64, any shape; ``-1``
        gives 0), for kernels that read records where they lie. Valid until the store grows,
        shrinks or closes; the ids must be allocated (not checked here: callers pass ids of their
        block table)."""
        if self.backend != "cpu":
            raise OffloadError(f"the {self.backend} store {self.name!r} has no stable record addresses")
        self._check_open()
        if not self._starts:
            return torch.zeros_like(ids)
        starts = torch.tensor(self._starts, dtype=torch.long)
        bases = torch.tensor([t.data_ptr() for t in self._slabs], dtype=torch.long)
        flat = ids.reshape(-1)
        slab = torch.searchsorted(starts, flat.clamp(min=0), right=True) - 1
        addr = bases[slab] + (flat - starts[slab]) * self.record_bytes
        return torch.where(flat >= 0, addr, torch.zeros_like(addr)).reshape(ids.shape)

    # --- data -------------------------------------------------------------------------------
    def write(self, ids: torch.Tensor, data: torch.Tensor) -> None:
        """Write records: ``ids`` int64 ``[n]`` (allocated), ``data`` uint8 ``[n, record_bytes]``."""
        if data.dtype != torch.uint8 or data.shape != (ids.numel(), self.record_bytes):
            raise ValueError(f"data must be uint8 [{ids.numel()}, {self.record_bytes}], got {data.dtype} {data.shape}")
        self._check_live(ids)
        data = data.detach().to("cpu").contiguous()
        src = data.numpy()
        runs = self._runs(ids) if ids.numel() else []
        bad = self._unbacked(s for _, _, s, _ in runs)
        if bad:
            raise OffloadError(f"cannot write {ids.numel()} record(s) of the {self.name!r} store: {self._shrunk(bad)}")
        views: dict[int, np.ndarray] = {}
        try:
            for a, b, s, lo in runs:
                view = views.get(s)
                if view is None:
                    view = views[s] = self._slab_view(s)
                view[lo : lo + b - a] = src[a:b]
        finally:
            views.clear()  # drop views of the mappings (a traceback must not keep them alive)
        if self._crc is not None:
            rows = data.numpy()
            crc = [zlib.crc32(rows[i]) for i in range(rows.shape[0])]
            self._crc[ids] = torch.tensor(crc, dtype=torch.int64).to(torch.int32)  # wraps mod 2^32

    def read(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Records ``ids`` (int64 ``[n]``) as uint8 ``[n, record_bytes]`` (into ``out`` if given).

        Raises :class:`RecordError` for ids that are not allocated, whose file was truncated, or
        whose bytes fail the crc32.
        """
        ids = ids.to("cpu", torch.long)
        self._check_live(ids)
        if out is None:
            out = torch.empty(ids.numel(), self.record_bytes, dtype=torch.uint8, pin_memory=self.pin)
        if ids.numel() == 0:
            return out
        dst = out.numpy()
        runs = self._runs(ids)
        bad = self._unbacked(s for _, _, s, _ in runs)
        if bad:
            recs = [i for a, b, s, _ in runs if s in bad for i in ids[a:b].tolist()]
            shown = f"{recs[:8]}" if len(recs) <= 8 else f"{recs[:8]} (and {len(recs) - 8} more)"
            raise RecordError(f"record(s) {shown} cannot be read: {self._shrunk(bad)}", recs)
        if self.backend == "disk" and len(runs) > 1:  # queue every run's read at once, then copy
            readahead(self._file_ranges(runs))
        views: dict[int, np.ndarray] = {}
        try:
            for a, b, s, lo in runs:
                view = views.get(s)
                if view is None:
                    view = views[s] = self._slab_view(s)
                dst[a:b] = view[lo : lo + b - a]
        finally:
            views.clear()
        if self._crc is not None:
            rows = out.numpy()
            crc = torch.tensor([zlib.crc32(rows[i]) for i in range(rows.shape[0])], dtype=torch.int64)
            bad = (crc.to(torch.int32) != self._crc[ids]).nonzero().flatten()
            if bad.numel():
                recs = ids[bad].tolist()
                files = sorted({self._paths[s] for _, _, s, _ in self._runs(ids[bad])})
                raise RecordError(f"record(s) {recs} failed the crc32 check (file {', '.join(files)})", recs)
        return out

    def _check_open(self) -> None:
        if self.closed:
            raise OffloadError(f"the {self.backend} store {self.name!r} is closed")

    def _check_live(self, ids: torch.Tensor) -> None:
        self._check_open()
        bad = [i for i in ids.tolist() if not (0 <= i < self.capacity and self._live[i])]
        if bad:
            raise RecordError(f"record(s) {bad} are missing from the {self.backend} store {self.name!r}", bad)

    def close(self) -> None:
        """Release the storage and delete the files (idempotent)."""
        self._finalizer()
        self._slabs.clear()
        self._free.clear()
        self._live = bytearray()
        self._starts.clear()
        self._crc = None
        self.capacity = 0
        self.version += 1

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def files(self) -> list[str]:
        """Paths of this store's slab files (disk backend)."""
        return list(self._paths)
