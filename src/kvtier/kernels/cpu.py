"""CPU kernel: fused attention over one packed tier (k-bit or 1-bit), compiled on first use.

Decode is bound by the bytes it reads, and a chain of torch ops over 4-bit data (unpack, cast,
scale, matmul) reads and writes dense-sized temporaries several times, which is why unfused
quantized caches decode slower than fp16. This kernel reads each packed byte once: per KV head
(parallel over batch x heads) and per stored token it unpacks the codes in registers, scores all
query rows sharing the head, then accumulates the values the same way, with a safe two-pass
softmax. Only the blocks listed in ``blocks`` are read, so block-sparse selection skips real work.

Every stored value is ``x = a * code + b``: k-bit codes have ``a = scale, b = -scale * zero``,
sign codes ``a = 2 * scale, b = mean - scale``; keys carry ``a, b`` per block and channel, values
per token and channel group. The torch functions in :mod:`kvtier.attention.partials` are the
reference this kernel is tested against.

The C++ is ``csrc/packed_attention.cpp`` (with ``csrc/common.h``: the bit-plane term table and the
selection cuts it shares with :mod:`kvtier.kernels.fused_cpu`), built by :mod:`kvtier.kernels.build`
with ``torch.utils.cpp_extension`` (needs a C++ compiler and ninja); when that is not possible
:func:`available` is False and callers use the torch path. Imports only torch and ``.build``.
"""

from __future__ import annotations

import functools

import torch

from . import build


@functools.lru_cache(maxsize=1)
def _module():
    return build.load("kvtier_cpu_v12", "packed_attention.cpp", ["packed_attention"], ("-fno-math-errno",))


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the kernel compiled (once per machine; cached by torch)."""
    return build.check(_module, "kvtier CPU kernel", "the torch path")


def packed_attention(
    rows: torch.Tensor,
    k_codes: torch.Tensor,
    k_a: torch.Tensor,
    k_b: torch.Tensor,
    v_codes: torch.Tensor,
    v_a: torch.Tensor,
    v_b: torch.Tensor,
    valid: torch.Tensor,
    bits: int,
    dim: int,
    blocks: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    select: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``rows [B,H,R,D]`` (fp32, scaled) over a packed tier.

    Parameters
    ----------
    k_codes, v_codes : uint8 ``[B,H,n,T,P]``.
    k_a, k_b : fp32 ``[B,H,n,D]`` per-block, per-channel affine of the keys.
    v_a, v_b : fp32 ``[B,H,n,T,NG]`` per-token, per-group affine of the values.
    valid : bool ``[B,n,T]``.
    blocks : int64 ``[B,H,k]`` block ids to read (-1 = none), or None for all.
    row_mask : bool ``[B,H,R,k]`` blocks each row may read, or None.
    select : token selection on the exact scores, ``(method, level, forced_from, tier_start[,
        rest_lse])``: ``method`` ``"mass"`` or ``"quantile"`` (rules of
        :func:`kvtier.attention.sparse.select_tokens`), ``forced_from`` int64 ``[R]`` (tokens at
        index >= it are always kept), ``tier_start`` the index of the tier's first token slot,
        ``rest_lse`` fp32 ``[B,H,R]`` (optional) the log mass of the row's other attended tokens.
        Dropped tokens cost no value work; kept weights are renormalized while ``lse`` covers the
        full mass.

    Returns
    -------
    ``out [B,H,R,D]`` (normalized), ``lse [B,H,R]`` (fp32), and ``counts`` int64 ``[B*H, 3]``:
    pairs scored, pairs whose value was accumulated, tokens whose value bytes were read.
    """
    empty_l = torch.empty(0, dtype=torch.long)
    empty_b = torch.empty(0, dtype=torch.bool)
    rest = select[4] if select is not None and len(select) > 4 and select[4] is not None else None
    return tuple(
        _module().packed_attention(
            rows.contiguous(),
            k_codes.contiguous(),
            k_a.contiguous(),
            k_b.contiguous(),
            v_codes.contiguous(),
            v_a.contiguous(),
            v_b.contiguous(),
            valid.contiguous(),
            empty_l if blocks is None else blocks.contiguous(),
            empty_b if row_mask is None else row_mask.contiguous(),
            bits,
            dim,
            0 if select is None else {"mass": 1, "quantile": 2}[select[0]],
            1.0 if select is None else float(select[1]),
            empty_l if select is None else select[2].to(torch.long).contiguous(),
            0 if select is None else int(select[3]),
            torch.empty(0) if rest is None else rest.float().contiguous(),
        )
    )
