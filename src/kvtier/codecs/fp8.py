"""The fp8 codec: fp8 e4m3 codes with one fp16 absmax scale per group (keys per channel, centered on
an fp16 midrange per channel; values per token), and the scaled fp8 quantizer it uses.

Its codes are not affine in their bytes (``AFFINE = None``): the kernels cannot read them and
attention decodes them chunk by chunk. May import: torch, ``kvtier.quant``, :mod:`.base`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..quant import rotation
from ..quant.groups import SCALE_ROUND
from .base import FP16_BYTES, block_key_bounds, check_params, encode_inputs

#: fp8 e4m3 (OCP "fn": no infinities, max 448), the format of transformers' and vLLM's fp8 KV caches.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
#: Floor of an fp8 scale: the smallest normal fp16, so a stored scale is never 0 or subnormal.
FP8_SCALE_MIN = 2.0**-14


@torch.no_grad()
def quantize_fp8(x: torch.Tensor, dim: int, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled fp8 (e4m3) codes with one absmax scale per slice along ``dim``.

    Parameters
    ----------
    x : float tensor of any shape.
    dim : axis whose entries share one scale.
    valid : bool, broadcastable to ``x``; invalid entries do not enter the statistics and are
        stored as code 0.

    Returns
    -------
    codes : uint8 (the fp8 bytes), shape of ``x``.
    scale : fp16, shape of ``x`` with ``dim`` reduced to size 1; ``x ~= fp8(codes) * scale`` with a
        relative error of at most 2**-4 per entry (3 mantissa bits, round to nearest) down to
        ``2**-6 * scale`` (below it, e4m3's subnormals: an absolute error of at most ``2**-10 * scale``).
    """
    xf = x.float()
    if valid is not None:
        xf = torch.where(valid.expand_as(xf), xf, torch.zeros_like(xf))
    amax = xf.abs().amax(dim, keepdim=True)
    # fp16 scale rounded up, so that the largest entry stays within +-448 (never saturates); a scale
    # clamped at fp16's largest value (|x| beyond ~2.9e7) is refused by Fp8Codec (check_params), as is
    # a key shift beyond fp16 (|k| beyond 65504).
    scale = (amax / FP8_MAX * (1 + SCALE_ROUND)).clamp(FP8_SCALE_MIN, 65504.0).to(torch.float16)
    codes = (xf / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.view(torch.uint8), scale


@torch.no_grad()
def key_shift(k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """fp16 midrange of each key channel over a block's valid tokens (``k [B,H,n,T,D]``, ``valid``
    broadcastable, reduced over ``T``; empty blocks: 0), subtracted before the fp8 codes.

    Keys of models with q/k biases (Qwen2.5) sit far from zero in some channels: offset / range up to
    ~200 in Qwen2.5-Coder-1.5B's first layers, |k| up to 360, where e4m3's step is 32, so absmax fp8
    codes erase a channel's whole variation (streamed perplexity +392 % at 4k); codes of the
    centered keys keep it (relative key error 0.0153 -> 0.0004 in layer 0).
    """
    lo, hi = block_key_bounds(k.float(), valid)
    return ((lo + hi) / 2).clamp(-65504.0, 65504.0).to(torch.float16)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8(codes) * scale`` in fp32, cast to ``dtype``."""
    return (codes.view(FP8).float() * scale.float()).to(dtype)


@dataclass(frozen=True)
class Fp8Codec:
    """fp8 e4m3 codes with fp16 scales: keys per channel over a block (one scale and one shift, the
    channel's midrange, per channel and block, as KIVI's keys), values per token over
    ``value_group`` channels (one scale per token and group). Codes are the fp8 bytes, stored as
    uint8. With ``rotate`` K and V are first rotated by the fixed randomized Hadamard matrix, as in
    :class:`~kvtier.codecs.kbit.KBitCodec`.

    An fp8 value is not an affine function of its byte, so ``AFFINE`` is None: the decode kernels
    cannot read it and attention decodes it chunk by chunk (``chunked_partial``), dense only.
    """

    value_group: int
    rotate: bool = False
    #: key codes, key scale, value codes, value scale (no kernel reads fp8 codes; ``k_shift`` is a
    #: field of its own, added back by :meth:`decode_keys`)
    KERNEL_FIELDS: ClassVar[tuple[str, ...]] = ("k_codes", "k_scale", "v_codes", "v_scale")
    AFFINE: ClassVar[str | None] = None
    bits: ClassVar[int] = 8
    key_bits: ClassVar[int] = 8
    value_bits: ClassVar[int] = 8

    @property
    def name(self) -> str:
        return "fp8" + ("-rot" if self.rotate else "")

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        B, H, n, T, D = k.shape
        G = self.value_group
        k, v, tv = encode_inputs(k, v, valid, self.rotate)
        shift = key_shift(k, tv)
        kc, ks = quantize_fp8(k - shift.float(), dim=3, valid=tv)
        vc, vs = quantize_fp8(v.reshape(B, H, n, T, D // G, G), dim=5, valid=tv.unsqueeze(-1))
        check_params(self.name, (ks, vs, shift), (k, v, k))
        return {
            "k_codes": kc,
            "k_scale": ks,
            "v_codes": vc.reshape(B, H, n, T, D),
            "v_scale": vs.squeeze(-1),
            "k_shift": shift,
        }

    def decode(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_keys(f, dim, dtype), self.decode_values(f, dim, dtype)

    def _stored_keys(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        """Keys as stored (rotated space when ``rotate``), fp32 ``[B,H,n,T,D]``."""
        return dequantize_fp8(f["k_codes"], f["k_scale"]) + f["k_shift"].float()

    def decode_keys(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        k = self._stored_keys(f)
        return (k @ rotation(dim, k.device).T if self.rotate else k).to(dtype)

    def decode_values(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        vc = f["v_codes"]
        B, H, n, T, D = vc.shape
        G = self.value_group
        v = dequantize_fp8(vc.reshape(B, H, n, T, D // G, G), f["v_scale"].unsqueeze(-1)).reshape(B, H, n, T, D)
        return (v @ rotation(dim, v.device).T if self.rotate else v).to(dtype)

    def key_range(self, f: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel ``(lo, hi)`` of each block's stored keys, fp32 ``[B,H,n,D]`` (rotated space when
        ``rotate``): the min and max over the block's valid tokens, computed from the codes (nothing
        extra is stored; it reads every key code once). Empty blocks give ``(0, 0)``."""
        lo, hi = block_key_bounds(self._stored_keys(f), f["valid"].unsqueeze(-1))  # valid [B,1,n,T,1]
        return lo.squeeze(3), hi.squeeze(3)

    def nbytes(self, B: int, H: int, n: int, T: int, D: int) -> int:
        codes = B * H * n * T * D
        return 2 * codes + 2 * FP16_BYTES * B * H * n * D + FP16_BYTES * B * H * n * T * (D // self.value_group)
