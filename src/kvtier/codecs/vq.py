"""The vq codec: vector codes on rotated coordinates, a fixed codebook per width shipped with the
package, a mean and an RMS scale per group (issue 38's codes, better per bit than scalar ones).

Owns the format: :data:`SUBVECTOR` (the sub-vector length of each width), the codebooks
(:func:`codebook`, read from ``kvtier/data/vq_codebooks.bin`` whose sha256 is :data:`CODEBOOK_SHA256`;
:func:`fit_codebook` makes them, :func:`write_codebooks` writes the file), the fields
and their bytes. May import: torch, ``kvtier.quant``, :mod:`.base`.

Why: at equal code + parameter bits, 4-D vector codes on Hadamard-rotated coordinates cut the
model's KL against the full cache by 27-43 % compared with kvtier's scalar affine codes
(``benchmarks/codes_per_bit.py``, BENCHMARKS.md "v9"): about a quarter bit per element. The
codebooks are k-means centres of seeded N(0, I) samples, not fitted to any model (the rotated,
normalized coordinates are close to Gaussian), so nothing is calibrated per model.

Format of a block ``k, v: [B, H, n, T, D]`` (coordinates ``x @ rotation(D)``):

* keys: ``k_mean [B,H,n,1,D]`` fp16, each channel's mean over the block's valid tokens (fp16, not
  fp8: Qwen2.5's key biases put channel offsets of ~20 in rotated coordinates, where e4m3's step
  is ~1); ``k_rms [B,H,n,T]`` fp8 e4m3, the RMS of the token's centred key; ``z = (k - mean) / rms``
  split into ``D / d`` sub-vectors of ``d = SUBVECTOR[key_bits]`` coordinates, each replaced by the
  index of its nearest codebook centre (``key_bits * d`` bits);
* values: ``v_mean [B,H,n,T]`` fp8, the token's mean over the model's ``D`` channels (taken out
  before the rotation: a constant token stays exact, where the rotation would turn it into one
  spike no codebook holds), ``v_rms [B,H,n,T]`` fp8 the RMS of the rotated rest, then the same codes
  at ``value_bits``;
* indices: ``*_idx`` the low 8 bits (packed at ``min(ib, 8)`` bits, ``ib = bits * d``),
  ``*_hi`` the bits above 8 (packed at ``ib - 8``; an empty last axis when ``ib <= 8``, as for every
  width of :data:`SUBVECTOR` today), along the ``D / d`` sub-vectors.

Parameters are rounded into their formats before the codes are chosen, so the codes absorb the
rounding. Decoding: keys ``(codebook[idx] * rms + mean) @ rotation.T``, values
``(codebook[idx] * rms) @ rotation.T + mean``. The codes are not affine (``AFFINE = None``):
attention reads a vq tier in place through :mod:`kvtier.kernels.vq_cpu` (C++, product-quantization
tables per query row), :func:`kvtier.kernels.triton_decode.vq_attention` (Triton, codebook
coordinates gathered per token) or :func:`kvtier.attention.partials.vq_partial` (torch tables, the
reference), and decodes it chunk by chunk for long prefill calls; dense only (no sparse
selection). The kernels read the fp8 parameters as bytes through :func:`fp8_values` and one byte
per index (:func:`check_byte_indices`).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import ClassVar

import torch

from ..quant import pack_bits, packed_size, planes, rotation, unpack_bits
from .base import FP16_BYTES, block_key_bounds, check_params, token_valid

#: Sub-vector length ``d`` of each code width (bits per coordinate): a codebook of ``2**(bits * d)``
#: centres in ``d`` dimensions, at most 256 so that an index is one byte and the encoder's
#: nearest-centre search stays cheap. Mean squared error per coordinate on N(0, 1) (65,536 fresh
#: samples) vs the optimal scalar quantizer: 1 bit 8-D 0.327 vs 0.363; 2 bits 4-D 0.0992 vs 0.1175;
#: 3 bits 2-D 0.0300 vs 0.0346; 4 bits 2-D 0.00858 vs 0.0095. (3 bits in 4-D, 4,096 centres, would
#: err ~9 % less again at 64x the encoder's work.)
SUBVECTOR = {1: 8, 2: 4, 3: 2, 4: 2}
#: Widths a vq code may have.
VQ_BITS = tuple(SUBVECTOR)
#: fp8 e4m3 (the RMS scales and the values' means).
FP8 = torch.float8_e4m3fn
#: Floor of a stored RMS: e4m3's smallest subnormal (a constant group codes as its mean).
RMS_MIN = 2.0**-9
#: The shipped codebooks, in :data:`VQ_BITS` order, little-endian fp32, ``[2**(bits*d), d]`` each.
CODEBOOK_FILE = "vq_codebooks.bin"
CODEBOOK_SHA256 = "484683d6df3b7ca2583bb48507513ebb2b3222e3dfec927d06a8894e4bf31470"
#: k-means of :func:`fit_codebook`: samples per centre (at least 65,536 in all) and Lloyd iterations.
FIT_SAMPLES_PER_CENTRE = 32
FIT_ITERATIONS = 40


def centres(bits: int) -> int:
    """Number of codebook centres of a width."""
    return 1 << (bits * SUBVECTOR[bits])


def nearest(x: torch.Tensor, book: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """Index (int64) of the nearest centre of ``book [C, d]`` for each row of ``x [N, d]`` (squared
    distance in fp32; ties: the lowest index), ``chunk`` rows at a time."""
    cc = (book * book).sum(1)
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    for i in range(0, x.shape[0], chunk):
        xs = x[i : i + chunk]
        torch.argmin(cc[None, :] - 2 * (xs @ book.T), dim=1, out=out[i : i + chunk])
    return out


def fit_codebook(bits: int, seed: int = 0) -> torch.Tensor:
    """``[2**(bits*d), d]`` fp32 k-means centres of seeded N(0, I_d) samples (``d = SUBVECTOR[bits]``),
    sorted by their first coordinates (the shipped codebooks; deterministic for a torch build)."""
    d, n = SUBVECTOR[bits], centres(bits)
    g = torch.Generator().manual_seed(seed * 1009 + bits)
    x = torch.randn(max(FIT_SAMPLES_PER_CENTRE * n, 1 << 16), d, generator=g)
    c = x[torch.randperm(x.shape[0], generator=g)[:n]].clone()
    for _ in range(FIT_ITERATIONS):
        idx = nearest(x, c)
        s = torch.zeros_like(c).index_add_(0, idx, x)
        cnt = torch.bincount(idx, minlength=n).float()[:, None]
        c = torch.where(cnt > 0, s / cnt.clamp_min(1), c)
    order = sorted(range(n), key=lambda i: tuple(c[i].tolist()))
    return c[order].contiguous()


def _codebook_path() -> Path:
    return Path(str(resources.files("kvtier") / "data" / CODEBOOK_FILE))


@functools.lru_cache(maxsize=1)
def _codebooks_cpu() -> dict[int, torch.Tensor]:
    path = _codebook_path()
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != CODEBOOK_SHA256:
        raise RuntimeError(
            f"{path}: sha256 {digest} is not the shipped codebooks' {CODEBOOK_SHA256}; reinstall kvtier "
            "(or rewrite it with `python scripts/fit_vq_codebooks.py`)"
        )
    flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
    books, at = {}, 0
    for bits in VQ_BITS:
        size = centres(bits) * SUBVECTOR[bits]
        books[bits] = flat[at : at + size].reshape(centres(bits), SUBVECTOR[bits]).clone()
        at += size
    if at != flat.numel():
        raise RuntimeError(f"{path}: {flat.numel()} floats, expected {at}")
    return books


def codebook(bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The shipped fp32 codebook of a width, ``[2**(bits*d), d]`` (read once per process)."""
    if bits not in SUBVECTOR:
        raise ValueError(f"vq bits={bits!r} is not allowed: expected one of {VQ_BITS}")
    return _codebooks_cpu()[bits].to(device)


@functools.lru_cache(maxsize=4)
def fp8_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 value of each byte of the fp8 parameters (``[256]``, NaN for e4m3's NaN bytes): the
    table through which the kernels read ``k_rms``, ``v_rms`` and ``v_mean`` as bytes."""
    return torch.arange(256, dtype=torch.uint8).view(FP8).float().to(device)


def check_byte_indices(fields: dict[str, torch.Tensor]) -> None:
    """Refuse fields whose centre indices have bits above the low byte (``*_hi`` not empty): the
    kernels read one byte per index (every width of :data:`SUBVECTOR` today)."""
    for side in ("k", "v"):
        if fields[f"{side}_hi"].shape[-1]:
            raise ValueError(f"vq indices wider than 8 bits ({side}) are not read by the kernels")


def kernel_operands(codec: VqCodec, fields: dict[str, torch.Tensor]) -> tuple:
    """What the vq kernels (C++ and Triton) take after the query rows, in their order, for each side
    (keys, then values): the packed indices (contiguous uint8), their plane widths
    (:func:`kvtier.quant.planes`), the codebook on the fields' device; then keys' fp16 ``k_mean``,
    and the fp8 parameters as bytes. Refuses indices wider than a byte (:func:`check_byte_indices`)."""
    check_byte_indices(fields)
    dev = fields["k_idx"].device

    def side(s: str) -> tuple:
        bits = codec.width(s)
        return fields[f"{s}_idx"].contiguous(), planes(index_widths(bits)[0]), codebook(bits, dev).contiguous()

    def as_bytes(name: str) -> torch.Tensor:
        return fields[name].contiguous().view(torch.uint8)

    return (
        *side("k"),
        fields["k_mean"].contiguous(),
        as_bytes("k_rms"),
        *side("v"),
        as_bytes("v_rms"),
        as_bytes("v_mean"),
    )


def codebook_bytes() -> int:
    """Bytes of every codebook a process holds once (shared by all vq tiers, on the CPU)."""
    return sum(centres(b) * SUBVECTOR[b] * 4 for b in VQ_BITS)


def index_widths(bits: int) -> tuple[int, int]:
    """Packed widths of a width's centre indices (``bits * d`` bits): the low byte's (``*_idx``) and
    the part above it (``*_hi``; 0 when none, as for every width of :data:`SUBVECTOR` today)."""
    ib = bits * SUBVECTOR[bits]
    return min(ib, 8), max(ib - 8, 0)


def code_bytes_per_token(bits: int, dim: int) -> int:
    """Bytes of one token's codes on one side (keys or values) at width ``bits`` over ``dim``
    coordinates (the low-byte and high parts of its ``dim / d`` indices, packed)."""
    P = dim // SUBVECTOR[bits]
    lo_w, hi_w = index_widths(bits)
    return packed_size(P, lo_w) + (packed_size(P, hi_w) if hi_w else 0)


def _f8(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 (values within +-448; :func:`check_params` refuses beyond)."""
    return x.clamp(-448.0, 448.0).to(FP8)


@dataclass(frozen=True)
class VqCodec:
    """Vector codes (see the module docstring): keys at ``key_bits``, values at ``value_bits`` per
    coordinate (each in :data:`VQ_BITS`), always on rotated coordinates. ``head_dim`` must be a
    multiple of both widths' sub-vector lengths (checked by :meth:`check_dim`)."""

    key_bits: int
    value_bits: int
    value_group: int  # the interface's field; vq values are normalized per token over the head dim
    #: the fields in the order the kernels take them (:mod:`kvtier.kernels.vq_cpu` reads them by name)
    KERNEL_FIELDS: ClassVar[tuple[str, ...]] = (
        "k_idx",
        "k_hi",
        "k_mean",
        "k_rms",
        "v_idx",
        "v_hi",
        "v_mean",
        "v_rms",
    )
    AFFINE: ClassVar[str | None] = None
    rotate: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name in ("key_bits", "value_bits"):
            width = getattr(self, name)
            if not (isinstance(width, int) and not isinstance(width, bool) and width in SUBVECTOR):
                raise ValueError(f"vq {name}={width!r} is not allowed: expected one of {VQ_BITS}")

    @property
    def bits(self) -> int:
        return max(self.key_bits, self.value_bits)

    @property
    def name(self) -> str:
        return f"vq-k{self.key_bits}v{self.value_bits}"

    def check_dim(self, dim: int) -> None:
        """Refuse a head dim that the sub-vectors do not tile (one line naming the widths that fit)."""
        for name, bits in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if dim % SUBVECTOR[bits]:
                fits = [b for b in VQ_BITS if dim % SUBVECTOR[b] == 0]
                raise ValueError(
                    f"vq {name}={bits} codes {SUBVECTOR[bits]}-dimensional sub-vectors, which do not tile "
                    f"head_dim={dim}; widths that fit: {fits or 'none'} (or an affine cold tier)"
                )

    # --- encode -----------------------------------------------------------------------------

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """``k, v: [B, H, n, T, D]``, ``valid: [B, 1, n, T]`` -> the fields (block axis 2)."""
        with torch.no_grad():
            D = k.shape[-1]
            self.check_dim(D)
            tv = token_valid(valid)  # [B,1,n,T,1]
            w = tv.float()
            v_mean = _f8(v.float().mean(-1, keepdim=True) * w)  # over the model's channels (not rotated)
            r = rotation(D, k.device)
            k, v = k.float() @ r, (v.float() - v_mean.float()) @ r
            count = w.sum(3, keepdim=True).clamp_min(1.0)
            k_mean = ((k * w).sum(3, keepdim=True) / count).clamp(-65504.0, 65504.0).to(torch.float16)
            k_idx, k_hi, k_rms = self._code(k - k_mean.float(), tv, self.key_bits)
            v_idx, v_hi, v_rms = self._code(v, tv, self.value_bits)
            check_params(self.name, (k_mean, k_rms, v_mean, v_rms), (k, v), "; an affine cold tier reaches further")
            return {
                "k_idx": k_idx,
                "k_hi": k_hi,
                "k_mean": k_mean,
                "k_rms": k_rms.squeeze(-1),
                "v_idx": v_idx,
                "v_hi": v_hi,
                "v_mean": v_mean.squeeze(-1),
                "v_rms": v_rms.squeeze(-1),
            }

    def _code(self, xc: torch.Tensor, tv: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Centred rows ``xc [..., T, D]`` -> packed low / high index parts and the fp8 RMS ``[..., T, 1]``
        (invalid tokens: RMS floor, codes of 0)."""
        d = SUBVECTOR[bits]
        rms = _f8(xc.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(RMS_MIN))
        rms = torch.where(tv, rms.float(), torch.full_like(rms, RMS_MIN, dtype=torch.float32)).to(FP8)
        z = torch.where(tv, xc / rms.float(), torch.zeros_like(xc))
        book = codebook(bits, xc.device)
        idx = nearest(z.reshape(-1, d), book).reshape(*xc.shape[:-1], xc.shape[-1] // d)
        lo_w, hi_w = index_widths(bits)
        lo = pack_bits((idx & 0xFF).to(torch.uint8), lo_w)
        hi = idx.new_zeros(*idx.shape[:-1], 0, dtype=torch.uint8)  # no bits above the low byte
        if hi_w:
            hi = pack_bits((idx >> 8).to(torch.uint8), hi_w)
        return lo, hi, rms

    # --- decode -----------------------------------------------------------------------------

    def width(self, side: str) -> int:
        """The code width of ``side``: ``"k"`` keys, ``"v"`` values."""
        return self.key_bits if side == "k" else self.value_bits

    def indices(self, f: dict[str, torch.Tensor], side: str, dim: int) -> torch.Tensor:
        """int64 centre indices ``[B, H, n, T, D / d]`` of one side (``"k"`` or ``"v"``)."""
        bits = self.width(side)
        P = dim // SUBVECTOR[bits]
        lo_w, hi_w = index_widths(bits)
        idx = unpack_bits(f[f"{side}_idx"], lo_w, P).long()
        if hi_w:
            idx |= unpack_bits(f[f"{side}_hi"], hi_w, P).long() << 8
        return idx

    def _unit(self, f: dict[str, torch.Tensor], side: str, dim: int) -> torch.Tensor:
        """The coded unit coordinates ``codebook[idx]``, fp32 ``[B, H, n, T, D]``."""
        idx = self.indices(f, side, dim)
        return codebook(self.width(side), idx.device)[idx].reshape(*idx.shape[:-1], dim)

    def stored_keys(self, f: dict[str, torch.Tensor], dim: int) -> torch.Tensor:
        """Keys as stored (rotated coordinates), fp32 ``[B, H, n, T, D]``."""
        return self._unit(f, "k", dim) * f["k_rms"].float().unsqueeze(-1) + f["k_mean"].float()

    def stored_values(self, f: dict[str, torch.Tensor], dim: int) -> torch.Tensor:
        """The values' coded part as stored (rotated coordinates, their mean not added back), fp32
        ``[B, H, n, T, D]``: ``values = stored_values @ rotation.T + v_mean``."""
        return self._unit(f, "v", dim) * f["v_rms"].float().unsqueeze(-1)

    def decode_keys(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        k = self.stored_keys(f, dim)
        return (k @ rotation(dim, k.device).T).to(dtype)

    def decode_values(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> torch.Tensor:
        v = self.stored_values(f, dim)
        return (v @ rotation(dim, v.device).T + f["v_mean"].float().unsqueeze(-1)).to(dtype)

    def decode(self, f: dict[str, torch.Tensor], dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_keys(f, dim, dtype), self.decode_values(f, dim, dtype)

    def key_range(self, f: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel ``(lo, hi)`` of each block's stored keys over its valid tokens, fp32
        ``[B, H, n, D]`` in rotated coordinates (read from the codes; empty blocks ``(0, 0)``)."""
        lo, hi = block_key_bounds(self.stored_keys(f, f["k_mean"].shape[-1]), f["valid"].unsqueeze(-1))
        return lo.squeeze(3), hi.squeeze(3)

    def nbytes(self, B: int, H: int, n: int, T: int, D: int) -> int:
        codes = code_bytes_per_token(self.key_bits, D) + code_bytes_per_token(self.value_bits, D)
        return B * H * n * (T * codes + FP16_BYTES * D + 3 * T)


def write_codebooks(path: Path | None = None) -> str:
    """Fit every codebook and write them (default: the package's file); returns the sha256
    (``python scripts/fit_vq_codebooks.py``; then pin it in :data:`CODEBOOK_SHA256`)."""
    data = b"".join(fit_codebook(b).numpy().astype("<f4").tobytes() for b in VQ_BITS)
    (path or _codebook_path()).write_bytes(data)
    return hashlib.sha256(data).hexdigest()
