"""The packed vLLM page format: one block of one layer's KV in k-bit codes (layout, encode, decode).

A *page* is one layer's KV of one vLLM block of ``T`` tokens over ``H`` KV heads. vLLM's own CPU
page holds it exact, ``[H, T, 2 * D]`` in the model dtype (``4 * H * T * D`` bytes in bf16). A
packed page holds the same block in ``bits``-bit codes in KIVI's layout
(https://arxiv.org/abs/2402.02750): keys per channel over ``key_group`` tokens, values per token
over ``value_group`` channels, fp16 scale and zero (``kvtier.quant.quantize_kbit``), and the
block's first ``sink_tokens`` tokens exact and left out of the key statistics (for a sequence's
first block those are the attention sinks of StreamingLLM, https://arxiv.org/abs/2309.17453).

The byte layout of a page (all offsets even, so fp16 / bf16 fields are aligned views)::

    kscale, kzero : fp16 [H, T / key_group, D]
    vscale, vzero : fp16 [H, T, D / value_group]
    sink          : dtype [H, sink_tokens, 2, D]   (keys, values)
    kcodes        : uint8 [H, T, D * bits / 8]       (``kvtier.quant.pack_bits`` along D)
    vcodes        : uint8 [H, T, D * value_bits / 8]

vLLM sizes a page as ``H * T * cell`` bytes (its ``AttentionSpec.state_content_bytes``), so a
page is padded up to a whole, even ``cell``. The C++ kernels (``kernels/csrc/page_codes.h``,
``vllm_paged_attend.cpp`` / ``_encode.cpp`` / ``_decode.cpp``) and Triton
(:mod:`kvtier.kernels.triton_pages`) read a page through :meth:`PageFormat.layout` and the constants
of :mod:`kvtier.codecs.constants`; what a page holds is chosen by a policy with the fields of
:class:`PageCodes` (:class:`kvtier.vllm.pages.policy.PagePolicy`).

This module owns the layout and the codec. May import: torch, ``kvtier.quant``; never vLLM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from ..quant import pack_words, quantize_kbit, unpack_words


class PageCodes(Protocol):
    """What a page format reads from its policy (:class:`kvtier.vllm.pages.policy.PagePolicy` has it all)."""

    @property
    def packed(self) -> bool: ...  # False: vLLM's exact pages (no page format)
    @property
    def bits(self) -> int | None: ...  # key code width
    @property
    def vbits(self) -> int | None: ...  # value code width
    @property
    def block_size(self) -> int: ...  # tokens per page
    @property
    def sink_tokens(self) -> int: ...  # leading tokens kept exact
    @property
    def key_group(self) -> int | None: ...  # tokens per key group (None: the block)
    @property
    def value_group(self) -> int: ...  # channels per value group (capped at the head dim)


@dataclass(frozen=True)
class PageFormat:
    """Byte layout of one packed page for ``heads`` KV heads of ``head_dim`` in ``dtype``."""

    policy: PageCodes
    heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not self.policy.packed:
            raise ValueError("PageFormat needs a packed PagePolicy (bits is None: vLLM's exact pages)")
        D, p = self.head_dim, self.policy
        if D % self.value_group or (D * p.bits) % 8 or (D * p.vbits) % 8:
            raise ValueError(f"head_dim={self.head_dim} is not allowed with value_group={self.value_group}")
        if self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype={self.dtype} is not allowed: expected float16, bfloat16 or float32")

    @property
    def tokens(self) -> int:
        return self.policy.block_size

    @property
    def key_group(self) -> int:
        return self.policy.key_group or self.tokens

    @property
    def value_group(self) -> int:
        return min(self.policy.value_group, self.head_dim)

    def fields(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of each field of a page, in byte order."""
        H, T, D, s = self.heads, self.tokens, self.head_dim, self.policy.sink_tokens
        nk, nv = T // self.key_group, D // self.value_group
        cb, cv = D * self.policy.bits // 8, D * self.policy.vbits // 8
        out = [
            ("kscale", torch.float16, (H, nk, D)),
            ("kzero", torch.float16, (H, nk, D)),
            ("vscale", torch.float16, (H, T, nv)),
            ("vzero", torch.float16, (H, T, nv)),
        ]
        if s:
            out.append(("sink", self.dtype, (H, s, 2, D)))
        out += [("kcodes", torch.uint8, (H, T, cb)), ("vcodes", torch.uint8, (H, T, cv))]
        return out

    @property
    def used_bytes(self) -> int:
        return sum(dt.itemsize * _numel(shape) for _, dt, shape in self.fields())

    @property
    def cell_bytes(self) -> int:
        """Bytes per (head, token) cell: vLLM's ``state_content_bytes`` (even, for its bf16 view)."""
        cells = self.heads * self.tokens
        c = -(-self.used_bytes // cells)
        return c + (c % 2)

    @property
    def page_bytes(self) -> int:
        return self.heads * self.tokens * self.cell_bytes

    @property
    def exact_page_bytes(self) -> int:
        """Bytes of vLLM's exact page of the same block."""
        return 2 * self.heads * self.tokens * self.head_dim * self.dtype.itemsize

    def offsets(self) -> dict[str, int]:
        """Byte offset of each field in a page."""
        out, off = {}, 0
        for name, dt, shape in self.fields():
            out[name] = off
            off += dt.itemsize * _numel(shape)
        return out

    def layout(self) -> list[int]:
        """The ints the C++ kernel reads a page with (``kvtier.kernels.vllm_paged_cpu``)."""
        return list(_layout(self))

    def _layout(self) -> tuple[int, ...]:
        o = self.offsets()
        fixed = [self.heads, self.head_dim, self.tokens, self.key_group, self.value_group, self.policy.sink_tokens]
        fields = ("kscale", "kzero", "vscale", "vzero", "sink", "kcodes", "vcodes")
        return (*fixed, self.page_bytes, *(o.get(n, 0) for n in fields), self.policy.vbits)

    # --- views ------------------------------------------------------------------------------
    def views(self, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of the fields of ``pages: uint8 [N, page_bytes]`` (no copy): ``name -> [N, *shape]``."""
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != self.page_bytes:
            raise ValueError(f"pages {tuple(pages.shape)} {pages.dtype}: expected uint8 [N, {self.page_bytes}]")
        out, off, n = {}, 0, pages.shape[0]
        for name, dt, shape in self.fields():
            nbytes = dt.itemsize * _numel(shape)
            out[name] = pages[:, off : off + nbytes].view(dt).view(n, *shape)
            off += nbytes
        return out

    # --- codec ------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Pack full blocks ``k, v: [N, H, T, D]`` (any float dtype) into pages ``uint8 [N, page_bytes]``
        (written into ``out`` when given: rows of vLLM's pool)."""
        N, H, T, D = k.shape
        if (H, T, D) != (self.heads, self.tokens, self.head_dim) or v.shape != k.shape:
            raise ValueError(f"blocks {tuple(k.shape)}: expected [N, {self.heads}, {self.tokens}, {self.head_dim}]")
        bits, s, kg, vg = self.policy.bits, self.policy.sink_tokens, self.key_group, self.value_group
        if out is None:
            out = torch.zeros(N, self.page_bytes, dtype=torch.uint8, device=k.device)
        f = self.views(out)
        valid = None
        if s:
            valid = (torch.arange(T, device=k.device) >= s).view(1, 1, T // kg, kg, 1)
            f["sink"].copy_(torch.stack((k[:, :, :s], v[:, :, :s]), dim=3))
        kc, ks, kz = quantize_kbit(k.reshape(N, H, T // kg, kg, D), bits, dim=-2, valid=valid)
        f["kscale"].copy_(ks.view(N, H, T // kg, D))
        f["kzero"].copy_(kz.view(N, H, T // kg, D))
        vc, vs, vz = quantize_kbit(v.reshape(N, H, T, D // vg, vg), self.policy.vbits, dim=-1)
        f["vscale"].copy_(vs.view(N, H, T, D // vg))
        f["vzero"].copy_(vz.view(N, H, T, D // vg))
        f["kcodes"].copy_(pack_words(kc.view(N, H, T, D), bits))
        f["vcodes"].copy_(pack_words(vc.view(N, H, T, D), self.policy.vbits))
        return out

    @torch.no_grad()
    def decode(self, pages: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``k, v: [N, H, T, D]`` in ``dtype`` of ``pages: uint8 [N, page_bytes]``."""
        f = self.views(pages)
        N = pages.shape[0]
        H, T, D, bits = self.heads, self.tokens, self.head_dim, self.policy.bits
        kg, vg, s = self.key_group, self.value_group, self.policy.sink_tokens
        kc = unpack_words(f["kcodes"], bits, D).view(N, H, T // kg, kg, D).float()
        k = (kc - f["kzero"].float().unsqueeze(3)) * f["kscale"].float().unsqueeze(3)
        vc = unpack_words(f["vcodes"], self.policy.vbits, D).view(N, H, T, D // vg, vg).float()
        v = (vc - f["vzero"].float().unsqueeze(-1)) * f["vscale"].float().unsqueeze(-1)
        k, v = k.view(N, H, T, D).to(dtype), v.view(N, H, T, D).to(dtype)
        if s:
            sink = f["sink"].to(dtype)
            k[:, :, :s], v[:, :, :s] = sink[:, :, :, 0], sink[:, :, :, 1]
        return k, v


@functools.lru_cache(maxsize=64)
def _layout(fmt: PageFormat) -> tuple[int, ...]:
    return fmt._layout()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n
