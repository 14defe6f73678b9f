"""Resident 1-bit key sketches of offloaded blocks, and per-block attention mass estimates from them.

When a block is offloaded its exact keys and values leave; what stays is a sketch of the keys:
after a fixed randomized Hadamard rotation (QuaRot https://arxiv.org/abs/2404.00456), the sign of
each channel's deviation from the block's per-channel mean, with that mean and a scale
``mean |x - mean|`` (the same 1-bit code as :class:`~kvtier.cache.codecs.SignCodec`, keys only):
``D / 8`` bytes per token plus ``4 D`` bytes per block.

A query scores every sketched token, ``s = q . k_hat``, and a block's log-sum-exp of those
scores estimates the log of the softmax mass the block would get (an unnormalized estimate,
compared against the exact mass of the resident tokens). This is what chooses the blocks to
fetch (see :mod:`kvtier.offload.attention`); the fetched blocks are then attended exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import pack_bits, packed_size, quantize_sign, rotation, unpack_bits

_FP16 = 2


@dataclass(frozen=True)
class KeySketch:
    """1-bit sign sketch of keys, per-channel mean and scale per block (optionally rotated)."""

    rotate: bool = True

    @property
    def name(self) -> str:
        return "key-sketch-rot" if self.rotate else "key-sketch"

    def encode(self, k: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """``k: [B, H, n, T, D]``, ``valid: bool [B, 1, n, T]`` -> ``k_signs uint8 [B,H,n,T,D/8]``,
        ``k_scale, k_mean fp16 [B,H,n,1,D]`` (statistics over valid tokens only)."""
        D = k.shape[-1]
        kf = k.float() @ rotation(D, k.device) if self.rotate else k.float()
        signs, scale, mean = quantize_sign(kf, dim=3, valid=valid.unsqueeze(-1))
        return {"k_signs": pack_bits(signs, 1), "k_scale": scale, "k_mean": mean}

    def nbytes(self, B: int, H: int, n: int, T: int, D: int) -> int:
        """Bytes of the sketch fields (validity not included)."""
        return B * H * n * T * packed_size(D, 1) + 2 * _FP16 * B * H * n * D


#: Blocks scored per pass: bounds the transient unpacked sketch to ``CHUNK_BLOCKS * T * D`` floats per head.
CHUNK_BLOCKS = 32


def token_scores(rows: torch.Tensor, fields: dict[str, torch.Tensor], sketch: KeySketch) -> torch.Tensor:
    """Sketch scores ``rows . k_hat`` of every token: ``rows [B,H,R,D]`` (fp32, scaled) -> ``[B,H,n,R,T]``.

    ``k_hat = mean + scale * (2 b - 1)``, so ``q . k_hat = q . (mean - scale) + (2 q * scale) . b``.
    """
    D = rows.shape[-1]
    q = rows @ rotation(D, rows.device) if sketch.rotate else rows
    ks, km = fields["k_scale"].float(), fields["k_mean"].float()  # [B,H,n,1,D]
    bias = (q.unsqueeze(2) * (km - ks)).sum(-1, keepdim=True)  # [B,H,n,R,1]
    qs = 2.0 * q.unsqueeze(2) * ks  # [B,H,n,R,D]
    bits = unpack_bits(fields["k_signs"], 1, D).to(qs.dtype)  # [B,H,n,T,D]
    return bias + qs @ bits.transpose(-1, -2)


def block_lse(rows: torch.Tensor, fields: dict[str, torch.Tensor], sketch: KeySketch) -> torch.Tensor:
    """Estimated log mass per block: ``rows [B,H,R,D]`` -> ``[B,H,R,n]`` (``-inf``: no valid token).

    Blocks are scored ``CHUNK_BLOCKS`` at a time, so no full-length unpacked sketch is built.
    """
    n = fields["valid"].shape[2]
    out = []
    for s in range(0, n, CHUNK_BLOCKS):
        part = {name: t[:, :, s : s + CHUNK_BLOCKS] for name, t in fields.items()}
        scores = token_scores(rows, part, sketch)  # [B,H,c,R,T]
        valid = part["valid"].unsqueeze(3)  # [B,1,c,1,T]
        out.append(torch.logsumexp(scores.masked_fill(~valid, float("-inf")), dim=-1))  # [B,H,c,R]
    lse = torch.cat(out, dim=2) if len(out) != 1 else out[0]
    return lse.transpose(2, 3)
