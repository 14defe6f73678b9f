"""The k-bit codec: ``bits``-bit asymmetric group quantization of keys per channel and values per token
(KIVI, https://arxiv.org/abs/2402.02750), optionally after the randomized Hadamard rotation.

The warm tier's codec in the fixed presets, the offload store's record format
(:mod:`kvtier.offload.records`) and the vLLM store's block codec (:mod:`kvtier.vllm.store.blocks`, through
:meth:`KBitCodec.encode_into`, the in-place path beside the pure :meth:`KBitCodec.encode`: the same bytes).
May import: torch, ``kvtier.quant``, :mod:`.base`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..quant import dequantize_kbit, pack_bits, pack_words, packed_size, quantize_kbit, rotation, unpack_bits
from ..quant.groups import fit_scale_zero
from .base import FP16_BYTES, AffineCodec, check_params, encode_inputs

#: ``buffer(name, shape, dtype) -> Tensor``: where :meth:`KBitCodec.encode_into` gets its scratch tensors.
Buffer = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


def _pack_codes_into(x: torch.Tensor, bits: int, buffer, out: dict[str, torch.Tensor]) -> None:  # noqa: ANN001
    """Codes of ``x`` (``[2, ...]`` keys then values, already scaled and shifted, overwritten) packed
    into ``out["k_codes"]`` and ``out["v_codes"]``.

    round(x).clamp(0, qmax) as uint8, without the slow float -> uint8 cast: clamped first (the same
    codes), then + 2**23 rounds to the nearest integer, ties to even (as torch.round), and leaves it in
    the low byte of the float's bits; the int32 -> uint8 cast keeps that byte."""
    x.clamp_(0, (1 << bits) - 1).add_(2.0**23)
    q = buffer("q", x.shape, torch.uint8).copy_(x.view(torch.int32))
    pack_words(q[0], bits, buffer, out=out["k_codes"])
    pack_words(q[1], bits, buffer, out=out["v_codes"])


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

    @torch.no_grad()
    def encode_into(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor | None,
        out: dict[str, torch.Tensor],
        buffer: Buffer | None = None,
    ) -> dict[str, torch.Tensor]:
        """:meth:`encode` written into the caller's tensors: the same bytes, in a few in-place passes
        over one fp32 scratch copy of keys and values (one conversion, one rotation matmul, min and max
        per group, the quantization in place, one pack per field).

        Parameters
        ----------
        k, v : ``[B, H, n, T, D]``, any float dtype, any strides (views into a larger block are fine).
        valid : bool ``[B, 1, n, T]`` (as :meth:`encode`), or ``None``: every token valid. Invalid tokens
            stay out of the statistics; only the key groups holding one are reduced again.
        out : the fields of :meth:`encode`, same names, shapes and dtypes (uint8 codes, fp16 scales and
            zeros), e.g. views into a record's payload; every one is overwritten.
        buffer : ``buffer(name, shape, dtype)`` gives the scratch tensors (``"x"``, ``"y"``, ``"q"`` and
            :func:`~kvtier.quant.pack_words`'s), e.g. kept per thread by the caller; default: new ones.

        Returns
        -------
        ``out``. Raises :class:`~kvtier.errors.StorageRangeError` as :meth:`encode` does.
        """
        B, H, n, T, D = k.shape
        G, bits = self.value_group, self.bits
        if buffer is None:
            buffer = lambda name, shape, dtype: torch.empty(shape, dtype=dtype, device=k.device)
        x = self._scratch(k, v, buffer)
        xk, xv = x[0], x[1].view(B, H, n, T, D // G, G)
        # amin and amax, not aminmax: 20x faster reductions on the CPU
        kmn, kmx = xk.amin(3, keepdim=True), xk.amax(3, keepdim=True)
        vmn, vmx = xv.amin(5, keepdim=True), xv.amax(5, keepdim=True)
        if valid is not None and not bool(valid.all()):
            _drop_invalid(xk, valid.expand(B, 1, n, T), kmn, kmx, vmn, vmx)
        ks, kz = fit_scale_zero(kmn, kmx, bits)
        vs, vz = fit_scale_zero(vmn, vmx, bits)
        check_params(self.name, (ks, vs), (k, v))  # |zero| <= ZERO_MAX by construction
        xk.div_(ks.float()).add_(kz.float())
        xv.div_(vs.float()).add_(vz.float())
        _pack_codes_into(x, bits, buffer, out)
        out["k_scale"].copy_(ks)
        out["k_zero"].copy_(kz)
        out["v_scale"].copy_(vs.squeeze(-1))
        out["v_zero"].copy_(vz.squeeze(-1))
        return out

    def _scratch(self, k: torch.Tensor, v: torch.Tensor, buffer: Buffer) -> torch.Tensor:
        """fp32 ``[2, B, H, n, T, D]`` copy of keys and values (after the rotation when the codec rotates)."""
        D = k.shape[-1]
        x = buffer("x", (2, *k.shape), torch.float32)
        x[0].copy_(k)
        x[1].copy_(v)
        if self.rotate:
            y = buffer("y", x.shape, torch.float32)
            x = torch.mm(x.view(-1, D), rotation(D, k.device), out=y.view(-1, D)).view(x.shape)
        return x

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


def _drop_invalid(
    xk: torch.Tensor,
    valid: torch.Tensor,
    kmn: torch.Tensor,
    kmx: torch.Tensor,
    vmn: torch.Tensor,
    vmx: torch.Tensor,
) -> None:
    """Take the tokens where ``valid: [B, 1, n, T]`` is False out of the group statistics, in place:
    key groups ``[B, H, n, 1, D]`` holding one are reduced again over their valid tokens of ``xk``
    (``inf`` / ``-inf`` where none is left, as :func:`~kvtier.quant.quantize_kbit`), value groups
    ``[B, H, n, T, D // G, 1]`` of an invalid token become empty."""
    T = xk.shape[3]
    b, j = (~valid.all(-1)).squeeze(1).nonzero(as_tuple=True)  # key groups holding an invalid token
    drop = ~valid[b, 0, j].view(-1, 1, T, 1)
    rows = xk[b, :, j]  # [m, H, T, D]: a copy of those groups only
    kmn[b, :, j] = rows.masked_fill(drop, float("inf")).amin(2, keepdim=True)
    kmx[b, :, j] = rows.masked_fill(drop, float("-inf")).amax(2, keepdim=True)
    gone = ~valid[..., None, None]
    vmn.masked_fill_(gone, float("inf"))
    vmx.masked_fill_(gone, float("-inf"))
