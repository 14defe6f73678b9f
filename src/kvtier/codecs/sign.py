"""The sign codec: 1 bit per element (the sign of the centered value) with a mean and a scale per group.

The cold tier's codec of ``cold="sign"`` policies. May import: torch, ``kvtier.quant``, :mod:`.base`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..quant import dequantize_sign, pack_bits, packed_size, quantize_sign, rotation, unpack_bits
from .base import FP16_BYTES, AffineCodec, check_params, encode_inputs


@dataclass(frozen=True)
class SignCodec(AffineCodec):
    """1-bit sign of the centered value, with a mean and a scale (``mean |x - mean|``).

    Keys: mean and scale per channel over a block; values: per token over ``value_group``
    channels. With ``rotate`` both are first rotated by a fixed randomized Hadamard matrix.
    """

    value_group: int
    rotate: bool = False
    #: key signs, key scale, key mean, value signs, value scale, value mean (the kernels' order)
    KERNEL_FIELDS: ClassVar[tuple[str, ...]] = ("k_signs", "k_scale", "k_mean", "v_signs", "v_scale", "v_mean")
    AFFINE: ClassVar[str] = "scale_mean"
    bits: ClassVar[int] = 1
    key_bits: ClassVar[int] = 1
    value_bits: ClassVar[int] = 1

    @property
    def name(self) -> str:
        return "sign-rot" if self.rotate else "sign"

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        B, H, n, T, D = k.shape
        G = self.value_group
        k, v, tv = encode_inputs(k, v, valid, self.rotate)
        ks, kscale, kmean = quantize_sign(k, dim=3, valid=tv)
        vs, vscale, vmean = quantize_sign(v.reshape(B, H, n, T, D // G, G), dim=5, valid=tv.unsqueeze(-1))
        check_params(self.name, (kscale, kmean, vscale, vmean), (k, v))
        return {
            "k_signs": pack_bits(ks, 1),
            "k_scale": kscale,
            "k_mean": kmean,
            "v_signs": pack_bits(vs.reshape(B, H, n, T, D), 1),
            "v_scale": vscale.squeeze(-1),
            "v_mean": vmean.squeeze(-1),
        }

    def decode(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_keys(f, dim, dtype), self.decode_values(f, dim, dtype)

    def decode_keys(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        k = dequantize_sign(unpack_bits(f["k_signs"], 1, dim), f["k_scale"], f["k_mean"])
        return (k @ rotation(dim, k.device).T if self.rotate else k).to(dtype)

    def decode_values(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        vs = unpack_bits(f["v_signs"], 1, dim)
        B, H, n, T, D = vs.shape
        G = self.value_group
        v = dequantize_sign(
            vs.reshape(B, H, n, T, D // G, G), f["v_scale"].unsqueeze(-1), f["v_mean"].unsqueeze(-1)
        ).reshape(B, H, n, T, D)
        return (v @ rotation(dim, v.device).T if self.rotate else v).to(dtype)

    def nbytes(self, B: int, H: int, n: int, T: int, D: int) -> int:
        signs = B * H * n * T * packed_size(D, 1)
        return 2 * signs + 2 * FP16_BYTES * B * H * n * D + 2 * FP16_BYTES * B * H * n * T * (D // self.value_group)
