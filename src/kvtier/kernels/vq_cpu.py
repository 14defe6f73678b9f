"""CPU kernel: attention over one tier of vector codes (:class:`~kvtier.codecs.VqCodec`), read in
place, compiled on first use.

Product-quantization style, per (batch, KV head) in parallel and per group of 8 query rows sharing
the head: one table ``q_p . centre_c`` per sub-space ``p`` and key centre ``c`` (rows as the 8
lanes of an entry), so a key's score is ``rms * sum_p table[p, idx_p] + q . block mean`` (``D / d``
lookups of 8 lanes per token, no key rebuilt); after a safe two-pass softmax each token's weights
times its RMS are added into a per-centre accumulator (``D / d`` adds), expanded once per row
through the value codebook; the values' token means are summed apart. No tier-sized decode. The
layout (fields, plane widths, codebooks, the fp8 format of the parameters, read through a 256-entry
table) comes from :mod:`kvtier.codecs.vq` and :func:`kvtier.quant.planes`, passed in; the torch
reference is
:func:`kvtier.attention.partials.vq_partial` (and :func:`~kvtier.attention.partials.chunked_partial`).
Dense selection only (a vq policy has no sparse attention).

The C++ is ``csrc/vq_attention.cpp`` around ``csrc/vq_tier.h`` (the routine per head and group of
rows, which the fused layer call, :mod:`kvtier.kernels.fused_cpu`, runs too), built by
:mod:`kvtier.kernels.build`. Imports torch, ``.build``, ``kvtier.codecs`` and ``kvtier.quant``.
"""

from __future__ import annotations

import functools

import torch

from ..codecs import VqCodec
from ..codecs.vq import fp8_values, kernel_operands
from ..quant import rotation
from . import build


@functools.lru_cache(maxsize=1)
def _module():
    return build.load("kvtier_vq_cpu_v3", "vq_attention.cpp", ["vq_attention"], ("-fno-math-errno",))


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the kernel compiled (once per machine; cached by torch)."""
    return build.check(_module, "kvtier vq kernel", "the torch path")


def vq_attention(
    rows: torch.Tensor, fields: dict[str, torch.Tensor], codec: VqCodec, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``rows [B, H, R, D]`` (fp32, scaled) over a vq tier (``fields`` as the codec
    stores them, with ``valid [B, 1, n, T]``): normalized ``out [B, H, R, D]`` and ``lse [B, H, R]``
    (``-inf`` and 0 for a row with nothing valid)."""
    r = rotation(dim, rows.device)
    out, mean_out, lse = _module().vq_attention(
        (rows.float() @ r).contiguous(),
        *kernel_operands(codec, fields),
        fields["valid"].squeeze(1).contiguous(),
        fp8_values(),
    )
    return out @ r.T + mean_out.unsqueeze(-1), lse
