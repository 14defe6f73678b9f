"""Triton attention over kvtier's packed vLLM pages, the exact side buffer and the step's new tokens.

The CUDA counterpart of :func:`kvtier.kernels.vllm_paged_cpu.attend` (dense): one layer of one vLLM
step, every request of it, decode rows and prefill chunks alike. A request reads its full blocks as
packed pages (:mod:`kvtier.codecs.pages`: keys per channel over ``key_group`` tokens, values per token
over ``value_group`` channels, fp16 scale and zero, ``sink_tokens`` exact rows at the start of each
page; codes of any width in bit planes, :mod:`kvtier.quant.bits`), optionally the first rows of one
cached block read in part, then the exact rows of its partly filled block (side slot) and its own
new tokens, causally. Codes are unpacked and dequantized in registers; nothing dense is written.

One program serves one (request, KV head, row tile, split). A request's ``G`` query heads per KV
head times its ``n`` new tokens are its rows (``row = g * n + i``, GQA without ``repeat_kv``), cut
into tiles of ``BLOCK_R`` rows, so a long prefill chunk is as welcome as a decode row (tiles of 16
rows or more use ``tl.dot``, fewer rows broadcast products, see :func:`tiles`). The units of
work of a request are its pages, then one exact unit (side rows + new tokens); the splits take
units ``s, s + S, ...`` (FlashDecoding's split-K) with an online softmax each, and a merge kernel
combines the splits' normalized partials by log-sum-exp and writes vLLM's output rows in place.

The page layout arrives as :meth:`kvtier.codecs.pages.PageFormat.layout`'s ints plus the key code
width. The torch backend of :class:`kvtier.vllm.pages.attention.PagedAttention` is the reference
(``tests/test_vllm_pages.py`` runs this kernel on the CPU through Triton's interpreter). **No engine
path**: kvtier's vLLM backend runs on vLLM's CPU platform only, so no engine calls this kernel; it runs
as ``PagedAttention(fmt, "triton")`` in tests and in ``benchmarks/gpu_check.py`` (part 5). Imports
torch, Triton and the code planes of :mod:`.triton_decode`; never vLLM or :mod:`kvtier.vllm`.
Importing it imports Triton: import it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import (
    TILE_ELEMENTS,
    _codes,
    _merged,
    _num_splits,
    _online_update,
    _plane_spec,
    _pow2,
)

#: fields of a layout (``PageFormat.layout()``), in order
LAYOUT_FIELDS = (
    "heads", "head_dim", "tokens", "key_group", "value_group", "sink_tokens", "page_bytes",
    "kscale", "kzero", "vscale", "vzero", "sink", "kcodes", "vcodes", "value_bits",
)  # fmt: skip
#: rows x channels of a program's row tile at most (prefill chunks are cut into tiles): with the tile
#: sizes of :func:`tiles`, no register spills on sm_90 at head dims 64 and 128 (``gpu_check.py --compile-only``)
ROW_TILE_ELEMENTS = 2048
#: rows x tokens x channels of the broadcast product of a tile of fewer than 16 rows (``triton_decode``'s budget)
PRODUCT_ELEMENTS = TILE_ELEMENTS


def tiles(rows: int, head_dim: int) -> dict[str, int]:
    """``BLOCK_R`` (rows of a program), ``BLOCK_T`` (tokens per inner step), ``BLOCK_D`` and
    ``num_warps`` for requests of at most ``rows`` rows per KV head (``G`` x new tokens). Fewer than 16
    rows (decode): broadcast products over ``PRODUCT_ELEMENTS``; more: ``tl.dot`` tiles of 16-64 rows."""
    bd = max(16, _pow2(head_dim))
    if rows < 16:
        br = max(2, _pow2(rows))
        return {"BLOCK_R": br, "BLOCK_T": max(2, min(32, PRODUCT_ELEMENTS // (br * bd))), "BLOCK_D": bd, "num_warps": 8}
    br = min(_pow2(rows), max(16, ROW_TILE_ELEMENTS // bd))
    return {"BLOCK_R": br, "BLOCK_T": 16 if bd >= 128 else 32, "BLOCK_D": bd, "num_warps": 4 if br * bd <= 1024 else 8}


@triton.jit
def _attend_tile(q, k, v, allowed, m_i, l_i, acc, DOT: tl.constexpr):
    """One online-softmax step of rows ``q [R, D]`` over keys / values ``[T, D]`` (``allowed [R, T]``):
    ``tl.dot`` for tiles of 16 rows or more (prefill chunks), broadcast products for fewer (decode rows,
    which ``tl.dot`` would pad to 16)."""
    if DOT:
        sc = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        sc = tl.sum(q[:, None, :] * k[None, :, :], 2)
    sc = tl.where(allowed, sc, float("-inf"))
    p, alpha, m_i, l_i = _online_update(sc, m_i, l_i)
    if DOT:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.sum(p[:, :, None] * v[None, :, :], 1)
    acc = acc * alpha[:, None] + pv
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["row_tiles", "num_splits"])  # both change every step: no recompiles
def _page_split_kernel(
    Q, KN, VN, Side, Pages, Pages16, PagesS, Reqs, Pstart, Pids, OutPart, LsePart,
    scale, row_tiles, num_splits, page_bytes, side_slot_stride,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, T: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
    SINK: tl.constexpr, SINK_ISZ: tl.constexpr,
    O_KS: tl.constexpr, O_KZ: tl.constexpr, O_VS: tl.constexpr, O_VZ: tl.constexpr, O_SINK: tl.constexpr,
    O_KC: tl.constexpr, O_VC: tl.constexpr,
    KW0: tl.constexpr, KS0: tl.constexpr, KW1: tl.constexpr, KS1: tl.constexpr, KW2: tl.constexpr,
    KS2: tl.constexpr, KNPAD: tl.constexpr, KP: tl.constexpr,
    VW0: tl.constexpr, VS0: tl.constexpr, VW1: tl.constexpr, VS1: tl.constexpr, VW2: tl.constexpr,
    VS2: tl.constexpr, VNPAD: tl.constexpr, VP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (request x KV head x row tile, split): online softmax over units ``s, s + S, ...``."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rt = pid % row_tiles
    h = (pid // row_tiles) % H
    req = (pid // row_tiles) // H
    rq = Reqs + req.to(tl.int64) * 6
    qs = tl.load(rq)
    n = (tl.load(rq + 1) - qs).to(tl.int32)  # counts as int32: loop variables of one type in both branches
    slot = tl.load(rq + 2)
    side_rows = tl.load(rq + 3).to(tl.int32)
    head_block = tl.load(rq + 4)
    head_rows = tl.load(rq + 5).to(tl.int32)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_T)
    d_ok = d < D
    rr = rt * BLOCK_R + r
    r_ok = rr < G * n
    nn = tl.maximum(n, 1)
    i = rr % nn  # new token of the row
    qrow = (qs + i) * (H * G) + h * G + rr // nn
    q = tl.load(Q + qrow[:, None] * D + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(tl.float32) * scale
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    p0 = tl.load(Pstart + req)
    npk = (tl.load(Pstart + req + 1) - p0).to(tl.int32)
    npages = npk + (head_rows > 0).to(tl.int32)
    hD = h * D
    for e in range(s, npages + 1, num_splits):
        if e < npages:  # a packed page: all T rows, or the first head_rows of a cached block
            listed = e < npk
            page = tl.where(listed, tl.load(Pids + p0 + e, mask=listed, other=0), head_block).to(tl.int64)
            ntok = tl.where(listed, T, head_rows)
            p8 = page * page_bytes
            p16 = page * (page_bytes // 2)
            kc_row = Pages + p8 + O_KC + h * (T * KP)
            vc_row = Pages + p8 + O_VC + h * (T * VP)
            for pt in range(0, T, BLOCK_T):
                tt = pt + t
                t_ok = tt < ntok
                td_ok = t_ok[:, None] & d_ok[None, :]
                kcode = _codes(kc_row, tt, t_ok, KP, KW0, KS0, KW1, KS1, KW2, KS2, KNPAD, BLOCK_T, BLOCK_D)
                if KG % BLOCK_T == 0:  # the tile lies in one key group: one scale and zero per channel
                    kpar = p16 + (h * (T // KG) + pt // KG) * D + d
                    ks = tl.load(Pages16 + O_KS // 2 + kpar, mask=d_ok, other=0.0).to(tl.float32)
                    kz = tl.load(Pages16 + O_KZ // 2 + kpar, mask=d_ok, other=0.0).to(tl.float32)
                    k = (kcode - kz[None, :]) * ks[None, :]
                else:
                    kpar = p16 + (h * (T // KG) + tt // KG)[:, None] * D + d[None, :]
                    ks = tl.load(Pages16 + O_KS // 2 + kpar, mask=td_ok, other=0.0).to(tl.float32)
                    kz = tl.load(Pages16 + O_KZ // 2 + kpar, mask=td_ok, other=0.0).to(tl.float32)
                    k = (kcode - kz) * ks
                vcode = _codes(vc_row, tt, t_ok, VP, VW0, VS0, VW1, VS1, VW2, VS2, VNPAD, BLOCK_T, BLOCK_D)
                vpar = p16 + (h * T + tt)[:, None] * (D // VG) + (d // VG)[None, :]
                vs = tl.load(Pages16 + O_VS // 2 + vpar, mask=td_ok, other=0.0).to(tl.float32)
                vz = tl.load(Pages16 + O_VZ // 2 + vpar, mask=td_ok, other=0.0).to(tl.float32)
                v = (vcode - vz) * vs
                if SINK > 0:  # the page's first rows are exact: [H, SINK, 2, D] in the model dtype
                    is_s = tt < SINK
                    sp = page * (page_bytes // SINK_ISZ) + O_SINK // SINK_ISZ + ((h * SINK + tt) * 2)[:, None] * D
                    smask = (is_s & t_ok)[:, None] & d_ok[None, :]
                    sk = tl.load(PagesS + sp + d[None, :], mask=smask, other=0.0).to(tl.float32)
                    sv = tl.load(PagesS + sp + D + d[None, :], mask=smask, other=0.0).to(tl.float32)
                    k = tl.where(is_s[:, None], sk, k)
                    v = tl.where(is_s[:, None], sv, v)
                allowed = r_ok[:, None] & t_ok[None, :]
                m_i, l_i, acc = _attend_tile(q, k, v, allowed, m_i, l_i, acc, BLOCK_R >= 16)
        else:  # the exact unit: side rows [slot, t, 2, H, D], then the new tokens [N, H, D], causal
            sbase = Side + slot.to(tl.int64) * side_slot_stride + hD
            for st in range(0, side_rows, BLOCK_T):
                tt = st + t
                t_ok = tt < side_rows
                td_ok = t_ok[:, None] & d_ok[None, :]
                srow = sbase + tt.to(tl.int64)[:, None] * (2 * H * D) + d[None, :]
                k = tl.load(srow, mask=td_ok, other=0.0).to(tl.float32)
                v = tl.load(srow + H * D, mask=td_ok, other=0.0).to(tl.float32)
                m_i, l_i, acc = _attend_tile(q, k, v, r_ok[:, None] & t_ok[None, :], m_i, l_i, acc, BLOCK_R >= 16)
            for j0 in range(0, n, BLOCK_T):
                jj = j0 + t
                j_ok = jj < n
                jd_ok = j_ok[:, None] & d_ok[None, :]
                np_ = (qs + jj)[:, None] * (H * D) + hD + d[None, :]
                k = tl.load(KN + np_, mask=jd_ok, other=0.0).to(tl.float32)
                v = tl.load(VN + np_, mask=jd_ok, other=0.0).to(tl.float32)
                allowed = r_ok[:, None] & j_ok[None, :] & (jj[None, :] <= i[:, None])
                m_i, l_i, acc = _attend_tile(q, k, v, allowed, m_i, l_i, acc, BLOCK_R >= 16)
    # triton_decode._store_split's rule, masked to this tile's rows (its all-rows store spilled 8 B at sm_90)
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    base = pid.to(tl.int64) * num_splits + s
    tl.store(OutPart + (base * BLOCK_R + r[:, None]) * D + d[None, :], acc / tl.where(has, l_i, 1.0)[:, None],
             mask=r_ok[:, None] & d_ok[None, :])  # fmt: skip
    tl.store(LsePart + base * BLOCK_R + r, lse, mask=r_ok)


@triton.jit(do_not_specialize=["row_tiles", "num_splits"])
def _page_merge_kernel(
    OutPart, LsePart, Out, Reqs, row_tiles, num_splits,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Log-sum-exp merge of one (request x KV head x row tile)'s splits into vLLM's output rows."""
    pid = tl.program_id(0)
    rt = pid % row_tiles
    h = (pid // row_tiles) % H
    rq = Reqs + ((pid // row_tiles) // H).to(tl.int64) * 6
    qs = tl.load(rq)
    n = tl.load(rq + 1) - qs
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    rr = rt * BLOCK_R + r
    r_ok = rr < G * n
    nn = tl.maximum(n, 1)
    od_mask = r_ok[:, None] & (d[None, :] < D)
    out, _ = _merged(OutPart, LsePart, pid.to(tl.int64), BLOCK_R, num_splits, r, d, r_ok, od_mask, D, BLOCK_R, BLOCK_D)
    qrow = (qs + rr % nn) * (H * G) + h * G + rr // nn
    if OUT_BF16:  # round to nearest even by hand: Triton's interpreter truncates in .to(bfloat16)
        bits = out.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    tl.store(Out + qrow[:, None] * D + d[None, :], out.to(Out.dtype.element_ty), mask=od_mask)


def constants(layout: list[int] | tuple[int, ...], bits: int, G: int, rows: int, sink_itemsize: int):  # noqa: ANN201
    """The launch constants of the split and the merge kernel (``num_warps`` included) for pages of
    ``layout`` with ``bits``-bit keys, ``G`` query heads per KV head, requests of at most ``rows`` rows
    per KV head and sinks of ``sink_itemsize`` bytes; the merge's ``OUT_BF16`` is the caller's."""
    lay = dict(zip(LAYOUT_FIELDS, (int(x) for x in layout)))
    D = lay["head_dim"]
    tile = tiles(rows, D)
    split = dict(
        H=lay["heads"], G=G, D=D, T=lay["tokens"], KG=lay["key_group"], VG=lay["value_group"],
        SINK=lay["sink_tokens"], SINK_ISZ=sink_itemsize,
        O_KS=lay["kscale"], O_KZ=lay["kzero"], O_VS=lay["vscale"], O_VZ=lay["vzero"], O_SINK=lay["sink"],
        O_KC=lay["kcodes"], O_VC=lay["vcodes"],
        **{f"K{k}": x for k, x in _plane_spec(bits, D).items()}, KP=D * bits // 8,
        **{f"V{k}": x for k, x in _plane_spec(lay["value_bits"], D).items()}, VP=D * lay["value_bits"] // 8,
        **tile,
    )  # fmt: skip
    merge = dict(
        H=lay["heads"], G=G, D=D, BLOCK_R=tile["BLOCK_R"], BLOCK_D=tile["BLOCK_D"], num_warps=tile["num_warps"]
    )
    return split, merge


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"triton_pages.attend: {msg}")


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    side: torch.Tensor,
    pages: torch.Tensor,
    reqs: torch.Tensor,
    pstart: torch.Tensor,
    pids: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    layout: list[int] | tuple[int, ...],
    bits: int,
    *,
    max_query: int,
    max_units: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One layer's attention for the requests of ``reqs``, written into ``out`` and returned.

    Parameters
    ----------
    query : ``[N, Hq, D]``; key, value : ``[N, H, D]`` the step's new tokens (rows contiguous).
    side : ``[slots, T, 2, H, D]`` the layer's side buffer (contiguous).
    pages : uint8 ``[num_blocks, page_bytes]`` the layer's packed pages.
    reqs : int64 ``[R, 6]`` per request: first and end new token, side slot and rows, block read in part
        and its rows (:class:`kvtier.vllm.pages.attention.TritonPages`'s index).
    pstart : int64 ``[R + 1]``; pids : int64 ``[P]`` the packed pages of request ``r`` are
        ``pids[pstart[r]:pstart[r + 1]]``.
    out : ``[N, Hq, D]`` fp32 or the model dtype; rows of the listed requests are written.
    layout, bits : the pages' :meth:`~kvtier.codecs.pages.PageFormat.layout` and key code width.
    max_query : most new tokens of a request; max_units : most pages of a request plus two (host ints:
        no device sync).
    num_splits : splits per (request, KV head, row tile); None picks one from the device.
    """
    lay = dict(zip(LAYOUT_FIELDS, (int(x) for x in layout)))
    _check(len(layout) == len(LAYOUT_FIELDS), f"layout has {len(layout)} ints, expected {len(LAYOUT_FIELDS)}")
    H, D, T = lay["heads"], lay["head_dim"], lay["tokens"]
    N, Hq = query.shape[:2]
    _check(query.dim() == 3 and query.shape[2] == D and Hq % H == 0, f"query {tuple(query.shape)} vs H={H}, D={D}")
    _check(
        key.shape == (N, H, D) and value.shape == key.shape, f"key/value {tuple(key.shape)}: expected [{N}, {H}, {D}]"
    )
    _check(
        side.dim() == 5 and side.shape[1:] == (T, 2, H, D),
        f"side {tuple(side.shape)}: expected [slots, {T}, 2, {H}, {D}]",
    )
    _check(pages.dtype == torch.uint8 and pages.dim() == 2 and pages.shape[1] == lay["page_bytes"],
           f"pages {tuple(pages.shape)} {pages.dtype}: expected uint8 [blocks, {lay['page_bytes']}]")  # fmt: skip
    _check(out.shape == query.shape, f"out {tuple(out.shape)}: expected {tuple(query.shape)}")
    dev = query.device
    tensors = (key, value, side, pages, reqs, pstart, pids, out)
    _check(all(x.device == dev for x in tensors), "all tensors must be on the query's device")
    _check(all(x.is_contiguous() for x in (query, key, value, side, pages, out)), "tensors must be contiguous")
    _check(reqs.dtype == pstart.dtype == pids.dtype == torch.int64, "reqs, pstart and pids must be int64")
    R = reqs.shape[0]
    if R == 0:
        return out
    sink_dtype = side.dtype
    isz = sink_dtype.itemsize
    _check(lay["page_bytes"] % max(2, isz) == 0 and lay["sink"] % isz == 0, "page fields are not aligned")
    G = Hq // H
    split, merge = constants(layout, bits, G, G * max_query, isz)
    BLOCK_R = split["BLOCK_R"]
    row_tiles = -(-G * max_query // BLOCK_R)
    programs = R * H * row_tiles
    S = _num_splits(programs, max_units, dev, num_splits)
    out_part = torch.empty(programs * S * BLOCK_R * D, dtype=torch.float32, device=dev)
    lse_part = torch.empty(programs * S * BLOCK_R, dtype=torch.float32, device=dev)
    _page_split_kernel[(programs, S)](
        query, key, value, side, pages, pages.view(torch.float16), pages.view(sink_dtype), reqs, pstart, pids,
        out_part, lse_part, float(scale), row_tiles, S, lay["page_bytes"], side.stride(0), **split,
    )  # fmt: skip
    _page_merge_kernel[(programs,)](
        out_part, lse_part, out, reqs, row_tiles, S, OUT_BF16=out.dtype == torch.bfloat16, **merge
    )
    return out
