"""CPU kernel: per-block log-sum-exp of 1-bit key-sketch scores (offload block selection), compiled on first use.

Decode scores every sketched token of an offloaded layer for a few query rows. Through torch
that is an unpack of the sign bits to floats and a batched matmul per chunk of blocks; this
kernel reads each packed byte once: per (batch, KV head) and block it forms the rows' weights
``w = q * scale`` (see :mod:`kvtier.offload.sketch` for the sketch), then per token expands each
byte to eight 0/1 floats through a 256-entry table, scores ``q . mean + alpha_t (2 w . bits -
w . 1)`` and folds it into an online log-sum-exp, writing one value per (row, block). The torch reference is
:func:`kvtier.offload.sketch.block_lse_torch`; :func:`available` is False when no C++ compiler
is present and callers use it instead.

The C++ is ``csrc/sketch_block_lse.cpp``, built by :mod:`kvtier.kernels.build`. Imports only torch
and ``.build``.
"""

from __future__ import annotations

import functools

import torch

from . import build


@functools.lru_cache(maxsize=1)
def _module():
    return build.load("kvtier_sketch_cpu_v4", "sketch_block_lse.cpp", ["sketch_block_lse"], ())


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the kernel compiled (once per machine; cached by torch)."""
    return build.check(_module, "kvtier sketch kernel", "the torch path")


def sketch_block_lse(
    q: torch.Tensor,
    signs: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    alpha: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """Per-block log-sum-exp over valid tokens of ``q . (mean + alpha_t * scale * (2 bits - 1))``.

    Parameters
    ----------
    q : fp32 ``[B, H, R, D]`` query rows (scaled, rotated like the sketch).
    signs : uint8 ``[B, H, n, T, P]`` packed sign bits (bit ``i`` of byte ``j``: channel ``8 j + i``).
    scale, mean : fp32 ``[B, H, n, D]`` per-block, per-channel scale and mean of the sketch.
    alpha : fp32 ``[B, H, n, T]`` per-token factor.
    valid : bool ``[B, n, T]``.

    Returns
    -------
    fp32 ``[B, H, R, n]`` (``-inf`` for blocks without a valid token).
    """
    args = (q, signs, scale, mean, alpha, valid)
    return _module().sketch_block_lse(*(t.contiguous() for t in args))
