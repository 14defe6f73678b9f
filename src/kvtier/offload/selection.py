"""Selection memory of one offloaded layer: what its attention selected, kept for the next steps.

Three things outlive one attention call of a layer whose cold tier is offloaded
(:class:`~kvtier.offload.tier.OffloadTier`), and :class:`SelectionMemory` owns them:

* the selection kept for reuse ``keep: bool [B, H, R, n']`` and its age in decode steps
  (``OffloadPolicy.reuse_every``): :meth:`SelectionMemory.reused`, :meth:`SelectionMemory.remember`;
* the prediction of the next step's blocks ``predicted: bool [B, H, n']`` (this step's union of
  selections plus the next-best ``margin`` blocks), built during a step (:meth:`observe`) and kept
  at its end (:meth:`end_step`); the prefetcher fetches :meth:`predicted_blocks`;
* the estimates of what the read budget left unread (:meth:`note_estimate`, ``stats.est_skipped_*``).

Plain bookkeeping over small bool tensors; the blocks themselves stay with the tier. Selections of
fewer blocks than the tier now holds (blocks offloaded since) are extended with those blocks
(:meth:`padded`), given the tier's packed validity ``valid_bits: uint8 [B, 1, n, ceil(T/8)]``.
May import: torch, ``kvtier.offload.sketch``, ``kvtier.policy``, ``kvtier.stats``, ``kvtier.errors``.
"""

from __future__ import annotations

import warnings

import torch

from ..errors import BudgetWarning
from ..policy import OffloadPolicy
from ..stats import OffloadStats
from .sketch import nonempty

#: :meth:`SelectionMemory.note_estimate` warns when a call's rows leave more than this mean share of
#: their estimated attention mass unread because of the read budget.
BUDGET_WARN_SHARE = 0.05


class SelectionMemory:
    """The kept selection, the prediction and the budget estimates of one offloaded layer.

    Parameters
    ----------
    policy : the layer's :class:`~kvtier.policy.OffloadPolicy` (``reuse_every``, ``margin``,
        ``max_blocks``).
    stats : the layer's :class:`~kvtier.stats.OffloadStats` (shared with its tier).
    """

    def __init__(self, policy: OffloadPolicy, stats: OffloadStats):
        self.policy = policy
        self.stats = stats
        self.predicted: torch.Tensor | None = None  # bool [B, H, n'] blocks predicted for the next step
        self.observed: torch.Tensor | None = None  # prediction being built during this step
        self.kept: tuple[torch.Tensor, int] | None = None  # (keep [B,H,R,n'], steps reused)

    # --- following the tier's moves -------------------------------------------------------------
    def state(self) -> tuple:
        """The per-step prediction (what a layer's journal restores beside the block moves)."""
        return self.predicted, self.observed

    def restore(self, state: tuple) -> None:
        self.predicted, self.observed = state
        self.kept = None

    def moved(self) -> None:
        """The tier's blocks moved (truncated, dropped, put back): nothing kept still applies."""
        self.predicted = None
        self.kept = None

    def index_select(self, index: torch.Tensor) -> None:
        """Rows were selected / reordered: the prediction follows, the kept selection is dropped."""
        if self.predicted is not None:
            self.predicted = self.predicted.index_select(0, index.to(self.predicted.device))
        self.kept = None

    def tensors(self) -> list[torch.Tensor]:
        """The prediction and the selection kept for reuse."""
        out = [] if self.predicted is None else [self.predicted]
        return out if self.kept is None else [*out, self.kept[0]]

    # --- reuse -----------------------------------------------------------------------------------
    def padded(self, keep: torch.Tensor, valid_bits: torch.Tensor) -> torch.Tensor:
        """A selection ``[B,H,R,n']`` of fewer blocks extended to the tier's ``n``: blocks offloaded
        since (attended exactly in the hot window at that step) are kept when they hold real tokens."""
        B, H, R, old = keep.shape
        n = valid_bits.shape[2]
        if old == n:
            return keep
        new = nonempty(valid_bits[:, :, old:]).unsqueeze(2).expand(B, H, R, n - old)
        return torch.cat([keep, new], dim=-1)

    def reused(self, B: int, H: int, R: int, valid_bits: torch.Tensor) -> torch.Tensor | None:
        """The previous selection, extended to blocks offloaded since, when this call may reuse it
        (``policy.reuse_every``; the same batch, heads and rows); else None."""
        n = valid_bits.shape[2]
        steps = self.policy.reuse_every(n)
        if steps <= 1 or self.kept is None:
            return None
        keep, age = self.kept
        if age + 1 >= steps or keep.shape[:3] != (B, H, R) or keep.shape[3] > n:
            return None
        keep = self.padded(keep, valid_bits)
        self.kept = (keep, age + 1)
        self.stats.reused += 1
        return keep

    def remember(self, keep: torch.Tensor, scored: int, valid_bits: torch.Tensor) -> None:
        """A fresh selection ``keep [B,H,R,n]`` (``scored`` blocks scored from sketches): counts
        how much of it the previous selection (reused or not) already held, and keeps it."""
        st = self.stats
        st.blocks_scored += scored
        if self.kept is not None:
            prev = self.kept[0]
            if prev.shape[:3] == keep.shape[:3] and prev.shape[3] <= keep.shape[3]:
                union, before = keep.any(2), self.padded(prev, valid_bits).any(2)
                st.reuse_needed += int(union.sum())
                st.reuse_hits += int((union & before).sum())
        self.kept = (keep, 0)

    # --- estimates -------------------------------------------------------------------------------
    def note_estimate(self, skipped: torch.Tensor) -> None:
        """Add a fresh selection's estimated skipped shares ``skipped [B,H,R]`` (see
        :func:`kvtier.attention.offloaded.estimated_skipped`) to ``stats.est_skipped_*``; warn (once
        per message, Python's default filter) when a call's mean share exceeds
        :data:`BUDGET_WARN_SHARE`: the read budget, not the mass rule, then decides the output."""
        st = self.stats
        st.est_skipped_mass += float(skipped.sum())
        st.est_skipped_rows += skipped.numel()
        st.est_skipped_max = max(st.est_skipped_max, float(skipped.max()))
        if float(skipped.mean()) > BUDGET_WARN_SHARE:
            warnings.warn(
                f"kvtier offload: the read budget (OffloadPolicy.max_blocks={self.policy.max_blocks}) left more "
                f"than {BUDGET_WARN_SHARE:.0%} of the estimated attention mass unread in a layer: attention is "
                "diffuse at this length; raise max_blocks (None: the mass rule alone, every block it needs) "
                "for exact-quality output. cache.offload_stats().est_skipped_* has the numbers.",
                BudgetWarning,
                stacklevel=3,
            )

    # --- prediction ------------------------------------------------------------------------------
    def observe(self, keep: torch.Tensor, scores: torch.Tensor) -> None:
        """Record this step's selection ``keep: bool [B,H,R,n]`` and block scores ``[B,H,R,n]``."""
        union = keep.any(2)
        margin = self.policy.margin
        if margin:
            best = scores.amax(2).masked_fill(union, float("-inf"))  # [B,H,n]
            k = min(margin, best.shape[-1])
            top = best.topk(k, dim=-1)
            extra = torch.zeros_like(union).scatter(-1, top.indices, torch.isfinite(top.values))
            union = union | extra
        union = union.cpu()
        self.observed = union if self.observed is None else self.observed | union

    def end_step(self) -> None:
        """The layer's attention is over: keep the prediction."""
        if self.observed is not None:
            self.predicted = self.observed
            self.observed = None

    def predicted_blocks(self, shape: tuple[int, int, int], valid_bits: torch.Tensor) -> torch.Tensor:
        """bool ``[B, H, n]`` (``shape``, the block table's): the blocks predicted for the layer's
        next attention - last step's selection and margin, plus every block offloaded since - that
        hold real tokens; empty without a prediction."""
        if self.predicted is None:
            return torch.zeros(0, 0, 0, dtype=torch.bool)
        B, H, n = shape
        known = self.predicted.shape[2]
        mask = torch.ones(B, H, n, dtype=torch.bool)
        mask[:, :, :known] = self.predicted[:, :, :n].cpu()
        return mask & nonempty(valid_bits).cpu()  # [B, 1, n]: blocks holding real tokens
