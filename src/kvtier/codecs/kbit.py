"""The k-bit codec: ``bits``-bit asymmetric group quantization of keys per channel and values per token
(KIVI, https://arxiv.org/abs/2402.02750), optionally after the randomized Hadamard rotation.

The warm tier's codec in the fixed presets, the offload store's record format
(:mod:`kvtier.offload.records`) and the vLLM store's block codec (:mod:`kvtier.vllm.blocks`).
May import: torch, ``kvtier.quant``, :mod:`.base`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..quant import dequantize_kbit, pack_bits, packed_size, quantize_kbit, rotation, unpack_bits
from .base import FP16_BYTES, AffineCodec, check_params, encode_inputs


@dataclass(frozen=True)
class KBitCodec(AffineCodec):
    """``bits``-bit asymmetric group quantization (KIVI layout). With ``rotate`` K and V are first
    rotated by the fixed randomized Hadamard matrix (QuaRot, https://arxiv.org/abs/2404.00456),
    which spreads outlier channels before the per-channel / per-token grids are fitted."""

    bits: int
    value_group: int
    rotate: bool = False
    #: key codes, key scale, key zero, value codes, value scale, value zero (the kernels' order)
    KERNEL_FIELDS: ClassVar[tuple[str, ...]] = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
    AFFINE: ClassVar[str] = "scale_zero"

    @property
    def key_bits(self) -> int:
        """Width of the key codes."""
        return self.bits

    @property
    def value_bits(self) -> int:
        """Width of the value codes."""
        return self.bits

    @property
    def name(self) -> str:
        return f"int{self.bits}" + ("-rot" if self.rotate else "")

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        B, H, n, T, D = k.shape
        G = self.value_group
        k, v, tv = encode_inputs(k, v, valid, self.rotate)
        kq, ks, kz = quantize_kbit(k, self.bits, dim=3, valid=tv)
        vq, vs, vz = quantize_kbit(v.reshape(B, H, n, T, D // G, G), self.bits, dim=5, valid=tv.unsqueeze(-1))
        check_params(self.name, (ks, vs), (k, v))  # |zero| <= ZERO_MAX by construction
        return {
            "k_codes": pack_bits(kq, self.bits),
            "k_scale": ks,
            "k_zero": kz,
            "v_codes": pack_bits(vq.reshape(B, H, n, T, D), self.bits),
            "v_scale": vs.squeeze(-1),
            "v_zero": vz.squeeze(-1),
        }

    def decode(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_keys(f, dim, dtype), self.decode_values(f, dim, dtype)

    def decode_keys(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_bits(f["k_codes"], self.bits, dim)
        if not self.rotate:
            return dequantize_kbit(codes, f["k_scale"], f["k_zero"], dtype)
        k = dequantize_kbit(codes, f["k_scale"], f["k_zero"], torch.float32)
        return (k @ rotation(dim, k.device).T).to(dtype)

    def decode_values(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        vq = unpack_bits(f["v_codes"], self.bits, dim)
        B, H, n, T, D = vq.shape
        G = self.value_group
        vq = vq.reshape(B, H, n, T, D // G, G)
        out = torch.float32 if self.rotate else dtype
        v = dequantize_kbit(vq, f["v_scale"].unsqueeze(-1), f["v_zero"].unsqueeze(-1), out).reshape(B, H, n, T, D)
        return (v @ rotation(dim, v.device).T).to(dtype) if self.rotate else v

    def nbytes(self, B: int, H: int, n: int, T: int, D: int) -> int:
        codes = B * H * n * T * packed_size(D, self.bits)
        return 2 * codes + 2 * FP16_BYTES * B * H * n * D + 2 * FP16_BYTES * B * H * n * T * (D // self.value_group)
