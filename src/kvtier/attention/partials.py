"""Per-tier partial attention read straight from the stored tensors, merged by log-sum-exp.

Each function attends a block of query *rows* to one tier and returns the tier-local softmax
output and its log-sum-exp (the FlashDecoding split-KV merge, https://crfm.stanford.edu/2023/10/12/flashdecoding.html).
Rows are the ``Gq * q`` queries that share one KV head (GQA without ``repeat_kv``):
``query [B, Hq, q, D] -> rows [B, Hkv, Gq * q, D]``.

Packed tiers are never dequantized as a whole. Scores against k-bit keys use the per-channel
layout: ``q . ((c - z) * s) = (q * s) . c - (q * s) . z``, and codes are read one bit-plane
slice at a time (a 4-bit code is two slices of ``D / 2`` channels), each a transient of
``T x D / per`` values; the same holds for values.

These are the torch backend's maths (:mod:`kvtier.attention.backends.torch`) and the merge every
backend's partials go through; which function runs for which segment is the plan's choice
(:mod:`kvtier.attention.plan`), never made here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import Codec, VqCodec
from ..codecs.vq import codebook
from ..quant import planes, rotation

NEG_INF = float("-inf")


@dataclass
class Partial:
    """Normalized output ``out [B, H, R, D]`` (fp32) and ``lse [B, H, R]`` (``-inf`` = nothing attended)."""

    out: torch.Tensor
    lse: torch.Tensor
    counts: torch.Tensor | None = None  # kernel work counts, see kvtier.kernels.cpu.packed_attention


def to_rows(query: torch.Tensor, kv_heads: int, scaling: float) -> torch.Tensor:
    """``[B, Hq, q, D] -> [B, Hkv, Gq * q, D]`` in fp32, pre-multiplied by ``scaling``."""
    B, Hq, q, D = query.shape
    return (query.float() * scaling).reshape(B, kv_heads, (Hq // kv_heads) * q, D)


def from_rows(out: torch.Tensor, heads: int, q: int) -> torch.Tensor:
    """``[B, Hkv, Gq * q, D] -> [B, q, Hq, D]`` (the attention-interface output layout)."""
    B, _, _, D = out.shape
    return out.reshape(B, heads, q, D).transpose(1, 2)


def _softmax_parts(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Safe softmax over the last axis: probabilities and lse (rows fully masked give 0 and -inf)."""
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(scores - finite.unsqueeze(-1)), lse


def merge(parts: list[Partial]) -> torch.Tensor:
    """Combine tier partials: ``sum_i exp(lse_i - m) out_i / sum_i exp(lse_i - m)``."""
    parts = [p for p in parts if p is not None]
    if len(parts) == 1:
        return parts[0].out
    lse = torch.stack([p.lse for p in parts])  # [P, B, H, R]
    m = lse.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)  # exp(-inf) = 0 for empty parts
    total = w.sum(0)
    out = sum(w[i].unsqueeze(-1) * p.out for i, p in enumerate(parts))
    return out / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)


def exact_partial(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> Partial:
    """Attention over exact tokens.

    Parameters
    ----------
    rows : ``[B, H, R, D]`` fp32, scaled.
    k, v : ``[B, H, N, D]`` (any float dtype).
    allowed : bool broadcastable to ``[B, H, R, N]``, or None.
    """
    scores = rows @ k.float().transpose(-1, -2)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, NEG_INF)
    p, lse = _softmax_parts(scores)
    return Partial(p @ v.float(), lse)


def flash_exact_partial(
    rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    flash,
    budget: int,
    dtype: torch.dtype = torch.float32,
) -> Partial:
    """:func:`exact_partial` through ``flash`` (torch's CPU flash op with lse, the plan's probe): no
    ``[R, N]`` score matrix is built; the boolean mask becomes an additive one, made for at most
    ``budget`` rows x tokens at a time (rows in slices). Inputs are cast to ``dtype`` (bf16 for a
    bf16 model: what its own SDPA reads; the op accumulates in fp32); ``out`` is fp32. Rows with
    nothing allowed give 0 and ``-inf`` as in :func:`exact_partial`. Shapes as :func:`exact_partial`."""
    B, H, R, D = rows.shape
    rows, k, v = rows.to(dtype), k.to(dtype), v.to(dtype)
    N = k.shape[2]
    step = R if allowed is None or allowed.shape[-2] == 1 else max(1, budget // max(1, N))
    outs, lses = [], []
    for s in range(0, R, step):
        r = rows[:, :, s : s + step]
        if allowed is None:
            out, lse = flash(r, k, v, 0.0, False, scale=1.0)[:2]
        else:
            a = allowed if allowed.shape[-2] == 1 else allowed[..., s : s + step, :]
            bias = torch.zeros(a.shape, dtype=dtype, device=rows.device).masked_fill_(~a, NEG_INF)
            out, lse = flash(r, k, v, 0.0, False, attn_mask=bias, scale=1.0)[:2]
            empty = ~a.any(-1)  # the op reports lse 0 (and no output) for rows with nothing to attend
            out, lse = out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, NEG_INF)
        outs.append(out.float())
        lses.append(lse)
    if len(outs) == 1:
        return Partial(outs[0], lses[0])
    return Partial(torch.cat(outs, 2), torch.cat(lses, 2))


def _subplanes(codes: torch.Tensor, bits: int, dim: int):
    """Yield ``(weight, channel_slice, values)`` for every bit-plane slice of packed codes.

    ``codes: uint8 [..., packed]`` -> ``values: fp32 [..., D_pad / per]`` holding bits of channels
    ``i::per`` (padded channel axis); the code equals ``sum(weight * values)`` per channel.
    """
    if bits == 8:
        yield 1.0, slice(0, dim), codes.float()
        return
    n_pad = -(-dim // 8) * 8
    start, offset = 0, 0
    for w in planes(bits):
        per = 8 // w
        size = n_pad // per
        chunk = codes[..., start : start + size]
        mask = (1 << w) - 1
        for i in range(per):
            yield float(1 << offset), slice(i, n_pad, per), ((chunk >> (w * i)) & mask).float()
        start += size
        offset += w


def _pad_channels(x: torch.Tensor, dim: int) -> torch.Tensor:
    n_pad = -(-dim // 8) * 8
    return x if n_pad == dim else torch.nn.functional.pad(x, (0, n_pad - dim))


def _weighted_codes(p: torch.Tensor, codes: torch.Tensor, bits: int, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """``sum_t p[r, t] * scale[t, g(c)] * code[t, c]`` without unpacking whole rows of codes.

    Parameters
    ----------
    p : ``[B, H, n, R, T]`` probabilities.
    codes : uint8 ``[B, H, n, T, P]`` packed along channels.
    scale : ``[B, H, n, T, NG]`` per-token, per-group scale (``G = dim / NG`` channels a group).

    Returns
    -------
    ``[B, H, n, R, dim]`` fp32.
    """
    NG = scale.shape[-1]
    G = dim // NG
    ps = p.unsqueeze(3) * scale.float().permute(0, 1, 2, 4, 3).unsqueeze(-2)  # [B,H,n,NG,R,T]
    out = p.new_zeros(*p.shape[:-1], -(-dim // 8) * 8)
    for weight, sl, sub in _subplanes(codes, bits, dim):
        i, per = sl.start, sl.step or 1
        for g in range(NG):
            lo, hi = -(-(g * G - i) // per), -(-((g + 1) * G - i) // per)
            if hi > lo:
                out[..., i + per * lo : i + per * hi : per] += weight * (ps[:, :, :, g] @ sub[..., lo:hi])
    return out[..., :dim]


def _per_group(p: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``sum_t p[r, t] * x[t, g]`` expanded to channels: ``[B,H,n,R,T] x [B,H,n,T,NG] -> [B,H,n,R,dim]``."""
    NG = x.shape[-1]
    return (p @ x.float()).repeat_interleave(dim // NG, dim=-1)


def _block_softmax(scores: torch.Tensor, valid: torch.Tensor, block_mask: torch.Tensor | None, select=None):
    """Softmax over all tokens of all blocks: ``scores [B,H,n,R,T]`` -> ``p`` (same shape), ``lse [B,H,R]``.

    ``select``, if given, maps the masked flat scores ``[B,H,R,n*T]`` to the tokens whose value
    work is done; the others get weight 0 and the kept weights are renormalized (``lse`` stays the
    log of the full mass, so merging across tiers weighs this tier correctly).
    """
    valid = valid.unsqueeze(3)  # [B,1,n,1,T]
    if block_mask is not None:
        valid = valid & block_mask.permute(0, 1, 3, 2).unsqueeze(-1)
    scores = scores.masked_fill(~valid, NEG_INF)
    B, H, n, R, T = scores.shape
    flat = scores.permute(0, 1, 3, 2, 4).reshape(B, H, R, n * T)
    p, lse = _softmax_parts(flat)
    if select is not None:
        p = p * select(flat)
        total = p.sum(-1, keepdim=True)
        p = p / torch.where(total > 0, total, torch.ones_like(total))
    return p.reshape(B, H, R, n, T).permute(0, 1, 3, 2, 4), lse


def packed_partial(
    rows: torch.Tensor,
    fields: dict[str, torch.Tensor],
    codec: Codec,
    dim: int,
    block_mask: torch.Tensor | None,
    select=None,
) -> Partial:
    """Attention over a packed tier (any codec with affine codes) without dequantizing it.

    With ``x = a * code + b`` (:meth:`~kvtier.codecs.AffineCodec.affine`), key scores are
    ``(q * a) . code + q . b`` and values ``sum_t p_t a_t code_t + sum_t p_t b_t``, codes read one
    bit-plane slice at a time.

    Parameters
    ----------
    rows : ``[B, H, R, D]`` fp32, scaled.
    fields : the tier's tensors (codes ``[B,H,n,T,P]``, key parameters ``[B,H,n,1,D]``, value
        parameters ``[B,H,n,T,D/G]``, ``valid [B,1,n,T]``).
    block_mask : optional bool ``[B, H, R, n]``: blocks each row may read (sparse selection).
    select : optional token selection on exact scores (see :func:`_block_softmax`).
    """
    r = rotation(dim, rows.device) if codec.rotate else None
    rows = rows @ r if r is not None else rows
    ka, kb, va, vb, kc, vc = codec.affine(fields)  # [B,H,n,D] x2, [B,H,n,T,NG] x2
    q = rows.unsqueeze(2)  # [B,H,1,R,D]
    qa = _pad_channels(q * ka.unsqueeze(3), dim)  # [B,H,n,R,Dp]
    scores = (q * kb.unsqueeze(3)).sum(-1, keepdim=True)  # [B,H,n,R,1]
    for weight, sl, sub in _subplanes(kc, codec.key_bits, dim):
        scores = scores + weight * (qa[..., sl] @ sub.transpose(-1, -2))  # [B,H,n,R,T]
    p, lse = _block_softmax(scores, fields["valid"], block_mask, select)
    out = (_weighted_codes(p, vc, codec.value_bits, va, dim) + _per_group(p, vb, dim)).sum(2)
    return Partial(out @ r.T if r is not None else out, lse)


def reads_in_place(codec: Codec) -> bool:
    """Whether :func:`packed_partial` or :func:`vq_partial` reads this codec's tier in place (else
    only :func:`chunked_partial` decodes it)."""
    return codec.AFFINE is not None or isinstance(codec, VqCodec)


def _subspace_index(idx: torch.Tensor, centres: int, R: int) -> torch.Tensor:
    """Centre indices ``[B,H,n,T,P]`` -> flat indices into a per-row ``[P * C]`` table, ``[B,H,R,n*T*P]``."""
    B, H, n, T, P = idx.shape
    offset = torch.arange(P, device=idx.device) * centres
    return (idx + offset).reshape(B, H, 1, n * T * P).expand(B, H, R, n * T * P)


def vq_partial(
    rows: torch.Tensor,
    fields: dict[str, torch.Tensor],
    codec: VqCodec,
    dim: int,
    block_mask: torch.Tensor | None,
    select=None,
) -> Partial:
    """Attention over a vq tier read in place, product-quantization style (the reference of kernels
    that read vector codes; same semantics as :func:`packed_partial`).

    With rotated rows ``q`` split into ``P = D / d`` sub-vectors and the key codebook ``c [C, d]``:
    one table ``q_p . c_j`` per row (``[R, P, C]``), then a key's score is
    ``k_rms * sum_p table[p, idx_p] + q . k_mean`` (lookups, no decoded key). Values: each row's
    weights ``p_t * v_rms_t`` are summed per sub-space and centre (``[R, P, C]``), expanded once
    through the value codebook, rotated back, plus ``sum_t p_t v_mean_t`` on every channel.
    Transients are ``R x n x T x P`` indices and table values (no ``[n, T, D]`` decode).
    """
    B, H, R, D = rows.shape
    n, T = fields["valid"].shape[2:4]
    r = rotation(dim, rows.device)
    q = rows @ r
    kbook = codebook(codec.key_bits, rows.device)  # [C, d]
    C, d = kbook.shape
    table = (q.reshape(B, H, R, D // d, d) @ kbook.T).reshape(B, H, R, -1)  # [B,H,R,P*C]
    kidx = codec.indices(fields, "k", dim)  # [B,H,n,T,P]
    unit = table.gather(-1, _subspace_index(kidx, C, R)).reshape(B, H, R, n, T, D // d).sum(-1)
    mean_scores = q @ fields["k_mean"].float().squeeze(3).transpose(-1, -2)  # [B,H,R,n]
    scores = unit * fields["k_rms"].float().unsqueeze(2) + mean_scores.unsqueeze(-1)  # [B,H,R,n,T]
    p, lse = _block_softmax(scores.permute(0, 1, 3, 2, 4), fields["valid"], block_mask, select)
    p = p.permute(0, 1, 3, 2, 4)  # [B,H,R,n,T]
    vbook = codebook(codec.value_bits, rows.device)
    C, d = vbook.shape
    vidx = codec.indices(fields, "v", dim)
    weight = (p * fields["v_rms"].float().unsqueeze(2)).unsqueeze(-1).expand(B, H, R, n, T, D // d)
    acc = rows.new_zeros(B, H, R, (D // d) * C)
    acc.scatter_add_(-1, _subspace_index(vidx, C, R), weight.reshape(B, H, R, -1))
    out = (acc.reshape(B, H, R, D // d, C) @ vbook).reshape(B, H, R, D) @ r.T
    out = out + (p * fields["v_mean"].float().unsqueeze(2)).sum((3, 4)).unsqueeze(-1)
    return Partial(out, lse)


def _flash_chunks(rows, fields, codec, dim: int, step: int, flash, dtype: torch.dtype = torch.float32) -> Partial:
    """Per chunk of decoded blocks: ``flash`` (fused flash attention with lse) in ``dtype`` (blocks
    decoded in fp32, then cast), then the LSE merge."""
    B, H, R, D = rows.shape
    rows = rows.to(dtype)
    parts = []
    for c in range(0, fields["valid"].shape[2], step):
        f = {name: t[:, :, c : c + step] for name, t in fields.items()}
        k = codec.decode_keys(f, dim, torch.float32).reshape(B, H, -1, D).to(dtype)
        v = codec.decode_values(f, dim, torch.float32).reshape(B, H, -1, D).to(dtype)
        valid = f["valid"].reshape(B, 1, 1, -1)
        bias = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, NEG_INF)
        out, lse = flash(rows, k, v, 0.0, False, attn_mask=bias, scale=1.0)[:2]
        empty = ~valid.any(-1)  # [B,1,1]: the op reports lse 0 for rows with nothing to attend
        parts.append(Partial(out.float().masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, NEG_INF)))
    return Partial(merge(parts), torch.logsumexp(torch.stack([p.lse for p in parts]), 0))


def chunked_partial(
    rows: torch.Tensor,
    fields: dict[str, torch.Tensor],
    codec: Codec,
    dim: int,
    block_mask: torch.Tensor | None = None,
    select=None,
    *,
    chunk_tokens: int,
    flash=None,
    flash_dtype: torch.dtype = torch.float32,
) -> Partial:
    """Attention over a tier for many query rows (prefill chunks): keys, then values, are decoded
    ``chunk_tokens`` at a time and multiplied in dense GEMMs, which beats reading the packed
    codes per row when rows are many; the tier is never decoded as a whole. Same semantics as
    :func:`packed_partial` (``block_mask``, ``select``). ``flash``: torch's CPU flash op with lse
    (the plan's probe), used per decoded chunk when nothing is selected, in ``flash_dtype``."""
    B, H, R, D = rows.shape
    n, T = fields["valid"].shape[2:4]
    step = max(1, chunk_tokens // T)
    if block_mask is None and select is None and flash is not None:
        return _flash_chunks(rows, fields, codec, dim, step, flash, flash_dtype)
    scores = torch.empty(B, H, R, n * T, device=rows.device)
    for c in range(0, n, step):
        f = {name: t[:, :, c : c + step] for name, t in fields.items()}
        k = codec.decode_keys(f, dim, torch.float32)  # [B,H,b,T,D]
        torch.matmul(rows, k.reshape(B, H, -1, D).transpose(-1, -2), out=scores[..., c * T : (c + step) * T])
    valid = fields["valid"].reshape(B, -1, 1, n * T)
    if block_mask is not None:
        valid = valid & block_mask.repeat_interleave(T, dim=-1)
    scores.masked_fill_(~valid, NEG_INF)
    p, lse = _softmax_parts(scores)
    if select is not None:
        p = p * select(scores)
        total = p.sum(-1, keepdim=True)
        p = p / torch.where(total > 0, total, torch.ones_like(total))
    out = rows.new_zeros(B, H, R, D)
    for c in range(0, n, step):
        f = {name: t[:, :, c : c + step] for name, t in fields.items()}
        v = codec.decode_values(f, dim, torch.float32)
        out += p[..., c * T : (c + step) * T] @ v.reshape(B, H, -1, D)
    return Partial(out, lse)
