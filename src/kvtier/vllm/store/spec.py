"""vLLM's side of the prefix store: the out-of-tree ``OffloadingSpec`` its ``OffloadingConnector`` loads.

vLLM's ``OffloadingConnector`` (``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``)
keeps its scheduler logic (block hashes, which blocks to look up, load and store, job tracking) and
asks an ``OffloadingSpec`` for two objects: a scheduler-side ``OffloadingManager`` (lookup,
prepare/complete load and store, keyed by ``OffloadKey`` = block hash + group) and a worker-side
``OffloadingWorker`` (``submit_store``/``submit_load``/``get_finished``/``wait`` over per-layer int8
page views ``(num_blocks, page_bytes)``). :class:`KVTierOffloadingSpec` gives both: the manager owns
the engine's :class:`kvtier.vllm.store.prefix.PrefixStore` in vLLM's scheduler process (the engine
core), each worker (one per tensor-parallel rank; in the engine core with vLLM's in-process
executor, a process of its own under its default multiprocessing) copies its KV heads of whole
blocks between vLLM's pages and the shared transfer slots of :mod:`kvtier.vllm.store.slots`.
Records hold every KV head whatever the parallel layout (a server with TP = 2 and one with TP = 1
share block files and Redis records).

Page layout (vLLM CPU attention, ``KVCacheLayout.LBHNC``): one layer's page of one block is
``[H, T, 2 * D]`` elements, keys then values per head, each in the order of vLLM's CPU kernels
for the ISA it picked (``vec``: keys ``[D, T]``, values ``[T, D]``; ``amx``: 16x2 tiles), found
once per engine by :func:`page_layout` through vLLM's own ``cpu_attn_reshape_and_cache``. The
store's records hold a block over all layers in canonical order, ``kv: [L, H, 2, T, D]`` (before
block format version 2 the page bytes were read as if already in that order: the codecs' channel
groups and sink tokens fell on the wrong elements).

Loads decode on the scheduler's thread when vLLM prepares them (the request waits for them
anyway; a decoding thread competing for the GIL with the engine's polling loop was 20x slower on
the CPU platform); stores encode on the store's worker thread once every worker copied its part.

Failure: vLLM's offloading worker asserts that every transfer succeeded (``get_finished``), so a
load cannot fail after lookup said hit. Every check therefore happens at lookup (block files are
read and verified there, see :mod:`kvtier.vllm.store.prefix`; a hit also needs a free transfer
slot); loads decode records already checked and pinned in RAM. A failed store only makes a future
miss.

Imports vLLM (this module is loaded by vLLM, or through :mod:`kvtier.vllm.store.config`), torch,
``kvtier.errors`` and the store's own modules (:mod:`.blocks`, :mod:`.config`, :mod:`.prefix`,
:mod:`.remote`, :mod:`.slots`);
never :mod:`kvtier.vllm.pages`, transformers or ``kvtier.hf``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...errors import KVTierError
from ..page_events import pages_loaded
from .blocks import BlockFormat
from .config import StoreConfig
from .policy import get_store_policy
from .prefix import PrefixStore
from .remote import RemoteTier, load_key
from .slots import SlotArea, SlotPool, pointer_path, slot_dir

logger = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """kvtier's records print through vLLM's handler in this process, at vLLM's level.

    vLLM configures only its own ``vllm`` logger; kvtier's INFO records (the store's startup line)
    were dropped in a served engine and its warnings printed without vLLM's prefix. Nothing changes
    where the application gave ``kvtier`` a handler of its own, or where vLLM has none.
    """
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = theirs.propagate


_LOOKUP = {"hit": LookupResult.HIT, "pending": LookupResult.HIT_PENDING, "miss": LookupResult.MISS}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: store counter -> (vLLM metric name, documentation): kvtier's series in vLLM's stats log and in
#: the server's ``/metrics`` (counters; ``*_ns`` counters are reported in seconds)
STORE_COUNTERS: dict[str, tuple[str, str]] = {
    "lookup_hits": ("vllm:kvtier_store_lookup_hits", "Blocks kvtier's prefix store reported as hits at lookup."),
    "lookup_misses": ("vllm:kvtier_store_lookup_misses", "Blocks kvtier's prefix store reported as misses at lookup."),
    "disk_hits": ("vllm:kvtier_store_disk_hits", "Hits read from block files (then kept in RAM where it has room)."),
    "disk_promoted": ("vllm:kvtier_store_disk_promoted", "Blocks hit from disk and kept in RAM."),
    "stored": ("vllm:kvtier_store_blocks_stored", "Blocks encoded into the store."),
    "loaded": ("vllm:kvtier_store_blocks_loaded", "Blocks decoded from the store into vLLM's KV cache."),
    "step_downs": ("vllm:kvtier_store_step_downs", "Blocks re-encoded to the colder codec under RAM pressure."),
    "to_disk": ("vllm:kvtier_store_to_disk", "Blocks that left RAM for their block file."),
    "evicted": ("vllm:kvtier_store_evicted", "Blocks dropped from the store."),
    "store_refused": ("vllm:kvtier_store_refused", "Blocks not stored: larger than the RAM budget."),
    "corrupt": ("vllm:kvtier_store_corrupt_files", "Block files that failed their checks (misses)."),
    "disk_errors": ("vllm:kvtier_store_disk_errors", "Block file writes or removals that failed."),
    "disk_evicted": ("vllm:kvtier_store_disk_evicted", "Block files removed by the disk budget."),
    "disk_bytes_written": ("vllm:kvtier_store_disk_bytes_written", "Bytes written to block files."),
    "store_ns": ("vllm:kvtier_store_encode_seconds", "Seconds spent encoding blocks (store thread)."),
    "load_ns": ("vllm:kvtier_store_decode_seconds", "Seconds spent decoding blocks for loads."),
    "slots_short": (
        "vllm:kvtier_store_slots_short",
        "Hits reported as misses: every transfer slot was promised to other loads this step.",
    ),
    "store_slots_short": (
        "vllm:kvtier_store_store_slots_short",
        "Blocks not stored: no transfer slot free for stores (raise transfer_bytes).",
    ),
    "remote_hits": (
        "vllm:kvtier_store_remote_hits",
        "Hits read from the shared Redis pool (checked, then kept in RAM).",
    ),
    "remote_promoted": ("vllm:kvtier_store_remote_promoted", "Blocks hit from Redis and kept in RAM."),
    "remote_misses": ("vllm:kvtier_store_remote_misses", "Lookups the Redis pool did not answer with a record."),
    "remote_writes": ("vllm:kvtier_store_remote_writes", "Records written to the Redis pool."),
    "remote_bytes_written": ("vllm:kvtier_store_remote_bytes_written", "Bytes written to the Redis pool."),
    "remote_errors": ("vllm:kvtier_store_remote_errors", "Redis calls that failed (down, slow, refused, full)."),
    "remote_skipped": ("vllm:kvtier_store_remote_skipped", "Redis reads and writes skipped while it was failing."),
    "remote_dropped": ("vllm:kvtier_store_remote_dropped", "Redis writes dropped: too many waiting."),
    "remote_rejected": (
        "vllm:kvtier_store_remote_rejected",
        "Records from Redis that failed their checks or did not open (wrong key, tampered): misses.",
    ),
    "remote_state_changes": ("vllm:kvtier_store_remote_state_changes", "Changes of the Redis pool's health state."),
}
#: gauge name -> documentation
STORE_GAUGES: dict[str, str] = {
    "vllm:kvtier_store_ram_bytes": "Bytes of kvtier's prefix store counted against cpu_bytes.",
}

#: block buffers a manager keeps for the copies waiting to be encoded (a burst allocates more, freed after)
KEPT_BUFFERS = 8

_STORES: dict[str, PrefixStore] = {}
_STORES_LOCK = threading.Lock()


def engine_store(engine_id: str) -> PrefixStore | None:
    """The store of an engine whose scheduler runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
    tests, benchmarks), or None."""
    return _STORES.get(engine_id)


class KVTierLoadStoreSpec(LoadStoreSpec):
    """Which store blocks a transfer reads or writes (their keys, in the order of vLLM's block ids)
    and the transfer slot of each (:mod:`kvtier.vllm.store.slots`)."""

    def __init__(self, keys: Collection[bytes], slots: Collection[int]):
        self.keys = list(keys)
        self.slots = list(slots)

    def __repr__(self) -> str:
        return f"KVTierLoadStoreSpec({len(self.keys)} blocks)"


class KVTierManager(OffloadingManager):
    """Scheduler side: vLLM's manager contract over the engine's :class:`PrefixStore` and the
    transfer slots shared with its workers.

    Stores: :meth:`prepare_store` reserves the blocks it has slots for, the workers copy their
    pages into the slots, :meth:`complete_store` (every worker done) copies each block out of its
    slot, frees the slot and has the store's thread encode the copy. Loads: a hit at
    :meth:`lookup` promises a slot, :meth:`prepare_load` decodes the record into it,
    :meth:`complete_load` frees it.
    """

    def __init__(self, store: PrefixStore, area: SlotArea, tokens_per_block: int):
        self.store = store
        self.area = area
        self.pool = SlotPool(area.count)
        self.tokens_per_block = tokens_per_block
        self._stores: dict[bytes, int] = {}  # key -> slot, until its store job completes
        self._loads: dict[bytes, list[int]] = {}  # key -> [slot, jobs], until its load jobs complete
        self._promised: set[bytes] = set()  # hits of this step (requests sharing a prefix share a slot)
        # blocks copied out of their slots, waiting for the store's thread to encode them (a slot
        # is held one step, whatever the encoding backlog); reused: a fresh tensor per block costs
        # page faults on every store
        self._buffers: list[torch.Tensor] = []
        self._buffers_lock = threading.Lock()
        self._reported: dict[str, int] = {}  # counters at the last get_stats

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.store.lookup(key)
        if found == "hit" and key not in self._loads and key not in self._promised:
            if not self.pool.promise():
                self.store.counters["slots_short"] += 1
                return LookupResult.MISS
            self._promised.add(key)
        return _LOOKUP[found]

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The store's counters since the last call and its RAM bytes (vLLM's stats log and ``/metrics``)."""
        counters = self.store.counter_snapshot()
        stats = OffloadingConnectorStats()
        for key, (name, _) in STORE_COUNTERS.items():
            delta = counters.get(key, 0) - self._reported.get(key, 0)
            if delta:
                stats.increase_counter(name, delta / 1e9 if key.endswith("_ns") else delta)
        self._reported = counters
        stats.set_gauge("vllm:kvtier_store_ram_bytes", self.store.ram_bytes)
        return stats

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Decode each block into a transfer slot (on this thread: the request waits for it anyway,
        and a decoding thread contends for the GIL with the engine's loop)."""
        keys = list(keys)
        slots = []
        self.store.pin(keys)
        try:
            for key in keys:
                held = self._loads.get(key)
                if held is None:
                    slot = self.pool.take_load()
                    self._loads[key] = held = [slot, 0]
                    try:
                        self.store.read(key, self.area.slot(slot))
                    except BaseException:
                        del self._loads[key]
                        self.pool.release([slot])
                        raise
                held[1] += 1
                slots.append(held[0])
        finally:
            self.store.unpin(keys)
        return KVTierLoadStoreSpec(keys, slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        for key in keys:
            held = self._loads.get(key)
            if held is not None:
                held[1] -= 1
                if held[1] <= 0:
                    del self._loads[key]
                    self.pool.release([held[0]])

    def _sink(self, key: OffloadKey, req_context: ReqContext) -> int:
        end = req_context.get_offload_key_position(key)
        if end is None:
            return 0
        start = end - self.tokens_per_block
        return max(0, min(self.tokens_per_block, self.store.policy.sink_tokens - start))

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        self.store.touch(keys)
        new = self.store.reserve(keys, [self._sink(k, req_context) for k in keys])
        slots = self.pool.take_store(len(new))
        if len(slots) < len(new):  # no transfer slot left: these stay unstored (a future miss)
            self.store.abort(new[len(slots) :])
            self.store.counters["store_slots_short"] += len(new) - len(slots)
            new = new[: len(slots)]
        self._stores.update(zip(new, slots))
        return PrepareStoreOutput(keys_to_store=new, store_spec=KVTierLoadStoreSpec(new, slots), evicted_keys=[])

    def _encode(self, key: bytes, kv: torch.Tensor) -> None:
        try:
            self.store.put(key, kv)
        except Exception:  # put forgets the block: a future miss
            logger.exception("kvtier: a block could not be encoded into the store")
        finally:
            with self._buffers_lock:
                if len(self._buffers) < KEPT_BUFFERS:
                    self._buffers.append(kv)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Every worker copied its part: the blocks leave their slots for the store's thread (in the
        order they were prepared: vLLM passes a set, and a sequence's blocks are best written in order)."""
        keys = set(keys)
        for key in [k for k in self._stores if k in keys]:
            slot = self._stores.pop(key)
            if success:
                with self._buffers_lock:
                    kv = self._buffers.pop() if self._buffers else None
                kv = torch.empty_like(self.area.slot(slot)) if kv is None else kv
                kv.copy_(self.area.slot(slot))
                self.store.submit(self._encode, key, kv)
            else:
                self.store.abort([key])
            self.pool.release([slot])

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.store.maintain()
        self._promised.clear()
        self.pool.end_step()

    def reset_cache(self) -> None:
        # vLLM discards the jobs in flight (their completions never come): their slots wait a few
        # steps, since a worker may still copy into them in the next step
        self.pool.retire(list(self._stores.values()) + [held[0] for held in self._loads.values()])
        self._stores.clear()
        self._loads.clear()
        self.store.flush()
        self.store.reset()

    def shutdown(self) -> None:
        self.store.flush()


class KVTierWorker(OffloadingWorker):
    """Worker side (one per tensor-parallel rank): copies this rank's heads ``[head0, head0 + H)``
    of whole blocks between vLLM's pages and the transfer slots, inline (a block is a few hundred
    KB: the slow parts, encoding and decoding, run in the scheduler's process)."""

    def __init__(
        self,
        area: SlotArea,
        fmt: BlockFormat,
        kv_caches: CanonicalKVCaches,
        group_ids: Sequence[int] = (0,),
        head0: int = 0,
        engine_id: str | None = None,
    ):
        self.area = area
        self.engine_id = engine_id  # whose side buffers learn of the packed pages a load writes
        self.fmt = fmt  # this rank's pages
        self.heads = slice(head0, head0 + fmt.heads)
        if len(kv_caches.group_data_refs) != len(group_ids):
            raise KVTierError(
                f"kvtier's prefix store expected {len(group_ids)} KV-cache groups, vLLM registered "
                f"{len(kv_caches.group_data_refs)}"
            )
        # a store key's group (vLLM's KV-cache group id, in the key) -> that group's layers
        self.group_of = {gid: i for i, gid in enumerate(group_ids)}
        # vLLM's CPU pages keep K/V in its kernels' order: gathered into [H, 2, T, D] through `perm`
        # (packed pages are stored byte for byte)
        self.perm = None if fmt.page_bytes else page_layout(fmt.heads, fmt.tokens, fmt.head_dim, fmt.dtype)
        # per layer: [num_blocks, H, 2, T, D] views of vLLM's pages (flat [num_blocks, H*2*T*D] with a
        # `perm`), or [num_blocks, page_bytes] packed pages
        self.groups = [self._views(kv_caches, refs) for refs in kv_caches.group_data_refs]
        self._done: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()

    def _views(self, kv_caches: CanonicalKVCaches, refs: list) -> list[torch.Tensor]:  # noqa: ANN001
        """One group's per-layer views: ``[num_blocks, H, 2, T, D]`` of vLLM's pages (flat
        ``[num_blocks, H*2*T*D]`` with a ``perm``), or ``[num_blocks, page_bytes]`` packed pages."""
        fmt = self.fmt
        page = fmt.exact_bytes // fmt.layers
        if len(refs) != fmt.layers:
            raise KVTierError(f"kvtier's prefix store expected {fmt.layers} layers per group, vLLM has {len(refs)}")
        views = []
        for ref in refs:
            t = kv_caches.tensors[ref.tensor_idx].tensor
            if ref.page_size_bytes != page or t.device.type != "cpu":
                raise KVTierError(
                    f"kvtier's prefix store expected {page}-byte CPU pages ({fmt}), vLLM has {ref.page_size_bytes} "
                    f"bytes on {t.device}"
                )
            view = t[:, :page].view(fmt.kv_dtype)
            views.append(view if self.perm is not None else view.view(t.shape[0], *fmt.shape[1:]))
        return views

    def _pages(self, key: bytes) -> list[torch.Tensor]:
        """The layers of the KV-cache group a store key belongs to (vLLM's key carries its group)."""
        gid = get_offload_group_idx(key)
        if gid not in self.group_of:
            raise KVTierError(f"store key of KV-cache group {gid}: this engine offloads groups {sorted(self.group_of)}")
        return self.groups[self.group_of[gid]]

    def _gather(self, pages: list[torch.Tensor], block: int, slot: torch.Tensor) -> None:
        """This rank's heads of ``block`` into ``slot: [L, H, 2, T, D]`` (or packed pages)."""
        if self.fmt.page_bytes:
            torch.stack([p[block] for p in pages], out=slot)
            return
        for layer, p in enumerate(pages):
            dst = slot[layer, self.heads]  # contiguous: heads are a layer's outer dimension
            if self.perm is None:
                dst.copy_(p[block])
            else:
                torch.index_select(p[block], 0, self.perm, out=dst.view(-1))

    def _scatter(self, pages: list[torch.Tensor], block: int, slot: torch.Tensor) -> None:
        """This rank's heads of ``slot: [L, H, 2, T, D]`` (or packed pages) into vLLM's pages of ``block``."""
        for layer, p in enumerate(pages):
            src = slot[layer] if self.fmt.page_bytes else slot[layer, self.heads]
            if self.perm is None:
                p[block].copy_(src)
            else:
                p[block].index_copy_(0, self.perm, src.reshape(-1))

    def _transfer(self, job_id: int, what: str, block_ids, spec: LoadStoreSpec) -> bool:  # noqa: ANN001
        assert isinstance(spec, KVTierLoadStoreSpec)
        blocks = [int(b) for b in block_ids]
        if not len(blocks) == len(spec.keys) == len(spec.slots):
            raise KVTierError(
                f"{what} job {job_id}: {len(blocks)} vLLM blocks for {len(spec.keys)} store blocks and "
                f"{len(spec.slots)} slots"
            )
        copy = self._gather if what == "store" else self._scatter
        t0 = time.perf_counter()
        for key, block, slot in zip(spec.keys, blocks, spec.slots):
            copy(self._pages(key), block, self.area.slot(slot))
        if what == "load" and self.fmt.page_bytes:  # whole packed pages: no exact rows of them stay valid
            pages_loaded(self.engine_id, blocks)
        size = len(blocks) * self.fmt.exact_bytes
        self._done.put(TransferResult(job_id, True, size, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, "store", src_spec.block_ids, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, "load", dst_spec.block_ids, src_spec)

    def get_finished(self) -> list[TransferResult]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every transfer is done when ``submit_*`` returns."""


def page_layout(heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Where vLLM's CPU attention keeps each element of one layer's page, probed through its own op.

    vLLM's CPU backend writes a block's keys and values with ``cpu_attn_reshape_and_cache`` in an
    order of its ISA's kernels (``vec``: per head, keys ``[D, T]`` then values ``[T, D]``; ``amx``:
    keys in ``[T/16, D/2, 16, 2]`` tiles, values in ``[D/16, T/2, 16, 2]``), not ``[H, 2, T, D]``.
    The store's codecs need the canonical order (keys per channel, sinks are the first tokens), so
    this writes index patterns through the same op and ISA the engine uses (three passes: token,
    head and channel numbers, keys positive, values negative) and reads where they landed.

    Returns ``perm`` (int64, ``[H * 2 * T * D]``): ``page.flatten()[perm]`` is the block's
    ``[H, 2, T, D]`` K/V flattened; None when the page already is in that order. Raises KVTierError
    when the probe does not find every element exactly once (an unknown layout: refused, never a
    silently scrambled block).
    """
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, tokens, head_dim, "auto")
    except (ImportError, AttributeError) as err:
        raise KVTierError(
            f"kvtier's prefix store cannot find this vLLM's CPU page layout ({err}): it supports vLLM 0.32-0.33"
        ) from None
    n = heads * 2 * tokens * head_dim
    cache = torch.zeros(2, heads, tokens, 2 * head_dim, dtype=dtype)  # block 1 is probed (block 0: padding)
    key_cache, value_cache = cache.view(2, heads, 2 * tokens, head_dim).chunk(2, dim=2)
    slots = torch.arange(tokens, 2 * tokens, dtype=torch.int64)
    grid = torch.meshgrid(torch.arange(tokens), torch.arange(heads), torch.arange(head_dim), indexing="ij")
    found = []
    for x in grid:  # [T, H, D] numbers + 1: exact in bf16 up to 256
        cache.zero_()
        k = (x + 1).to(dtype)
        ops.cpu_attn_reshape_and_cache(k, -k, key_cache, value_cache, slots, isa)
        found.append(cache[1].flatten().to(torch.float32, copy=True))
    t, h, d = (f.abs().long() - 1 for f in found)
    is_value = (found[0] < 0).long()
    canonical = ((h * 2 + is_value) * tokens + t) * head_dim + d
    if found[0].eq(0).any() or torch.bincount(canonical.clamp(0, n - 1), minlength=n).ne(1).any():
        raise KVTierError(
            f"kvtier's prefix store does not know vLLM's CPU page layout (isa {isa!r}, {heads} heads, {tokens} tokens, "
            f"head size {head_dim}): use policy 'exact' (stores pages byte for byte)"
        )
    perm = torch.empty(n, dtype=torch.int64)
    perm[canonical] = torch.arange(n)
    return None if torch.equal(perm, torch.arange(n)) else perm


def _packed_pages(vllm_config, heads: int, head_dim: int, dtype: torch.dtype) -> tuple[str, int] | None:  # noqa: ANN001
    """``(page policy name, bytes per page)`` where the engine attends through kvtier's packed pages
    (its ``additional_config`` names a packed page policy), else None."""
    from ...codecs.pages import PageFormat
    from ..pages.policy import CONFIG_KEY, parse_policy_name

    name = (vllm_config.additional_config or {}).get(CONFIG_KEY)
    if name is None:
        return None
    policy = parse_policy_name(name)
    return (name, PageFormat(policy, heads, head_dim, dtype).page_bytes) if policy.packed else None


def _block_format(config: OffloadingConfig) -> tuple[BlockFormat, str | None, int]:
    """This worker's block format (its rank's KV heads), in an engine on kvtier's packed pages the
    page policy's name, and the model's KV heads over all ranks."""
    from vllm.config import get_current_vllm_config_or_none

    group = config.groups[0]  # all of one size (checked by the spec)
    dtype = _DTYPES.get(config.model.dtype)
    if dtype is None:
        raise KVTierError(
            "kvtier's prefix store needs kv_cache_dtype 'auto' with a float16/bfloat16/float32 model, "
            f"got {config.model.dtype!r}"
        )
    layers, tokens = len(group.layer_names), group.tokens_per_block
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is not None:
        mc = vllm_config.model_config
        heads, head_dim = mc.get_num_kv_heads(vllm_config.parallel_config), mc.get_head_size()
        total_heads = mc.get_total_num_kv_heads()
    else:  # the page size only gives heads * head_dim
        raise KVTierError("kvtier's prefix store could not read the model's KV heads and head size from vLLM's config")
    pages = _packed_pages(vllm_config, heads, head_dim, dtype)
    fmt = BlockFormat(layers, heads, tokens, head_dim, dtype, page_bytes=0 if pages is None else pages[1])
    one_group = len(config.groups) == 1  # several groups share vLLM's tensors: its per-block figure is not ours
    if one_group and config.worker_kv_bytes_per_block and config.worker_kv_bytes_per_block != fmt.exact_bytes:
        raise KVTierError(
            f"kvtier's prefix store computed {fmt.exact_bytes} bytes per block ({fmt}), vLLM "
            f"{config.worker_kv_bytes_per_block}: only plain full-attention models are supported"
        )
    return fmt, None if pages is None else pages[0], total_heads


def _check_parallel(config: OffloadingConfig) -> None:
    """Refuse, where vLLM builds the engine, parallel layouts the store does not split blocks for."""
    par = config.parallel
    others = {"pipeline": par.pp_size, "prefill context": par.pcp_size, "decode context": par.dcp_size}
    for name, size in others.items():
        if size != 1:
            raise KVTierError(
                f"kvtier's prefix store supports tensor parallelism only: {name} parallel size is {size} (expected 1)"
            )


class KVTierOffloadingSpec(OffloadingSpec):
    """The spec named by :func:`kvtier.vllm.kv_transfer_config` (``spec_name``/``spec_module_path``).

    vLLM builds one spec in the scheduler's process (the engine core) and one in each worker
    (the same process with vLLM's in-process executor; processes of their own under its default
    multiprocessing and per tensor-parallel rank). Each worker's spec knows the model's KV heads and
    head size (it registers the KV caches inside vLLM's config context); rank 0's creates the
    transfer area (:class:`SlotArea`) with the block format in its header. The scheduler's spec,
    built after every worker registered, opens the area and builds the :class:`PrefixStore`.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        out: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=doc) for name, doc in STORE_COUNTERS.values()
        }
        out.update({name: OffloadingGaugeMetadata(documentation=doc) for name, doc in STORE_GAUGES.items()})
        return out

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.store_config = StoreConfig.from_extra(self.extra_config)
        # vLLM's hybrid KV-cache manager (e.g. Gemma 3: 5 sliding-window groups + 1 full group) gives
        # groups of equal size; a store key carries its group, so every group's blocks are records
        # of one format (vLLM decides which blocks of a sliding group are worth storing)
        shapes = {(len(g.layer_names), g.tokens_per_block) for g in config.groups}
        if len(shapes) != 1:
            raise KVTierError(
                "kvtier's prefix store needs KV-cache groups of one size (layers, tokens per block), vLLM gives "
                f"{sorted(shapes)}: build the engine with disable_hybrid_kv_cache_manager=True (one group)"
            )
        if self.blocks_per_chunk != 1:
            raise KVTierError("kvtier's prefix store stores one vLLM block per record: leave block_size unset")
        _check_parallel(config)
        _log_through_vllm()
        self._manager: KVTierManager | None = None
        self._worker: KVTierWorker | None = None

    def _build_store(self, fmt: BlockFormat, pages: str | None) -> PrefixStore:
        """The engine's store over blocks of ``fmt`` (all KV heads); ``pages``: the packed page
        policy's name where the engine attends through kvtier's packed pages."""
        config, sc = self.config, self.store_config
        policy = sc.store_policy if pages is None else get_store_policy("exact")
        fields = sc.policy_fields() if pages is None else asdict(policy)
        what = [config.model.name, str(fmt), fields, self.tokens_per_hash]
        if pages is not None:  # the page layout is the codec: one folder per page policy
            what.append(pages)
        ident = json.dumps(what, sort_keys=True)
        namespace = "kvtier-" + hashlib.sha256(ident.encode()).hexdigest()[:16]
        remote = None
        if sc.remote is not None:  # a bad key source is refused here, at engine build
            key = None if sc.remote_key is None else load_key(sc.remote_key)
            remote = RemoteTier(sc.remote, namespace, ttl=sc.remote_ttl, timeout=sc.remote_timeout, key=key)
        store = PrefixStore(policy, fmt, sc.cpu_bytes, sc.disk_path, namespace, sc.disk_bytes, remote)
        logger.info("%s", store.describe())
        if pages is not None and policy != sc.store_policy:
            logger.info(
                "kvtier prefix store: this engine's KV is in kvtier's packed pages (%s), stored as they "
                "are: the codecs of store policy %r do not apply",
                pages,
                sc.policy,
            )
        return store

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            pointer = pointer_path(slot_dir(), self.config.engine_id)
            area = SlotArea.open(pointer)
            SlotArea.unlink(pointer, area.path)  # every worker has it mapped: no name outlives the engine
            store = self._build_store(area.fmt, area.info.get("pages"))
            self._manager = KVTierManager(store, area, self.tokens_per_block[0])
            with _STORES_LOCK:
                _STORES[self.config.engine_id] = store
            logger.info(
                "kvtier prefix store: %d transfer slots (%.0f MiB shared with %d worker(s))",
                area.count,
                area.count * area.fmt.exact_bytes / 2**20,
                self.config.parallel.world_size,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            config, par = self.config, self.config.parallel
            fmt, pages, total_heads = _block_format(config)
            tp, rank = par.tp_size, par.rank % par.tp_size
            if tp > 1 and (pages is not None or total_heads != fmt.heads * tp):
                raise KVTierError(
                    f"kvtier's prefix store under tensor parallel size {tp} needs the KV heads ({total_heads}) split "
                    "evenly across ranks and vLLM's own pages (not kvtier's packed pages)"
                )
            full = replace(fmt, heads=total_heads) if pages is None else fmt
            area = None
            if par.rank == 0:
                area = SlotArea.create(full, self.store_config.transfer_bytes, {"pages": pages})
            if tp > 1:  # the other ranks map the file rank 0 created (its name is unique to this start)
                from vllm.distributed import get_tp_group

                path = get_tp_group().broadcast_object(None if area is None else str(area.path), src=0)
                area = area or SlotArea.open(path)
            if par.rank == 0:
                area.publish(pointer_path(slot_dir(), config.engine_id))
            groups = [g.group_id for g in config.groups]
            self._worker = KVTierWorker(
                area, fmt, kv_caches, groups, head0=rank * fmt.heads, engine_id=config.engine_id
            )
        return self._worker


def store_stats(engine_id: str) -> dict[str, Any] | None:
    """Counters of an engine's store in this process (None when it runs elsewhere)."""
    store = engine_store(engine_id)
    return None if store is None else store.stats()
