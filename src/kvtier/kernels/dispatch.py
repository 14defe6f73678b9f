"""GPU dispatch: per-tier attention on CUDA tensors through the Triton kernels.

:mod:`kvtier.attention.backends.triton` calls :func:`gpu_partial` (packed tiers) and
:func:`gpu_exact` (sinks, hot tokens) when the attention plan picks Triton (CUDA tensors and
:func:`available`); everywhere else the torch backend (and the C++ CPU kernels) stays the path
and the reference. Triton is imported on first use only, so CPU-only use of kvtier never imports it.
The functions here also run on CPU tensors under Triton's interpreter, which is how they are tested.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..codecs import Codec, VqCodec
from ..codecs.vq import fp8_values, kernel_operands
from ..quant import rotation


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when Triton imports and the kernels module loads (checked once)."""
    try:
        from . import triton_decode  # noqa: F401
    except Exception as err:  # noqa: BLE001 - no or broken Triton means: use the torch path
        warnings.warn(f"kvtier Triton kernels unavailable, using the torch path: {err}", stacklevel=2)
        return False
    return True


def gpu_partial(
    rows: torch.Tensor,
    fields: dict[str, torch.Tensor],
    codec: Codec,
    dim: int,
    blocks: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one tier read from its stored fields (the Triton backend's
    contract).

    Parameters
    ----------
    rows : fp32 ``[B, H, R, D]``, pre-scaled.
    fields : the tier's tensors (``codec.KERNEL_FIELDS``, see :mod:`kvtier.codecs`),
        ``valid`` bool ``[B, 1, n, T]``.
    codec : the tier's codec; a rotated sign codec rotates the rows in and the output back.
    dim : head dim ``D``.
    blocks : int ``[B, H, k]`` block ids to read (``-1`` = none), or None for all.
    row_mask : bool ``[B, H, R, k]`` listed blocks each row may read, or None.
    num_splits : splits of the sequence (None: chosen from the device).

    Returns
    -------
    ``out [B, H, R, D]`` (normalized) and ``lse [B, H, R]``, fp32.
    """
    from . import triton_decode as td

    indptr = indices = csr_mask = None
    if blocks is not None:
        indptr, indices = td.padded_to_csr(blocks)
        csr_mask = None if row_mask is None else td.csr_row_mask(blocks, row_mask)
    return gpu_csr_partial(rows, fields, codec, dim, indptr, indices, csr_mask, num_splits=num_splits)


def gpu_csr_partial(
    rows: torch.Tensor,
    fields: dict[str, torch.Tensor],
    codec: Codec,
    dim: int,
    indptr: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gpu_partial` over the blocks of a CSR plan, which a caller computes once per step
    (:func:`kvtier.kernels.triton_decode.padded_to_csr`) and reuses across layers.

    Parameters
    ----------
    indptr : int ``[B * H + 1]``; indices : int ``[nnz]`` block ids (both None: every block).
    row_mask : bool ``[nnz, R]`` aligned with ``indices``, or None.
    """
    from . import triton_decode as td

    if isinstance(codec, VqCodec):
        if indptr is not None:
            raise ValueError("the vq kernel attends densely (vq policies refuse sparse attention)")
        return _vq_partial(td, rows, fields, codec, dim, num_splits)
    kc, ka, kb, vc, va, vb = (fields[name] for name in codec.KERNEL_FIELDS)
    r = rotation(dim, rows.device) if codec.rotate else None
    q = rows @ r if r is not None else rows
    valid = fields["valid"].squeeze(1)
    out, lse = td.packed_attention_csr(
        q,
        kc,
        ka,
        kb,
        vc,
        va,
        vb,
        valid,
        codec.bits,
        dim,
        indptr,
        indices,
        row_mask,
        affine=codec.AFFINE,
        num_splits=num_splits,
    )
    return (out @ r.T if r is not None else out), lse


def _vq_partial(td, rows, fields, codec: VqCodec, dim: int, num_splits: int | None):
    """A vq tier through :func:`kvtier.kernels.triton_decode.vq_attention`, the codec's operands
    (:func:`kvtier.codecs.vq.kernel_operands`) passed in; rows rotated in, the output back."""
    r = rotation(dim, rows.device)
    out, lse = td.vq_attention(
        rows.float() @ r,
        *kernel_operands(codec, fields),
        r.sum(0),  # the all-ones vector in rotated coordinates: the values' means ride in the sum
        fp8_values(rows.device),
        fields["valid"].squeeze(1),
        num_splits=num_splits,
    )
    return out @ r.T, lse


def gpu_exact(
    rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over exact tokens (:func:`kvtier.attention.partials.exact_partial`'s contract).

    Parameters
    ----------
    rows : fp32 ``[B, H, R, D]``, pre-scaled.
    k, v : ``[B, H, N, D]`` any float dtype and strides.
    allowed : bool broadcastable to ``[B, H, R, N]``, or None.
    """
    from . import triton_decode as td

    return td.exact_attention(rows, k, v, allowed, num_splits=num_splits)
