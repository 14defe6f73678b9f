"""The torch backend: plain torch ops on any device and every codec; the reference of the others.

Exact segments: one score GEMM and a safe softmax (:func:`~kvtier.attention.partials.exact_partial`).
Packed tiers: for few rows (decode) the bit-plane path reads the codes in place
(:func:`~kvtier.attention.partials.packed_partial`, codecs with affine codes; vector codes through
:func:`~kvtier.attention.partials.vq_partial`'s tables); for many rows
(prefill chunks) and for codecs the kernels cannot read, keys and values are decoded chunk by
chunk and multiplied in dense GEMMs, or fed to torch's flash op with lse
(:func:`~kvtier.attention.partials.chunked_partial`). Which of the two is the plan's choice
(``chunked``), given to the instance. Token selection runs :func:`~kvtier.attention.sparse.select_tokens`
on the exact scores and reports the work it did in the partial's ``counts``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..partials import (
    Partial,
    chunked_partial,
    exact_partial,
    flash_exact_partial,
    packed_partial,
    reads_in_place,
    vq_partial,
)
from ..sparse import gather_fields, select_tokens
from .base import DENSE, Backend, Selection


class TorchBackend(Backend):
    """Plain torch ops. ``chunked``: decode the tier in chunks of ``chunk_tokens`` tokens and use
    GEMMs (or ``flash``, torch's CPU flash op with lse, when given and nothing is selected); with
    ``flash``, exact segments of a chunked call go through it too, their masks made for at most
    ``mask_budget`` rows x tokens at a time; ``flash_dtype``: what the flash op reads (the
    model's bf16 / fp16 where it is one, else fp32)."""

    name = "torch"
    devices = ("cpu", "cuda")
    affine_only = False
    selections = ("dense", "blocks", "tokens")
    exact_segments = True

    def __init__(
        self,
        chunked: bool = False,
        chunk_tokens: int = 1024,
        flash: Any = None,
        mask_budget: int = 1 << 23,
        flash_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.chunked = chunked
        self.chunk_tokens = chunk_tokens
        self.flash = flash
        self.mask_budget = mask_budget
        self.flash_dtype = flash_dtype

    def __repr__(self) -> str:
        return f"TorchBackend(chunked={self.chunked}, flash={self.flash is not None}, flash_dtype={self.flash_dtype})"

    def exact(self, rows, k, v, allowed) -> Partial:
        if self.chunked and self.flash is not None:
            return flash_exact_partial(rows, k, v, allowed, self.flash, self.mask_budget, self.flash_dtype)
        return exact_partial(rows, k, v, allowed)

    def tier(self, rows: torch.Tensor, fields: dict, codec, dim: int, sel: Selection = DENSE) -> Partial:
        block_mask = select = None
        kept: dict[str, torch.Tensor] = {}
        if sel.kind == "blocks":
            fields, block_mask = gather_fields(fields, sel.blocks), sel.row_mask
        elif sel.kind == "tokens":
            n, T = fields["valid"].shape[2:4]
            pos = sel.start + torch.arange(n * T, device=rows.device)
            forced = pos[None, None, None, :] >= sel.forced_from[None, None, :, None]

            def select(flat):
                keep = select_tokens(flat, sel, forced, sel.exact_lse)
                kept["keep"], kept["valid"] = keep, torch.isfinite(flat)
                return keep

        if self.chunked or not reads_in_place(codec):
            part = chunked_partial(
                rows,
                fields,
                codec,
                dim,
                block_mask,
                select,
                chunk_tokens=self.chunk_tokens,
                flash=self.flash,
                flash_dtype=self.flash_dtype,
            )
        elif codec.AFFINE is None:  # vector codes
            part = vq_partial(rows, fields, codec, dim, block_mask, select)
        else:
            part = packed_partial(rows, fields, codec, dim, block_mask, select)
        if kept:  # [B*H, 3]: pairs scored, pairs valued, tokens whose values some row read
            B, H = rows.shape[:2]
            keep, valid = kept["keep"], kept["valid"]
            counts = torch.stack([valid.sum((2, 3)), keep.sum((2, 3)), keep.any(2).sum(-1)], -1)
            part.counts = counts.reshape(B * H, 3)
        return part
