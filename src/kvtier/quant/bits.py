"""Bit packing of small unsigned integer codes into uint8 bytes.

A ``bits``-wide code is split into *planes* whose widths divide 8 (3 = 2 + 1, 6 = 4 + 2,
5 = 4 + 1, 7 = 4 + 2 + 1), and each plane is packed densely along the last axis. Every
width from 1 to 8 therefore costs exactly ``bits / 8`` bytes per code (plus padding of the
last axis to a multiple of 8), and unpacking is a handful of shifts and masks per plane.
"""

from __future__ import annotations

import torch

_PLANES = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 7: (4, 2, 1), 8: (8,)}


def planes(bits: int) -> tuple[int, ...]:
    """Plane widths (each dividing 8) that add up to ``bits``."""
    if bits not in _PLANES:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    return _PLANES[bits]


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``pack_bits`` produces for ``n`` codes of width ``bits``."""
    if bits == 8:
        return n
    n_pad = -(-n // 8) * 8
    return n_pad * bits // 8


def _shifts(width: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, width, dtype=torch.uint8, device=device)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes along the last axis.

    Parameters
    ----------
    codes : uint8 ``[..., n]`` with values in ``[0, 2**bits)``.
    bits : code width, 1..8.

    Returns
    -------
    uint8 ``[..., packed_size(n, bits)]``.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    widths = planes(bits)
    if widths == (8,):
        return codes.clone()
    n = codes.shape[-1]
    n_pad = -(-n // 8) * 8
    if n_pad != n:
        codes = torch.nn.functional.pad(codes, (0, n_pad - n))
    out, offset = [], 0
    for w in widths:
        per = 8 // w
        plane = (codes >> offset) & ((1 << w) - 1)
        plane = plane.reshape(*codes.shape[:-1], n_pad // per, per)
        # Fields are disjoint, so a sum of shifted fields is their bitwise OR.
        out.append((plane << _shifts(w, codes.device)).sum(-1, dtype=torch.uint8))
        offset += w
    return torch.cat(out, dim=-1) if len(out) > 1 else out[0]


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., packed_size(n, bits)]`` -> uint8 ``[..., n]``."""
    widths = planes(bits)
    if widths == (8,):
        return packed
    n_pad = -(-n // 8) * 8
    if packed.shape[-1] != packed_size(n, bits):
        raise ValueError(f"packed last axis {packed.shape[-1]} does not hold {n} codes of {bits} bits")
    codes, start, offset = None, 0, 0
    for w in widths:
        per = 8 // w
        size = n_pad // per
        chunk = packed[..., start : start + size]
        plane = (chunk.unsqueeze(-1) >> _shifts(w, packed.device)) & ((1 << w) - 1)
        plane = plane.reshape(*packed.shape[:-1], n_pad)
        codes = plane if codes is None else codes | (plane << offset)
        start += size
        offset += w
    return codes[..., :n]
