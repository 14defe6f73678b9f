"""Triton decode attention over packed tiers and exact hot tokens (FlashDecoding split-K).

Decode reads every stored byte once per step and does little arithmetic per byte, so it is bound by
memory bandwidth. The kernels here read the *packed* bytes of a tier and unpack and dequantize them
in registers: nothing dense is ever written back. Each program serves one (batch, KV head, split):
all ``R`` query rows of the head's group (GQA, no ``repeat_kv``) are scored against the same
tokens, so each byte is loaded once for the whole group. The token axis is split over programs
(split-K, https://crfm.stanford.edu/2023/10/12/flashdecoding.html); each split keeps an online
softmax and writes a normalized partial output and its log-sum-exp, and a small merge kernel
combines the splits. The result has the contract of :func:`kvtier.kernels.cpu.packed_attention`
(normalized ``out`` and ``lse``, ``-inf`` where nothing was attended), so
:func:`kvtier.attention.partials.merge` combines tiers whatever kernel produced them.

Codes follow :mod:`kvtier.quant.bits`: a ``bits``-wide code is split into planes of widths that
divide 8 (``3 = 2 + 1``, ``6 = 4 + 2``), each plane packed densely along the channels; channel
``c`` of a plane of width ``w`` lives in byte ``start + c // (8 / w)`` at shift ``w * (c % (8 / w))``.
A kernel loads a plane's bytes contiguously, expands each byte into its ``8 / w`` fields with a
broadcast shift and reshapes them into channel order, so any width 1..8 works. Every stored value
is ``x = a * code + b`` (:meth:`kvtier.codecs.AffineCodec.affine`); the kernel can also
read a tier's fields as stored (fp16 ``scale, zero`` or ``scale, mean``) and form ``a, b`` in
registers, which saves the fp32 copies ``affine`` would make every step.

Vector codes (:class:`kvtier.codecs.VqCodec`) have their own kernel, :func:`vq_attention`: per tile
of tokens each coordinate's centre index is read from its plane (a sub-vector's byte shared by its
``d`` coordinates), the codebook coordinate gathered (the codebooks are a few KiB: cached), scaled
by the token's RMS (fp8 bytes through a 256-entry table) and the block's mean added; values the
same, their token means riding in the sum as ``mean * ones @ rotation`` - no separate output.

Block-sparse attention takes the selected blocks in CSR form (``indptr [B*H+1]``, ``indices [nnz]``,
FlashInfer's layout), computed once per step and reusable across layers; :func:`padded_to_csr`
converts the padded ``[B, H, k]`` form used elsewhere in kvtier. Per-row masks within the selected
blocks travel as ``[nnz, R]`` booleans aligned with ``indices`` (:func:`csr_row_mask`).

The torch functions of :mod:`kvtier.attention.partials` are the reference (``tests/test_triton.py``
runs these kernels on the CPU with Triton's interpreter). Importing this module imports Triton:
import it lazily (see :mod:`kvtier.kernels.dispatch`).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .. import codecs
from ..quant import packed_size, planes

#: Elements of the ``[rows, tokens, channels]`` product a program holds per step: the register budget
#: (about 100-130 registers a thread at 4 warps on sm_90, no spills; see ``gpu_check.py --compile-only``).
TILE_ELEMENTS = 4096
#: How the affine parameters of a tier are read (the codecs' table, :data:`kvtier.codecs.AFFINE_MODES`).
AFFINE_MODES = codecs.AFFINE_MODES


# --- kernels ---------------------------------------------------------------------------------------


@triton.jit
def _affine(p1, p2, AFFINE: tl.constexpr):
    """``(a, b)`` of ``x = a * code + b`` from the two stored parameters (fp32); the rules of
    :func:`kvtier.codecs.affine_ab`."""
    if AFFINE == 1:
        a = p1
        b = -p1 * p2
    elif AFFINE == 2:
        a = 2.0 * p1
        b = p2 - p1
    else:
        a = p1
        b = p2
    return a, b


@triton.jit
def _plane(
    row_ptr, tt, t_ok, P, W: tl.constexpr, START: tl.constexpr, OFF: tl.constexpr, NPAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One bit plane of ``BLOCK_T`` tokens' codes, in channel order: int32 ``[BLOCK_T, BLOCK_D]``.

    The plane holds ``NPAD / PER`` bytes per token (``PER = 8 / W`` fields a byte); field ``i`` of
    byte ``j`` is channel ``j * PER + i``, so expanding bytes to ``[T, J, PER]`` and flattening the
    last two axes gives channel order.
    """
    j = tl.arange(0, BLOCK_D // (8 // W))
    ptrs = row_ptr + tt[:, None].to(tl.int64) * P + START + j[None, :]
    byte = tl.load(ptrs, mask=t_ok[:, None] & (j[None, :] < NPAD // (8 // W)), other=0).to(tl.int32)
    if W == 8:
        code = byte
    else:
        shift = tl.arange(0, 8 // W) * W
        fields = (byte[:, :, None] >> shift[None, None, :]) & ((1 << W) - 1)  # [T, J, PER]
        code = tl.reshape(fields, [BLOCK_T, BLOCK_D])
    return code << OFF


@triton.jit
def _codes(
    row_ptr, tt, t_ok, P, W0: tl.constexpr, S0: tl.constexpr, W1: tl.constexpr, S1: tl.constexpr,
    W2: tl.constexpr, S2: tl.constexpr, NPAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Codes of ``BLOCK_T`` tokens (``row_ptr`` = the block's first byte): fp32 ``[BLOCK_T, BLOCK_D]``.

    Planes ``(W0, S0)``, ``(W1, S1)``, ``(W2, S2)`` (width, first byte; width 0 = absent) hold the
    low, middle and high bits, as in :func:`kvtier.quant.bits.pack_bits`.
    """
    code = _plane(row_ptr, tt, t_ok, P, W0, S0, 0, NPAD, BLOCK_T, BLOCK_D)
    if W1 > 0:
        code = code | _plane(row_ptr, tt, t_ok, P, W1, S1, W0, NPAD, BLOCK_T, BLOCK_D)
    if W2 > 0:
        code = code | _plane(row_ptr, tt, t_ok, P, W2, S2, W0 + W1, NPAD, BLOCK_T, BLOCK_D)
    return code.to(tl.float32)


@triton.jit
def _online_update(sc, m_i, l_i):
    """Online softmax step: returns ``p`` (unnormalized), the rescale factor and the new max/sum."""
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet stay exact zeros
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _program_start(Rows, H, R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """What a (batch x KV head, split) program of a tier starts from: its ids (``bh``, split ``s``,
    batch row ``b``), row and channel ranges with their masks, its query rows ``q [BLOCK_R,
    BLOCK_D]`` and an empty online-softmax state ``(m, l, acc)``."""
    bh = tl.program_id(0)
    s = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < R
    d_ok = d < D
    q = tl.load(Rows + (bh64 * R + r[:, None]) * D + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    return bh, s, bh // H, bh64, r, d, r_ok, d_ok, q, m_i, l_i, acc


@triton.jit
def _store_split(OutPart, LsePart, bh, s, num_splits, R, acc, m_i, l_i, r, d, D: tl.constexpr):
    """Write one split's normalized output and log-sum-exp (``-inf`` when it attended nothing)."""
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    base = bh.to(tl.int64) * num_splits + s
    r_ok = r < R
    tl.store(OutPart + (base * R + r[:, None]) * D + d[None, :], out, mask=r_ok[:, None] & (d[None, :] < D))
    tl.store(LsePart + base * R + r, lse, mask=r_ok)


@triton.jit(do_not_specialize=["n", "num_splits"])  # lengths change every step: no recompiles
def _packed_split_kernel(
    Rows, KC, KA, KB, VC, VA, VB, Valid, Indptr, Indices, RowMask, OutPart, LsePart,
    H, R, n, T, P, NG, G, num_splits,
    D: tl.constexpr, W0: tl.constexpr, S0: tl.constexpr, W1: tl.constexpr, S1: tl.constexpr,
    W2: tl.constexpr, S2: tl.constexpr, NPAD: tl.constexpr,
    AFFINE: tl.constexpr, SPARSE: tl.constexpr, ROW_MASK: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (batch x KV head, split): online softmax over the blocks ``e = lo + s, lo + s + S, ...``."""
    bh, s, b, bh64, r, d, r_ok, d_ok, q, m_i, l_i, acc = _program_start(Rows, H, R, D, BLOCK_R, BLOCK_D)
    t = tl.arange(0, BLOCK_T)
    if SPARSE:
        lo = tl.load(Indptr + bh).to(tl.int32)
        hi = tl.load(Indptr + bh + 1).to(tl.int32)
    else:
        lo = 0
        hi = n
    g = d // G
    for e in range(lo + s, hi, num_splits):
        if SPARSE:
            blk = tl.load(Indices + e).to(tl.int64)
        else:
            blk = tl.cast(e, tl.int64)
        base = bh64 * n + blk  # this block in [B * H * n]
        # keys: score = (q * a) . code + q . b, with (a, b) per channel of the block
        ka, kb = _affine(
            tl.load(KA + base * D + d, mask=d_ok, other=0.0).to(tl.float32),
            tl.load(KB + base * D + d, mask=d_ok, other=0.0).to(tl.float32),
            AFFINE,
        )
        qa = q * ka[None, :]
        bias = tl.sum(q * kb[None, :], 1)
        allowed_r = r_ok
        if ROW_MASK:
            allowed_r = allowed_r & (tl.load(RowMask + tl.cast(e, tl.int64) * R + r, mask=r_ok, other=0) != 0)
        valid_row = Valid + (b.to(tl.int64) * n + blk) * T
        k_row = KC + base * T * P
        v_row = VC + base * T * P
        for t0 in range(0, T, BLOCK_T):
            tt = t0 + t
            t_ok = tt < T
            ok = (tl.load(valid_row + tt, mask=t_ok, other=0) != 0) & t_ok
            kcode = _codes(k_row, tt, t_ok, P, W0, S0, W1, S1, W2, S2, NPAD, BLOCK_T, BLOCK_D)
            sc = tl.sum(qa[:, None, :] * kcode[None, :, :], 2) + bias[:, None]  # [R, T]
            sc = tl.where(allowed_r[:, None] & ok[None, :], sc, float("-inf"))
            p, alpha, m_i, l_i = _online_update(sc, m_i, l_i)
            # values: x = a[t, g(c)] * code[t, c] + b[t, g(c)]
            vcode = _codes(v_row, tt, t_ok, P, W0, S0, W1, S1, W2, S2, NPAD, BLOCK_T, BLOCK_D)
            vptr = (base * T + tt[:, None]) * NG + g[None, :]
            vmask = t_ok[:, None] & d_ok[None, :]
            va, vb = _affine(
                tl.load(VA + vptr, mask=vmask, other=0.0).to(tl.float32),
                tl.load(VB + vptr, mask=vmask, other=0.0).to(tl.float32),
                AFFINE,
            )
            vx = va * vcode + vb
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vx[None, :, :], 1)
    _store_split(OutPart, LsePart, bh, s, num_splits, R, acc, m_i, l_i, r, d, D)


@triton.jit(do_not_specialize=["N", "num_splits"])  # lengths change every step: no recompiles
def _exact_split_kernel(
    Rows, K, V, Mask, OutPart, LsePart,
    H, R, N, num_splits,
    skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smr, smn,
    D: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (batch x KV head, split): online softmax over token chunks ``c = s, s + S, ...``."""
    bh, s, b, bh64, r, d, r_ok, d_ok, q, m_i, l_i, acc = _program_start(Rows, H, R, D, BLOCK_R, BLOCK_D)
    b = b.to(tl.int64)
    h = (bh % H).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    for c in range(s, tl.cdiv(N, BLOCK_N), num_splits):
        nn = (c * BLOCK_N + j).to(tl.int64)
        n_ok = nn < N
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + nn[:, None] * skn + d[None, :] * skd, mask=kv_mask, other=0.0).to(tl.float32)
        sc = tl.sum(q[:, None, :] * k[None, :, :], 2)  # [R, N]
        allowed = r_ok[:, None] & n_ok[None, :]
        if HAS_MASK:  # int64 base, int32 offsets within the (small) mask of one head
            mptr = Mask + b * smb + h * smh + (r[:, None] * smr + (c * BLOCK_N + j)[None, :] * smn)
            allowed = allowed & (tl.load(mptr, mask=allowed, other=0) != 0)
        sc = tl.where(allowed, sc, float("-inf"))
        p, alpha, m_i, l_i = _online_update(sc, m_i, l_i)
        v = tl.load(v_base + nn[:, None] * svn + d[None, :] * svd, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
    _store_split(OutPart, LsePart, bh, s, num_splits, R, acc, m_i, l_i, r, d, D)


@triton.jit
def _vq_plane(row_ptr, tt, t_ok, stride, p, p_ok, W: tl.constexpr, START: tl.constexpr, OFF: tl.constexpr):
    """One bit plane of the centre index of sub-vector ``p [BLOCK_D]`` (per coordinate) for
    ``BLOCK_T`` tokens: int32 ``[BLOCK_T, BLOCK_D]`` (fields of :func:`_plane`'s layout, each byte
    read by every coordinate of its sub-vectors: cached loads)."""
    PER: tl.constexpr = 8 // W
    ptrs = row_ptr + tt[:, None].to(tl.int64) * stride + START + (p // PER)[None, :]
    byte = tl.load(ptrs, mask=t_ok[:, None] & p_ok[None, :], other=0).to(tl.int32)
    return ((byte >> ((p % PER) * W)[None, :]) & ((1 << W) - 1)) << OFF


@triton.jit
def _vq_centres(
    Book, row_ptr, tt, t_ok, stride, d, d_ok, SUB: tl.constexpr, W0: tl.constexpr, S0: tl.constexpr,
    W1: tl.constexpr, S1: tl.constexpr, W2: tl.constexpr, S2: tl.constexpr,
):  # fmt: skip
    """The codebook coordinates of ``BLOCK_T`` tokens, fp32 ``[BLOCK_T, BLOCK_D]``: coordinate ``c``
    is coordinate ``c % SUB`` of the centre whose index sub-vector ``c // SUB`` holds (planes
    ``(W, S)``: width and first byte, width 0 = absent)."""
    p = d // SUB
    idx = _vq_plane(row_ptr, tt, t_ok, stride, p, d_ok, W0, S0, 0)
    if W1 > 0:
        idx = idx | _vq_plane(row_ptr, tt, t_ok, stride, p, d_ok, W1, S1, W0)
    if W2 > 0:
        idx = idx | _vq_plane(row_ptr, tt, t_ok, stride, p, d_ok, W2, S2, W0 + W1)
    return tl.load(Book + idx * SUB + (d % SUB)[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit(do_not_specialize=["n", "num_splits"])  # lengths change every step: no recompiles
def _vq_split_kernel(
    Rows, KI, KBook, KMean, KRms, VI, VBook, VRms, VMean, Ones, F8, Valid, OutPart, LsePart,
    H, R, n, T, KS, VS, num_splits,
    D: tl.constexpr, KSUB: tl.constexpr, KW0: tl.constexpr, KS0: tl.constexpr, KW1: tl.constexpr,
    KS1: tl.constexpr, KW2: tl.constexpr, KS2: tl.constexpr, VSUB: tl.constexpr, VW0: tl.constexpr,
    VS0: tl.constexpr, VW1: tl.constexpr, VS1: tl.constexpr, VW2: tl.constexpr, VS2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (batch x KV head, split) over a vq tier (:class:`kvtier.codecs.VqCodec`, rotated rows):
    keys ``centre * rms + block mean``, values ``centre * rms + mean * Ones`` (``Ones`` = the
    all-ones vector in rotated coordinates, so the values' token means ride in the same sum), the
    fp8 parameters read through the 256-entry table ``F8``; online softmax over the blocks
    ``s, s + S, ...``."""
    bh, s, b, bh64, r, d, r_ok, d_ok, q, m_i, l_i, acc = _program_start(Rows, H, R, D, BLOCK_R, BLOCK_D)
    t = tl.arange(0, BLOCK_T)
    ones = tl.load(Ones + d, mask=d_ok, other=0.0)
    for e in range(s, n, num_splits):
        base = bh64 * n + e  # this block in [B * H * n]
        mean = tl.load(KMean + base * D + d, mask=d_ok, other=0.0).to(tl.float32)
        bias = tl.sum(q * mean[None, :], 1)
        valid_row = Valid + (b.to(tl.int64) * n + e) * T
        for t0 in range(0, T, BLOCK_T):
            tt = t0 + t
            t_ok = tt < T
            ok = (tl.load(valid_row + tt, mask=t_ok, other=0) != 0) & t_ok
            tok = base * T + tt
            k_rms = tl.load(F8 + tl.load(KRms + tok, mask=t_ok, other=0).to(tl.int32))
            kx = _vq_centres(KBook, KI + base * T * KS, tt, t_ok, KS, d, d_ok, KSUB, KW0, KS0, KW1, KS1, KW2, KS2)
            sc = tl.sum(q[:, None, :] * (kx * k_rms[:, None])[None, :, :], 2) + bias[:, None]  # [R, T]
            sc = tl.where(r_ok[:, None] & ok[None, :], sc, float("-inf"))
            p, alpha, m_i, l_i = _online_update(sc, m_i, l_i)
            v_rms = tl.load(F8 + tl.load(VRms + tok, mask=t_ok, other=0).to(tl.int32))
            v_mean = tl.load(F8 + tl.load(VMean + tok, mask=t_ok, other=0).to(tl.int32))
            vx = _vq_centres(VBook, VI + base * T * VS, tt, t_ok, VS, d, d_ok, VSUB, VW0, VS0, VW1, VS1, VW2, VS2)
            vx = vx * v_rms[:, None] + v_mean[:, None] * ones[None, :]
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vx[None, :, :], 1)
    _store_split(OutPart, LsePart, bh, s, num_splits, R, acc, m_i, l_i, r, d, D)


@triton.jit
def _merged(OutPart, LsePart, bh, R, num_splits, r, d, r_ok, od_mask, D: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_D: tl.constexpr):  # fmt: skip
    """Log-sum-exp merge of the ``num_splits`` partials (:func:`_store_split`, ``R`` rows each) of rows
    ``r`` of program ``bh``: ``(out [BLOCK_R, BLOCK_D] normalized, lse [BLOCK_R])``."""
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(LsePart + (bh * num_splits + s) * R + r, mask=r_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        base = bh * num_splits + s
        w = tl.exp(tl.load(LsePart + base * R + r, mask=r_ok, other=float("-inf")) - m_safe)
        part = tl.load(OutPart + (base * R + r[:, None]) * D + d[None, :], mask=od_mask, other=0.0)
        total += w
        acc += w[:, None] * part
    has = total > 0
    out = acc / tl.where(has, total, 1.0)[:, None]
    lse = tl.where(has, m_safe + tl.log(tl.where(has, total, 1.0)), float("-inf"))
    return out, lse


@triton.jit(do_not_specialize=["num_splits"])  # lengths change every step: no recompiles
def _merge_splits_kernel(
    OutPart, LsePart, Out, Lse, R, num_splits, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Log-sum-exp merge of the splits of one (batch x KV head)."""
    bh = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < R
    od_mask = r_ok[:, None] & (d[None, :] < D)
    out, lse = _merged(OutPart, LsePart, bh, R, num_splits, r, d, r_ok, od_mask, D, BLOCK_R, BLOCK_D)
    tl.store(Out + (bh * R + r[:, None]) * D + d[None, :], out, mask=od_mask)
    tl.store(Lse + bh * R + r, lse, mask=r_ok)


# --- host side ---------------------------------------------------------------------------------------


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def _plane_spec(bits: int, dim: int) -> dict[str, int]:
    """Kernel constants of a code width: ``W{i}, S{i}`` width and first byte of plane ``i`` (width
    0 = absent) and ``NPAD``, the channels a plane covers (``dim`` padded to a multiple of 8)."""
    n_pad = dim if bits == 8 else -(-dim // 8) * 8
    return {"NPAD": n_pad} | _index_spec("", planes(bits), dim)


def _index_spec(prefix: str, widths: tuple[int, ...], count: int) -> dict[str, int]:
    """``{prefix}W{i}, {prefix}S{i}``: width and first byte of plane ``i`` (width 0 = absent) of
    ``count`` codes packed at ``widths`` (:func:`kvtier.quant.planes`; each plane covers ``count``
    padded to a multiple of 8 unless it is one 8-bit plane)."""
    n_pad = count if tuple(widths) == (8,) else -(-count // 8) * 8
    spec, start = {}, 0
    for i in range(3):
        w = widths[i] if i < len(widths) else 0
        spec[f"{prefix}W{i}"], spec[f"{prefix}S{i}"] = w, start
        start += n_pad // (8 // w) if w else 0
    return spec


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _num_splits(bh: int, work: int, device: torch.device, num_splits: int | None) -> int:
    """Splits of the sequence: about four programs per multiprocessor, never more than units of work."""
    if num_splits is None:
        num_splits = -(-4 * _multiprocessors(device) // max(1, bh))
    return max(1, min(num_splits, max(1, work)))


def _tier_launch(rows: torch.Tensor, T: int, work: int, num_splits: int | None):
    """A tier kernel's launch over ``rows [B, H, R, D]`` and ``T``-token blocks, ``work`` blocks per
    (batch, KV head): ``(BLOCK_R, BLOCK_T, BLOCK_D, S, out_part, lse_part)``, the tile sizes within
    :data:`TILE_ELEMENTS`, the splits, and the empty ``[B, H, S, R, D]`` / ``[B, H, S, R]`` partials."""
    B, H, R, D = rows.shape
    BLOCK_D = max(8, _pow2(D))
    BLOCK_R = max(2, _pow2(R))
    BLOCK_T = max(2, min(_pow2(T), TILE_ELEMENTS // (BLOCK_R * BLOCK_D)))
    S = _num_splits(B * H, work, rows.device, num_splits)
    out_part = torch.empty(B, H, S, R, D, dtype=torch.float32, device=rows.device)
    lse_part = torch.empty(B, H, S, R, dtype=torch.float32, device=rows.device)
    return BLOCK_R, BLOCK_T, BLOCK_D, S, out_part, lse_part


def _finish(out_part: torch.Tensor, lse_part: torch.Tensor, S: int, BLOCK_R: int, BLOCK_D: int):
    """Merge ``[B, H, S, R, D]`` split partials into ``out [B, H, R, D]``, ``lse [B, H, R]``."""
    B, H, _, R, D = out_part.shape
    if S == 1:
        return out_part.view(B, H, R, D), lse_part.view(B, H, R)
    out = torch.empty(B, H, R, D, dtype=torch.float32, device=out_part.device)
    lse = torch.empty(B, H, R, dtype=torch.float32, device=out_part.device)
    _merge_splits_kernel[(B * H,)](out_part, lse_part, out, lse, R, S, D=D, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D)
    return out, lse


def _empty_result(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, R, D = rows.shape
    out = torch.zeros(B, H, R, D, dtype=torch.float32, device=rows.device)
    return out, torch.full((B, H, R), float("-inf"), dtype=torch.float32, device=rows.device)


def padded_to_csr(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected blocks in padded form to CSR.

    Parameters
    ----------
    blocks : int ``[B, H, k]`` block ids per (batch, KV head), ``-1`` = none (anywhere in a row).

    Returns
    -------
    indptr : int64 ``[B * H + 1]``: the blocks of head ``bh`` are ``indices[indptr[bh]:indptr[bh + 1]]``.
    indices : int32 ``[nnz]`` block ids, in the order they were listed.
    """
    B, H, k = blocks.shape
    keep = blocks >= 0
    indptr = torch.zeros(B * H + 1, dtype=torch.int64, device=blocks.device)
    indptr[1:] = keep.reshape(B * H, k).sum(-1).cumsum(0)
    return indptr, blocks[keep].to(torch.int32)


def csr_row_mask(blocks: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
    """Per-row masks aligned with :func:`padded_to_csr`'s ``indices``.

    Parameters
    ----------
    blocks : int ``[B, H, k]`` (``-1`` = none).
    row_mask : bool ``[B, H, R, k]``: which listed blocks each query row may read.

    Returns
    -------
    bool ``[nnz, R]``.
    """
    return row_mask.permute(0, 1, 3, 2)[blocks >= 0]


def packed_attention_csr(
    rows: torch.Tensor,
    k_codes: torch.Tensor,
    k_a: torch.Tensor,
    k_b: torch.Tensor,
    v_codes: torch.Tensor,
    v_a: torch.Tensor,
    v_b: torch.Tensor,
    valid: torch.Tensor,
    bits: int,
    dim: int,
    indptr: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    *,
    affine: str = "ab",
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``rows`` over a packed tier: all blocks, or the blocks listed in CSR form.

    Parameters
    ----------
    rows : fp32 ``[B, H, R, D]`` query rows, pre-scaled (``R`` = query heads per KV head x queries).
    k_codes, v_codes : uint8 ``[B, H, n, T, P]``, ``P = packed_size(D, bits)``.
    k_a, k_b : ``[B, H, n, D]`` (or ``[B, H, n, 1, D]``) per-block, per-channel key parameters.
    v_a, v_b : ``[B, H, n, T, NG]`` per-token, per-group value parameters (``D / NG`` channels a group).
    valid : bool ``[B, n, T]`` real tokens.
    bits : code width, 1..8 (1 with ``affine="scale_mean"`` for sign codes).
    dim : head dim ``D``.
    indptr, indices : CSR blocks per (batch, KV head) (see :func:`padded_to_csr`), or None for all.
    row_mask : bool ``[nnz, R]`` aligned with ``indices`` (see :func:`csr_row_mask`), or None.
    affine : how the parameters are read (float of any width): ``"ab"`` ``x = a * code + b``,
        ``"scale_zero"`` ``x = scale * (code - zero)``, ``"scale_mean"`` ``x = mean + scale * (2 code - 1)``.
    num_splits : splits of the sequence per (batch, KV head); None picks one from the device.

    Returns
    -------
    out : fp32 ``[B, H, R, D]`` normalized (zeros where nothing was attended).
    lse : fp32 ``[B, H, R]`` log-sum-exp of the scores (``-inf`` where nothing was attended).
    """
    B, H, R, D = rows.shape
    n, T, P = k_codes.shape[2:]
    NG = v_a.shape[-1]
    if D != dim or P != packed_size(dim, bits) or dim % NG:
        raise ValueError(f"shapes do not match: rows {tuple(rows.shape)}, codes {tuple(k_codes.shape)}, bits {bits}")
    sparse = indptr is not None
    work = (indices.numel() // max(1, B * H)) if sparse else n
    if R == 0 or n == 0 or (sparse and indices.numel() == 0):
        return _empty_result(rows)
    BLOCK_R, BLOCK_T, BLOCK_D, S, out_part, lse_part = _tier_launch(rows, T, work, num_splits)
    rows = rows.float().contiguous()
    dummy = rows
    _packed_split_kernel[(B * H, S)](
        rows,
        k_codes.contiguous(),
        k_a.reshape(B, H, n, D).contiguous(),
        k_b.reshape(B, H, n, D).contiguous(),
        v_codes.contiguous(),
        v_a.contiguous(),
        v_b.contiguous(),
        valid.reshape(B, n, T).contiguous().view(torch.uint8),
        indptr if sparse else dummy,
        indices if sparse else dummy,
        row_mask.contiguous().view(torch.uint8) if row_mask is not None else dummy,
        out_part,
        lse_part,
        H,
        R,
        n,
        T,
        P,
        NG,
        D // NG,
        S,
        **_plane_spec(bits, dim),
        D=D,
        AFFINE=AFFINE_MODES[affine],
        SPARSE=sparse,
        ROW_MASK=row_mask is not None,
        BLOCK_R=BLOCK_R,
        BLOCK_T=BLOCK_T,
        BLOCK_D=BLOCK_D,
    )
    return _finish(out_part, lse_part, S, BLOCK_R, BLOCK_D)


def packed_attention(
    rows: torch.Tensor,
    k_codes: torch.Tensor,
    k_a: torch.Tensor,
    k_b: torch.Tensor,
    v_codes: torch.Tensor,
    v_a: torch.Tensor,
    v_b: torch.Tensor,
    valid: torch.Tensor,
    bits: int,
    dim: int,
    blocks: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    *,
    affine: str = "ab",
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kvtier.kernels.cpu.packed_attention`'s contract on Triton.

    Parameters
    ----------
    rows, k_codes, k_a, k_b, v_codes, v_a, v_b, valid, bits, dim, affine, num_splits :
        as in :func:`packed_attention_csr`.
    blocks : int ``[B, H, k]`` block ids to read (``-1`` = none), or None for all.
    row_mask : bool ``[B, H, R, k]`` listed blocks each row may read, or None.

    Returns
    -------
    ``out [B, H, R, D]`` (normalized) and ``lse [B, H, R]``, fp32.
    """
    indptr = indices = csr_mask = None
    if blocks is not None:
        indptr, indices = padded_to_csr(blocks)
        if row_mask is not None:
            csr_mask = csr_row_mask(blocks, row_mask)
    return packed_attention_csr(
        rows, k_codes, k_a, k_b, v_codes, v_a, v_b, valid, bits, dim, indptr, indices, csr_mask,
        affine=affine, num_splits=num_splits,
    )  # fmt: skip


def vq_attention(
    rows: torch.Tensor,
    k_idx: torch.Tensor,
    k_planes: tuple[int, ...],
    k_book: torch.Tensor,
    k_mean: torch.Tensor,
    k_rms: torch.Tensor,
    v_idx: torch.Tensor,
    v_planes: tuple[int, ...],
    v_book: torch.Tensor,
    v_rms: torch.Tensor,
    v_mean: torch.Tensor,
    ones: torch.Tensor,
    fp8: torch.Tensor,
    valid: torch.Tensor,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of rotated ``rows`` over a vq tier, read in place (the layout of
    :class:`kvtier.codecs.VqCodec`; the caller, :func:`kvtier.kernels.dispatch.gpu_partial`, passes
    its constants).

    Parameters
    ----------
    rows : fp32 ``[B, H, R, D]`` query rows, pre-scaled, in rotated coordinates.
    k_idx, v_idx : uint8 ``[B, H, n, T, KS]`` / ``[..., VS]`` packed centre indices (one per sub-vector).
    k_planes, v_planes : their plane widths (:func:`kvtier.quant.planes` of the index width).
    k_book, v_book : fp32 codebooks ``[C, d]`` (``d`` the sub-vector length, dividing ``D``).
    k_mean : fp16 ``[B, H, n, 1, D]``; k_rms, v_rms, v_mean : fp8 bytes (uint8) ``[B, H, n, T]``.
    ones : fp32 ``[D]`` the all-ones vector in rotated coordinates; fp8 : fp32 ``[256]`` the value
        of each fp8 byte.
    valid : bool ``[B, n, T]``.

    Returns
    -------
    ``out [B, H, R, D]`` (normalized, rotated coordinates, value means included) and ``lse
    [B, H, R]``, fp32 (``-inf`` and zeros where nothing was attended).
    """
    B, H, R, D = rows.shape
    n, T, KS = k_idx.shape[2:]
    VS = v_idx.shape[-1]
    if R == 0 or n == 0:
        return _empty_result(rows)
    ksub, vsub = k_book.shape[1], v_book.shape[1]
    if D % ksub or D % vsub or k_book.shape[0] > 256 or v_book.shape[0] > 256:
        raise ValueError(f"codebooks {tuple(k_book.shape)} / {tuple(v_book.shape)} do not fit head dim {D}")
    BLOCK_R, BLOCK_T, BLOCK_D, S, out_part, lse_part = _tier_launch(rows, T, n, num_splits)
    _vq_split_kernel[(B * H, S)](
        rows.float().contiguous(), k_idx.contiguous(), k_book.float().contiguous(), k_mean.contiguous(),
        k_rms.contiguous(), v_idx.contiguous(), v_book.float().contiguous(), v_rms.contiguous(),
        v_mean.contiguous(), ones.float().contiguous(), fp8.float().contiguous(),
        valid.reshape(B, n, T).contiguous().view(torch.uint8), out_part, lse_part,
        H, R, n, T, KS, VS, S,
        **_index_spec("K", tuple(k_planes), D // ksub), **_index_spec("V", tuple(v_planes), D // vsub),
        D=D, KSUB=ksub, VSUB=vsub, BLOCK_R=BLOCK_R, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    return _finish(out_part, lse_part, S, BLOCK_R, BLOCK_D)


def exact_attention(
    rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``rows`` over exact tokens (hot window, sinks, or a dense cache).

    Parameters
    ----------
    rows : fp32 ``[B, H, R, D]`` query rows, pre-scaled.
    k, v : ``[B, H, N, D]`` fp16, bf16 or fp32, any strides (a view of a larger buffer is read in place).
    mask : bool broadcastable to ``[B, H, R, N]`` (True = attend), or None.
    num_splits : splits of the sequence per (batch, KV head); None picks one from the device.

    Returns
    -------
    out : fp32 ``[B, H, R, D]`` normalized; lse : fp32 ``[B, H, R]`` (``-inf`` where nothing attended).
    """
    B, H, R, D = rows.shape
    N = k.shape[2]
    if R == 0 or N == 0:
        return _empty_result(rows)
    BLOCK_D = _pow2(D)
    BLOCK_R = max(2, _pow2(R))
    BLOCK_N = max(2, min(_pow2(N), 64, TILE_ELEMENTS // (BLOCK_R * BLOCK_D)))
    S = _num_splits(B * H, -(-N // BLOCK_N), rows.device, num_splits)
    out_part = torch.empty(B, H, S, R, D, dtype=torch.float32, device=rows.device)
    lse_part = torch.empty(B, H, S, R, dtype=torch.float32, device=rows.device)
    rows = rows.float().contiguous()
    m = rows if mask is None else mask.expand(B, H, R, N).view(torch.uint8)
    _exact_split_kernel[(B * H, S)](
        rows, k, v, m, out_part, lse_part,
        H, R, N, S,
        *k.stride(), *v.stride(), *(m.stride() if mask is not None else (0, 0, 0, 0)),
        D=D, HAS_MASK=mask is not None, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    return _finish(out_part, lse_part, S, BLOCK_R, BLOCK_D)
