"""CPU kernels of the offloaded cold tier: two-level block selection and in-place exact attention,
compiled on first use.

:func:`offload_select` chooses each query row's cold blocks in one call per layer:

1. a coarse bound per block from resident per-block data, ``ub = q . mean + amax * sum_c |q_c
   scale_c| + log(valid tokens)``: an upper bound of the block's 1-bit sketch log-sum-exp (every
   sketched key is ``mean + alpha_t * scale * (+-1)``, ``alpha_t <= amax``);
2. blocks walked by descending bound (the max over the rows sharing the KV head); each walked block
   is scored from its sketch (its log-sum-exp, as :func:`kvtier.kernels.sketch_cpu.sketch_block_lse`),
   and the walk stops once the bounds of every block left sum to at most ``tol`` times each row's
   estimated total (resident mass plus the blocks scored): the blocks never scored cannot carry
   more than ``tol`` of any row's estimated mass;
3. per row, the mass rule of :func:`kvtier.attention.offloaded.select_offloaded` over the scored blocks.

:func:`offload_attend` attends the selected blocks *exactly*, reading each record where it lies -
a host-RAM store's slab, or a buffer of records read from disk - from a table of key and value
addresses, and merges the result with the resident part by log-sum-exp (online softmax).

With AVX-512 and ``head_dim`` 64 both run block routines that score 16 tokens at a time (their
partial dot products summed by one transposing reduction instead of one horizontal sum per token),
share each token's loads among up to 4 query rows, and read records in their storage dtype
without a converted copy; other shapes take plain loops the compiler vectorizes.

The torch references are :func:`kvtier.attention.offloaded.select_two_level_torch` and
:func:`kvtier.attention.offloaded.attend_blocks_torch`. :func:`available` is False when no C++
compiler is present; callers then use the torch path.

The C++ is ``csrc/offload_attention.cpp``, built by :mod:`kvtier.kernels.build`. Imports only
torch and ``.build``.
"""

from __future__ import annotations

import functools

import torch

from . import build

#: Record storage dtypes the attention kernel reads, by code.
DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@functools.lru_cache(maxsize=1)
def _module():
    return build.load(
        "kvtier_offload_cpu_v8",
        "offload_attention.cpp",
        ["offload_select", "offload_attend"],
        ("-fno-math-errno", "-fno-trapping-math"),
    )


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the kernels compiled (once per machine; cached by torch)."""
    return build.check(_module, "kvtier offload kernel", "the torch path")


def offload_select(
    qrot: torch.Tensor,
    fields: dict[str, torch.Tensor],
    lse_res: torch.Tensor,
    forced_from: torch.Tensor,
    mass: float | None,
    min_blocks: int,
    max_blocks: int | None,
    tol: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two-level selection of cold blocks.

    Parameters
    ----------
    qrot : fp32 ``[B, H, R, D]`` query rows (scaled, rotated like the sketch).
    fields : the coded sketch fields of :mod:`kvtier.offload.sketch` (``k_signs`` uint8
        ``[B,H,n,T,P]``, ``k_scale`` uint8 / ``k_mean`` int8 ``[B,H,n,1,D]``, ``k_alpha`` uint8
        ``[B,H,n,T]``, ``k_amax``, ``k_smax``, ``k_mmax`` fp16 ``[B,H,n]``, ``valid_bits`` uint8
        ``[B,1,n,ceil(T/8)]``); read coded, as stored.
    lse_res : fp32 ``[B, H, R]`` exact log mass of the resident tokens.
    forced_from : int64 ``[R]``: blocks ``j >= forced_from[r]`` holding a valid token are kept.
    mass, min_blocks, max_blocks : the rule of :func:`kvtier.attention.offloaded.select_offloaded`
        (``mass=None``: no mass cut).
    tol : the walk's stopping tolerance (0: score every block).

    Returns
    -------
    ``keep`` bool ``[B,H,R,n]``, ``lse`` fp32 ``[B,H,R,n]`` (the sketch estimate; ``-inf`` for
    blocks not scored or empty), ``scored`` int64 ``[B*H]`` blocks scored per (row, KV head).
    """
    return tuple(
        _module().offload_select(
            qrot.contiguous(),
            fields["k_signs"].contiguous(),
            fields["k_scale"].contiguous(),
            fields["k_mean"].contiguous(),
            fields["k_alpha"].contiguous(),
            fields["k_amax"].contiguous(),
            fields["k_smax"].contiguous(),
            fields["k_mmax"].contiguous(),
            fields["valid_bits"].contiguous(),
            lse_res.float().contiguous(),
            forced_from.to(torch.long).contiguous(),
            -1.0 if mass is None else float(mass),
            int(min_blocks),
            0 if max_blocks is None else int(max_blocks),
            float(tol),
        )
    )


def offload_attend(
    rows: torch.Tensor,
    keep: torch.Tensor,
    kptr: torch.Tensor,
    vptr: torch.Tensor,
    valid: torch.Tensor,
    block_tokens: int,
    dtype: torch.dtype,
    out_prev: torch.Tensor,
    lse_prev: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact attention of ``rows [B,H,R,D]`` (fp32, scaled) over the blocks each row keeps, merged
    with a previous partial.

    Parameters
    ----------
    keep : bool ``[B, H, R, n]``.
    kptr, vptr : int64 ``[B, H, n]`` addresses of each block's keys and values, each ``[T, D]``
        contiguous in ``dtype`` (0: the block is not in this source and is skipped). The memory
        must stay alive and unchanged during the call.
    valid : ``valid_bits`` uint8 ``[B, 1, n, ceil(T/8)]`` (packed, as the sketch stores it).
    out_prev, lse_prev : fp32 ``[B,H,R,D]`` normalized output and ``[B,H,R]`` log-sum-exp of what
        was attended before (``lse_prev = -inf``: nothing).

    Returns
    -------
    ``out [B,H,R,D]`` and ``lse [B,H,R]`` of everything attended, ``counts`` int64 ``[B*H, 2]``:
    blocks read, (row, token) pairs scored.
    """
    return tuple(
        _module().offload_attend(
            rows.contiguous(),
            keep.contiguous(),
            kptr.contiguous(),
            vptr.contiguous(),
            valid.contiguous(),
            int(block_tokens),
            DTYPES[dtype],
            out_prev.float().contiguous(),
            lse_prev.float().contiguous(),
        )
    )
