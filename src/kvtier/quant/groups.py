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
a, b:   ``x ~= a * q + b`` with ``q`` in ``[0, 2**bits)`` and ``(a, b)`` stored directly in fp16 or fp8
        e4m3 (:func:`quantize_ab`): ``b`` is the group's minimum rounded down into the storage
        format and ``a`` the step rounded up, so the stored grid spans the group and
        ``|x - x_hat| <= a / 2``.
sign:   ``x ~= mean + scale * (2 * s - 1)`` with ``s`` in ``{0, 1}`` and
        ``scale = mean |x - mean|`` (the L2-optimal magnitude for a sign code).

Scales are floored (relative to the group's magnitude and absolutely), so constant and
all-zero groups give finite parameters and exact or near-exact reconstructions, never NaN.
All functions run under ``torch.no_grad`` semantics: they never build autograd graphs.
"""

from __future__ import annotations

import functools

import torch

#: Absolute floor of a scale (an fp16 subnormal that is exactly representable).
SCALE_EPS = 2.0**-20
#: ``|zero|`` stays below this, so its fp16 rounding error is at most 1/8 of a step.
ZERO_MAX = 512.0
#: A scale is rounded up by this relative amount (one fp16 step at 1) before its fp16 cast, so the
#: stored grid still spans the group.
SCALE_ROUND = 2.0**-10


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
    xf, valid, mn, mx = _valid_range(x, bits, dim, valid)
    scale_h, zero_h = fit_scale_zero(mn, mx, bits)
    q = torch.round(xf / scale_h.float() + zero_h.float()).clamp_(0, (1 << bits) - 1)
    return q.to(torch.uint8), scale_h, zero_h


def _valid_range(
    x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(x as fp32, valid expanded to x, min, max over dim of the valid entries)`` after checking
    ``bits`` in 1..8."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    xf = x.float()
    if valid is not None:
        valid = valid.expand_as(xf)
    mn, mx = valid_minmax(xf, dim, valid)
    return xf, valid, mn, mx


def valid_minmax(x: torch.Tensor, dim: int, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` over ``dim`` (kept, size 1) of the entries where ``valid`` (broadcastable to
    ``x``) is True; ``(inf, -inf)`` where there are none."""
    return _valid_fill(x, valid, float("inf")).amin(dim, keepdim=True), _valid_fill(x, valid, float("-inf")).amax(
        dim, keepdim=True
    )


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
    scale_h = (scale * (1 + SCALE_ROUND)).to(torch.float16)
    zero_h = (-mn / scale_h.float()).to(torch.float16)
    return scale_h, zero_h


@functools.lru_cache(maxsize=8)
def _grid(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an 8- or 16-bit float ``dtype``, sorted ascending (fp32, CPU)."""
    width = torch.finfo(dtype).bits
    raw = torch.arange(1 << width, dtype=torch.int32)
    raw = raw.to(torch.uint8) if width == 8 else raw.to(torch.int16)
    vals = raw.view(dtype).float()
    return torch.unique(vals[torch.isfinite(vals)])


def round_to(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` (fp32) rounded up (``up``) or down into ``dtype``'s values, clamped to its finite range;
    returned in ``dtype``."""
    grid = _grid(dtype).to(x.device)
    xc = x.clamp(float(grid[0]), float(grid[-1])).contiguous()
    idx = torch.searchsorted(grid, xc, right=not up)
    idx = idx if up else idx - 1
    return grid[idx.clamp_(0, grid.numel() - 1)].to(dtype)


#: Smallest step ``a`` of :func:`quantize_ab` (the smallest fp8 e4m3 subnormal: 2**-9).
AB_STEP_MIN = 2.0**-9
#: Fractions of a group's range :func:`quantize_ab` tries as its grid (``clip=True``), keeping the
#: one with the least squared error per group: min/max wastes levels on the tails of
#: bell-shaped (e.g. rotated) data, which costs most at 2 bits.
AB_CLIPS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


@torch.no_grad()
def quantize_ab(
    x: torch.Tensor,
    bits: int,
    dim: int,
    valid: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float16,
    clip: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k-bit codes with ``x ~= a * q + b``, ``(a, b)`` stored directly in ``dtype`` (fp16 or fp8 e4m3).

    With ``clip`` each group's grid is the best (least squared error over its valid entries) of
    :data:`AB_CLIPS` fractions of its range, centered on the range's midpoint; entries beyond a
    clipped grid take its end codes (the ``a / 2`` bound then holds for the entries inside it).

    ``b`` is the minimum of the valid entries over ``dim`` rounded *down* into ``dtype``, ``a`` the
    step ``(max - b) / (2**bits - 1)`` rounded *up* (at least :data:`AB_STEP_MIN`), so the stored
    grid spans every valid entry and codes are rounded against the stored parameters:
    ``|x - x_hat| <= a / 2`` wherever ``dtype``'s range holds the group (e4m3: magnitudes up to 448).
    One bit is the exception: min and max are a poor 1-bit grid, so ``b = mean - s`` and ``a = 2 s``
    with ``s = mean |x - mean|`` (the L2-optimal sign code, as :func:`quantize_sign`), both rounded
    to nearest, and the code is 1 where ``x`` is at or above the stored grid's midpoint.

    Returns
    -------
    codes : uint8, shape of ``x``.
    a, b : ``dtype``, shape of ``x`` with ``dim`` reduced to size 1.
    """
    xf, valid, mn, mx = _valid_range(x, bits, dim, valid)
    empty = mn > mx
    mn = torch.where(empty, torch.zeros_like(mn), mn)
    mx = torch.where(empty, torch.zeros_like(mx), mx)
    if bits == 1:
        w = torch.ones_like(xf) if valid is None else valid.float()
        count = w.sum(dim, keepdim=True).clamp_min(1.0)
        mean = (xf * w).sum(dim, keepdim=True) / count
        mad = ((xf - mean).abs() * w).sum(dim, keepdim=True) / count
        a = (2 * mad).clamp_min(AB_STEP_MIN).to(dtype)
        b = (mean - a.float() / 2).to(dtype)
        q = (xf >= b.float() + a.float() / 2).to(torch.uint8)
        return q, a, b
    qmax = (1 << bits) - 1
    best = None
    for frac in AB_CLIPS if clip else (1.0,):
        half = (mx - mn) * (frac / 2)
        lo = (mn + mx) / 2 - half
        b = round_to(lo, dtype, up=False)
        a = round_to(((lo + 2 * half - b.float()) / qmax).clamp_min(AB_STEP_MIN), dtype, up=True)
        q = torch.round((xf - b.float()) / a.float()).clamp_(0, qmax)
        if not clip:
            return q.to(torch.uint8), a, b
        err = (q * a.float() + b.float() - xf) ** 2
        err = _valid_fill(err, valid, 0.0).sum(dim, keepdim=True)
        if best is None:
            best = [q, a, b, err]
        else:
            better = err < best[3]
            best = [torch.where(better, new, old) for new, old in zip((q, a, b, err), best)]
    assert best is not None
    return best[0].to(torch.uint8), best[1], best[2]


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
