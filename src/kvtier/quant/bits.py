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


# --- the same bytes on int64 words: a few in-place passes (the vLLM store's and pages' CPU path) ---
def _byte_mask(pattern: int, period: int) -> int:
    """An int64 mask: ``pattern`` repeated every ``period`` bits (stays below 2**63 here)."""
    return sum(pattern << i for i in range(0, 64, period))


def _stages(w: int) -> list[tuple[int, int, int]]:
    """``(shift, mask after packing the stage, mask after unpacking it)`` of the three halvings that
    gather the ``w``-bit fields of 8 bytes of an int64 word into its low ``w`` bytes."""
    out = []
    for s in range(3):
        lane, width = 8 << s, w << s
        out.append((lane - width, _byte_mask((1 << 2 * width) - 1, 2 * lane), _byte_mask((1 << width) - 1, lane)))
    return out


#: the integer dtype of ``w`` bytes
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _empty(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def pack_words(codes: torch.Tensor, bits: int, buffer=_empty, out: torch.Tensor | None = None) -> torch.Tensor:  # noqa: ANN001
    """:func:`pack_bits` (planes of 4/2/1 bits, each packed densely along the last axis, low
    bits first) on int64 words: each word holds 8 codes, and three shift-or-mask halvings gather
    their ``w``-bit fields into its low ``w`` bytes (little-endian, so byte order is code order).
    The same bytes (``tests/vllm/test_vllm_store.py``), in a few in-place passes over the codes.
    ``buffer(name, shape, dtype)`` gives the two int64 scratch tensors; the result is ``out``
    (uint8 ``[..., packed_size(n, bits)]``, written in place) or new. Off the CPU (scratch and
    result are CPU tensors here) it is :func:`pack_bits` itself."""
    if bits == 8 or codes.shape[-1] % 8 or codes.device.type != "cpu":
        packed = pack_bits(codes, bits)
        return packed if out is None else out.copy_(packed)
    lead, n = codes.shape[:-1], codes.shape[-1]
    words = codes.contiguous().view(torch.int64)  # [..., n // 8]; codes < 2**7: non-negative
    x, t = buffer("pack_x", words.shape, torch.int64), buffer("pack_t", words.shape, torch.int64)
    if out is None:
        out = torch.empty(*lead, n * bits // 8, dtype=torch.uint8)
    elif out.shape != (*lead, n * bits // 8) or out.dtype != torch.uint8:
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)}: expected uint8 {(*lead, n * bits // 8)}")
    start, offset = 0, 0
    for w in planes(bits):
        torch.bitwise_and(words, _byte_mask((1 << w) - 1, 8) << offset, out=x)
        if offset:
            torch.bitwise_right_shift(x, offset, out=t)
            x, t = t, x
        for shift, mask, _ in _stages(w):
            torch.bitwise_right_shift(x, shift, out=t)
            x.bitwise_or_(t).bitwise_and_(mask)
        dst = out[..., start : start + n * w // 8]
        try:  # the plane's low w bytes as one integer each: a cast
            dst.view(_WORD[w]).copy_(x)
        except RuntimeError:  # a slice not aligned to w bytes
            dst.view(*lead, n // 8, w).copy_(x.view(torch.uint8).view(*x.shape, 8)[..., :w])
        start += n * w // 8
        offset += w
    return out


def unpack_words(packed: torch.Tensor, bits: int, n: int, buffer=_empty) -> torch.Tensor:  # noqa: ANN001
    """Inverse of :func:`pack_words` (:func:`unpack_bits`, same values): the halvings reversed.
    The result may be a ``buffer`` (scratch) tensor; off the CPU it is :func:`unpack_bits`'s."""
    if bits == 8 or n % 8 or packed.device.type != "cpu":
        return unpack_bits(packed, bits, n)
    lead = packed.shape[:-1]
    words = buffer("unpack_w", (*lead, n // 8), torch.int64)
    x, t = buffer("pack_x", words.shape, torch.int64), buffer("pack_t", words.shape, torch.int64)
    start, offset = 0, 0
    for w in planes(bits):
        src = packed[..., start : start + n * w // 8]
        try:
            x.copy_(src.view(_WORD[w]))  # sign-extended: masked to the low w bytes
            if w > 1:
                x.bitwise_and_((1 << 8 * w) - 1)
        except RuntimeError:  # a slice not aligned to w bytes
            x.zero_()
            x.view(torch.uint8).view(*lead, n // 8, 8)[..., :w] = src.view(*lead, n // 8, w)
        for shift, _, mask in reversed(_stages(w)):
            torch.bitwise_left_shift(x, shift, out=t)
            x.bitwise_or_(t).bitwise_and_(mask)
        if offset == 0:
            words.copy_(x)
        else:
            words.bitwise_or_(torch.bitwise_left_shift(x, offset, out=t))
        start += n * w // 8
        offset += w
    return words.view(torch.uint8).view(*lead, n)
