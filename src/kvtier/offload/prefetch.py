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
garbage-collected (``weakref.finalize``), whichever comes first. :meth:`Offloader.close` waits
for the worker thread to finish, so none is left running after it. An offloader (like its tiers
and stores) refuses ``copy`` and ``pickle`` with an :class:`~kvtier.offload.store.OffloadError`.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..policy import OffloadPolicy
from .store import NotCopyable, OffloadError, check_directory, readahead

if TYPE_CHECKING:
    from .tier import OffloadTier

#: Disk readahead runs this many offloading layers ahead of the one attending.
READAHEAD_LAYERS = 3


def _shutdown(executors: list[ThreadPoolExecutor], dirs: list[str]) -> None:
    """Finalizer: stop the worker and delete the private directories (never references the offloader).
    It may run on any thread (garbage collection), so it does not wait for the worker."""
    for ex in executors:
        ex.shutdown(wait=False, cancel_futures=True)
    executors.clear()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    dirs.clear()


class Offloader(NotCopyable):
    """Shared state of the offloading layers of one cache.

    Parameters
    ----------
    policies : the offload policies of the cache's layers (their disk directories are created here).
    """

    def __init__(self, policies: list[OffloadPolicy]):
        self._dirs: dict[str, str] = {}
        self._created: list[str] = []
        self._executors: list[ThreadPoolExecutor] = []
        self._finalizer = weakref.finalize(self, _shutdown, self._executors, self._created)
        self.tiers: list[OffloadTier] = []
        self._streams: dict[Any, Any] = {}
        for p in policies:
            if p.backend == "disk":
                self.directory(p)

    def directory(self, policy: OffloadPolicy) -> str | None:
        """This cache's private subdirectory for a disk policy (created on first use), or None."""
        if policy.backend != "disk":
            return None
        base = check_directory(policy.path if policy.path is not None else tempfile.gettempdir())
        if base not in self._dirs:
            try:
                private = tempfile.mkdtemp(prefix="kvtier-", dir=base)
            except OSError as err:
                raise OffloadError(f"offload directory {base!r} is not usable: {err}") from err
            self._dirs[base] = private
            self._created.append(private)
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
