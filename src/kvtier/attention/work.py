"""Work counting of sparse attention, in one place: fed by what the backends return.

A layer whose policy is sparse adds one :class:`~kvtier.stats.SparseStats` per call: pairs a
dense pass evaluates, pairs scored and valued, block bounds, tier bytes a dense pass reads and
those read. The inputs are what the backends already produce: the C++ kernels' and the torch
backend's per-(batch, head) counts ``[B*H, 3]`` (scored, valued, tokens whose values were read),
the fused call's ``[B*H, 1 + tiers, 3]``, and the block masks of block selection. Calls that
attend densely under a sparse policy (prefill) are counted apart (``dense_calls``).

May import: torch, ``kvtier.stats``.
"""

from __future__ import annotations

import torch

from ..stats import SparseStats


def value_bytes_per_token(t, D: int) -> float:
    """Bytes a tier holds per token for values (codes + per-token scale metadata)."""
    return (t.codec.nbytes(1, 1, 1, t.block_tokens, D) - t.codec.nbytes(1, 1, 1, 0, D)) / 2 / t.block_tokens


def exact(stats: SparseStats, pairs: int) -> None:
    """Sinks or hot tokens: every pair scored and valued."""
    stats.dense(pairs)


def tier_counts(stats: SparseStats, t, B: int, H: int, D: int, counts: torch.Tensor | list[int]) -> None:
    """One tier under token selection (or dense, in a fused call): ``counts`` = pairs scored, pairs
    valued and tokens whose value bytes were read (summed over batch and heads, or ``[B*H, 3]``);
    bytes read are the tier's bytes less the values of the tokens no row kept."""
    if isinstance(counts, torch.Tensor):
        counts = counts.sum(0).tolist()
    scored, valued, read_tokens = (int(x) for x in counts)
    total = t.codec.nbytes(B, H, t.nblocks, t.block_tokens, D)
    real_tokens = int(t.fields["valid"].sum()) * H
    stats.pairs += scored
    stats.scored += scored
    stats.valued += valued
    stats.bytes_total += total
    stats.bytes_read += int(total - (real_tokens - read_tokens) * value_bytes_per_token(t, D))


def tier_blocks(stats: SparseStats, t, keep: torch.Tensor, blocks: torch.Tensor, R: int, D: int) -> None:
    """One tier under block selection: ``keep [B,H,R,n]`` blocks each row kept, ``blocks [B,H,k]``
    the union a head read (the kernels score the union for every row of the head)."""
    B, H = keep.shape[:2]
    T = t.block_tokens
    per_block = t.fields["valid"].sum(-1)  # [B,1,n] real tokens per block
    listed = per_block.expand(B, H, -1).gather(-1, blocks.clamp(min=0)) * (blocks >= 0)
    stats.pairs += int(per_block.sum()) * H * R
    stats.scored += int(listed.sum()) * R
    stats.valued += int((keep * per_block.unsqueeze(2)).sum())
    stats.bounds += B * H * R * t.nblocks
    stats.bytes_total += t.codec.nbytes(B, H, t.nblocks, T, D)
    stats.bytes_read += t.codec.nbytes(B, H, blocks.shape[-1], T, D)


def dense_call(stats: SparseStats, tiers, H: int, R: int) -> SparseStats:
    """A call that attends densely under a sparse policy (prefill): its pairs, counted apart."""
    pairs = stats.pairs + sum(int(t.fields["valid"].sum()) for t in tiers) * H * R
    return SparseStats(dense_calls=1, dense_pairs=pairs)


def fused(
    stats: SparseStats, counts: torch.Tensor, tiers, B: int, H: int, D: int, R: int, selected: bool
) -> SparseStats:
    """The fused call's counts ``[B*H, 1 + tiers, 3]`` (exact part first)."""
    c = counts.sum(0).tolist()
    exact(stats, c[0][0])
    if not selected:
        return dense_call(stats, tiers, H, R)
    for t, row in zip(tiers, c[1:]):
        tier_counts(stats, t, B, H, D, row)
    return stats
