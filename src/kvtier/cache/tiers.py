"""Tier storage: the exact hot buffer, the exact sink buffer, and block tiers of packed data.

All tensors are head-major: ``[batch, kv_head, ...]``. The token ranges of the tiers are kept
by :class:`~kvtier.cache.state.LayerState`; these classes only hold tensors and move blocks.
Storage is sized to what it holds (block tiers grow by concatenation, which frees the old
storage; the hot buffer grows geometrically up to its bound), so the bytes a memory report
counts are the bytes the process holds.

Moves are copy-on-write: no method writes into a tensor that an earlier :meth:`state` may still
refer to, so a layer can take a tier's ``state()`` (a few references), attempt a move, and
``restore()`` it if anything fails. Block tiers also undo a move without keeping their old
storage alive (:meth:`BlockTier.truncate`, :meth:`BlockTier.put_front`). Block tiers subclass
:class:`kvtier.tier.Tier` (as the offloaded cold tier does). May import ``kvtier.codecs`` and
``kvtier.tier``; nothing here imports attention or transformers.
"""

from __future__ import annotations

import torch

from ..codecs import Codec
from ..tier import Tier

#: The hot buffer's smallest allocation (tokens).
HOT_MIN_CAPACITY = 16


def hot_capacity(need: int, bound: int) -> int:
    """Slots a hot buffer allocates to hold ``need`` tokens: the next power of two (at least
    ``HOT_MIN_CAPACITY``) up to ``bound``, or exactly ``need`` beyond it (a prefill chunk). It
    depends only on ``need``, so the planner prices it exactly whatever the call sizes were."""
    if need > bound:
        return need
    return min(bound, max(HOT_MIN_CAPACITY, 1 << max(0, need - 1).bit_length()))


def _writable(t: torch.Tensor) -> bool:
    """Whether ``t`` may be written in place now (a tensor made under ``torch.inference_mode()``
    cannot be, outside it)."""
    return not t.is_inference() or torch.is_inference_mode_enabled()


class HotBuffer:
    """Exact recent tokens, ``k, v: [B, H, capacity, D]`` of which the first ``length`` are used.

    Capacity grows by powers of two with what is held (:func:`hot_capacity`), up to ``bound``
    (hot window + one block) in steady state, so a buffer never holds much more than its tokens
    need; a longer append (a
    prefill) grows it past ``bound`` and :meth:`take_front` gives the memory back. With
    ``bound=None`` (exact layers) the buffer grows exactly like ``DynamicCache``.

    Appends write in place beyond ``length`` only (a restored state ignores those slots);
    :meth:`take_front` moves the rest into new storage.
    """

    def __init__(self, bound: int | None):
        self.bound = bound
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def state(self) -> tuple:
        return self.k, self.v, self.length

    def restore(self, state: tuple) -> None:
        self.k, self.v, self.length = state

    def _moved(self, capacity: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New storage of ``capacity`` slots holding tokens ``[start, stop)`` at its front."""
        assert self.k is not None and self.v is not None
        B, H, _, D = self.k.shape
        k = self.k.new_empty(B, H, capacity, D)
        v = self.v.new_empty(B, H, capacity, D)
        k[:, :, : stop - start] = self.k[:, :, start:stop]
        v[:, :, : stop - start] = self.v[:, :, start:stop]
        return k, v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v: [B, H, q, D]`` (already in the storage dtype)."""
        q = k.shape[2]
        if self.k is None and self.bound is None:  # never written in place: may alias the input
            self.k, self.v, self.length = k.contiguous(), v.contiguous(), q
            return
        if self.bound is None:  # grow like DynamicCache: cat, no spare capacity
            self.k = torch.cat([self.k[:, :, : self.length], k], dim=2)
            self.v = torch.cat([self.v[:, :, : self.length], v], dim=2)
            self.length += q
            return
        if self.k is None:
            B, H, _, D = k.shape
            cap = hot_capacity(q, self.bound)
            self.k, self.v = k.new_empty(B, H, cap, D), v.new_empty(B, H, cap, D)
        elif self.length + q > self.capacity or not _writable(self.k):
            cap = max(self.capacity, hot_capacity(self.length + q, self.bound))
            self.k, self.v = self._moved(cap, 0, self.length)
        self.k[:, :, self.length : self.length + q] = k
        self.v[:, :, self.length : self.length + q] = v
        self.length += q

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The used part, ``[B, H, length, D]`` views."""
        assert self.k is not None and self.v is not None
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def take_front(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return the oldest ``n`` tokens (views of the old storage, which this buffer
        no longer refers to); the rest moves to new storage sized for it."""
        assert self.k is not None and self.v is not None and self.bound is not None
        old_k, old_v, length = self.k, self.v, self.length
        rest = length - n
        self.k, self.v = self._moved(max(rest, min(self.bound, self.capacity)), n, length)
        self.length = rest
        return old_k[:, :, :n], old_v[:, :, :n]

    def truncate(self, length: int) -> None:
        """Keep the oldest ``length`` tokens (drop the latest: a crop). The slots past ``length``
        become free for later appends, as after a restore; an exact buffer (``bound=None``, sized
        to what it holds) keeps views of its first ``length`` tokens, as ``DynamicCache`` does."""
        assert 0 <= length <= self.length
        if self.k is not None and self.bound is None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]
        self.length = length

    def index_select(self, index: torch.Tensor) -> None:
        if self.k is not None:
            self.k = self.k.index_select(0, index.to(self.k.device))
            self.v = self.v.index_select(0, index.to(self.v.device))

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.k is None else [self.k, self.v]


class SinkBuffer:
    """The first ``size`` real tokens of each row, exact: ``k, v: [B, H, size, D]``.

    Rows fill independently (left padding shifts where a row's first token is); ``filled[b]``
    counts the slots of row ``b`` in use. :meth:`capture` writes into new tensors (the buffer is
    ``size`` tokens, and fills only while the first blocks of a sequence migrate).
    """

    def __init__(self, size: int):
        self.size = size
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.filled: torch.Tensor | None = None  # int64 [B]

    def state(self) -> tuple:
        return self.k, self.v, self.filled

    def restore(self, state: tuple) -> None:
        self.k, self.v, self.filled = state

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
            sk, sv = k.new_zeros(B, H, self.size, D), v.new_zeros(B, H, self.size, D)
            filled = torch.zeros(B, dtype=torch.long, device=k.device)
        else:
            sk, sv, filled = self.k.clone(), self.v.clone(), self.filled.clone()
        rank = filled[:, None] + valid.long().cumsum(1) - 1
        is_sink = valid & (rank < self.size)
        rows, cols = is_sink.nonzero(as_tuple=True)
        if rows.numel():
            slots = rank[rows, cols]
            sk[rows, :, slots] = k[rows, :, cols]
            sv[rows, :, slots] = v[rows, :, cols]
            filled += is_sink.sum(1)
        self.k, self.v, self.filled = sk, sv, filled
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


class BlockTier(Tier):
    """A FIFO of encoded blocks (a :class:`~kvtier.tier.Tier`): a dict of tensors
    ``[B, H, nblocks, ...]`` plus validity.

    ``valid: bool [B, 1, nblocks, T]`` marks real tokens (pads and captured sinks are False
    and were kept out of the quantization statistics). Every change builds new tensors;
    :meth:`truncate` and :meth:`put_front` undo a :meth:`push` and a :meth:`drop_front`.
    """

    def __init__(self, codec: Codec, block_tokens: int, head_dim: int):
        self.codec = codec
        self.block_tokens = block_tokens
        self.head_dim = head_dim
        self.fields: dict[str, torch.Tensor] = {}

    @property
    def nblocks(self) -> int:
        return 0 if not self.fields else self.fields["valid"].shape[2]

    def __getstate__(self) -> dict:
        """For ``pickle`` (``copy.deepcopy`` too): 1-byte float fields (fp8 codes and parameters)
        travel as their bytes, ``(uint8 view, dtype)``: torch pickles a float8 tensor that
        ``pickle.loads`` cannot read back (torch 2.13: "UntypedStorage has no attribute dtype"),
        so a pickled cache would be written and then lost."""
        state = dict(self.__dict__)
        state["fields"] = {
            name: (t.view(torch.uint8), t.dtype) if t.is_floating_point() and t.element_size() == 1 else t
            for name, t in self.fields.items()
        }
        return state

    def __setstate__(self, state: dict) -> None:
        fields = {name: t[0].view(t[1]) if isinstance(t, tuple) else t for name, t in state.pop("fields").items()}
        self.__dict__.update(state, fields=fields)

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
        self.put_back(new)

    def put_back(self, new: dict[str, torch.Tensor]) -> None:
        """Append encoded blocks (fields as this tier holds them)."""
        if not self.fields:
            self.fields = new
        else:
            self.fields = {name: torch.cat([self.fields[name], t], dim=2) for name, t in new.items()}

    def put_front(self, old: dict[str, torch.Tensor]) -> None:
        """Put encoded blocks back in front (undoes :meth:`drop_front`)."""
        if not old:
            return
        if not self.fields:
            self.fields = old
        else:
            self.fields = {name: torch.cat([old[name], t], dim=2) for name, t in self.fields.items()}

    def truncate(self, n: int) -> None:
        """Keep the oldest ``n`` blocks (undoes a :meth:`push` onto ``n`` blocks)."""
        if n >= self.nblocks:
            return
        self.fields = {} if n == 0 else {name: t[:, :, :n].clone() for name, t in self.fields.items()}

    def drop_front(self, n: int) -> dict[str, torch.Tensor]:
        """Remove the oldest ``n`` blocks and return their encoded fields (copies)."""
        old = {name: t[:, :, :n].clone() for name, t in self.fields.items()}
        rest = self.nblocks - n
        self.fields = {} if rest == 0 else {name: t[:, :, n:].clone() for name, t in self.fields.items()}
        return old

    def decode_blocks(
        self, fields: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Encoded blocks as ``k, v: [B, H, n*T, D]`` and validity ``[B, n*T]``."""
        k, v = self.codec.decode(fields, self.head_dim, dtype)
        B, H = k.shape[:2]
        return k.reshape(B, H, -1, self.head_dim), v.reshape(B, H, -1, self.head_dim), fields["valid"].reshape(B, -1)

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode everything (reference path): ``k, v: [B, H, N, D]``, ``valid: [B, N]``."""
        return self.decode_blocks(self.fields, dtype)

    def index_select(self, index: torch.Tensor) -> None:
        self.fields = {name: t.index_select(0, index.to(t.device)) for name, t in self.fields.items()}

    def tensors(self) -> list[torch.Tensor]:
        return list(self.fields.values())
