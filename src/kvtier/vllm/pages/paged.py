"""Attention over packed vLLM pages plus an exact side buffer: the step plan and the torch path.

vLLM hands an attention backend, once per step, the requests of the batch: where each one's new
tokens sit in the flat batch (``query_start_loc``), its length after the step (``seq_lens``) and
its block table. A request of length ``L`` with ``q`` new tokens has ``c = L - q`` tokens from
earlier steps; with ``T`` tokens per block its blocks before column ``c // T`` are full and
packed (:mod:`kvtier.codecs.pages`), and the block at that column, when ``c % T != 0``, is partly filled: its
first ``c % T`` tokens are exact in a *side buffer* slot (KIVI's residual). The new tokens are
attended exact from the step's own K/V. After a layer attends, the blocks that this step fills
are packed into their pages (once: a page is never rewritten while it is read) and the tokens
of blocks still partial are written into the side buffer.

:class:`SideBuffer` is the bookkeeping (block id -> slot, plain Python) and the per-layer exact
tensors ``[slots, T, 2, H, D]``; :func:`plan_step` turns one step's metadata into a
:class:`StepPlan` (pure Python over lists, run once per step, shared by every layer). The plain
torch path of one layer is here too: :func:`attend_request` (decode a request's pages, one SDPA call)
and :func:`update_pages` (pack the blocks a step fills, write the side rows), the oracle every faster
path is tested against. Which path attends which request is decided by
:meth:`kvtier.vllm.pages.attention.PagedAttention.plan`, which runs these as its torch backend. With
``PagePolicy.sparse_mass``, decode requests read the values of only the packed tokens
:func:`select_packed` keeps. May import torch, the partials merge of :mod:`kvtier.attention.partials`
and the page format of :mod:`kvtier.codecs.pages`; never vLLM or the kernels.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ...attention.partials import Partial, merge
from ...codecs.pages import PageFormat
from ...errors import KVTierError


class SideSlotLost(KVTierError):
    """A partly filled block's exact tokens are gone (its side slot was reused): raise, never guess."""


class SideBuffer:
    """Exact tokens of partly filled blocks, one slot per block, for every layer of one engine.

    Slots are assigned when a block's first token is written and released when the block is
    packed; a block whose request ended while it was partial keeps its slot until the block id
    is written again from its first token, or until a new slot is needed and none is free (the
    least recently written one is reused). Per-layer tensors grow on demand up to ``capacity``.
    """

    def __init__(
        self,
        capacity: int,
        tokens: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"side buffer capacity={capacity} is not allowed: expected >= 1")
        self.capacity, self.tokens, self.heads, self.head_dim, self.dtype = capacity, tokens, heads, head_dim, dtype
        self.device = torch.device(device)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # block id -> slot, least recently written first
        self.free: list[int] = []
        self.allocated = 0
        self.packed: set[int] = set()  # block ids whose page holds a packed full block
        self.layers: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by the per-layer exact tensors."""
        return sum(t.numel() * t.element_size() for t in self.layers.values())

    def layer(self, name: str) -> torch.Tensor:
        """``[allocated, T, 2, H, D]`` exact tokens of ``name``'s partly filled blocks (on ``device``)."""
        t = self.layers.get(name)
        if t is None or t.shape[0] != self.allocated:
            shape = (self.allocated, self.tokens, 2, self.heads, self.head_dim)
            new = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if t is not None:
                new[: t.shape[0]] = t
            self.layers[name] = t = new
        return t

    def touch(self, block: int) -> int | None:
        slot = self.slot_of.get(block)
        if slot is not None:
            self.slot_of.move_to_end(block)
        return slot

    def assign(self, block: int, busy: set[int]) -> int:
        """A slot for ``block`` whose first token is written now (``busy``: slots read this step)."""
        self.packed.discard(block)
        slot = self.slot_of.pop(block, None)
        if slot is None:
            if self.free:
                slot = self.free.pop()
            elif self.allocated < self.capacity:
                slot = self.allocated
                self.allocated = min(self.capacity, max(self.allocated * 2, 8))
                self.free.extend(range(self.allocated - 1, slot, -1))
            else:
                victim = next((b for b, s in self.slot_of.items() if s not in busy), None)
                if victim is None:
                    raise SideSlotLost(f"all {self.capacity} side slots are in use this step: raise side_slots")
                slot = self.slot_of.pop(victim)
        self.slot_of[block] = slot
        return slot

    def release(self, block: int) -> None:
        slot = self.slot_of.pop(block, None)
        if slot is not None:
            self.free.append(slot)
        self.packed.add(block)

    def pages_loaded(self, blocks: list[int]) -> None:
        """Blocks whose pages were written whole from outside (the prefix store loaded full packed
        pages): drop any exact tokens still kept for those ids (a slot left by the block's last,
        partial use, which would be read as its first tokens) and mark them packed, so a request
        that starts reading one in part (vLLM recomputes the last token of a prompt the store held
        whole) reads the page (:mod:`kvtier.vllm.page_events`)."""
        for b in blocks:
            self.release(b)


@dataclass
class RequestPlan:
    """One request of a step: its new tokens ``[qs, qe)`` of the batch, the packed blocks it reads
    whole, a packed block it reads the first ``head_rows`` rows of (a full cached block whose
    last tokens vLLM recomputes), and ``side_rows`` exact rows of side slot ``side_slot``."""

    qs: int
    qe: int
    packed: list[int]
    head_block: int = -1
    head_rows: int = 0
    side_slot: int = -1
    side_rows: int = 0


@dataclass
class StepPlan:
    """What every layer does this step (built once by :func:`plan_step`)."""

    num_tokens: int
    requests: list[RequestPlan]
    #: blocks this step fills: page ids, and per block (side slot or -1, side rows, first new token)
    encode_blocks: list[int] = field(default_factory=list)
    encode_src: list[tuple[int, int, int]] = field(default_factory=list)
    #: side rows written after attention (slot * T + offset) and the batch token of each
    write_rows: torch.Tensor | None = None
    write_tokens: torch.Tensor | None = None


def plan_step(
    side: SideBuffer, query_start_loc: list[int], seq_lens: list[int], block_table: torch.Tensor, num_tokens: int
) -> StepPlan:
    """The :class:`StepPlan` of one step; updates ``side``'s bookkeeping (slots assigned to blocks
    that stay partial, released for blocks this step fills).

    Parameters
    ----------
    query_start_loc : ``num_reqs + 1`` offsets of each request's new tokens in the batch.
    seq_lens : ``num_reqs`` lengths after this step.
    block_table : int ``[num_reqs, max_blocks]`` vLLM block ids.
    """
    T = side.tokens
    plan = StepPlan(num_tokens, [])
    rows: list[int] = []
    toks: list[int] = []
    busy: set[int] = set()
    reqs = []
    bt = block_table.tolist() if len(seq_lens) else []
    for r, L in enumerate(seq_lens):
        qs, qe = query_start_loc[r], query_start_loc[r + 1]
        c = L - (qe - qs)
        p0, off = divmod(c, T)
        req = RequestPlan(qs, qe, bt[r][:p0])
        if off:
            b = bt[r][p0]
            slot = side.touch(b)
            if slot is not None:
                req.side_slot, req.side_rows = slot, off
                busy.add(slot)
            elif b in side.packed:
                req.head_block, req.head_rows = b, off
            else:
                raise SideSlotLost(
                    f"block {b} is partly filled ({off} of {T} tokens) but its exact tokens were not kept: "
                    "raise PagePolicy.side_slots"
                )
        reqs.append((req, c, L, bt[r]))
        plan.requests.append(req)
    for req, c, L, row in reqs:
        for j in range(c // T, (L - 1) // T + 1 if L > c else c // T):
            b, start, end = row[j], max(c, j * T) - j * T, min(L, (j + 1) * T) - j * T
            first_new = req.qs + (j * T + start - c)
            if start and b not in side.slot_of and b in side.packed:
                if end != T:
                    raise SideSlotLost(f"block {b} is packed but vLLM writes tokens {start}..{end - 1} of it")
                continue  # a full cached block recomputed at its end: already packed, never rewritten
            if end == T:
                slot = side.slot_of.get(b, -1) if start else -1
                plan.encode_blocks.append(b)
                plan.encode_src.append((slot, start, first_new))
                side.release(b)  # its rows are read before any write of this step (update_pages)
            else:
                slot = side.touch(b) if start else side.assign(b, busy)
                if slot is None:
                    raise SideSlotLost(f"block {b} continues at token {start} but its exact tokens were not kept")
                busy.add(slot)
                rows.extend(range(slot * T + start, slot * T + end))
                toks.extend(range(first_new, first_new + end - start))
    plan.write_rows = torch.tensor(rows, dtype=torch.long)
    plan.write_tokens = torch.tensor(toks, dtype=torch.long)
    return plan


def _packed_kv(fmt: PageFormat, req: RequestPlan, pages: torch.Tensor, H: int, D: int):  # noqa: ANN202
    """Lists of fp32 ``[H, n, D]`` keys and values a request reads from packed pages: its whole
    packed blocks, then the first ``head_rows`` of a cached block read in part."""
    ks, vs = [], []
    if req.packed:
        k, v = fmt.decode(pages[torch.tensor(req.packed)])
        ks.append(k.transpose(0, 1).reshape(H, -1, D))
        vs.append(v.transpose(0, 1).reshape(H, -1, D))
    if req.head_rows:
        k, v = fmt.decode(pages[req.head_block : req.head_block + 1])
        ks.append(k[0, :, : req.head_rows])
        vs.append(v[0, :, : req.head_rows])
    return ks, vs


@torch.no_grad()
def attend_request(
    fmt: PageFormat,
    req: RequestPlan,
    pages: torch.Tensor,
    side: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sparse: bool = False,
) -> torch.Tensor:
    """``[q, Hq, D]`` fp32: one request's new tokens over its decoded pages and exact rows (SDPA), in
    plain torch: the reference every faster path is tested against.

    Parameters
    ----------
    pages : uint8 ``[num_blocks, page_bytes]``, this layer's packed pages.
    side : ``[slots, T, 2, H, D]`` this layer's side buffer.
    query : ``[N, Hq, D]``; key, value : ``[N, H, D]`` (the step's new tokens).
    sparse : sparse decode (``PagePolicy.sparse_mass``; decided per request by the plan): the packed
        tokens through :func:`select_packed` (kept weights renormalized), the exact rows dense.
    """
    H, D = key.shape[1:]
    Hq = query.shape[1]
    q = query[req.qs : req.qe].float().transpose(0, 1).contiguous()  # [Hq, n, D]
    n, G = q.shape[1], Hq // H
    parts = []  # (out [Hq, n, D], lse [Hq, n]) of each part of the request's keys
    ks, vs = _packed_kv(fmt, req, pages, H, D)
    if ks and sparse:
        parts.append(_sparse_packed(fmt, req, q.view(H, G * n, D), torch.cat(ks, 1), torch.cat(vs, 1), scale))
        ks, vs = [], []
    if req.side_rows:
        rows = side[req.side_slot, : req.side_rows].float()  # [n, 2, H, D]
        ks.append(rows[:, 0].transpose(0, 1))
        vs.append(rows[:, 1].transpose(0, 1))
    if ks:  # the chunk over everything before it (all visible): the G query heads of a KV head as one row block
        k, v = torch.cat(ks, 1).contiguous(), torch.cat(vs, 1).contiguous()
        old = _flash(q.view(H, G * n, D), k, v, scale, causal=False)
        parts.append((old[0].reshape(Hq, n, D), old[1].reshape(Hq, n)))
    kn = key[req.qs : req.qe].float().transpose(0, 1).repeat_interleave(G, 0)  # [Hq, n, D]
    vn = value[req.qs : req.qe].float().transpose(0, 1).repeat_interleave(G, 0)
    parts.append(_flash(q, kn, vn, scale, causal=n > 1))  # the chunk over itself
    return merge([Partial(o, lse) for o, lse in parts]).transpose(0, 1)


def select_packed(scores: torch.Tensor, level: float, forced: torch.Tensor) -> torch.Tensor:
    """bool ``[H, P]``: the packed tokens sparse decode reads the values of (``PagePolicy.sparse_mass``).

    ``scores [H, R, P]`` fp32 of the ``R`` query rows of each KV head over its ``P`` packed tokens.
    Per row, weights ``e = exp(s - max)`` fall in factor-of-two buckets ``k = min(63, -floor(log2 e))``;
    buckets are dropped from the lightest up while their mass stays within ``1 - level`` of the row's
    sum (bucket 0, the row's largest weight, never). A token is kept when some row of its head keeps
    it, or ``forced [P]`` (local window, sinks). The kernel does the same in fp32."""
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    _, ex = torch.frexp(e)
    k = torch.where(e > 0, (1 - ex).clamp(0, 63), 63).long()
    mass = torch.zeros(*e.shape[:-1], 64, dtype=torch.float64).scatter_add_(-1, k, e.double())
    tail = mass.flip(-1).cumsum(-1).flip(-1)  # tail[k]: mass of buckets k..63
    budget = (1 - level) * e.double().sum(-1, keepdim=True)
    drop_from = 64 - (tail[..., 1:] <= budget).sum(-1, keepdim=True)  # a suffix of buckets 1..63
    thr = torch.where(drop_from <= 63, torch.pow(2.0, (1 - drop_from).double()), 0.0).float()
    return (e >= thr).any(1) | forced


def _sparse_packed(fmt: PageFormat, req: RequestPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):  # noqa: ANN202
    """``(out [Hq, n, D], lse [Hq, n])`` of rows ``q [H, G n, D]`` over packed ``k, v [H, P, D]``,
    values of only the tokens :func:`select_packed` keeps (weights renormalized over them)."""
    D, P = q.shape[-1], k.shape[1]
    s = (q * scale) @ k.transpose(1, 2)  # [H, G n, P]
    pos = torch.arange(P)
    forced = (pos >= P + req.side_rows - fmt.policy.local_window) | (pos < fmt.policy.sink_tokens)
    keep = select_packed(s, fmt.policy.sparse_mass, forced)  # [H, P]
    m = s.amax(-1)
    e = torch.exp(s - m.unsqueeze(-1)) * keep.unsqueeze(1)
    l = e.sum(-1)  # noqa: E741
    n = req.qe - req.qs
    return ((e @ v) / l.unsqueeze(-1)).reshape(-1, n, D), (m + l.log()).reshape(-1, n)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):  # noqa: ANN202
    """``(out [H, n, D], lse [H, n])`` of torch's CPU flash attention (fp32; causal: top-left aligned)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, scale=scale
    )
    return out[0], lse[0]


@torch.no_grad()
def update_pages(
    fmt: PageFormat, plan: StepPlan, pages: torch.Tensor, side: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Pack the blocks this step fills into ``pages``, then write the other new tokens into ``side``
    (after attention: a slot released this step may be reused by a block started now), in torch."""
    T = fmt.tokens
    if plan.encode_blocks:
        ks, vs = [], []
        for slot, start, first_new in plan.encode_src:
            kparts, vparts = [], []
            if start:
                kparts.append(side[slot, :start, 0])
                vparts.append(side[slot, :start, 1])
            kparts.append(key[first_new : first_new + T - start])
            vparts.append(value[first_new : first_new + T - start])
            ks.append(torch.cat(kparts).transpose(0, 1))
            vs.append(torch.cat(vparts).transpose(0, 1))
        ids = torch.tensor(plan.encode_blocks, device=pages.device)
        pages[ids] = fmt.encode(torch.stack(ks), torch.stack(vs))
    if plan.write_rows is not None and plan.write_rows.numel():
        flat = side.view(-1, 2, *side.shape[3:])
        rows, t = plan.write_rows.to(side.device), plan.write_tokens.to(key.device)
        flat[rows, 0] = key[t].to(side.dtype)
        flat[rows, 1] = value[t].to(side.dtype)
