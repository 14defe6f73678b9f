"""The codec interface and the affine rule every block codec with affine codes shares.

A codec turns exact blocks ``k, v: [B, H, n, T, D]`` (``n`` blocks of ``T`` tokens) into a dict
of tensors whose third axis is the block axis, and back. Keys are quantized per channel (their
statistics run over the ``T`` tokens of a block), values per token (over groups of ``G``
channels). Codes are packed along ``D``. ``nbytes`` gives the exact storage for a shape, so the
planner and the cache's own report count the same bytes.

The codec interface (what attention, kernels and the planner may rely on; see "Add a codec" in
CONTRIBUTING.md):

* ``name``, ``bits`` (code width, 1..8), ``key_bits`` / ``value_bits`` (the widths of the key and
  of the value codes; both ``bits`` except in :class:`~kvtier.codecs.mixed.MixedCodec`),
  ``rotate`` (codes of ``x @ rotation``), ``value_group``;
* ``encode(k, v, valid) -> fields``, ``decode_keys`` / ``decode_values`` / ``decode``, ``nbytes``;
  ``encode`` refuses a block whose parameters would leave their fp16 / fp8 format
  (:func:`check_params`: a :class:`~kvtier.errors.StorageRangeError`, never ``inf`` or clamped
  parameters);
* ``AFFINE``: how every stored value follows from its code, ``x = a * code + b``, with ``(a, b)``
  read from the two metadata fields after the codes in ``KERNEL_FIELDS`` by one rule of
  :data:`AFFINE_MODES` (the kernels' codec switch: fused C++ ``Meta``, Triton ``_affine``), or
  ``None`` for a codec whose codes are not affine (the kernels cannot read it; attention decodes
  it chunk by chunk);
* :meth:`AffineCodec.affine` (that rule in torch) and :meth:`AffineCodec.key_range` (per-channel
  bounds of the stored keys, Quest's block bounds), both derived from ``AFFINE``.

Owns :data:`AFFINE_MODES`, :func:`affine_ab`, :class:`AffineCodec`, :func:`check_params` and the
helpers the codec modules share (:func:`encode_inputs`, :func:`block_key_bounds`,
:func:`token_valid`). May import: torch, ``kvtier.errors``, ``kvtier.quant``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import StorageRangeError
from ..quant import rotation
from ..quant.groups import valid_minmax

#: Bytes of one fp16 parameter.
FP16_BYTES = 2


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


def encode_inputs(
    k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, rotate: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The common start of a codec's ``encode``: ``k, v: [B, H, n, T, D]`` in the rotated basis
    (fp32) when the codec rotates, as given otherwise, and the token mask of :func:`token_valid`."""
    if rotate:
        r = rotation(k.shape[-1], k.device)
        k, v = k.float() @ r, v.float() @ r
    return k, v, token_valid(valid)


def block_key_bounds(k: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(lo, hi)`` of ``k [B,H,n,T,D]`` over each block's valid tokens (``valid``
    broadcastable), ``[B,H,n,1,D]``; ``(0, 0)`` for a block without one."""
    lo, hi = valid_minmax(k, 3, valid)
    empty = lo > hi
    return lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)


def token_valid(valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1, n, T]`` -> broadcastable to ``[B, H, n, T, 1]``."""
    return valid.unsqueeze(-1)
