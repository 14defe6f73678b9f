"""Block codecs: how a tier encodes whole blocks of keys and values into packed tensors.

A codec turns exact blocks ``k, v: [B, H, n, T, D]`` (``n`` blocks of ``T`` tokens) into a dict
of tensors whose third axis is the block axis, and back. Keys are quantized per channel (their
statistics run over the ``T`` tokens of a block), values per token (over groups of ``G``
channels). Codes are packed along ``D``. ``nbytes`` gives the exact storage for a shape, so the
planner and the cache's own report count the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..policy import TierPolicy
from ..quant import (
    dequantize_kbit,
    dequantize_sign,
    pack_bits,
    packed_size,
    quantize_kbit,
    quantize_sign,
    rotation,
    unpack_bits,
)

_FP16 = 2


def _token_valid(valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1, n, T]`` -> broadcastable to ``[B, H, n, T, 1]``."""
    return valid.unsqueeze(-1)


@dataclass(frozen=True)
class KBitCodec:
    """``bits``-bit asymmetric group quantization (KIVI layout). With ``rotate`` K and V are first
    rotated by the fixed randomized Hadamard matrix (QuaRot, https://arxiv.org/abs/2404.00456),
    which spreads outlier channels before the per-channel / per-token grids are fitted."""

    bits: int
    value_group: int
    rotate: bool = False
    #: key codes, key scale, key zero, value codes, value scale, value zero (the kernels' order)
    KERNEL_FIELDS: ClassVar[tuple[str, ...]] = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")

    @property
    def name(self) -> str:
        return f"int{self.bits}" + ("-rot" if self.rotate else "")

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        B, H, n, T, D = k.shape
        G = self.value_group
        if self.rotate:
            r = rotation(D, k.device)
            k, v = k.float() @ r, v.float() @ r
        tv = _token_valid(valid)
        kq, ks, kz = quantize_kbit(k, self.bits, dim=3, valid=tv)
        vq, vs, vz = quantize_kbit(v.reshape(B, H, n, T, D // G, G), self.bits, dim=5, valid=tv.unsqueeze(-1))
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
        return 2 * codes + 2 * _FP16 * B * H * n * D + 2 * _FP16 * B * H * n * T * (D // self.value_group)


@dataclass(frozen=True)
class SignCodec:
    """1-bit sign of the centered value, with a mean and a scale (``mean |x - mean|``).

    Keys: mean and scale per channel over a block; values: per token over ``value_group``
    channels. With ``rotate`` both are first rotated by a fixed randomized Hadamard matrix.
    """

    value_group: int
    rotate: bool = False
    #: key signs, key scale, key mean, value signs, value scale, value mean (the kernels' order)
    KERNEL_FIELDS: ClassVar[tuple[str, ...]] = ("k_signs", "k_scale", "k_mean", "v_signs", "v_scale", "v_mean")

    @property
    def name(self) -> str:
        return "sign-rot" if self.rotate else "sign"

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        B, H, n, T, D = k.shape
        G = self.value_group
        if self.rotate:
            r = rotation(D, k.device)
            k, v = k.float() @ r, v.float() @ r
        tv = _token_valid(valid)
        ks, kscale, kmean = quantize_sign(k, dim=3, valid=tv)
        vs, vscale, vmean = quantize_sign(v.reshape(B, H, n, T, D // G, G), dim=5, valid=tv.unsqueeze(-1))
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
        return 2 * signs + 2 * _FP16 * B * H * n * D + 2 * _FP16 * B * H * n * T * (D // self.value_group)


Codec = KBitCodec | SignCodec


# --- what a policy stores: exact dtype, value groups, tier codecs ------------------------------
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def storage_dtype(policy: TierPolicy, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype sinks and hot tokens are stored in."""
    if policy.exact_dtype == "model":
        return model_dtype
    if policy.exact_dtype == "half":
        return torch.float16 if model_dtype == torch.float32 else model_dtype
    return _DTYPES[policy.exact_dtype]


def value_group(policy: TierPolicy, head_dim: int) -> int:
    """Channels per value group: ``policy.value_group_size`` capped at ``head_dim`` (a divisor of it)."""
    g = min(policy.value_group_size, head_dim)
    if head_dim % g:
        raise ValueError(
            f"value_group_size={policy.value_group_size} is not allowed for head_dim={head_dim}: "
            "expected a divisor of head_dim"
        )
    return g


def make_codecs(policy: TierPolicy, head_dim: int) -> tuple[Codec, Codec | None]:
    """Warm and cold codecs of a policy (cold is None when evicted)."""
    g = value_group(policy, head_dim)
    warm = KBitCodec(policy.warm_bits, g)
    if policy.cold in ("evict", "offload"):  # offload: resident sketches, see kvtier.offload.tier
        return warm, None
    if policy.cold == "sign":
        return warm, SignCodec(g, rotate=policy.cold_rotation)
    return warm, KBitCodec(policy.cold_bits, g, rotate=policy.cold_rotation)
