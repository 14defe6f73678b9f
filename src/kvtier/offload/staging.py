"""Staging of one offloaded layer: the blocks fetched ahead of its attention, and the fetch in flight.

:class:`Staging` runs a layer's prefetch on the cache's :class:`~kvtier.offload.prefetch.Offloader`
worker (reading the predicted blocks into attention layout on the compute device, fp32; a side
stream and an event on CUDA), stages the result when attention starts, and hands attention its
*sources* (:meth:`Staging.sources`): the staged blocks in place plus a synchronous read of the
misses, each selected block in exactly one source. It counts hits, misses, prefetched and unused
blocks, bytes moved and stall time in the layer's :class:`~kvtier.stats.OffloadStats`.

It reads through the tier's reader (``read(blocks [B, H, k]) -> k, v [B, H, k, T, D]``, passed per
call, so no reference cycle ties it to its tier). May import: torch, ``kvtier.indexing``,
``kvtier.stats``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ..indexing import union_blocks
from ..stats import OffloadStats

#: Reads blocks ``[B, H, k]`` (``-1``: none) into ``k, v [B, H, k, T, D]`` fp32 on the compute device.
Reader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Staging:
    """Prefetched blocks of one offloaded layer (see the module docstring).

    Parameters
    ----------
    offloader : the cache's :class:`~kvtier.offload.prefetch.Offloader` (worker, CUDA side stream).
    device : the compute device.
    stats : the layer's counters (shared with its tier).
    record_bytes : bytes of one record (what a fetched block moves).
    """

    def __init__(self, offloader: Any, device: torch.device, stats: OffloadStats, record_bytes: int):
        self.offloader = offloader
        self.device = device
        self.stats = stats
        self.record_bytes = record_bytes
        self.pending: Future | None = None
        # (blocks [B,H,k], k, v [B,H,k,T,D] on the device, listed bool [B,H,n], used bool [B,H,n])
        self.staged: tuple | None = None

    @property
    def busy(self) -> bool:
        """A fetch is in flight or its blocks are staged."""
        return self.pending is not None or self.staged is not None

    def submit(self, listed: torch.Tensor, read: Reader) -> None:
        """Start fetching the blocks ``listed: bool [B, H, n]`` on the offloader's worker."""
        self.pending = self.offloader.submit(self._job, listed, read)

    def _job(self, listed: torch.Tensor, read: Reader) -> tuple:
        """Worker thread: read the listed blocks into attention layout on the device, converted
        to fp32, so that the compute thread neither copies nor converts them (a side stream and an
        event on CUDA)."""
        t0 = time.perf_counter()
        blocks = union_blocks(listed.unsqueeze(2))[0]
        event = None
        if self.device.type == "cuda":
            stream = self.offloader.stream(self.device)
            with torch.cuda.stream(stream):
                k, v = read(blocks)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            k, v = read(blocks)
        return blocks, k, v, listed, event, time.perf_counter() - t0

    def wait(self) -> None:
        """Wait for the fetch in flight, if any, and stage its result (a failed one is dropped:
        its blocks become misses, read and checked synchronously)."""
        if self.pending is None:
            return
        fut, self.pending = self.pending, None
        try:
            blocks, k, v, listed, event, busy = fut.result()
        except Exception:  # noqa: BLE001 - a bad record is reported by the synchronous read
            return
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            k.record_stream(current)
            v.record_stream(current)
        count = int(listed.sum())
        self.stats.prefetched += count
        self.stats.bytes_moved += count * self.record_bytes
        self.stats.fetch_s += busy
        listed = listed.to(self.device)
        self.staged = (blocks.to(self.device), k, v, listed, torch.zeros_like(listed))

    def drop(self) -> None:
        """Release staged blocks (counting those never used); a fetch in flight is cancelled or
        waited for."""
        if self.pending is not None and self.pending.cancel():
            self.pending = None
        self.wait()
        if self.staged is not None:
            listed, used = self.staged[3], self.staged[4]
            self.stats.unused += int((listed & ~used).sum())
            self.staged = None

    def sources(self, union: torch.Tensor, read: Reader) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Exact K/V of every block in ``union: bool [B, H, n]`` (blocks some query row of each
        (row, KV head) selected), as *sources* ``(blocks [B, H, k], k, v [B, H, k, T, D])``.

        Blocks staged are used in place - the staged source lists the predicted blocks, a
        superset, so callers mask each row by its own selection - and the others are read
        synchronously (``read``) into a second source: each selected block is in exactly one
        source and nothing staged is copied again. Counts needed blocks, hits, misses, bytes and
        stall.
        """
        st = self.stats
        t0 = time.perf_counter()
        self.wait()
        stall = time.perf_counter() - t0
        sources = []
        miss = union
        if self.staged is not None:
            blocks, k, v, listed, used = self.staged
            hit = union & listed
            miss = union & ~hit
            if bool(hit.any()):
                sources.append((blocks, k, v))
                used |= hit
            st.hits += int(hit.sum())
        n_miss = int(miss.sum())
        if n_miss:
            t1 = time.perf_counter()
            blocks = union_blocks(miss.unsqueeze(2))[0]
            k, v = read(blocks)
            sources.append((blocks, k, v))
            stall += time.perf_counter() - t1
            st.bytes_moved += n_miss * self.record_bytes
        st.needed += int(union.sum())
        st.misses += n_miss
        st.stall_s += stall
        return sources

    def tensors(self) -> list[torch.Tensor]:
        """The staged tensors (blocks, k, v, listed, used)."""
        return [] if self.staged is None else list(self.staged)
