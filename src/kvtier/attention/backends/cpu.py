"""The C++ CPU backend: the per-tier kernels (:mod:`kvtier.kernels.cpu`; vector codes:
:mod:`kvtier.kernels.vq_cpu`) and the fused whole-layer decode call (:mod:`kvtier.kernels.fused_cpu`).

:meth:`CpuBackend.tier` reads one packed tier (all blocks, listed blocks, or token selection in
C++) and returns the kernel's work counts with the partial. :meth:`CpuBackend.layer` attends every
segment of a layer - exact sinks and hot read in place, every packed tier (affine or vector codes),
token selection and the merge - in one call. Exact segments alone are torch's (the plan pairs this backend with torch).
"""

from __future__ import annotations

import torch

from ...codecs import VqCodec
from ...kernels import cpu, fused_cpu, vq_cpu
from ...quant import rotation
from ..partials import Partial
from .base import DENSE, Backend, Selection


class CpuBackend(Backend):
    name = "cpu"
    devices = ("cpu",)
    affine_only = True
    selections = ("dense", "blocks", "tokens")
    layer_call = True
    one_width_only = True  # the per-tier kernel; the fused layer call reads every affine codec

    @staticmethod
    def available() -> bool:
        return cpu.available()

    @staticmethod
    def layer_available() -> bool:
        """Whether the fused whole-layer kernel compiled."""
        return fused_cpu.available()

    def __repr__(self) -> str:
        return "CpuBackend()"

    def reads(self, codec) -> bool:
        """Affine codecs of one width (the per-tier kernel) and vector codes (:mod:`kvtier.kernels.vq_cpu`)."""
        if isinstance(codec, VqCodec):
            return vq_cpu.available()
        return super().reads(codec)

    def tier(self, rows: torch.Tensor, fields: dict, codec, dim: int, sel: Selection = DENSE) -> Partial:
        if isinstance(codec, VqCodec):
            if sel.kind != "dense":  # policies refuse sparse attention over vq tiers (TierPolicy._check_vq)
                raise ValueError(f"the vq kernel attends densely; got a {sel.kind!r} selection")
            return Partial(*vq_cpu.vq_attention(rows, fields, codec, dim))
        ka, kb, va, vb, kc, vc = codec.affine(fields)
        r = rotation(dim, rows.device) if codec.rotate else None
        q = rows @ r if r is not None else rows
        blocks = row_mask = select = None
        if sel.kind == "blocks":
            blocks, row_mask = sel.blocks, sel.row_mask
        elif sel.kind == "tokens":
            select = (sel.method, sel.level, sel.forced_from, sel.start, sel.exact_lse)
        out, lse, counts = cpu.packed_attention(
            q, kc, ka, kb, vc, va, vb, fields["valid"].squeeze(1), codec.bits, dim, blocks, row_mask, select
        )
        return Partial(out @ r.T if r is not None else out, lse, counts)

    def layer(
        self,
        rows: torch.Tensor,
        exact: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        tiers: list[tuple[dict, object, int]],
        sel: Selection = DENSE,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every segment of a layer in one call.

        Parameters
        ----------
        exact : ``(k, v, allowed)`` per exact segment (``allowed`` bool ``[Bm, Rm, L]``).
        tiers : ``(fields, codec, start)`` per packed tier, ``start`` its first token slot; vq tiers
            (dense selection only) are read by the same call.
        sel : dense or token selection (``forced_from`` per row).

        Returns
        -------
        ``out [B,H,R,D]`` merged, ``lse [B,H,R]``, and ``counts`` int64 ``[B*H, 1 + tiers, 3]``
        (exact part first, then the affine tiers in order, then the vq tiers).
        """
        D = rows.shape[-1]
        args = []
        vq = [(f, c) for f, c, _ in tiers if isinstance(c, VqCodec)]
        for f, c, start in tiers:
            if isinstance(c, VqCodec):
                continue
            rot = rotation(D, rows.device) if c.rotate else None
            args.append(
                (
                    (*(f[n] for n in c.KERNEL_FIELDS), f["valid"].squeeze(1)),
                    (c.key_bits, c.value_bits),
                    start,
                    c.AFFINE,
                    rot,
                )
            )
        select = None if sel.kind == "dense" else (sel.method, sel.level, sel.forced_from)
        return fused_cpu.layer_attention(rows, exact, args, select, vq)
