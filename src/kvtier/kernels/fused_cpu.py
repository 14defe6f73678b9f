"""CPU kernel: one call attends a decode step over a whole tiered layer, compiled on first use.

The per-tier path (:func:`kvtier.kernels.cpu.packed_attention` per packed tier, torch ops for the
exact sinks and hot tokens, a log-sum-exp merge in torch) costs ~0.5 ms of Python and small-tensor
dispatch per layer, which at 30 layers is as much as the attention itself at 8k tokens. This
kernel takes every segment of a layer at once - exact segments (sinks, hot; fp16, bf16 or fp32)
and packed tiers (k-bit or 1-bit codes, optionally Hadamard-rotated) - and returns the merged
output: per (batch, KV head), in parallel,

1. exact scores and their softmax, accumulated straight into the output;
2. per packed tier and block: the rows' weights ``q * a`` in the codes' bit-plane order, the
   block's code bytes transposed to channel-major (so every later loop runs over tokens, in SIMD
   lanes), scores as ``q . b + sum_j (q * a)_j code_j``;
3. the tier's softmax (a vectorized exp) and, with selection, the mass or quantile rule of
   :func:`kvtier.attention.sparse.select_tokens` (the same rule as ``packed_attention``);
4. values only for tokens some row keeps, unpacked once per token, accumulated per row;
5. per tier of vector codes (:class:`~kvtier.codecs.VqCodec`, dense only): the product-quantization
   routine of :mod:`kvtier.kernels.vq_cpu` (``csrc/vq_tier.h``, one source for both calls), rows
   rotated in, the output rotated back;
6. the log-sum-exp merge of the exact part and every tier.

Every stored value is ``x = a * code + b`` (see :mod:`kvtier.kernels.cpu`). The reference is the
per-tier path it replaces (torch partials + :func:`kvtier.attention.partials.merge`), which the
tests compare it with. When the build fails :func:`available` is False and callers use that path.

The C++ is ``csrc/layer_attention.cpp`` (with ``csrc/common.h``, shared with :mod:`kvtier.kernels.cpu`,
``csrc/numeric.h``'s 16-token transpose-and-add for key scores, shared with the vLLM page kernel, and
``csrc/vq_tier.h``), built by :mod:`kvtier.kernels.build`. Imports torch, ``.build``,
:mod:`kvtier.codecs` (the affine table, the vq operands) and :mod:`kvtier.quant` (the rotation).
"""

from __future__ import annotations

import functools

import torch

from ..codecs import AFFINE_MODES, VqCodec
from ..codecs.vq import fp8_values, kernel_operands
from ..quant import rotation
from . import build


@functools.lru_cache(maxsize=1)
def _module():
    return build.load(
        "kvtier_fused_cpu_v16", "layer_attention.cpp", ["layer_attention"], ("-fno-math-errno", "-fno-trapping-math")
    )


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the kernel compiled (once per machine; cached by torch)."""
    return build.check(_module, "kvtier fused CPU kernel", "the per-tier path")


_EMPTY_F = torch.empty(0)
_EMPTY_L = torch.empty(0, dtype=torch.long)


def layer_attention(
    rows: torch.Tensor,
    exact: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    tiers: list[tuple[tuple[torch.Tensor, ...], int, int, bool, torch.Tensor | None]],
    select: tuple[str, float, torch.Tensor] | None = None,
    vq: list[tuple[dict[str, torch.Tensor], VqCodec]] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``rows [B,H,R,D]`` (fp32, scaled) over a layer's exact segments and packed tiers.

    Parameters
    ----------
    exact : ``(k, v, allowed)`` per exact segment: ``k, v [B,H,L,D]`` fp32/fp16/bf16 (views with a
        contiguous last axis are fine), ``allowed`` bool ``[Bm,Rm,L]`` (``Bm`` 1 or B, ``Rm`` 1 or R).
    tiers : ``((k_codes, k_p1, k_p2, v_codes, v_p1, v_p2, valid), bits, start, affine, rot)``
        per packed tier, as a codec stores them (``codec.KERNEL_FIELDS``, fp16, fp32 or fp8 e4m3
        metadata), ``bits`` one width or ``(key bits, value bits)``,
        ``affine`` the codec's rule for ``x = a * code + b`` (a key of
        :data:`kvtier.codecs.AFFINE_MODES`), ``valid [B,n,T]``, ``start`` the index of the
        tier's first token slot, ``rot [D,D]`` or None (codes of ``x @ rot``).
    vq : ``(fields, codec)`` per tier of vector codes, the fields as the codec stores them with
        ``valid [B,1,n,T]``; attended densely (``select`` must be None when any is given).
    select : ``(method, level, forced_from [R])``: token selection per tier (``"mass"`` or
        ``"quantile"``, rules of :func:`kvtier.attention.sparse.select_tokens`, the mass counting the
        tier's tokens and the exact ones); tokens at index >= ``forced_from`` are always kept.

    Returns
    -------
    ``out [B,H,R,D]`` merged and normalized, ``lse [B,H,R]`` (``-inf``: nothing attended), ``counts``
    int64 ``[B*H, 1 + tiers + vq tiers, 3]``: for the exact part, then per tier (the packed ones,
    then the vq ones): pairs scored, pairs valued, tokens whose value bytes were read.
    """
    if vq and select is not None:
        raise ValueError("vq tiers are attended densely: the fused call takes no token selection with them")
    flat_exact = [t for seg in exact for t in seg]
    flat_tiers: list[torch.Tensor] = []
    info: list[int] = []
    for tensors, bits, start, affine, rot in tiers:
        flat_tiers += [t.contiguous() for t in tensors]
        flat_tiers.append(_EMPTY_F if rot is None else rot.float().contiguous())
        kbits, vbits = bits if isinstance(bits, tuple) else (bits, bits)
        info += [int(kbits), int(vbits), int(start), AFFINE_MODES[affine]]
    flat_vq: list[torch.Tensor] = []
    vq_info: list[int] = []
    for fields, codec in vq:
        k_idx, k_planes, k_book, k_mean, k_rms, v_idx, v_planes, v_book, v_rms, v_mean = kernel_operands(codec, fields)
        rot = rotation(rows.shape[-1], rows.device).float().contiguous()
        valid = fields["valid"].squeeze(1).contiguous()
        flat_vq += [k_idx, k_book, k_mean, k_rms, v_idx, v_book, v_rms, v_mean, valid, rot]
        vq_info += [*_padded(k_planes), *_padded(v_planes)]
    method = 0 if select is None else {"mass": 1, "quantile": 2}[select[0]]
    return tuple(
        _module().layer_attention(
            rows.contiguous(),
            flat_exact,
            flat_tiers,
            info,
            flat_vq,
            vq_info,
            fp8_values() if vq else _EMPTY_F,
            method,
            1.0 if select is None else float(select[1]),
            _EMPTY_L if select is None else select[2].to(torch.long).contiguous(),
        )
    )


def _padded(planes) -> list[int]:
    """A vq side's plane widths (:func:`kvtier.quant.planes`, one to three) as the kernel's 3 ints."""
    widths = [int(w) for w in planes]
    if not 1 <= len(widths) <= 3:
        raise ValueError(f"vq indices in {len(widths)} bit planes; the fused kernel reads one to three")
    return widths + [0] * (3 - len(widths))
