"""The Triton backend: exact segments and packed tiers through :mod:`kvtier.kernels.dispatch`.

Runs on CUDA tensors, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, how
the tests run it). Packed tiers: all blocks or listed blocks (CSR inside the kernels); token
selection is not in the kernels (the plan attends densely instead); vq tiers densely. Triton is imported on first
call only (``dispatch`` imported inside the calls): the plan imports this module only when it picks the backend.
"""

from __future__ import annotations

import torch

from ...codecs import VqCodec
from ..partials import Partial
from .base import DENSE, Backend, Selection


class TritonBackend(Backend):
    name = "triton"
    devices = ("cuda",)
    affine_only = True
    selections = ("dense", "blocks")
    exact_segments = True
    one_width_only = True

    @staticmethod
    def available() -> bool:
        from ...kernels import dispatch

        return dispatch.available()

    def __repr__(self) -> str:
        return "TritonBackend()"

    def reads(self, codec) -> bool:
        """Affine codecs of one width and vector codes (dense: vq policies refuse sparse attention)."""
        return isinstance(codec, VqCodec) or super().reads(codec)

    def exact(self, rows, k, v, allowed) -> Partial:
        from ...kernels import dispatch

        return Partial(*dispatch.gpu_exact(rows, k, v, allowed))

    def tier(self, rows: torch.Tensor, fields: dict, codec, dim: int, sel: Selection = DENSE) -> Partial:
        if sel.kind == "tokens":
            raise ValueError("the Triton backend has no token selection")
        if isinstance(codec, VqCodec) and sel.kind != "dense":
            raise ValueError(f"the vq kernel attends densely; got a {sel.kind!r} selection")
        blocks, row_mask = (sel.blocks, sel.row_mask) if sel.kind == "blocks" else (None, None)
        from ...kernels import dispatch

        return Partial(*dispatch.gpu_partial(rows, fields, codec, dim, blocks, row_mask))
