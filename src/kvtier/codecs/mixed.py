"""The mixed codec: keys and values at their own widths (1..8), ``x = a * code + b`` with ``(a, b)``
stored directly in fp16 or fp8 e4m3.

The cold tier's codec of policies with ``cold_value_bits`` or ``cold_meta="fp8"``, and the adaptive
policy's per-layer widths (:mod:`kvtier.cache.adaptive`). May import: torch, ``kvtier.quant``,
:mod:`.base`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..quant import pack_bits, packed_size, quantize_ab, rotation, unpack_bits
from .base import AffineCodec, check_params, encode_inputs

#: Storage formats of :class:`MixedCodec`'s ``(a, b)`` parameters.
META_DTYPES = {"fp16": torch.float16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class MixedCodec(AffineCodec):
    """Keys at ``key_bits``, values at ``value_bits`` (each 1..8), with ``x = a * code + b`` and
    ``(a, b)`` stored directly (``AFFINE = "ab"``) in fp16 or fp8 e4m3 (``meta``).

    Same group layout as :class:`~kvtier.codecs.kbit.KBitCodec` (keys per channel over a block, values per token over
    ``value_group`` channels), after the randomized Hadamard rotation when ``rotate``. Widths
    differ because keys and values do not cost the same error (a key error moves every softmax
    weight of its token, a value error only that token's contribution), and fp8 parameters halve
    the metadata: 16 bits per group instead of 32, i.e. 0.25 instead of 0.5 bits per element at
    64-element groups. Parameters are rounded into their format before the codes are chosen
    (:func:`kvtier.quant.quantize_ab`); with ``clip`` each group's grid is the least-error of a few
    fractions of its range (halves the 2-bit error of rotated data). The adaptive policy chooses the widths per layer
    (:mod:`kvtier.cache.adaptive`).
    """

    key_bits: int
    value_bits: int
    value_group: int
    rotate: bool = True
    meta: str = "fp8"
    clip: bool = True
    #: key codes, key a, key b, value codes, value a, value b (the kernels' order)
    KERNEL_FIELDS: ClassVar[tuple[str, ...]] = ("k_codes", "k_a", "k_b", "v_codes", "v_a", "v_b")
    AFFINE: ClassVar[str] = "ab"

    def __post_init__(self) -> None:
        for name in ("key_bits", "value_bits"):
            width = getattr(self, name)
            if not (isinstance(width, int) and 1 <= width <= 8):
                raise ValueError(f"{name}={width!r} is not allowed: expected an int in 1..8")
        if self.meta not in META_DTYPES:
            raise ValueError(f"meta={self.meta!r} is not allowed: expected one of {sorted(META_DTYPES)}")

    @property
    def bits(self) -> int:  # the wider of the two (what a single-width reader would need)
        return max(self.key_bits, self.value_bits)

    @property
    def name(self) -> str:
        return f"k{self.key_bits}v{self.value_bits}" + ("-rot" if self.rotate else "") + f"-{self.meta}"

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        B, H, n, T, D = k.shape
        G = self.value_group
        dt = META_DTYPES[self.meta]
        k, v, tv = encode_inputs(k, v, valid, self.rotate)
        kq, ka, kb = quantize_ab(k, self.key_bits, dim=3, valid=tv, dtype=dt, clip=self.clip)
        vg = v.reshape(B, H, n, T, D // G, G)
        vq, va, vb = quantize_ab(vg, self.value_bits, dim=5, valid=tv.unsqueeze(-1), dtype=dt, clip=self.clip)
        fix = ""
        if self.meta == "fp8":
            fix = "; fp16 parameters reach further (cold_meta='fp16', and AdaptivePolicy(meta='fp16') when adaptive)"
        check_params(self.name, (ka, kb, va, vb), (k, v), fix)
        return {
            "k_codes": pack_bits(kq, self.key_bits),
            "k_a": ka,
            "k_b": kb,
            "v_codes": pack_bits(vq.reshape(B, H, n, T, D), self.value_bits),
            "v_a": va.squeeze(-1),
            "v_b": vb.squeeze(-1),
        }

    def decode(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_keys(f, dim, dtype), self.decode_values(f, dim, dtype)

    def decode_keys(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        k = unpack_bits(f["k_codes"], self.key_bits, dim).float() * f["k_a"].float() + f["k_b"].float()
        return (k @ rotation(dim, k.device).T if self.rotate else k).to(dtype)

    def decode_values(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        vq = unpack_bits(f["v_codes"], self.value_bits, dim)
        B, H, n, T, D = vq.shape
        G = self.value_group
        v = vq.reshape(B, H, n, T, D // G, G).float() * f["v_a"].float().unsqueeze(-1) + f["v_b"].float().unsqueeze(-1)
        v = v.reshape(B, H, n, T, D)
        return (v @ rotation(dim, v.device).T if self.rotate else v).to(dtype)

    def nbytes(self, B: int, H: int, n: int, T: int, D: int) -> int:
        m = META_DTYPES[self.meta].itemsize
        codes = B * H * n * T * (packed_size(D, self.key_bits) + packed_size(D, self.value_bits))
        return codes + 2 * m * B * H * n * D + 2 * m * B * H * n * T * (D // self.value_group)
