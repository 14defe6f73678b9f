"""The backend interface and the one selection type every backend reads.

A backend is a class of static facts (what it supports) with two calls: :meth:`Backend.exact`
over an exact segment (sinks or hot tokens) and :meth:`Backend.tier` over a packed tier, each
returning a :class:`~kvtier.attention.partials.Partial`. Options the plan chooses (chunked decoding
for many rows, the flash op) are given to the instance; facts are class attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..partials import Partial

SELECTION_KINDS = ("dense", "blocks", "tokens")


@dataclass(frozen=True)
class Selection:
    """What a partial reads of a tier: everything, listed blocks, or tokens chosen on exact scores.

    Attributes
    ----------
    kind : ``"dense"``, ``"blocks"`` or ``"tokens"``.
    method, level : the token rule (``"mass"`` or ``"quantile"``, see
        :func:`kvtier.attention.sparse.select_tokens`); ``kind="tokens"`` only.
    forced_from : int ``[R]``: per row, the token slot from which every token is kept (local window).
    start : index of the tier's first token slot (so slots compare with ``forced_from``).
    exact_lse : fp32 ``[B, H, R]`` log mass of the row's exact tokens (sinks, hot), or None.
    blocks : int ``[B, H, k]`` block ids to read (``-1``: none), ``kind="blocks"`` only.
    row_mask : bool ``[B, H, R, k]`` listed blocks each row may read, ``kind="blocks"`` only.
    """

    kind: str = "dense"
    method: str | None = None
    level: float = 1.0
    forced_from: torch.Tensor | None = None
    start: int = 0
    exact_lse: torch.Tensor | None = None
    blocks: torch.Tensor | None = None
    row_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in SELECTION_KINDS:
            raise ValueError(f"Selection kind={self.kind!r} is not allowed: expected one of {SELECTION_KINDS}")


DENSE = Selection()


class Backend:
    """Static facts and partials of one attention backend.

    Class attributes
    ----------------
    name : what ``force=`` and the logs call it.
    devices : device types it runs on (``"cpu"``, ``"cuda"``).
    affine_only : it reads codes in place, so only codecs with an ``AFFINE`` rule.
    selections : the :class:`Selection` kinds :meth:`tier` supports.
    exact_segments : :meth:`exact` is its own (else the plan gives sinks and hot to torch).
    layer_call : it has a fused whole-layer call (:meth:`layer`).
    one_width_only : its per-tier kernel reads one code width for keys and values and fp16 / fp32
        parameters (a :class:`~kvtier.codecs.MixedCodec` with two widths or fp8 parameters
        goes to the plan's chunk-wise torch backend instead: :meth:`reads`).
    """

    name: ClassVar[str] = ""
    devices: ClassVar[tuple[str, ...]] = ()
    affine_only: ClassVar[bool] = True
    selections: ClassVar[tuple[str, ...]] = ("dense",)
    exact_segments: ClassVar[bool] = False
    layer_call: ClassVar[bool] = False
    one_width_only: ClassVar[bool] = False

    def reads(self, codec) -> bool:
        """Whether :meth:`tier` reads this codec's tensors in place."""
        if self.affine_only and codec.AFFINE is None:
            return False
        if self.one_width_only:
            return codec.key_bits == codec.value_bits and getattr(codec, "meta", "fp16") == "fp16"
        return True

    @staticmethod
    def available() -> bool:
        """Whether it can run here (its kernels built or imported); checked once by the plan."""
        return True

    def exact(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> Partial:
        """Attention of ``rows [B,H,R,D]`` (fp32, scaled) over exact ``k, v [B,H,N,D]``;
        ``allowed`` bool broadcastable to ``[B,H,R,N]`` or None."""
        raise NotImplementedError

    def tier(self, rows: torch.Tensor, fields: dict, codec, dim: int, sel: Selection = DENSE) -> Partial:
        """Attention of ``rows [B,H,R,D]`` over a packed tier (``fields`` as ``codec`` stores them).
        With ``sel.kind == "tokens"`` the partial carries ``counts`` int64 ``[B*H, 3]``: pairs
        scored, pairs valued, tokens whose value bytes were read."""
        raise NotImplementedError
