"""Resident 1-bit key sketches of offloaded blocks, and per-block attention mass estimates from them.

When a block is offloaded its exact keys and values leave; what stays is a sketch of the keys.
After a fixed randomized Hadamard rotation (QuaRot https://arxiv.org/abs/2404.00456), a key
``k = mean + d`` (``mean``: the block's per-channel mean over its valid tokens) is kept as

    ``k_hat = mean + alpha_t * scale * (2 b - 1)``,

``b`` the sign bits of ``d``, ``scale = mean |d|`` per channel over the block (as the 1-bit code of
:class:`~kvtier.codecs.SignCodec`), and ``alpha_t`` a per-token factor, the least-squares fit
``sum_c |d_c| scale_c / sum_c scale_c^2``. The per-token factor keeps a key's magnitude: an
outlier key (a token the model will retrieve) scores as high as it should, where a sign code with
only per-channel scales flattens it.

Stored compactly (what stays resident is most of an offloaded cache's bytes): ``mean`` as int8
codes of the block's largest ``|mean_c|``, ``scale`` and ``alpha`` as uint8 codes of their block
maxima (the maxima fp16; the sign bits come from the exact mean and the per-token factor is fitted to the
coded scale, so the codes perturb the estimates smoothly, no sign flips), validity as packed bits.
Cost: ``D / 8 + 1`` bytes per token, ``2 D + 6`` per block, ``T / 8`` per block and batch row for
validity - 11.1 bytes per token and KV head at ``D = T = 64`` instead of 14.0 with fp16 fields.
Measured on SmolLM2 (8k decode rows, BENCHMARKS.md "Offload at 8k-32k"): the coded fields select
the same blocks as fp16 ones within the stated counts.

A query row scores every sketched token, ``s = q . k_hat``, and a block's log-sum-exp of those
scores estimates the log of the softmax mass the block would get; this chooses the blocks to
fetch (:mod:`kvtier.attention.offloaded`), which are then attended exactly. On SmolLM2 (1k tokens,
decode rows) the per-token factor cut the true attention mass missed at a 0.999 mass budget from
0.44% to 0.17% on average, at the same number of blocks kept.

Fields (``fields`` of :class:`~kvtier.offload.tier.OffloadTier`): ``k_signs`` uint8
``[B,H,n,T,ceil(D/8)]``, ``k_scale`` uint8 / ``k_mean`` int8 ``[B,H,n,1,D]``, ``k_alpha`` uint8
``[B,H,n,T]``, ``k_amax``, ``k_smax``, ``k_mmax`` fp16 ``[B,H,n]`` (the maxima of alpha, scale and
``|mean|``), ``valid_bits`` uint8 ``[B,1,n,ceil(T/8)]``. :func:`expand` gives the float view
(``k_scale``, ``k_mean`` fp32 ``[B,H,n,1,D]``, ``k_alpha`` fp32 ``[B,H,n,T]``, ``valid`` bool
``[B,1,n,T]``) that the torch references read; the C++ kernels read the coded fields directly.
Imports torch and :mod:`kvtier.quant` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import pack_bits, packed_size, rotation, unpack_bits
from ..quant.groups import SCALE_EPS

_FP16 = 2
_U8 = 255.0
_I8 = 127.0
#: Blocks scored per pass of the torch path: bounds its transient unpacked sketch.
CHUNK_BLOCKS = 32


@dataclass(frozen=True)
class KeySketch:
    """1-bit sign sketch of keys with per-channel mean and scale per block and a per-token factor."""

    rotate: bool = True

    @property
    def name(self) -> str:
        return "key-sketch-rot" if self.rotate else "key-sketch"

    def encode(self, k: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sketch keys of whole blocks.

        Parameters
        ----------
        k : ``[B, H, n, T, D]``.
        valid : bool ``[B, 1, n, T]``; invalid tokens (pads, captured sinks) stay out of the statistics.

        Returns
        -------
        The coded fields of the module docstring (``valid_bits`` included); ``k_alpha`` is 0 for
        invalid tokens.
        """
        D = k.shape[-1]
        kf = k.float() @ rotation(D, k.device) if self.rotate else k.float()
        tv = valid.unsqueeze(-1).float()  # [B,1,n,T,1]
        count = tv.sum(3, keepdim=True).clamp_min(1.0)
        mean = (kf * tv).sum(3, keepdim=True) / count  # [B,H,n,1,D]
        mmax = _block_max(mean.abs())
        mean_c = torch.round(mean / mmax.float()[..., None, None] * _I8).clamp(-_I8, _I8).to(torch.int8)
        dev = kf - mean  # signs and fits from the exact mean: the codes only perturb the estimate
        scale = (dev.abs() * tv).sum(3, keepdim=True) / count
        smax = _block_max(scale)
        scale_c = torch.round(scale / smax.float()[..., None, None] * _U8).clamp(0, _U8).to(torch.uint8)
        s = scale_c.float() * (smax.float()[..., None, None] / _U8)
        alpha = (dev.abs() * s).sum(-1) / (s * s).sum(-1).clamp_min(1e-30)  # [B,H,n,T]
        alpha = torch.where(valid.expand_as(alpha), alpha, torch.zeros_like(alpha))
        amax = _block_max(alpha)
        alpha_c = torch.round(alpha / amax.float()[..., None] * _U8).clamp(0, _U8).to(torch.uint8)
        return {
            "k_signs": pack_bits((dev >= 0).to(torch.uint8), 1),
            "k_scale": scale_c,
            "k_mean": mean_c,
            "k_alpha": alpha_c,
            "k_amax": amax,
            "k_smax": smax,
            "k_mmax": mmax,
            "valid_bits": pack_bits(valid.to(torch.uint8), 1),
        }

    def nbytes(self, B: int, H: int, n: int, T: int, D: int) -> int:
        """Bytes of the sketch fields, validity included."""
        per_token = packed_size(D, 1) + 1
        return B * H * n * (T * per_token + 2 * D + 3 * _FP16) + B * n * packed_size(T, 1)


def _block_max(x: torch.Tensor) -> torch.Tensor:
    """fp16 maximum of each block of ``x [B,H,n,...]`` -> ``[B,H,n]``, rounded up so that it bounds every
    value and at least ``SCALE_EPS`` (a code of 0 / 0 never happens)."""
    m = x.flatten(3).amax(-1).clamp_min(SCALE_EPS)
    h = m.to(torch.float16)
    return torch.where(h.float() < m, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def expand(fields: dict[str, torch.Tensor], T: int) -> dict[str, torch.Tensor]:
    """The float view of coded fields (module docstring): what the torch references read."""
    smax = fields["k_smax"].float()[..., None, None]
    mmax = fields["k_mmax"].float()[..., None, None]
    amax = fields["k_amax"].float()
    return {
        "k_signs": fields["k_signs"],
        "k_scale": fields["k_scale"].float() * (smax / _U8),
        "k_mean": fields["k_mean"].float() * (mmax / _I8),
        "k_alpha": fields["k_alpha"].float() * (amax[..., None] / _U8),
        "k_amax": amax,
        "valid": unpack_valid(fields["valid_bits"], T),
    }


def unpack_valid(bits: torch.Tensor, T: int) -> torch.Tensor:
    """bool ``[B, 1, n, T]`` from packed ``valid_bits``."""
    return unpack_bits(bits, 1, T).bool()


def nonempty(valid_bits: torch.Tensor) -> torch.Tensor:
    """bool ``[B, 1, n]``: blocks of ``valid_bits [B, 1, n, ceil(T/8)]`` holding a valid token
    (from the packed bits, nothing unpacked)."""
    return (valid_bits != 0).any(-1)


def query_rows(rows: torch.Tensor, sketch: KeySketch) -> torch.Tensor:
    """Query rows in the sketch's coordinates (rotated when the sketch is)."""
    return rows @ rotation(rows.shape[-1], rows.device) if sketch.rotate else rows


def token_scores(rows: torch.Tensor, fields: dict[str, torch.Tensor], sketch: KeySketch) -> torch.Tensor:
    """Sketch scores ``rows . k_hat`` of every token: ``rows [B,H,R,D]`` (fp32, scaled) -> ``[B,H,n,R,T]``.

    ``q . k_hat = q . mean + alpha_t (2 w . b - w . 1)`` with ``w = q * scale``.
    """
    D = rows.shape[-1]
    q = query_rows(rows, sketch).unsqueeze(2)  # [B,H,1,R,D]
    bias = (q * fields["k_mean"].float()).sum(-1, keepdim=True)  # [B,H,n,R,1]
    w = q * fields["k_scale"].float()  # [B,H,n,R,D]
    bits = unpack_bits(fields["k_signs"], 1, D).to(w.dtype)  # [B,H,n,T,D]
    dots = w @ bits.transpose(-1, -2)  # [B,H,n,R,T]
    alpha = fields["k_alpha"].float().unsqueeze(3)  # [B,H,n,1,T]
    return bias + alpha * (2.0 * dots - w.sum(-1, keepdim=True))


def block_lse_torch(rows: torch.Tensor, fields: dict[str, torch.Tensor], sketch: KeySketch) -> torch.Tensor:
    """Reference of :func:`block_lse` in torch ops, ``CHUNK_BLOCKS`` blocks at a time."""
    n = fields["valid"].shape[2]
    out = []
    for s in range(0, n, CHUNK_BLOCKS):
        part = {name: t[:, :, s : s + CHUNK_BLOCKS] for name, t in fields.items()}
        scores = token_scores(rows, part, sketch)  # [B,H,c,R,T]
        valid = part["valid"].unsqueeze(3)  # [B,1,c,1,T]
        out.append(torch.logsumexp(scores.masked_fill(~valid, float("-inf")), dim=-1))  # [B,H,c,R]
    lse = torch.cat(out, dim=2) if len(out) != 1 else out[0]
    return lse.transpose(2, 3)


def block_lse(
    rows: torch.Tensor, fields: dict[str, torch.Tensor], sketch: KeySketch, kernel: bool = False
) -> torch.Tensor:
    """Estimated log mass per block: ``rows [B,H,R,D]`` (fp32, scaled) -> ``[B,H,R,n]`` (``-inf``: no
    valid token). ``kernel``: the C++ kernel (CPU tensors; the attention plan decides, for few rows),
    else batched torch ops; no full-length unpacked sketch is built either way."""
    if not kernel:
        return block_lse_torch(rows, fields, sketch)
    from ..kernels import sketch_cpu

    return sketch_cpu.sketch_block_lse(
        query_rows(rows, sketch),
        fields["k_signs"],
        fields["k_scale"].float().squeeze(3),
        fields["k_mean"].float().squeeze(3),
        fields["k_alpha"].float(),
        fields["valid"].squeeze(1),
    )
