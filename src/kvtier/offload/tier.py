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
blocks from the sketches through :meth:`OffloadTier.select` (which reuses a kept selection where
the policy allows) and :meth:`OffloadTier.sources` gets them, from what the prefetcher staged or
synchronously from the store; :class:`OffloadStats` counts it.

This module owns the storage moves (a :class:`~kvtier.tier.Tier`: push, truncate, drop_front,
put_front, index_select, release) and the reads; two parts it composes own the rest: the
selection memory (:class:`~kvtier.offload.selection.SelectionMemory`: the selection kept for reuse,
the prediction, the budget estimates) and the staging (:class:`~kvtier.offload.staging.Staging`:
the prefetch in flight and the staged blocks). May import: torch, ``kvtier.offload``,
``kvtier.codecs``, ``kvtier.indexing``, ``kvtier.policy``, ``kvtier.stats``, ``kvtier.tier``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..codecs import check_params, value_group
from ..policy import TierPolicy
from ..stats import OffloadStats
from ..tier import Tier
from .prefetch import Offloader
from .records import RecordLayout
from .selection import BUDGET_WARN_SHARE, SelectionMemory
from .sketch import KeySketch, unpack_valid
from .staging import Staging
from .store import BlockStore, NotCopyable, OffloadError, RecordError, store_capacity

__all__ = ["BUDGET_WARN_SHARE", "OffloadTier", "planned_bytes"]

#: What :meth:`OffloadTier.select` calls for a fresh selection: ``(keep [B,H,R,n], scores
#: [B,H,R,n], blocks scored, estimated skipped share [B,H,R] or None)``.
Fresh = Callable[[], tuple[torch.Tensor, torch.Tensor, int, "torch.Tensor | None"]]


class OffloadTier(Tier, NotCopyable):
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
        # (weak reference to the table, store version, kptr): see record_addresses
        self._addresses: tuple | None = None
        self.stats = OffloadStats()
        self.memory = SelectionMemory(op, self.stats)
        self.staging = Staging(offloader, self.device, self.stats, self.layout.record_bytes)
        #: Diagnostic (benchmarks): measure the exact mass of the blocks each row skipped, reading
        #: every block of the tier at every call (slow). Counted in ``stats.skipped_*``.
        self.measure_skipped = False
        offloader.register(self)

    # --- tier interface (storage moves) -------------------------------------------------------
    @property
    def nblocks(self) -> int:
        return 0 if not self.fields else self.fields["valid_bits"].shape[2]

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
        """The per-step prediction and the store's slab count (what a layer's journal restores
        beside the block moves)."""
        return self.memory.state(), self.store.slabs

    def restore(self, state: tuple) -> None:
        """Put the prediction back and release the slabs grown since :meth:`state` (their records
        were freed by the undone pushes; slabs that held records before stay, as in a store that
        never ran the undone call)."""
        self.drop_staging()
        memory, slabs = state
        self.memory.restore(memory)
        self.store.trim(keep=slabs)

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
        self.memory.moved()
        self.release({"table": gone})  # the slabs the push grew go in restore

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
        self.memory.moved()
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
        self.memory.moved()

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
        self.memory.index_select(index)
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
        out += [] if self.table is None else [self.table]
        out += self.memory.tensors()
        if self._addresses is not None:
            out += list(self._addresses[2:])
        return out + self.store.tensors()

    def staging_tensors(self) -> list[torch.Tensor]:
        return self.staging.tensors()

    @property
    def offloaded_bytes(self) -> int:
        return self.store.nbytes

    def close(self) -> None:
        """Drop everything and delete the store's files."""
        self.drop_staging()
        self.store.close()
        self.fields, self.table = {}, None
        self.memory.moved()
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

    def sources(self, union: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Exact K/V of every block in ``union: bool [B, H, n]``, as *sources* ``(blocks [B, H, k],
        k, v [B, H, k, T, D])``: the staged blocks in place, the others read synchronously
        (:meth:`kvtier.offload.staging.Staging.sources`)."""
        return self.staging.sources(union, self.read_blocks)

    def select(self, B: int, H: int, R: int, fresh: Fresh, reuse: bool) -> torch.Tensor:
        """The blocks each of ``R`` query rows per (row, KV head) attends: bool ``[B, H, R, n]``.

        ``fresh()`` computes a new selection (attention's maths: sketch scores, the mass rule, the
        budget) as ``(keep [B,H,R,n], scores [B,H,R,n], blocks scored, estimated skipped share
        [B,H,R] or None)``. With ``reuse`` (the C++ decode path) the kept selection is returned
        instead while ``OffloadPolicy.reuse_every`` allows, a fresh one is kept for the next steps,
        and the prediction is recorded only when prefetching; without, every call is fresh and
        predicts. The selection memory counts what it did.
        """
        vb = self.fields["valid_bits"]
        if reuse:
            keep = self.memory.reused(B, H, R, vb)
            if keep is not None:
                return keep
        keep, scores, scored, skipped = fresh()
        if skipped is not None:
            self.memory.note_estimate(skipped)
        if not reuse:
            self.memory.observe(keep, scores)
            return keep
        self.memory.remember(keep, scored, vb)
        if self.prefetch_enabled:
            self.memory.observe(keep, scores)
        return keep

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

    # --- prefetch -----------------------------------------------------------------------------
    @property
    def prefetch_enabled(self) -> bool:
        """The policy's choice; auto (``None``): on unless the store is host RAM and compute is on the CPU."""
        if self.policy.prefetch is not None:
            return self.policy.prefetch
        return self.policy.backend == "disk" or self.device.type != "cpu"

    def predicted_blocks(self) -> torch.Tensor:
        """bool ``[B, H, n]``: the blocks predicted for this layer's next attention that hold real
        tokens (:meth:`SelectionMemory.predicted_blocks`)."""
        if self.table is None:
            return torch.zeros(0, 0, 0, dtype=torch.bool)
        return self.memory.predicted_blocks(self.table.shape, self.fields["valid_bits"])

    def predicted_ranges(self) -> list[tuple[str, int, int]]:
        """Disk store: the file ranges of the predicted blocks' records (for the step's readahead)."""
        if self.store.backend != "disk" or self.table is None or self.memory.predicted is None:
            return []
        return self.store.file_ranges(self.table[self.predicted_blocks()])

    def submit_prefetch(self) -> None:
        """Start fetching the predicted blocks on the offloader's worker (no-op when off or staged)."""
        if not self.prefetch_enabled or self.staging.busy:
            return
        listed = self.predicted_blocks()
        if bool(listed.any()):
            self.staging.submit(listed, self.read_blocks)

    def drop_staging(self) -> None:
        """Release staged blocks (:meth:`Staging.drop`)."""
        self.staging.drop()

    # --- prediction ---------------------------------------------------------------------------
    def end_step(self) -> None:
        """The layer's attention is over: keep the prediction, release staging."""
        self.memory.end_step()
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
