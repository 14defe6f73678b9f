"""vLLM's side of the prefix store: the out-of-tree ``OffloadingSpec`` its ``OffloadingConnector`` loads.

vLLM's ``OffloadingConnector`` (``vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py``)
keeps its scheduler logic (block hashes, which blocks to look up, load and store, job tracking) and
asks an ``OffloadingSpec`` for two objects: a scheduler-side ``OffloadingManager`` (lookup,
prepare/complete load and store, keyed by ``OffloadKey`` = block hash + group) and a worker-side
``OffloadingWorker`` (``submit_store``/``submit_load``/``get_finished``/``wait`` over per-layer int8
page views ``(num_blocks, page_bytes)``). :class:`KVTierOffloadingSpec` gives both over one
:class:`kvtier.vllm.store.prefix.PrefixStore`, shared through :func:`engine_store` by the scheduler and
the worker of an engine: with one worker (``tensor_parallel_size=1``, vLLM's in-process ``uni``
executor) both live in the engine-core process. The CPU platform switches that executor to ``mp``
(a worker process) unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; GPU platforms keep ``uni``.

Page layout (vLLM CPU attention, ``KVCacheLayout.LBHNC``): one layer's page of one block is
``[H, T, 2 * D]`` elements, keys then values per head, each in the order of vLLM's CPU kernels
for the ISA it picked (``vec``: keys ``[D, T]``, values ``[T, D]``; ``amx``: 16x2 tiles), found
once per engine by :func:`page_layout` through vLLM's own ``cpu_attn_reshape_and_cache``. The
store's records hold a block over all layers in canonical order, ``kv: [L, H, 2, T, D]`` (before
block format version 2 the page bytes were read as if already in that order: the codecs' channel
groups and sink tokens fell on the wrong elements).

Loads decode inline in ``submit_load`` (the request waits for them anyway; a decoding thread
competing for the GIL with the engine's polling loop was 20x slower on the CPU platform); stores
run on the store's worker thread.

Failure: vLLM's offloading worker asserts that every transfer succeeded (``get_finished``), so a
load cannot fail after lookup said hit. Every check therefore happens at lookup (block files are
read and verified there, see :mod:`kvtier.vllm.store.prefix`); loads read records already checked and
pinned in RAM. A failed store only makes a future miss.

Imports vLLM (this module is loaded by vLLM, or through :mod:`kvtier.vllm.store.config`), torch,
``kvtier.errors`` and the store's own modules (:mod:`.blocks`, :mod:`.config`, :mod:`.prefix`);
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
from concurrent.futures import Future
from dataclasses import asdict
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
from .blocks import BlockFormat
from .config import StoreConfig
from .policy import get_store_policy
from .prefix import PrefixStore
from .remote import RemoteTier, load_key

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

_STORES: dict[str, PrefixStore] = {}
_STORES_LOCK = threading.Lock()


def engine_store(engine_id: str) -> PrefixStore | None:
    """The store of an engine running in this process (tests, benchmarks), or None."""
    return _STORES.get(engine_id)


class KVTierLoadStoreSpec(LoadStoreSpec):
    """Which store blocks a transfer reads or writes: their keys, in the order of vLLM's block ids."""

    def __init__(self, keys: Collection[bytes]):
        self.keys = list(keys)

    def __repr__(self) -> str:
        return f"KVTierLoadStoreSpec({len(self.keys)} blocks)"


class KVTierManager(OffloadingManager):
    """Scheduler side: vLLM's manager contract over :class:`PrefixStore` bookkeeping."""

    def __init__(self, engine_id: str, tokens_per_block: int):
        self.engine_id = engine_id
        self.tokens_per_block = tokens_per_block
        self._store: PrefixStore | None = None
        self._reported: dict[str, int] = {}  # counters at the last get_stats

    @property
    def store(self) -> PrefixStore:
        if self._store is None:
            self._store = engine_store(self.engine_id)
            if self._store is None:
                raise KVTierError(
                    "kvtier's prefix store is not in vLLM's scheduler process: it needs vLLM's in-process "
                    "executor (one worker); on the CPU platform set VLLM_ENABLE_V1_MULTIPROCESSING=0"
                )
        return self._store

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self.store.lookup(key)]

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The store's counters since the last call and its RAM bytes (vLLM's stats log and ``/metrics``)."""
        store = self._store or engine_store(self.engine_id)
        if store is None:
            return None
        counters = store.counter_snapshot()
        stats = OffloadingConnectorStats()
        for key, (name, _) in STORE_COUNTERS.items():
            delta = counters.get(key, 0) - self._reported.get(key, 0)
            if delta:
                stats.increase_counter(name, delta / 1e9 if key.endswith("_ns") else delta)
        self._reported = counters
        stats.set_gauge("vllm:kvtier_store_ram_bytes", store.ram_bytes)
        return stats

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        self.store.pin(keys)
        return KVTierLoadStoreSpec(keys)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.unpin(list(keys))

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
        return PrepareStoreOutput(keys_to_store=new, store_spec=KVTierLoadStoreSpec(new), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        if not success:
            self.store.abort(list(keys))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.store.maintain()

    def reset_cache(self) -> None:
        self.store.flush()
        self.store.reset()


class KVTierWorker(OffloadingWorker):
    """Worker side: gathers whole blocks from vLLM's pages into the store and back, on the
    store's worker thread; ``get_finished`` reports what is done."""

    def __init__(self, store: PrefixStore, kv_caches: CanonicalKVCaches, group_ids: Sequence[int] = (0,)):
        self.store = store
        fmt = store.fmt
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
        self._jobs: dict[int, Future] = {}
        # one block each for the store thread's gather and the engine thread's loads: a fresh
        # tensor per block costs page faults on every transfer
        self._stored = torch.empty(fmt.shape, dtype=fmt.kv_dtype)
        self._loaded = torch.empty(fmt.shape, dtype=fmt.kv_dtype)

    def _views(self, kv_caches: CanonicalKVCaches, refs: list) -> list[torch.Tensor]:  # noqa: ANN001
        """One group's per-layer views: ``[num_blocks, H, 2, T, D]`` of vLLM's pages (flat
        ``[num_blocks, H*2*T*D]`` with a ``perm``), or ``[num_blocks, page_bytes]`` packed pages."""
        fmt = self.store.fmt
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

    def _gather(self, pages: list[torch.Tensor], block: int) -> torch.Tensor:
        """``kv: [L, H, 2, T, D]`` (or packed pages) of one block, into the store thread's buffer."""
        if self.perm is None:
            return torch.stack([p[block] for p in pages], out=self._stored)
        flat = self._stored.view(len(pages), -1)
        for layer, p in enumerate(pages):
            torch.index_select(p[block], 0, self.perm, out=flat[layer])
        return self._stored

    def _scatter(self, pages: list[torch.Tensor], block: int, kv: torch.Tensor) -> None:
        """Write ``kv: [L, H, 2, T, D]`` (or packed pages) into vLLM's pages of ``block``."""
        for layer, p in enumerate(pages):
            if self.perm is None:
                p[block].copy_(kv[layer])
            else:
                p[block].index_copy_(0, self.perm, kv[layer].reshape(-1))

    def _run(self, job_id: int, fn, *args) -> None:  # noqa: ANN001
        def job() -> None:
            t0 = time.perf_counter()
            size = 0
            try:
                size = fn(*args)
            except Exception:  # vLLM cannot take a failed transfer; a failed store is a future miss
                logger.exception("kvtier: transfer job %d failed", job_id)
            self._done.put(TransferResult(job_id, True, size, time.perf_counter() - t0))

        self._jobs[job_id] = self.store.submit(job)

    def _store(self, keys: list[bytes], blocks: list[int]) -> int:
        done = 0
        try:
            for key, b in zip(keys, blocks):
                self.store.put(key, self._gather(self._pages(key), b))
                done += 1
        finally:  # a block whose store did not happen must not stay pending (the scheduler waits on it)
            if done < len(keys):
                self.store.abort(keys[done:])
        return len(keys) * self.store.fmt.exact_bytes

    def _load(self, keys: list[bytes], blocks: list[int]) -> int:
        for key, b in zip(keys, blocks):
            self._scatter(self._pages(key), b, self.store.read(key, self._loaded))
        return len(keys) * self.store.fmt.exact_bytes

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KVTierLoadStoreSpec)
        blocks = [int(b) for b in src_spec.block_ids]
        if len(blocks) != len(dst_spec.keys):
            raise KVTierError(f"store job {job_id}: {len(blocks)} vLLM blocks for {len(dst_spec.keys)} store blocks")
        self._run(job_id, self._store, dst_spec.keys, blocks)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, KVTierLoadStoreSpec)
        blocks = [int(b) for b in dst_spec.block_ids]
        if len(blocks) != len(src_spec.keys):
            raise KVTierError(f"load job {job_id}: {len(blocks)} vLLM blocks for {len(src_spec.keys)} store blocks")
        # Inline on the engine's thread: the request waits for these blocks anyway, and on a CPU
        # platform a decoding thread contends for the GIL with the engine's polling loop (a 3 ms
        # decode took 70 ms there). Stores (encode + file write) stay on the store's thread.
        t0 = time.perf_counter()
        size = self._load(src_spec.keys, blocks)
        self._done.put(TransferResult(job_id, True, size, time.perf_counter() - t0))
        return True

    def get_finished(self) -> list[TransferResult]:
        out = []
        while True:
            try:
                r = self._done.get_nowait()
            except queue.Empty:
                return out
            self._jobs.pop(r.job_id, None)
            out.append(r)

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            f = self._jobs.get(job_id)
            if f is not None:
                f.result()

    def shutdown(self) -> None:
        self.store.flush()


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


def _block_format(config: OffloadingConfig) -> tuple[BlockFormat, str | None]:
    """The store's block format and, in an engine on kvtier's packed pages, the page policy's name."""
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
    return fmt, None if pages is None else pages[0]


def _require_one_process() -> None:
    """Refuse, where vLLM builds the engine, an executor that puts the worker in a process of its own.

    The store's scheduler side and its worker side share one :class:`PrefixStore` object, so they
    must run in one process (vLLM's ``uni`` executor). vLLM's CPU platform turns ``uni`` into ``mp``
    unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; without this check the engine built and died at its
    first request.
    """
    from vllm import envs
    from vllm.config import get_current_vllm_config_or_none
    from vllm.platforms import current_platform

    vllm_config = get_current_vllm_config_or_none()
    backend = None if vllm_config is None else vllm_config.parallel_config.distributed_executor_backend
    if backend is None or backend == "uni":
        cpu_mp = current_platform.is_cpu() and envs.VLLM_ENABLE_V1_MULTIPROCESSING
        backend = "mp" if cpu_mp else backend
    if backend not in (None, "uni"):
        raise KVTierError(
            f"kvtier's prefix store needs vLLM's worker in the scheduler's process (executor 'uni'), this engine's "
            f"executor is {backend!r}: set VLLM_ENABLE_V1_MULTIPROCESSING=0 (the CPU platform's default "
            "multiprocessing moves the worker into a process of its own, which the store does not support yet)"
        )


class KVTierOffloadingSpec(OffloadingSpec):
    """The spec named by :func:`kvtier.vllm.kv_transfer_config` (``spec_name``/``spec_module_path``).

    vLLM builds one spec for the scheduler and one for the worker. The worker's creates the store
    (it registers the KV caches at engine start, inside vLLM's config context, where the model's
    KV heads and head size are known); the scheduler's manager finds it by engine id at first use.
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
        if config.parallel.world_size != 1:
            raise KVTierError(
                f"kvtier's prefix store runs with one worker (tensor/pipeline parallel size 1), got world size "
                f"{config.parallel.world_size}"
            )
        _require_one_process()
        _log_through_vllm()
        self._manager: KVTierManager | None = None
        self._worker: KVTierWorker | None = None

    def _create_store(self) -> PrefixStore:
        config = self.config
        with _STORES_LOCK:
            store = _STORES.get(config.engine_id)
            if store is None:
                fmt, pages = _block_format(config)
                sc = self.store_config
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
                _STORES[config.engine_id] = store
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
            self._manager = KVTierManager(self.config.engine_id, self.tokens_per_block[0])
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KVTierWorker(self._create_store(), kv_caches, [g.group_id for g in self.config.groups])
        return self._worker


def store_stats(engine_id: str) -> dict[str, Any] | None:
    """Counters of an engine's store in this process (None when it runs elsewhere)."""
    store = engine_store(engine_id)
    return None if store is None else store.stats()
