"""The ``Tier`` base: what a layer's block tiers (warm, cold, offloaded cold) have in common.

A tier is a FIFO of blocks of ``block_tokens`` tokens, head-major ``[batch, kv_head, nblocks, ...]``.
The per-layer state machine (:class:`~kvtier.cache.state.LayerState`) moves blocks through tiers
with the verbs below only, and undoes a move with their inverses (:meth:`Tier.truncate` undoes a
:meth:`Tier.push`, :meth:`Tier.put_front` a :meth:`Tier.drop_front`). Whether a tier keeps its
blocks elsewhere (a block store) is a class fact, :attr:`Tier.is_offloaded`, not a probe; the hooks
an offloaded tier needs beside the moves (per-step state, freeing records, staging, store bytes,
closing) have do-nothing defaults here, so callers never branch on the tier's type to call them.

Subclasses: :class:`kvtier.cache.tiers.BlockTier` (encoded blocks in memory) and
:class:`kvtier.offload.tier.OffloadTier` (sketches in memory, exact blocks in a store). It sits
below both (a leaf module: it imports only torch).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch


class Tier:
    """A FIFO of blocks of one layer (see the module docstring).

    Attributes
    ----------
    is_offloaded : class fact: the blocks live in a block store (resident: what selects them).
    block_tokens : tokens per block.
    """

    is_offloaded: ClassVar[bool] = False
    block_tokens: int

    # --- counts --------------------------------------------------------------------------------
    @property
    def nblocks(self) -> int:
        """Blocks held per (row, KV head)."""
        raise NotImplementedError

    @property
    def ntokens(self) -> int:
        """Token slots held per (row, KV head) (pads and captured sinks included)."""
        return self.nblocks * self.block_tokens

    # --- moves ---------------------------------------------------------------------------------
    def push(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        """Append tokens ``k, v: [B, H, N, D]`` (``N`` a multiple of the block), ``valid: bool [B, N]``."""
        raise NotImplementedError

    def truncate(self, n: int) -> None:
        """Keep the oldest ``n`` blocks (undoes a :meth:`push` onto ``n`` blocks)."""
        raise NotImplementedError

    def drop_front(self, n: int) -> dict[str, torch.Tensor]:
        """Remove the oldest ``n`` blocks and return them (what :meth:`put_front` takes back)."""
        raise NotImplementedError

    def put_front(self, old: dict[str, torch.Tensor]) -> None:
        """Put blocks returned by :meth:`drop_front` back in front."""
        raise NotImplementedError

    def index_select(self, index: torch.Tensor) -> None:
        """Select / reorder batch rows (beam search, batch selection)."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the tier holds next to the compute (what a memory report counts)."""
        raise NotImplementedError

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every block decoded (reference path): ``k, v: [B, H, N, D]``, ``valid: [B, N]``."""
        raise NotImplementedError

    # --- hooks with do-nothing defaults (an offloaded tier overrides them) -----------------------
    def state(self) -> Any:
        """Per-step state a layer's journal restores beside the block moves (None: nothing)."""
        return None

    def restore(self, state: Any) -> None:
        """Put back what :meth:`state` returned."""

    def release(self, old: dict[str, torch.Tensor]) -> None:
        """Blocks returned by :meth:`drop_front` are gone for good (the move was kept): free what
        they hold outside the tier."""

    def staging_tensors(self) -> list[torch.Tensor]:
        """Blocks fetched ahead of attention, held next to the compute."""
        return []

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of this tier's blocks outside the compute's memory (a block store)."""
        return 0

    def close(self) -> None:
        """Drop everything, including what lives outside the tier (a store's files)."""
