"""Pure group quantizers: k-bit asymmetric integer codes and 1-bit centered signs.

Both reduce their statistics over one axis (``dim``) of the input: for keys that axis is
the token axis of a block (per-channel quantization, KIVI https://arxiv.org/abs/2402.02750),
for values it is a group of channels (per-token quantization). Statistics are computed in
fp32; entries where ``valid`` is False (padding, tokens kept elsewhere) are excluded from
them. Parameters are stored in fp16 and codes are rounded against the *stored* parameters,
so what is dequantized is exactly what the error bound below speaks of.

k-bit:  ``x ~= (q - zero) * scale`` with ``q`` in ``[0, 2**bits)``;
        ``|x - x_hat| <= 0.75 * scale`` for valid entries (0.5 from rounding, the rest
        from fp16 rounding of ``zero``, which the scale floor keeps below 512).
sign:   ``x ~= mean + scale * (2 * s - 1)`` with ``s`` in ``{0, 1}`` and
        ``scale = mean |x - mean|`` (the L2-optimal magnitude for a sign code).

Scales are floored (relative to the group's magnitude and absolutely), so constant and
all-zero groups give finite parameters and exact or near-exact reconstructions, never NaN.
All functions run under ``torch.no_grad`` semantics: they never build autograd graphs.
"""

from __future__ import annotations

import torch

#: Absolute floor of a scale (an fp16 subnormal that is exactly representable).
SCALE_EPS = 2.0**-20
#: ``|zero|`` stays below this, so its fp16 rounding error is at most 1/8 of a step.
ZERO_MAX = 512.0


def _valid_fill(x: torch.Tensor, valid: torch.Tensor | None, fill: float) -> torch.Tensor:
    return x if valid is None else torch.where(valid, x, torch.full_like(x, fill))


@torch.no_grad()
def quantize_kbit(
    x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric k-bit quantization with min/max statistics over ``dim``.

    Parameters
    ----------
    x : float tensor of any shape.
    bits : 1..8.
    dim : axis whose entries share one (scale, zero).
    valid : bool, broadcastable to ``x``; invalid entries do not enter the statistics.

    Returns
    -------
    codes : uint8, shape of ``x``.
    scale, zero : fp16, shape of ``x`` with ``dim`` reduced to size 1.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    xf = x.float()
    if valid is not None:
        valid = valid.expand_as(xf)
    mn = _valid_fill(xf, valid, float("inf")).amin(dim, keepdim=True)
    mx = _valid_fill(xf, valid, float("-inf")).amax(dim, keepdim=True)
    scale_h, zero_h = fit_scale_zero(mn, mx, bits)
    q = torch.round(xf / scale_h.float() + zero_h.float()).clamp_(0, (1 << bits) - 1)
    return q.to(torch.uint8), scale_h, zero_h


def fit_scale_zero(mn: torch.Tensor, mx: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 ``(scale, zero)`` of a ``bits``-bit grid over groups with minima ``mn`` and maxima ``mx``
    (fp32; ``inf`` / ``-inf`` for a group without valid entries): :func:`quantize_kbit`'s fit."""
    empty = mn > mx  # a group without valid entries
    mn = torch.where(empty, torch.zeros_like(mn), mn)
    mx = torch.where(empty, torch.zeros_like(mx), mx)
    qmax = (1 << bits) - 1
    amax = torch.maximum(mn.abs(), mx.abs())
    scale = torch.maximum((mx - mn) / qmax, amax / ZERO_MAX).clamp_min(SCALE_EPS)
    # Round the scale up into fp16 so the stored grid still spans [mn, mx].
    scale_h = (scale * (1 + 2.0**-10)).to(torch.float16)
    zero_h = (-mn / scale_h.float()).to(torch.float16)
    return scale_h, zero_h


def dequantize_kbit(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``(codes - zero) * scale`` in fp32, cast to ``dtype``."""
    return ((codes.float() - zero.float()) * scale.float()).to(dtype)


@torch.no_grad()
def quantize_sign(
    x: torch.Tensor, dim: int, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-bit sign quantization after centering, statistics over ``dim``.

    Returns
    -------
    signs : uint8 in ``{0, 1}`` (1 where ``x >= mean``), shape of ``x``.
    scale : fp16 ``mean |x - mean|`` over valid entries (dim reduced).
    mean : fp16 mean over valid entries (dim reduced).
    """
    xf = x.float()
    if valid is None:
        count = torch.full_like(xf.sum(dim, keepdim=True), xf.shape[dim])
        w = None
    else:
        w = valid.expand_as(xf).float()
        count = w.sum(dim, keepdim=True)
    denom = count.clamp_min(1.0)
    mean = (xf if w is None else xf * w).sum(dim, keepdim=True) / denom
    mean_h = mean.to(torch.float16)
    dev = xf - mean_h.float()
    mad = (dev.abs() if w is None else dev.abs() * w).sum(dim, keepdim=True) / denom
    scale_h = mad.clamp_min(SCALE_EPS).to(torch.float16)
    return (dev >= 0).to(torch.uint8), scale_h, mean_h


def dequantize_sign(
    signs: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``mean + scale * (2 * signs - 1)`` in fp32, cast to ``dtype``."""
    return (mean.float() + scale.float() * (signs.float() * 2 - 1)).to(dtype)
