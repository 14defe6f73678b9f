"""Attention over packed vLLM pages plus an exact side buffer: the step plan and the torch path.

vLLM hands an attention backend, once per step, the requests of the batch: where each one's new
tokens sit in the flat batch (``query_start_loc``), its length after the step (``seq_lens``) and
its block table. A request of length ``L`` with ``q`` new tokens has ``c = L - q`` tokens from
earlier steps; with ``T`` tokens per block its blocks before column ``c // T`` are full and
packed (:mod:`.pages`), and the block at that column, when ``c % T != 0``, is partly filled: its
first ``c % T`` tokens are exact in a *side buffer* slot (KIVI's residual). The new tokens are
attended exact from the step's own K/V. After a layer attends, the blocks that this step fills
are packed into their pages (once: a page is never rewritten while it is read) and the tokens
of blocks still partial are written into the side buffer.

:class:`SideBuffer` is the bookkeeping (block id -> slot, plain Python) and the per-layer exact
tensors ``[slots, T, 2, H, D]``; :func:`plan_step` turns one step's metadata into a
:class:`StepPlan` (pure Python over lists, run once per step, shared by every layer);
:func:`attend_layer` and :func:`update_layer` run one layer of it in plain torch (decode the
request's pages, one SDPA call per request; the oracle every faster path is tested against).
:func:`attend_layer_fused` and :func:`update_layer_fused` are the same in one C++ call each
(:mod:`kvtier.kernels.vllm_paged_cpu`, index tensors made once per step by :func:`kernel_index`):
decode requests over the pages, the side buffer and the new K/V read in place, vLLM's output
written in place; blocks packed and side rows written in C++. Prefill chunks go through the torch
path here, or through vLLM's own kernels in the backend (:mod:`.prefill`). On CUDA tensors
:func:`attend_layer_triton` attends every request of a step in one Triton launch
(:mod:`kvtier.kernels.triton_pages`) and :func:`update_layer` packs in torch. With
``PagePolicy.sparse_mass``, decode requests (at most ``SPARSE_MAX_QUERY`` new tokens) read the values
of only the packed tokens :func:`select_packed` keeps (both paths).
May import torch, :mod:`.pages`, the partials merge of :mod:`kvtier.attention.partials` and (lazily)
:mod:`kvtier.kernels.vllm_paged_cpu` / :mod:`kvtier.kernels.triton_pages`; never vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..attention.partials import Partial, merge
from ..codecs.pages import PageFormat
from ..errors import KVTierError
from .pages import SPARSE_MAX_QUERY


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
    #: the fused kernel's index tensors (:func:`kernel_index`), built once per step
    index: dict[str, torch.Tensor] | None = None
    #: the Triton kernel's (:func:`triton_index`), on its device
    triton: dict | None = None


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
                side.release(b)  # its rows are read before any write of this step (update_layer)
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


def _causal_mask(q: int, n: int) -> torch.Tensor | None:
    """bool ``[q, n]``: the last ``q`` of ``n`` positions attend themselves and everything before."""
    if q == 1:
        return None
    return torch.ones(q, n, dtype=torch.bool).tril(n - q)


@torch.no_grad()
def attend_layer(
    fmt: PageFormat,
    plan: StepPlan,
    pages: torch.Tensor,
    side: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One layer's attention for every request of the step, in fp32.

    Parameters
    ----------
    pages : uint8 ``[num_blocks, page_bytes]``, this layer's packed pages.
    side : ``[slots, T, 2, H, D]`` this layer's side buffer.
    query : ``[N, Hq, D]``; key, value : ``[N, H, D]`` (the step's new tokens).

    Returns
    -------
    ``[N, Hq, D]`` fp32.
    """
    out = torch.empty(query.shape, dtype=torch.float32)
    for req in plan.requests:
        out[req.qs : req.qe] = _attend_request(fmt, req, pages, side, query, key, value, scale)
    return out


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


def _attend_request(
    fmt: PageFormat,
    req: RequestPlan,
    pages: torch.Tensor,
    side: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[q, Hq, D]`` fp32: one request's new tokens over its decoded pages and exact rows (SDPA);
    with ``PagePolicy.sparse_mass`` and at most ``SPARSE_MAX_QUERY`` new tokens, the packed tokens
    through :func:`select_packed` (kept weights renormalized), the exact rows dense."""
    H, D = key.shape[1:]
    Hq = query.shape[1]
    q = query[req.qs : req.qe].float().transpose(0, 1).contiguous()  # [Hq, n, D]
    n, G = q.shape[1], Hq // H
    parts = []  # (out [Hq, n, D], lse [Hq, n]) of each part of the request's keys
    ks, vs = _packed_kv(fmt, req, pages, H, D)
    if ks and fmt.policy.sparse_mass is not None and n <= SPARSE_MAX_QUERY:
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


#: requests with more new tokens than this attend through SDPA (prefill chunks: compute-bound, BLAS
#: wins); the others (decode) through the fused kernel, which reads the packed pages once
KERNEL_MAX_QUERY = 16

#: new tokens up to which a chunk *over packed earlier blocks* also goes through the fused kernel,
#: which reads the pages in place (fp32, like the reference): 2.0-2.4x / 1.3-1.6x / 1.16-1.23x as
#: fast as decoding the pages for vLLM's fp32 kernel (:mod:`.prefill`) for 17 / 32 / 48 new tokens
#: over 2k packed tokens, 0.91-0.93x at 64 (2 threads, two runs of ``benchmarks/vllm_chunk_path.py``);
#: longer chunks, and chunks with no packed block (kvtier's bf16 prefill kernel), go to :mod:`.prefill`.
KERNEL_MAX_CHUNK = 48


def fused_takes(req: RequestPlan) -> bool:
    """Whether the fused kernel attends request ``req`` of a step (else :mod:`.prefill` does)."""
    n = req.qe - req.qs
    return n <= KERNEL_MAX_QUERY or (bool(req.packed or req.head_rows) and n <= KERNEL_MAX_CHUNK)


def _request_index(requests: list[RequestPlan]) -> tuple[list, list[int], list[int]]:
    """Per request ``(qs, qe, side slot, side rows, block read in part, its rows)``, and the packed
    blocks of all of them as ``pstart`` offsets into ``pids`` (the kernels' index lists)."""
    rows, pstart, pids = [], [0], []
    for req in requests:
        pids.extend(req.packed)
        pstart.append(len(pids))
        side_slot = req.side_slot if req.side_rows else 0
        rows.append((req.qs, req.qe, side_slot, req.side_rows, max(req.head_block, 0), req.head_rows))
    return rows, pstart, pids


def _long(x: list, n: int = 0, device: torch.device | None = None) -> torch.Tensor:
    t = torch.tensor(x, dtype=torch.long, device=device)
    return t.view(-1, n) if n else t


def kernel_index(plan: StepPlan) -> dict:
    """Index tensors of the fused kernels for ``plan`` (built once per step, cached on it): the
    requests :func:`fused_takes` (``reqs [R, 6]``: new tokens,
    side slot and rows, cached block read in part and its rows; their packed blocks ``pstart``,
    ``pids``), the other requests (``rest``), the blocks to pack (``enc [E, 4]``: page, side slot,
    side rows, first new token) and the side writes (``writes [W, 2]``: side row, new token)."""
    if plan.index is None:
        taken = [req for req in plan.requests if fused_takes(req)]
        reqs, pstart, pids = _request_index(taken)
        enc = [(b, max(slot, 0), start, first) for b, (slot, start, first) in zip(plan.encode_blocks, plan.encode_src)]
        writes = torch.stack((plan.write_rows, plan.write_tokens), 1) if plan.write_rows is not None else _long([], 2)
        plan.index = {
            "reqs": _long(reqs, 6),
            "pstart": _long(pstart),
            "pids": _long(pids),
            "rest": [req for req in plan.requests if not fused_takes(req)],
            "enc": _long(enc, 4),
            "writes": writes.contiguous(),
        }
    return plan.index


def triton_index(plan: StepPlan, device: torch.device) -> dict:
    """Index tensors of :func:`attend_layer_triton` on ``device`` (every request of the step; built
    once per step): ``reqs``, ``pstart``, ``pids`` as in :func:`kernel_index`, and the host ints
    ``max_query`` (most new tokens of a request) and ``max_units`` (most pages of a request + 2)."""
    if plan.triton is None or plan.triton["reqs"].device != device:
        reqs, pstart, pids = _request_index(plan.requests)
        plan.triton = {
            "reqs": _long(reqs, 6, device),
            "pstart": _long(pstart, 0, device),
            "pids": _long(pids, 0, device),
            "max_query": max((r.qe - r.qs for r in plan.requests), default=0),
            "max_units": max((len(r.packed) + 2 for r in plan.requests), default=1),
        }
    return plan.triton


def _check_kernel_codes(fmt: PageFormat) -> None:
    if not fmt.policy.kernel_codes:
        raise ValueError(
            f"the C++ page kernels read 4-bit keys with 4- or 3-bit values, not bits={fmt.policy.bits} / "
            f"value_bits={fmt.policy.vbits}: use attend_layer / update_layer"
        )


@torch.no_grad()
def attend_layer_fused(
    fmt: PageFormat,
    plan: StepPlan,
    pages: torch.Tensor,
    side: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    rest: bool = True,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attend_layer` through the fused CPU kernel (same arguments, same result to fp32 rounding),
    written into ``out [N, Hq, D]`` when given (fp32 or the model dtype: vLLM's output rows) and
    returned. ``query, key, value`` are read in place (rows contiguous), the side buffer too.
    ``rest=False`` leaves the rows of the requests the kernel does not take (prefill chunks, see
    :func:`kernel_index`) to the caller; otherwise they go through the torch path. ``counts``
    (int64 ``[2]``): incremented by the tokens valued and scored under sparse decode."""
    from ..kernels import vllm_paged_cpu

    _check_kernel_codes(fmt)
    idx = kernel_index(plan)
    if out is None:
        out = torch.empty(query.shape, dtype=torch.float32)
    if idx["reqs"].shape[0]:
        p = fmt.policy
        vllm_paged_cpu.attend(
            query,
            key,
            value,
            side,
            pages,
            idx["reqs"],
            idx["pstart"],
            idx["pids"],
            out,
            scale,
            fmt.layout(),
            1.0 if p.sparse_mass is None else p.sparse_mass,
            p.local_window,
            SPARSE_MAX_QUERY,
            counts,
        )
    for req in idx["rest"] if rest else ():
        out[req.qs : req.qe] = _attend_request(fmt, req, pages, side, query, key, value, scale)
    return out


@torch.no_grad()
def attend_layer_triton(
    fmt: PageFormat,
    plan: StepPlan,
    pages: torch.Tensor,
    side: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """:func:`attend_layer` through the Triton kernel (:mod:`kvtier.kernels.triton_pages`): every request
    of the step, decode rows and prefill chunks, pages of any :data:`~kvtier.vllm.pages.PAGE_BITS` codes,
    in one launch (plus a merge); for CUDA tensors (on the CPU under Triton's interpreter). Same
    arguments and result as :func:`attend_layer` to fp32 rounding; written into ``out [N, Hq, D]``
    (fp32 or the model dtype) when given. Dense: a ``sparse_mass`` policy is refused."""
    from ..kernels import triton_pages

    if fmt.policy.sparse_mass is not None:
        raise ValueError("the Triton page kernel attends densely: PagePolicy.sparse_mass has no Triton path")
    idx = triton_index(plan, query.device)
    if out is None:
        out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    return triton_pages.attend(
        query, key, value, side, pages, idx["reqs"], idx["pstart"], idx["pids"], out, scale, fmt.layout(),
        fmt.policy.bits, max_query=idx["max_query"], max_units=idx["max_units"], num_splits=num_splits,
    )  # fmt: skip


@torch.no_grad()
def update_layer_fused(
    fmt: PageFormat, plan: StepPlan, pages: torch.Tensor, side: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """:func:`update_layer` in one C++ call (pages of :attr:`PagePolicy.kernel_codes
    <kvtier.vllm.pages.PagePolicy.kernel_codes>`): the same page bytes and side rows."""
    from ..kernels import vllm_paged_cpu

    _check_kernel_codes(fmt)
    idx = kernel_index(plan)
    if idx["enc"].shape[0] or idx["writes"].shape[0]:
        vllm_paged_cpu.update(pages, side, key, value, idx["enc"], idx["writes"], fmt.layout())


@torch.no_grad()
def update_layer(
    fmt: PageFormat, plan: StepPlan, pages: torch.Tensor, side: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Pack the blocks this step fills into ``pages``, then write the other new tokens into ``side``
    (after :func:`attend_layer`: a slot released this step may be reused by a block started now)."""
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
