"""Block codecs: how a tier encodes whole blocks of keys and values into packed tensors.

A codec turns exact blocks ``k, v: [B, H, n, T, D]`` (``n`` blocks of ``T`` tokens) into a dict
of tensors whose third axis is the block axis, and back. Keys are quantized per channel (their
statistics run over the ``T`` tokens of a block), values per token (over groups of ``G``
channels). Codes are packed along ``D``. ``nbytes`` gives the exact storage for a shape, so the
planner and the cache's own report count the same bytes.

The codec interface (what attention, kernels and the planner may rely on; see "Add a codec" in
CONTRIBUTING.md):

* ``name``, ``bits`` (code width, 1..8), ``key_bits`` / ``value_bits`` (the widths of the key and
  of the value codes; both ``bits`` except in :class:`MixedCodec`), ``rotate`` (codes of
  ``x @ rotation``), ``value_group``;
* ``encode(k, v, valid) -> fields``, ``decode_keys`` / ``decode_values`` / ``decode``, ``nbytes``;
  ``encode`` refuses a block whose parameters would leave their fp16 / fp8 format
  (:func:`check_params`: a :class:`~kvtier.errors.StorageRangeError`, never ``inf`` or clamped
  parameters);
* ``AFFINE``: how every stored value follows from its code, ``x = a * code + b``, with ``(a, b)``
  read from the two metadata fields after the codes in ``KERNEL_FIELDS`` by one rule of
  :data:`AFFINE_MODES` (the kernels' codec switch: fused C++ ``Meta``, Triton ``_affine``), or
  ``None`` for a codec whose codes are not affine (the kernels cannot read it; attention decodes
  it chunk by chunk);
* :meth:`affine` (that rule in torch) and :meth:`key_range` (per-channel bounds of the stored keys,
  Quest's block bounds), both derived from ``AFFINE`` in :class:`AffineCodec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import StorageRangeError
from ..policy import TierPolicy
from ..quant import (
    dequantize_kbit,
    dequantize_sign,
    pack_bits,
    packed_size,
    quantize_ab,
    quantize_kbit,
    quantize_sign,
    rotation,
    unpack_bits,
)

_FP16 = 2


def check_params(what: str, params: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...], fix: str = "") -> None:
    """Refuse a block whose quantization parameters do not fit their format.

    A stored parameter at or beyond its format's largest finite value is out of range: fp16
    overflows to ``inf`` (an ``inf`` scale decodes ``inf``/``NaN``), fp8 e4m3 saturates at 448
    (a clamped ``(a, b)`` decodes silently wrong values). The check reads only the parameters
    (one small reduction per encode); the inputs are read only when it fails, to leave alone a
    block whose own values are not finite (the model's ``inf``/``NaN`` is not a range problem).

    Parameters
    ----------
    what : the codec, named in the error.
    params : the stored parameter tensors (fp16 or fp8).
    inputs : the blocks they were fitted to (``k, v``), as given to ``encode``.
    fix : what to do instead, appended to the message.

    Raises
    ------
    StorageRangeError : naming the largest ``|value|`` of the block and the format's limit.
    """
    hits = [p.float().abs() >= torch.finfo(p.dtype).max for p in params]  # inf included
    if not bool(torch.stack([h.any() for h in hits]).any()):
        return
    if not all(bool(torch.isfinite(x).all()) for x in inputs):
        return
    worst = max(float(x.float().abs().amax()) for x in inputs)
    fmts = sorted({f"{str(p.dtype).removeprefix('torch.')} (largest {torch.finfo(p.dtype).max:g})" for p in params})
    raise StorageRangeError(
        f"{what} cannot quantize a block whose keys/values reach |x| = {worst:.4g}: its parameters would leave "
        f"their format, {', '.join(fmts)}, and decode inf/NaN or clamped values{fix}"
    )


#: How a kernel reads ``(a, b)`` of ``x = a * code + b`` from a codec's two stored parameters
#: ``(p1, p2)``: ``"ab"`` given directly, ``"scale_zero"`` ``a = p1, b = -p1 * p2`` (k-bit),
#: ``"scale_mean"`` ``a = 2 p1, b = p2 - p1`` (sign codes). The integer is the mode the kernels take.
AFFINE_MODES = {"ab": 0, "scale_zero": 1, "scale_mean": 2}


def affine_ab(mode: str, p1: torch.Tensor, p2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` in fp32 from a codec's stored parameters by rule ``mode`` of :data:`AFFINE_MODES`."""
    p1, p2 = p1.float(), p2.float()
    if mode == "scale_zero":
        return p1, -p1 * p2
    if mode == "scale_mean":
        return 2 * p1, p2 - p1
    if mode == "ab":
        return p1, p2
    raise ValueError(f"unknown affine mode {mode!r}; expected one of {sorted(AFFINE_MODES)}")


class AffineCodec:
    """What every codec whose codes are affine (``x = a * code + b``) shares: the kernels' view of
    its fields and Quest bounds, both from ``KERNEL_FIELDS`` and ``AFFINE`` alone."""

    KERNEL_FIELDS: ClassVar[tuple[str, ...]]
    AFFINE: ClassVar[str | None]
    bits: int
    key_bits: int  # widths of the key and value codes (properties or fields of each codec)
    value_bits: int
    rotate: bool

    def affine(self, f: dict[str, torch.Tensor]):
        """``(k_a, k_b, v_a, v_b, k_codes, v_codes)``: fp32 keys ``[B,H,n,D]``, values ``[B,H,n,T,NG]``."""
        kc, k1, k2, vc, v1, v2 = (f[name] for name in self.KERNEL_FIELDS)
        ka, kb = affine_ab(self.AFFINE, k1.squeeze(3), k2.squeeze(3))
        va, vb = affine_ab(self.AFFINE, v1, v2)
        return ka, kb, va, vb, kc, vc

    def key_range(self, f: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel ``(lo, hi)`` of the stored keys of each block, fp32 ``[B,H,n,D]`` (rotated space
        when ``rotate``): codes span ``0 .. 2**bits - 1``."""
        _, k1, k2 = (f[name] for name in self.KERNEL_FIELDS[:3])
        a, b = affine_ab(self.AFFINE, k1.squeeze(3), k2.squeeze(3))
        top = a * ((1 << self.key_bits) - 1) + b
        return torch.minimum(b, top), torch.maximum(b, top)


def _token_valid(valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1, n, T]`` -> broadcastable to ``[B, H, n, T, 1]``."""
    return valid.unsqueeze(-1)


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
        if self.rotate:
            r = rotation(D, k.device)
            k, v = k.float() @ r, v.float() @ r
        tv = _token_valid(valid)
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
        return 2 * codes + 2 * _FP16 * B * H * n * D + 2 * _FP16 * B * H * n * T * (D // self.value_group)


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
        if self.rotate:
            r = rotation(D, k.device)
            k, v = k.float() @ r, v.float() @ r
        tv = _token_valid(valid)
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
        return 2 * signs + 2 * _FP16 * B * H * n * D + 2 * _FP16 * B * H * n * T * (D // self.value_group)


#: Storage formats of :class:`MixedCodec`'s ``(a, b)`` parameters.
META_DTYPES = {"fp16": torch.float16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class MixedCodec(AffineCodec):
    """Keys at ``key_bits``, values at ``value_bits`` (each 1..8), with ``x = a * code + b`` and
    ``(a, b)`` stored directly (``AFFINE = "ab"``) in fp16 or fp8 e4m3 (``meta``).

    Same group layout as :class:`KBitCodec` (keys per channel over a block, values per token over
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
        if self.rotate:
            r = rotation(D, k.device)
            k, v = k.float() @ r, v.float() @ r
        tv = _token_valid(valid)
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
    # clamped at fp16's largest value (|x| beyond ~2.9e7) is refused by Fp8Codec (check_params).
    scale = (amax / FP8_MAX * (1 + 2.0**-10)).clamp(FP8_SCALE_MIN, 65504.0).to(torch.float16)
    codes = (xf / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return codes.view(torch.uint8), scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8(codes) * scale`` in fp32, cast to ``dtype``."""
    return (codes.view(FP8).float() * scale.float()).to(dtype)


@dataclass(frozen=True)
class Fp8Codec:
    """fp8 e4m3 codes with fp16 scales: keys per channel over a block (one scale per channel and
    block, as KIVI's keys), values per token over ``value_group`` channels (one scale per token and
    group). Codes are the fp8 bytes, stored as uint8. With ``rotate`` K and V are first rotated by
    the fixed randomized Hadamard matrix, as in :class:`KBitCodec`.

    An fp8 value is not an affine function of its byte, so ``AFFINE`` is None: the decode kernels
    cannot read it and attention decodes it chunk by chunk (``chunked_partial``), dense only.
    """

    value_group: int
    rotate: bool = False
    #: key codes, key scale, value codes, value scale
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
        if self.rotate:
            r = rotation(D, k.device)
            k, v = k.float() @ r, v.float() @ r
        tv = _token_valid(valid)
        kc, ks = quantize_fp8(k, dim=3, valid=tv)
        vc, vs = quantize_fp8(v.reshape(B, H, n, T, D // G, G), dim=5, valid=tv.unsqueeze(-1))
        check_params(self.name, (ks, vs), (k, v))
        return {"k_codes": kc, "k_scale": ks, "v_codes": vc.reshape(B, H, n, T, D), "v_scale": vs.squeeze(-1)}

    def decode(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_keys(f, dim, dtype), self.decode_values(f, dim, dtype)

    def _stored_keys(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        """Keys as stored (rotated space when ``rotate``), fp32 ``[B,H,n,T,D]``."""
        return dequantize_fp8(f["k_codes"], f["k_scale"])

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
        k = self._stored_keys(f)
        valid = f["valid"].unsqueeze(-1)  # [B,1,n,T,1]
        lo = torch.where(valid, k, torch.full_like(k, float("inf"))).amin(3)
        hi = torch.where(valid, k, torch.full_like(k, float("-inf"))).amax(3)
        empty = lo > hi
        return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)

    def nbytes(self, B: int, H: int, n: int, T: int, D: int) -> int:
        codes = B * H * n * T * D
        return 2 * codes + _FP16 * B * H * n * D + _FP16 * B * H * n * T * (D // self.value_group)


Codec = KBitCodec | SignCodec | Fp8Codec | MixedCodec


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


def _group_codec(bits: int | str, group: int, rotate: bool = False) -> Codec:
    """The codec of a ``warm_bits`` / ``cold_bits`` value: ``"fp8"`` or a k-bit width."""
    return Fp8Codec(group, rotate=rotate) if bits == "fp8" else KBitCodec(bits, group, rotate=rotate)


def make_codecs(policy: TierPolicy, head_dim: int) -> tuple[Codec, Codec | None]:
    """Warm and cold codecs of a policy (cold is None when evicted). An adaptive policy's warm tier
    is coded like its cold tier (rotation, ``cold_meta`` parameters, clipped grids) at ``warm_bits``:
    on SmolLM2 a rotated 3-bit warm window with fp8 parameters (3.27 bits per element) costs less
    perplexity per byte than the unrotated 4-bit one with fp16 scales (4.5 bits)."""
    g = value_group(policy, head_dim)
    if policy.adaptive is not None and isinstance(policy.warm_bits, int):
        warm = MixedCodec(policy.warm_bits, policy.warm_bits, g, rotate=policy.cold_rotation, meta=policy.cold_meta)
    else:
        warm = _group_codec(policy.warm_bits, g)
    if policy.cold in ("evict", "offload"):  # offload: resident sketches, see kvtier.offload.tier
        return warm, None
    if policy.cold == "sign":
        return warm, SignCodec(g, rotate=policy.cold_rotation)
    if policy.cold_value_bits is not None or policy.cold_meta != "fp16":
        vb = policy.cold_bits if policy.cold_value_bits is None else policy.cold_value_bits
        return warm, MixedCodec(policy.cold_bits, vb, g, rotate=policy.cold_rotation, meta=policy.cold_meta)
    return warm, _group_codec(policy.cold_bits, g, rotate=policy.cold_rotation)
