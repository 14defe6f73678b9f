"""CPU kernel: attention over one tier of vector codes (:class:`~kvtier.codecs.VqCodec`), read in
place, compiled on first use.

Per (batch, KV head) in parallel and per stored token, the kernel unpacks the token's centre
indices from their bit planes, rebuilds its key in one ``D``-float tile from the codebook
(``centre * rms + the block's channel mean``) and scores every query row sharing the head (GQA: the
tile is built once for all of them); after a safe two-pass softmax each value tile
(``centre * rms``) is accumulated with the rows' weights, the values' token means apart. No
tier-sized decode. The layout (fields, plane widths, codebooks) comes from :mod:`kvtier.codecs.vq`
and :func:`kvtier.quant.planes`, passed in; the torch reference is
:func:`kvtier.attention.partials.vq_partial` (and :func:`~kvtier.attention.partials.chunked_partial`).
Dense selection only (a vq policy has no sparse attention).

The C++ is ``csrc/vq_attention.cpp``, built by :mod:`kvtier.kernels.build`. Imports torch, ``.build``,
``kvtier.codecs`` and ``kvtier.quant``.
"""

from __future__ import annotations

import functools

import torch

from ..codecs import VqCodec
from ..codecs.vq import codebook, index_widths
from ..quant import planes, rotation
from . import build


@functools.lru_cache(maxsize=1)
def _module():
    return build.load("kvtier_vq_cpu_v1", "vq_attention.cpp", ["vq_attention"], ("-fno-math-errno",))


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
    for side in ("k", "v"):
        if fields[f"{side}_hi"].shape[-1]:
            raise ValueError(f"vq indices wider than 8 bits ({side}) are not read by the CPU kernel")
    r = rotation(dim, rows.device)
    kb, vb = codec.key_bits, codec.value_bits
    out, mean_out, lse = _module().vq_attention(
        (rows.float() @ r).contiguous(),
        fields["k_idx"].contiguous(),
        list(planes(index_widths(kb)[0])),
        codebook(kb, rows.device).contiguous(),
        fields["k_mean"].float().squeeze(3).contiguous(),
        fields["k_rms"].float().contiguous(),
        fields["v_idx"].contiguous(),
        list(planes(index_widths(vb)[0])),
        codebook(vb, rows.device).contiguous(),
        fields["v_rms"].float().contiguous(),
        fields["v_mean"].float().contiguous(),
        fields["valid"].squeeze(1).contiguous(),
    )
    return out @ r.T + mean_out.unsqueeze(-1), lse
