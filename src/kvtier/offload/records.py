"""Record layout: how one offloaded block of one (row, KV head) becomes bytes, and back.

A record holds a block's ``T`` keys then its ``T`` values, token-major within the record, either
exact in the storage dtype (``bits=None``: ``k [T, D]``, ``v [T, D]``) or k-bit encoded with
:class:`~kvtier.codecs.KBitCodec` (``bits`` 8 or 4: codes, then the fp16 scales and
zeros). Each field is a fixed-size byte range, so a batch of records is one uint8 matrix
``[n, record_bytes]`` that the store moves without knowing what it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codecs import KBitCodec
from ..quant import packed_size


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of a record.

    Attributes
    ----------
    block_tokens, head_dim : ``T`` and ``D``.
    dtype : storage dtype of exact records (and the dtype decoded records come back in).
    bits : ``None`` (exact), 8 or 4.
    value_group : channels per value scale group of k-bit records (divides ``D``).
    """

    block_tokens: int
    head_dim: int
    dtype: torch.dtype
    bits: int | None = None
    value_group: int = 64

    @property
    def codec(self) -> KBitCodec | None:
        return None if self.bits is None else KBitCodec(self.bits, self.value_group)

    def fields(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``(name, shape, dtype)`` of each field, in record order."""
        T, D = self.block_tokens, self.head_dim
        if self.bits is None:
            return [("k", (T, D), self.dtype), ("v", (T, D), self.dtype)]
        P, NG, h = packed_size(D, self.bits), D // self.value_group, torch.float16
        return [
            ("k_codes", (T, P), torch.uint8),
            ("k_scale", (1, D), h),
            ("k_zero", (1, D), h),
            ("v_codes", (T, P), torch.uint8),
            ("v_scale", (T, NG), h),
            ("v_zero", (T, NG), h),
        ]

    @property
    def record_bytes(self) -> int:
        return sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for _, shape, dt in self.fields())

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Blocks ``k, v: [B, H, n, T, D]`` (``valid: bool [B, 1, n, T]``, for k-bit statistics)
        -> uint8 ``[B * H * n, record_bytes]`` in ``(b, h, block)`` order."""
        B, H, n = k.shape[:3]
        if self.bits is None:
            parts = {"k": k.to(self.dtype), "v": v.to(self.dtype)}
        else:
            parts = self.codec.encode(k, v, valid)
        cols = [parts[name].reshape(B * H * n, -1).contiguous().view(torch.uint8) for name, _, _ in self.fields()]
        return torch.cat(cols, dim=1)

    def decode(self, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 ``[m, record_bytes]`` (contiguous) -> ``k, v: [m, T, D]`` in ``dtype`` (exact
        records: views of ``data``)."""
        m = data.shape[0]
        if self.bits is None:  # views, no copy: k then v, each [T, D] per record
            kv = data.view(self.dtype).view(m, 2, self.block_tokens, self.head_dim)
            return kv[:, 0], kv[:, 1]
        out, start = {}, 0
        for name, shape, dt in self.fields():
            size = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            out[name] = data[:, start : start + size].contiguous().view(dt).reshape(m, *shape)
            start += size
        fields = {name: t.reshape(m, 1, 1, *t.shape[1:]) for name, t in out.items()}
        k, v = self.codec.decode(fields, self.head_dim, self.dtype)
        return k.reshape(m, self.block_tokens, self.head_dim), v.reshape(m, self.block_tokens, self.head_dim)
