"""Fixed random orthogonal rotations applied along ``head_dim`` before 1-bit quantization.

A randomized Hadamard transform ``R = H diag(s) / sqrt(d)`` (QuaRot https://arxiv.org/abs/2404.00456)
spreads outlier channels over all channels, which can make a sign code lose less. Because ``R``
is orthogonal, ``q . k = (q R) . (k R)``: attention can score rotated keys with a rotated query,
and values can be un-rotated after the weighted sum. For a ``head_dim`` that is not a power of
two a seeded random orthogonal matrix (QR of a Gaussian) is used instead.
"""

from __future__ import annotations

import functools

import torch


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=16)
def _rotation_cpu(d: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if d & (d - 1) == 0:
        signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
        return _hadamard(d) * signs[None, :] / d**0.5
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).float()


def rotation(d: int, device: torch.device | str = "cpu", seed: int = 0) -> torch.Tensor:
    """Orthogonal fp32 matrix ``[d, d]``; rotate with ``x @ R``, undo with ``y @ R.T``."""
    return _rotation_cpu(d, seed).to(device)
