"""The offloaded cold tier of one layer: resident key sketches and a block table over a block store.

When a block leaves the hot (or warm) tier it is split in two:

* resident, next to the compute: a 1-bit key sketch (:mod:`kvtier.offload.sketch`) and validity
  ``valid_bits: uint8 [B, 1, n, ceil(T/8)]`` (packed; pads and captured sinks are 0), stored like a
  :class:`~kvtier.cache.tiers.BlockTier`'s fields, plus the block table ``table: int64 [B, H, n]``
  mapping (row, KV head, cold block) to a record id of the store;
* offloaded: one record per (row, KV head, block) holding the exact keys and values (or their
  8-/4-bit codes, :mod:`kvtier.offload.records`) in a :class:`~kvtier.offload.store.BlockStore`.

Beam search and batch selection permute table rows; no data moves and records no row refers to
any more are freed (vLLM-style, beam-safe). Attention (:mod:`kvtier.attention.offloaded`) chooses
blocks from the sketches and :meth:`OffloadTier.gather` gets them, from what the prefetcher staged
(:mod:`kvtier.offload.prefetch`) or synchronously from the store; :class:`OffloadStats` counts it.
"""

from __future__ import annotations

import time
import warnings
import weakref
from concurrent.futures import Future

import torch

from ..codecs import check_params, value_group
from ..errors import BudgetWarning
from ..indexing import union_blocks
from ..policy import TierPolicy
from ..stats import OffloadStats
from .prefetch import Offloader
from .records import RecordLayout
from .sketch import KeySketch, nonempty, unpack_valid
from .store import BlockStore, NotCopyable, OffloadError, RecordError, store_capacity

#: :meth:`OffloadTier.note_estimate` warns when a call's rows leave more than this mean share of
#: their estimated attention mass unread because of the read budget.
BUDGET_WARN_SHARE = 0.05


class OffloadTier(NotCopyable):
    """Cold blocks of one layer: sketches and block table resident, exact K/V in a store.

    Parameters
    ----------
    policy : the layer's policy (``cold="offload"``).
    head_dim, dtype, device : learned from the layer's first tensors; ``dtype`` is the storage dtype.
    value_group : value scale group of k-bit records.
    offloader : the cache's :class:`~kvtier.offload.prefetch.Offloader`.
    layer_idx : the layer's index (in error messages and the prefetch order).
    """

    is_offloaded = True

    def __init__(
        self,
        policy: TierPolicy,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        value_group: int,
        offloader: Offloader,
        layer_idx: int | None = None,
    ):
        op = policy.offload
        assert op is not None
        if offloader.closed:
            raise OffloadError("this cache was closed; build a new TieredCache")
        self.policy = op
        self.block_tokens = policy.block_tokens
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.layer_idx = 0 if layer_idx is None else layer_idx
        self.sketch = KeySketch(rotate=policy.cold_rotation)
        self.layout = RecordLayout(policy.block_tokens, head_dim, dtype, op.store_bits, value_group)
        self.store = BlockStore(
            self.layout.record_bytes,
            op.backend,
            offloader.directory(op),
            name=f"layer{self.layer_idx:03d}",
            pin=self.device.type == "cuda",
        )
        self.offloader = offloader
        self.fields: dict[str, torch.Tensor] = {}  # k_signs, k_scale, k_mean [B,H,n,...]; valid [B,1,n,T]
        self.table: torch.Tensor | None = None  # int64 [B, H, n] record ids (host)
        self.predicted: torch.Tensor | None = None  # bool [B, H, n'] blocks predicted for the next step
        self._observed: torch.Tensor | None = None  # prediction being built during this step
        self._pending: Future | None = None
        # (blocks [B,H,k], k, v [B,H,k,T,D] on the device, listed bool [B,H,n], used bool [B,H,n])
        self._staged: tuple | None = None
        self._selection: tuple[torch.Tensor, int] | None = None  # (keep [B,H,R,n'], steps reused)
        # (weak reference to the table, store version, kptr): see record_addresses
        self._addresses: tuple | None = None
        self.stats = OffloadStats()
        #: Diagnostic (benchmarks): measure the exact mass of the blocks each row skipped, reading
        #: every block of the tier at every call (slow). Counted in ``stats.skipped_*``.
        self.measure_skipped = False
        offloader.register(self)

    # --- tier interface (as BlockTier) ------------------------------------------------------
    @property
    def nblocks(self) -> int:
        return 0 if not self.fields else self.fields["valid_bits"].shape[2]

    @property
    def ntokens(self) -> int:
        return self.nblocks * self.block_tokens

    def push(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        """Offload tokens ``k, v: [B, H, N, D]`` (``N`` a multiple of the block), ``valid: bool [B, N]``.

        All or nothing: everything is computed first and the store written last
        (:meth:`BlockStore.put`), so on failure (a full disk, a truncated file) no record stays
        allocated, no slab grown for it stays, and ``fields`` / ``table`` are unchanged.
        """
        self.drop_staging()
        B, H, N, D = k.shape
        T = self.block_tokens
        n = N // T
        kb, vb = k.reshape(B, H, n, T, D), v.reshape(B, H, n, T, D)
        bvalid = valid.reshape(B, 1, n, T).to(self.device)
        new = self.sketch.encode(kb, bvalid)  # valid_bits included
        check_params(self.sketch.name, (new["k_amax"], new["k_smax"], new["k_mmax"]), (kb,))  # fp16 maxima
        if self.fields:
            new = {name: torch.cat([self.fields[name], t], dim=2) for name, t in new.items()}
        old = self.nblocks
        table = torch.empty(B, H, old + n, dtype=torch.long)
        if self.table is not None:
            table[:, :, :old] = self.table
        table[:, :, old:] = self.store.put(self.layout.encode(kb, vb, bvalid)).view(B, H, n)
        self.fields, self.table = new, table

    def state(self) -> tuple:
        """The per-step prediction (what a layer's journal restores beside the block moves)."""
        return self.predicted, self._observed

    def restore(self, state: tuple) -> None:
        self.drop_staging()
        self.predicted, self._observed = state
        self._selection = None

    def truncate(self, n: int) -> None:
        """Keep the oldest ``n`` blocks and free the records of the others (undoes a :meth:`push`)."""
        if n >= self.nblocks:
            return
        self.drop_staging()
        assert self.table is not None
        gone = self.table[:, :, n:]
        if n == 0:
            self.fields, self.table = {}, None
        else:
            self.fields = {name: t[:, :, :n].clone() for name, t in self.fields.items()}
            self.table = self.table[:, :, :n].clone()
        self.predicted = None
        self._selection = None
        self.release({"table": gone})
        self.store.trim()

    def drop_front(self, n: int) -> dict[str, torch.Tensor]:
        """Remove the oldest ``n`` blocks from the tier and return them (resident fields and their
        ``table`` of record ids); their records stay allocated until :meth:`release`."""
        self.drop_staging()
        assert self.table is not None
        old = {name: t[:, :, :n].clone() for name, t in self.fields.items()}
        old["table"] = self.table[:, :, :n].clone()
        if n >= self.nblocks:
            self.fields, self.table = {}, None
        else:
            self.fields = {name: t[:, :, n:].clone() for name, t in self.fields.items()}
            self.table = self.table[:, :, n:].clone()
        self.predicted = None
        self._selection = None
        return old

    def put_front(self, old: dict[str, torch.Tensor]) -> None:
        """Put blocks returned by :meth:`drop_front` back in front."""
        if not old:
            return
        self.drop_staging()
        old = dict(old)
        table = old.pop("table")
        if not self.fields:
            self.fields, self.table = old, table
        else:
            self.fields = {name: torch.cat([old[name], t], dim=2) for name, t in self.fields.items()}
            self.table = torch.cat([table, self.table], dim=2)
        self.predicted = None
        self._selection = None

    def release(self, old: dict[str, torch.Tensor]) -> None:
        """Free the records of blocks that left the tier (``old["table"]``), unless still referenced."""
        gone = old["table"].unique()
        if self.table is not None:
            gone = gone[~torch.isin(gone, self.table.unique())]
        self.store.free(gone)

    def index_select(self, index: torch.Tensor) -> None:
        """Select / reorder batch rows (beam search): permute the table, free unreferenced records."""
        self.drop_staging()
        if not self.fields:
            return
        self.fields = {name: t.index_select(0, index.to(t.device)) for name, t in self.fields.items()}
        old = self.table
        self.table = old.index_select(0, index.to(old.device))
        if self.predicted is not None:
            self.predicted = self.predicted.index_select(0, index.to(self.predicted.device))
        self._selection = None
        before, after = old.unique(), self.table.unique()
        self.store.free(before[~torch.isin(before, after)])

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every block fetched exactly (reference path): ``k, v: [B, H, N, D]``, ``valid: [B, N]``."""
        assert self.table is not None
        B, H, n = self.table.shape
        k, v = self.layout.decode(self._read(self.table.flatten()))
        k = k.to(self.device, dtype).reshape(B, H, n * self.block_tokens, self.head_dim)
        v = v.to(self.device, dtype).reshape(B, H, n * self.block_tokens, self.head_dim)
        return k, v, unpack_valid(self.fields["valid_bits"], self.block_tokens).reshape(B, -1)

    def tensors(self) -> list[torch.Tensor]:
        """Resident tensors: sketches, validity, block table, prediction, kept selection, record
        addresses, store checksums."""
        out = list(self.fields.values())
        out += [t for t in (self.table, self.predicted) if t is not None]
        if self._selection is not None:  # the selection kept for reuse and the address cache
            out.append(self._selection[0])
        if self._addresses is not None:
            out += list(self._addresses[2:])
        return out + self.store.tensors()

    def staging_tensors(self) -> list[torch.Tensor]:
        return [] if self._staged is None else list(self._staged)

    @property
    def offloaded_bytes(self) -> int:
        return self.store.nbytes

    def close(self) -> None:
        """Drop everything and delete the store's files."""
        self.drop_staging()
        self.store.close()
        self.fields, self.table, self.predicted = {}, None, None
        self._selection = None
        self.offloader.unregister(self)

    # --- fetching -----------------------------------------------------------------------------
    def _read(self, ids: torch.Tensor) -> torch.Tensor:
        """Records ``ids`` from the store (host); a bad record raises naming layer, block and record."""
        try:
            return self.store.read(ids)
        except RecordError as err:
            raise self._named(err) from err

    def _named(self, err: RecordError) -> OffloadError:
        rid = err.records[0]
        where = "" if self.table is None else (self.table == rid).nonzero()
        if isinstance(where, torch.Tensor) and where.numel():
            b, h, j = where[0].tolist()
            block = f"cold block {j} (row {b}, KV head {h})"
        else:
            block = "a cold block"
        return OffloadError(f"layer {self.layer_idx}: {block}, record {rid}: {err}")

    def record_ids(self, blocks: torch.Tensor) -> torch.Tensor:
        """Record ids of ``blocks: int64 [B, H, k]`` (``-1`` stays ``-1``): int64 ``[B, H, k]`` (host)."""
        assert self.table is not None
        blocks = blocks.to(self.table.device)
        ids = self.table.gather(-1, blocks.clamp(min=0))
        return torch.where(blocks >= 0, ids, torch.full_like(ids, -1))

    def read_blocks(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K/V of ``blocks: int64 [B, H, k]`` read straight into attention layout, in fp32
        (the dtype attention computes in): one gather from the store, one conversion.

        ``-1`` slots hold a copy of some listed block (finite data: callers mask them).

        Returns
        -------
        ``k, v: [B, H, k, T, D]`` fp32, contiguous, on the compute device.
        """
        ids = self.record_ids(blocks)
        B, H, k = ids.shape
        shape = (B, H, k, self.block_tokens, self.head_dim)
        present = ids >= 0
        if not bool(present.any()):
            z = torch.zeros(shape, device=self.device)
            return z, z
        fill = ids[present][0]
        data = self._read(torch.where(present, ids, fill).flatten()).to(self.device, non_blocking=True)
        kd, vd = self.layout.decode(data)  # [B*H*k, T, D]
        return kd.float().reshape(shape), vd.float().reshape(shape)

    def gather(self, union: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Exact K/V of every block in ``union: bool [B, H, n]`` (blocks some query row of each
        (row, KV head) selected), as *sources* ``(blocks [B, H, k], k, v [B, H, k, T, D])``.

        Blocks the prefetcher staged are used in place - the staged source lists the predicted
        blocks, a superset, so callers mask each row by its own selection - and the others are
        read synchronously into a second source: each selected block is in exactly one source
        and nothing staged is copied again. Counts needed blocks, hits, misses, bytes and stall.
        """
        st = self.stats
        t0 = time.perf_counter()
        self._wait_pending()
        stall = time.perf_counter() - t0
        sources = []
        miss = union
        if self._staged is not None:
            blocks, k, v, listed, used = self._staged
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
            k, v = self.read_blocks(blocks)
            sources.append((blocks, k, v))
            stall += time.perf_counter() - t1
            st.bytes_moved += n_miss * self.layout.record_bytes
        st.needed += int(union.sum())
        st.misses += n_miss
        st.stall_s += stall
        return sources

    # --- selection reuse and diagnostics --------------------------------------------------------
    @property
    def in_place(self) -> bool:
        """Attention reads records where they lie: a host-RAM store without prefetch staging."""
        return self.store.backend == "cpu" and self.device.type == "cpu" and not self.prefetch_enabled

    def record_addresses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``"cpu"`` store: addresses of every block's keys and values, int64 ``[B, H, n]`` (exact
        records: keys ``[T, D]`` then values). The key addresses are cached until the block table
        or the store changes (the cache refers to its table weakly: a replaced table is not kept
        alive); the value addresses (a fixed offset) are derived per call."""
        cached = self._addresses
        if cached is not None and cached[0]() is self.table and cached[1] == self.store.version:
            kptr = cached[2]
        else:
            assert self.table is not None and self.layout.bits is None
            kptr = self.store.addresses(self.table)
            self._addresses = (weakref.ref(self.table), self.store.version, kptr)
        vptr = torch.where(kptr != 0, kptr + self.block_tokens * self.head_dim * self.layout.dtype.itemsize, kptr)
        return kptr, vptr

    def _padded(self, keep: torch.Tensor) -> torch.Tensor:
        """A selection ``[B,H,R,n']`` of fewer blocks extended to the tier's ``n``: blocks offloaded
        since (attended exactly in the hot window at that step) are kept when they hold real tokens."""
        B, H, R, old = keep.shape
        n = self.nblocks
        if old == n:
            return keep
        new = nonempty(self.fields["valid_bits"][:, :, old:]).unsqueeze(2).expand(B, H, R, n - old)
        return torch.cat([keep, new], dim=-1)

    def reused_selection(self, B: int, H: int, R: int) -> torch.Tensor | None:
        """The previous selection, extended to blocks offloaded since, when this call may reuse it
        (``policy.reuse_every``; the same batch, heads and rows); else None."""
        steps = self.policy.reuse_every(self.nblocks)
        if steps <= 1 or self._selection is None:
            return None
        keep, age = self._selection
        if age + 1 >= steps or keep.shape[:3] != (B, H, R) or keep.shape[3] > self.nblocks:
            return None
        keep = self._padded(keep)
        self._selection = (keep, age + 1)
        self.stats.reused += 1
        return keep

    def remember_selection(self, keep: torch.Tensor, scored: int) -> None:
        """A fresh selection ``keep [B,H,R,n]`` (``scored`` blocks scored from sketches): counts
        how much of it the previous selection (reused or not) already held, and keeps it."""
        st = self.stats
        st.blocks_scored += scored
        if self._selection is not None:
            prev = self._selection[0]
            if prev.shape[:3] == keep.shape[:3] and prev.shape[3] <= keep.shape[3]:
                union, before = keep.any(2), self._padded(prev).any(2)
                st.reuse_needed += int(union.sum())
                st.reuse_hits += int((union & before).sum())
        self._selection = (keep, 0)

    def measure(self, rows: torch.Tensor, keep: torch.Tensor, lse_res: torch.Tensor) -> None:
        """Diagnostic: the exact softmax mass of the cold blocks each row of ``rows [B,H,R,D]`` did
        not attend (``keep [B,H,R,n]``), relative to the row's total with the resident tokens
        (``lse_res [B,H,R]``), added to ``stats.skipped_*``."""
        B, H, R, D = rows.shape
        k, _, valid = self.dense(torch.float32)  # [B,H,N,D], valid [B,N]
        scores = (rows @ k.transpose(-1, -2)).masked_fill(~valid[:, None, None, :], float("-inf"))
        tok = keep.repeat_interleave(self.block_tokens, dim=-1)  # [B,H,R,N]
        total = torch.logaddexp(lse_res, scores.logsumexp(-1))
        skipped = torch.exp(scores.masked_fill(tok, float("-inf")).logsumexp(-1) - total)
        self.stats.skipped_mass += float(skipped.sum())
        self.stats.skipped_rows += skipped.numel()
        self.stats.skipped_max = max(self.stats.skipped_max, float(skipped.max()))

    def note_estimate(self, skipped: torch.Tensor) -> None:
        """Add a fresh selection's estimated skipped shares ``skipped [B,H,R]`` (see
        :func:`kvtier.attention.offloaded.estimated_skipped`) to ``stats.est_skipped_*``; warn (once
        per message, Python's default filter) when a call's mean share exceeds
        :data:`BUDGET_WARN_SHARE`: the read budget, not the mass rule, then decides the output."""
        st = self.stats
        st.est_skipped_mass += float(skipped.sum())
        st.est_skipped_rows += skipped.numel()
        st.est_skipped_max = max(st.est_skipped_max, float(skipped.max()))
        if float(skipped.mean()) > BUDGET_WARN_SHARE:
            warnings.warn(
                f"kvtier offload: the read budget (OffloadPolicy.max_blocks={self.policy.max_blocks}) left more "
                f"than {BUDGET_WARN_SHARE:.0%} of the estimated attention mass unread in a layer: attention is "
                "diffuse at this length; raise max_blocks (None: the mass rule alone, every block it needs) "
                "for exact-quality output. cache.offload_stats().est_skipped_* has the numbers.",
                BudgetWarning,
                stacklevel=2,
            )

    # --- prefetch -----------------------------------------------------------------------------
    @property
    def prefetch_enabled(self) -> bool:
        """The policy's choice; auto (``None``): on unless the store is host RAM and compute is on the CPU."""
        if self.policy.prefetch is not None:
            return self.policy.prefetch
        return self.policy.backend == "disk" or self.device.type != "cpu"

    def predicted_blocks(self) -> torch.Tensor:
        """bool ``[B, H, n]``: the blocks predicted for this layer's next attention - last step's
        selection and margin, plus every block offloaded since - that hold real tokens."""
        if self.table is None or self.predicted is None:
            return torch.zeros(0, 0, 0, dtype=torch.bool)
        B, H, n = self.table.shape
        known = self.predicted.shape[2]
        mask = torch.ones(B, H, n, dtype=torch.bool)
        mask[:, :, :known] = self.predicted[:, :, :n].cpu()
        return mask & nonempty(self.fields["valid_bits"]).cpu()  # [B, 1, n]: blocks holding real tokens

    def predicted_ranges(self) -> list[tuple[str, int, int]]:
        """Disk store: the file ranges of the predicted blocks' records (for the step's readahead)."""
        if self.store.backend != "disk" or self.table is None or self.predicted is None:
            return []
        return self.store.file_ranges(self.table[self.predicted_blocks()])

    def submit_prefetch(self) -> None:
        """Start fetching the predicted blocks on the offloader's worker (no-op when off or staged)."""
        if not self.prefetch_enabled or self._pending is not None or self._staged is not None:
            return
        listed = self.predicted_blocks()
        if bool(listed.any()):
            self._pending = self.offloader.submit(self._prefetch_job, listed)

    def _prefetch_job(self, listed: torch.Tensor) -> tuple:
        """Worker thread: read the predicted blocks into attention layout on the device, converted
        to fp32, so that the compute thread neither copies nor converts them (a side stream and an
        event on CUDA)."""
        t0 = time.perf_counter()
        blocks = union_blocks(listed.unsqueeze(2))[0]
        event = None
        if self.device.type == "cuda":
            stream = self.offloader.stream(self.device)
            with torch.cuda.stream(stream):
                k, v = self.read_blocks(blocks)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            k, v = self.read_blocks(blocks)
        return blocks, k, v, listed, event, time.perf_counter() - t0

    def _wait_pending(self) -> None:
        """Wait for the prefetch in flight, if any, and stage its result (a failed one is dropped:
        its blocks become misses, read and checked synchronously)."""
        if self._pending is None:
            return
        fut, self._pending = self._pending, None
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
        self.stats.bytes_moved += count * self.layout.record_bytes
        self.stats.fetch_s += busy
        listed = listed.to(self.device)
        self._staged = (blocks.to(self.device), k, v, listed, torch.zeros_like(listed))

    def drop_staging(self) -> None:
        """Release staged blocks (counting those never used); a prefetch in flight is cancelled or
        waited for."""
        if self._pending is not None and self._pending.cancel():
            self._pending = None
        self._wait_pending()
        if self._staged is not None:
            listed, used = self._staged[3], self._staged[4]
            self.stats.unused += int((listed & ~used).sum())
            self._staged = None

    # --- prediction ---------------------------------------------------------------------------
    def observe(self, keep: torch.Tensor, scores: torch.Tensor) -> None:
        """Record this step's selection ``keep: bool [B,H,R,n]`` and block scores ``[B,H,R,n]``."""
        union = keep.any(2)
        margin = self.policy.margin
        if margin:
            best = scores.amax(2).masked_fill(union, float("-inf"))  # [B,H,n]
            k = min(margin, best.shape[-1])
            top = best.topk(k, dim=-1)
            extra = torch.zeros_like(union).scatter(-1, top.indices, torch.isfinite(top.values))
            union = union | extra
        union = union.cpu()
        self._observed = union if self._observed is None else self._observed | union

    def end_step(self) -> None:
        """The layer's attention is over: keep the prediction, release staging."""
        if self._observed is not None:
            self.predicted = self._observed
            self._observed = None
        self.drop_staging()
        self.stats.calls += 1


def planned_bytes(policy: TierPolicy, B: int, H: int, n: int, D: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(resident, offloaded)`` bytes of an offloaded tier holding ``n`` blocks per (row, KV head)
    with distinct records (no beams), after at least one attention (the planner's formula).

    Resident: sketches with packed validity, block table ``8*B*H*n``, prediction ``B*H*n`` and, on
    disk, an int32 checksum per store slot; offloaded: the store's slots.
    """
    op = policy.offload
    assert op is not None
    T = policy.block_tokens
    layout = RecordLayout(T, D, dtype, op.store_bits, value_group(policy, D))
    slots = store_capacity(B * H * n, layout.record_bytes) if n else 0
    resident = KeySketch(policy.cold_rotation).nbytes(B, H, n, T, D) + 8 * B * H * n + B * H * n
    if op.backend == "disk":
        resident += 4 * slots
    return resident, slots * layout.record_bytes
