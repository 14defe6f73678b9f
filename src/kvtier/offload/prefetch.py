"""The per-cache offloader: disk directories, the prefetch worker, and the layer-to-layer schedule.

Prediction and prefetch. Each offloading layer remembers which cold blocks its query rows
selected at the previous step plus ``margin`` next-best blocks per KV head, and every block that
arrived since (see :meth:`~kvtier.offload.tier.OffloadTier.predicted_blocks`). When layer ``l``'s
attention starts, the offloader submits the fetch of layer ``l + 1``'s predicted records to one
worker thread, which reads them from the store straight into attention layout (and, on CUDA,
copies them to the device on a side stream, recording an event) while layer ``l`` computes; the
first offloading layer of a step submits its own fetch, which overlaps its sink, hot and sketch
work. A layer then waits for its staged blocks (time counted as stall), attends the ones it
selected in place (hits: no second copy on the compute thread) and reads the rest synchronously
(misses, also stall). Staged records are released when the layer's attention ends,
so staging never holds more than two layers and nothing is staged between steps.

Readahead (disk). Staging one layer ahead hides little of a device read: a layer's records are
read a page fault at a time. So the offloader also asks the OS to read the predicted records of
the layers ``READAHEAD_LAYERS`` ahead into the page cache (:func:`~kvtier.offload.store.readahead`,
``POSIX_FADV_WILLNEED``) on a second thread: the device serves those reads at its queue depth
while the layers compute, and the staging and synchronous reads copy from the page cache. Only a
few layers ahead, not the whole step: a layer's mispredicted records, read when its selection is
known, would otherwise queue behind every later layer's readahead. A read of several runs
(:meth:`BlockStore.read`) queues them all the same way before copying.

Disk directories: for each directory named by a disk policy, the offloader creates a private
subdirectory (``kvtier-*``) at construction; missing or read-only directories fail here, naming
the path. The subdirectories are removed by :meth:`Offloader.close` or when the offloader is
garbage-collected (``weakref.finalize``), whichever comes first. A process killed outside Python's
control (``SIGKILL``, a power cut) removes nothing, so each private subdirectory (named
``kvtier-<pid>-*`` after its owner's pid, for humans) holds an empty owner lock file
(``OWNER_LOCK``: no page of a small tmpfs) that the offloader keeps ``flock``-ed for its
lifetime; the kernel releases the lock of a dead process. Before creating its
own subdirectory in a directory, an offloader removes the ``kvtier-*`` subdirectories there whose
lock it can take (:func:`reclaim_orphans`): their owner is gone. A subdirectory without the lock
file, a symbolic link or anything else is left alone, and a failed reclaim only warns. :meth:`Offloader.close` waits
for the worker thread to finish, so none is left running after it. An offloader (like its tiers
and stores) refuses ``copy`` and ``pickle`` with an :class:`~kvtier.offload.store.OffloadError`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..policy import OffloadPolicy
from .store import NotCopyable, OffloadError, check_directory, readahead

if TYPE_CHECKING:
    from .tier import OffloadTier

try:
    import fcntl
except ImportError:  # not POSIX: no owner locks, so no reclaiming either
    fcntl = None  # type: ignore[assignment]

#: Disk readahead runs this many offloading layers ahead of the one attending.
READAHEAD_LAYERS = 3
#: Prefix of the private subdirectories, and the name of the owner lock file inside each.
PRIVATE_PREFIX = "kvtier-"
OWNER_LOCK = "owner.lock"


def _make_private(base: str) -> tuple[str, int | None]:
    """Create a private subdirectory of ``base`` holding its owner lock file, locked: ``(path, fd)``
    (``fd`` None without ``fcntl``). The lock is taken before the file gets its name, so no
    reclaimer ever sees an unlocked lock file of a live offloader; all or nothing."""
    private = tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-", dir=base)
    if fcntl is None:
        return private, None
    fd = None
    try:
        tmp = os.path.join(private, OWNER_LOCK + ".new")
        fd = os.open(tmp, os.O_RDONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, os.path.join(private, OWNER_LOCK))
    except BaseException:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(private, ignore_errors=True)
        raise
    return private, fd


def reclaim_orphans(base: str) -> list[str]:
    """Remove the private subdirectories in ``base`` left by offloaders whose process is gone.

    A ``kvtier-*`` subdirectory (not a symbolic link) whose ``OWNER_LOCK`` file can be
    ``flock``-ed without waiting has no live owner (the kernel drops a dead process's lock; a live
    offloader holds its lock until it removes its subdirectory), so it is removed. Entries without
    the lock file are left alone, entries that vanish meanwhile (a concurrent reclaimer) are
    skipped, and nothing is raised: a subdirectory that cannot be removed gives one warning.

    Returns
    -------
    The paths removed.
    """
    if fcntl is None:
        return []
    removed: list[str] = []
    failed: list[str] = []
    try:
        with os.scandir(base) as it:
            entries = [e for e in it if e.name.startswith(PRIVATE_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        lock = os.path.join(entry.path, OWNER_LOCK)
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))  # never wait on a FIFO
        except OSError:  # no lock file (not ours), or gone already
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its owner is alive
                continue
            try:  # still the directory's lock file (not one a concurrent reclaimer removed)?
                mine, now = os.fstat(fd), os.stat(lock, follow_symlinks=False)
            except OSError:
                continue
            if (mine.st_dev, mine.st_ino) != (now.st_dev, now.st_ino):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            (failed if os.path.lexists(entry.path) else removed).append(entry.path)
        finally:
            os.close(fd)
    if failed:
        warnings.warn(
            f"kvtier could not remove {len(failed)} offload director{'y' if len(failed) == 1 else 'ies'} "
            f"left by a process that is gone: {', '.join(failed)}",
            stacklevel=2,
        )
    return removed


#: at most this long a finalizer waits for a worker's job in flight before removing its directory
JOIN_SECONDS = 2.0


def _shutdown(executors: list[ThreadPoolExecutor], dirs: list[str], locks: list[int]) -> None:
    """Finalizer: stop the worker and delete the private directories, then release their owner
    locks (never references the offloader). It may run on any thread (garbage collection), so it
    never waits without bound: it cancels queued jobs and gives the job in flight (a block read or
    write, milliseconds) up to JOIN_SECONDS to end, so that no job writes into a directory while it
    is removed (a file created during the removal left the directory behind)."""
    here = threading.current_thread()
    for ex in executors:
        ex.shutdown(wait=False, cancel_futures=True)
        for t in list(getattr(ex, "_threads", ())):
            if t is not here:
                t.join(JOIN_SECONDS)
    executors.clear()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
        if os.path.lexists(d):  # a worker that could not be waited for wrote meanwhile: once more
            shutil.rmtree(d, ignore_errors=True)
    dirs.clear()
    for fd in locks:
        try:
            os.close(fd)
        except OSError:
            pass
    locks.clear()


class Offloader(NotCopyable):
    """Shared state of the offloading layers of one cache.

    Parameters
    ----------
    policies : the offload policies of the cache's layers (their disk directories are created here).
    """

    def __init__(self, policies: list[OffloadPolicy]):
        self._dirs: dict[str, str] = {}
        self._created: list[str] = []
        self._locks: list[int] = []  # descriptors of the owner lock files, flock-ed until shutdown
        self._executors: list[ThreadPoolExecutor] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._executors, self._created, self._locks)
        self.tiers: list[OffloadTier] = []
        self._streams: dict[Any, Any] = {}
        for p in policies:
            if p.backend == "disk":
                self.directory(p)

    def directory(self, policy: OffloadPolicy) -> str | None:
        """This cache's private subdirectory for a disk policy (created on first use, after the
        orphans of dead processes in the same directory are removed: :func:`reclaim_orphans`), or None."""
        if policy.backend != "disk":
            return None
        base = check_directory(policy.path if policy.path is not None else tempfile.gettempdir())
        if base not in self._dirs:
            reclaim_orphans(base)
            try:
                private, lock = _make_private(base)
            except OSError as err:
                raise OffloadError(f"offload directory {base!r} is not usable: {err}") from err
            self._dirs[base] = private
            self._created.append(private)
            if lock is not None:
                self._locks.append(lock)
        return self._dirs[base]

    @property
    def directories(self) -> list[str]:
        """The private subdirectories holding this cache's files."""
        return list(self._created)

    # --- layers and schedule ------------------------------------------------------------------
    def register(self, tier: OffloadTier) -> None:
        self.tiers = sorted([t for t in self.tiers if t is not tier] + [tier], key=lambda t: t.layer_idx)

    def unregister(self, tier: OffloadTier) -> None:
        self.tiers = [t for t in self.tiers if t is not tier]

    def submit(self, fn, *args, worker: int = 0) -> Future:
        """Run ``fn(*args)`` on the prefetch worker (``worker=1``: the readahead thread)."""
        if not self._finalizer.alive:
            raise OffloadError("the cache's offloader is closed")
        names = ("kvtier-prefetch", "kvtier-readahead")
        while len(self._executors) <= worker:
            self._executors.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix=names[len(self._executors)]))
        return self._executors[worker].submit(fn, *args)

    def stream(self, device):  # noqa: ANN201 - torch.cuda.Stream
        """The side stream prefetch copies run on (one per CUDA device)."""
        import torch

        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def begin(self, tier: OffloadTier) -> None:
        """Layer ``tier`` starts its attention: schedule its own fetch (first layer of a step) and the next layer's."""
        order = [t for t in self.tiers if t.nblocks]
        if tier not in order:
            return
        i = order.index(tier)
        if i == 0:  # a new step: nothing staged may survive from an interrupted one
            for t in order:
                t.drop_staging()
            self._readahead(order[: READAHEAD_LAYERS + 1])
            tier.submit_prefetch()
        elif i + READAHEAD_LAYERS < len(order):
            self._readahead(order[i + READAHEAD_LAYERS : i + READAHEAD_LAYERS + 1])
        if i + 1 < len(order):
            order[i + 1].submit_prefetch()

    def _readahead(self, tiers: list[OffloadTier]) -> None:
        """Queue the OS reads of ``tiers``' predicted disk records on the readahead thread."""
        ranges = [r for t in tiers if t.prefetch_enabled for r in t.predicted_ranges()]
        if ranges:
            self.submit(readahead, ranges, worker=1)

    def close(self) -> None:
        """Stop the worker (waiting for it to exit) and remove this cache's files and directories
        (idempotent; the directories go even if closing a tier fails)."""
        try:
            for ex in self._executors:
                ex.shutdown(wait=True, cancel_futures=True)
            for t in list(self.tiers):
                t.close()
        finally:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
