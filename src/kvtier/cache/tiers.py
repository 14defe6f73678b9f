"""Tier storage: the exact hot buffer, the exact sink buffer, and block tiers of packed data.

All tensors are head-major: ``[batch, kv_head, ...]``. The token ranges of the tiers are kept
by :class:`~kvtier.cache.layer.TieredLayer`; these classes only hold tensors and move blocks.
Storage is sized to what it holds (block tiers grow by concatenation, which frees the old
storage), so the bytes a memory report counts are the bytes the process holds.
"""

from __future__ import annotations

import torch

from .codecs import Codec


class HotBuffer:
    """Exact recent tokens, ``k, v: [B, H, capacity, D]`` of which the first ``length`` are used.

    ``capacity`` is ``bound`` (hot window + one block) in steady state; a longer append (a
    prefill) grows it and :meth:`shrink` gives the memory back once the overflow has migrated.
    With ``bound=None`` (exact layers) the buffer grows exactly like ``DynamicCache``.
    """

    def __init__(self, bound: int | None):
        self.bound = bound
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def _resize(self, capacity: int) -> None:
        assert self.k is not None and self.v is not None
        k = self.k.new_zeros(*self.k.shape[:2], capacity, self.k.shape[3])
        v = self.v.new_zeros(*self.v.shape[:2], capacity, self.v.shape[3])
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        self.k, self.v = k, v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v: [B, H, q, D]`` (already in the storage dtype)."""
        q = k.shape[2]
        if self.k is None and self.bound is None:  # never written in place: may alias the input
            self.k, self.v, self.length = k.contiguous(), v.contiguous(), q
            return
        if self.k is None:  # owned storage: the window is shifted in place later
            B, H, _, D = k.shape
            self.k = k.new_zeros(B, H, max(q, self.bound), D)
            self.v = v.new_zeros(B, H, max(q, self.bound), D)
        elif self.bound is None:  # grow like DynamicCache: cat, no spare capacity
            self.k = torch.cat([self.k[:, :, : self.length], k], dim=2)
            self.v = torch.cat([self.v[:, :, : self.length], v], dim=2)
            self.length += q
            return
        if self.length + q > self.capacity:
            self._resize(max(self.length + q, self.bound))
        self.k[:, :, self.length : self.length + q] = k
        self.v[:, :, self.length : self.length + q] = v
        self.length += q

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The used part, ``[B, H, length, D]`` views."""
        assert self.k is not None and self.v is not None
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def take_front(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return the oldest ``n`` tokens (copies)."""
        assert self.k is not None and self.v is not None
        k, v = self.k[:, :, :n].clone(), self.v[:, :, :n].clone()
        rest = self.length - n
        self.k[:, :, :rest] = self.k[:, :, n : self.length].clone()
        self.v[:, :, :rest] = self.v[:, :, n : self.length].clone()
        self.length = rest
        return k, v

    def shrink(self) -> None:
        """Give back capacity beyond ``bound`` once the overflow has left."""
        if self.bound is not None and self.k is not None and self.capacity > max(self.bound, self.length):
            self._resize(max(self.bound, self.length))

    def index_select(self, index: torch.Tensor) -> None:
        if self.k is not None:
            self.k = self.k.index_select(0, index.to(self.k.device))
            self.v = self.v.index_select(0, index.to(self.v.device))

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.k is None else [self.k, self.v]


class SinkBuffer:
    """The first ``size`` real tokens of each row, exact: ``k, v: [B, H, size, D]``.

    Rows fill independently (left padding shifts where a row's first token is); ``filled[b]``
    counts the slots of row ``b`` in use.
    """

    def __init__(self, size: int):
        self.size = size
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.filled: torch.Tensor | None = None  # int64 [B]

    @property
    def complete(self) -> bool:
        return self.size == 0 or (self.filled is not None and bool((self.filled >= self.size).all()))

    def capture(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Take the sink tokens out of a run of consecutive tokens leaving the hot tier.

        Parameters
        ----------
        k, v : ``[B, H, n, D]`` tokens in order.
        valid : bool ``[B, n]``, real (non-pad) tokens.

        Returns
        -------
        bool ``[B, n]``: valid tokens that were *not* captured (they go on to the next tier).
        """
        if self.size == 0 or self.complete:
            return valid
        B, H, _, D = k.shape
        if self.k is None:
            self.k = k.new_zeros(B, H, self.size, D)
            self.v = v.new_zeros(B, H, self.size, D)
            self.filled = torch.zeros(B, dtype=torch.long, device=k.device)
        rank = self.filled[:, None] + valid.long().cumsum(1) - 1
        is_sink = valid & (rank < self.size)
        rows, cols = is_sink.nonzero(as_tuple=True)
        if rows.numel():
            slots = rank[rows, cols]
            self.k[rows, :, slots] = k[rows, :, cols]
            self.v[rows, :, slots] = v[rows, :, cols]
            self.filled += is_sink.sum(1)
        return valid & ~is_sink

    def valid(self) -> torch.Tensor:
        """bool ``[B, size]``: slots in use."""
        assert self.filled is not None
        return torch.arange(self.size, device=self.filled.device)[None, :] < self.filled[:, None]

    def index_select(self, index: torch.Tensor) -> None:
        if self.k is not None:
            self.k = self.k.index_select(0, index.to(self.k.device))
            self.v = self.v.index_select(0, index.to(self.v.device))
            self.filled = self.filled.index_select(0, index.to(self.filled.device))

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.k is None else [self.k, self.v, self.filled]


class BlockTier:
    """A FIFO of encoded blocks: a dict of tensors ``[B, H, nblocks, ...]`` plus validity.

    ``valid: bool [B, 1, nblocks, T]`` marks real tokens (pads and captured sinks are False
    and were kept out of the quantization statistics).
    """

    def __init__(self, codec: Codec, block_tokens: int, head_dim: int):
        self.codec = codec
        self.block_tokens = block_tokens
        self.head_dim = head_dim
        self.fields: dict[str, torch.Tensor] = {}

    @property
    def nblocks(self) -> int:
        return 0 if not self.fields else self.fields["valid"].shape[2]

    @property
    def ntokens(self) -> int:
        return self.nblocks * self.block_tokens

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        B, H, n, D = x.shape
        return x.reshape(B, H, n // self.block_tokens, self.block_tokens, D)

    def push(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        """Encode and append tokens ``k, v: [B, H, n, D]`` (``n`` a multiple of the block),
        ``valid: bool [B, n]``."""
        B, _, n, _ = k.shape
        bvalid = valid.reshape(B, 1, n // self.block_tokens, self.block_tokens)
        new = self.codec.encode(self._blocks(k), self._blocks(v), bvalid)
        new["valid"] = bvalid.clone()  # may be a view of a larger (mask or popped) storage
        if not self.fields:
            self.fields = new
        else:
            self.fields = {name: torch.cat([self.fields[name], t], dim=2) for name, t in new.items()}

    def pop(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove the oldest ``n`` blocks; return them decoded as ``[B, H, n*T, D]`` and validity."""
        old = {name: t[:, :, :n] for name, t in self.fields.items()}
        self.fields = {name: t[:, :, n:].clone() for name, t in self.fields.items()}
        k, v = self.codec.decode(old, self.head_dim, dtype)
        B, H = k.shape[:2]
        return k.reshape(B, H, -1, self.head_dim), v.reshape(B, H, -1, self.head_dim), old["valid"].reshape(B, -1)

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode everything (reference path): ``k, v: [B, H, N, D]``, ``valid: [B, N]``."""
        k, v = self.codec.decode(self.fields, self.head_dim, dtype)
        B, H = k.shape[:2]
        return (
            k.reshape(B, H, -1, self.head_dim),
            v.reshape(B, H, -1, self.head_dim),
            self.fields["valid"].reshape(B, -1),
        )

    def index_select(self, index: torch.Tensor) -> None:
        self.fields = {name: t.index_select(0, index.to(t.device)) for name, t in self.fields.items()}

    def tensors(self) -> list[torch.Tensor]:
        return list(self.fields.values())
