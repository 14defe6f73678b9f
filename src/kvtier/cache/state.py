"""The per-layer state machine of a tiered cache: sinks, hot, warm and cold tiers (no transformers).

Owns :class:`LayerState` (everything one layer of a :class:`~kvtier.TieredCache` does: tiers,
settle/moves, input checks, the :class:`Journal` of all-or-nothing changes, eviction for byte
caps, views for attention and reports), the ids of kvtier masks (:func:`mark_forward`,
:func:`forward_epoch`) and the names the adapter and attention share (``ATTENTION_NAME``,
``HANDLE_KEY``). The transformers cache layer :class:`kvtier.hf.layer.TieredLayer` is
``LayerState`` plus transformers' ``CacheLayerMixin``.
May import: torch, ``kvtier.cache`` (tiers, adaptive), ``kvtier.tier``, ``kvtier.codecs``,
``kvtier.policy``, ``kvtier.errors``, ``kvtier.stats``, and (lazily, for ``cold="offload"``) ``kvtier.offload``; never
transformers, ``kvtier.attention`` or ``kvtier.hf``.

Data flow per forward call:

1. ``update(k, v)`` appends the new tokens (post-RoPE, ``[B, H, q, D]``) to the exact hot buffer
   and puts a handle to this layer into the attention kwargs; it returns only the new tokens.
2. kvtier's attention function reads the tiers through the handle (reference path: each tier is
   decoded transiently; fast paths read the packed data), then calls :meth:`settle` with the
   padding mask of this step.
3. ``settle`` moves the hot overflow, a block at a time: sink tokens (the first real tokens of
   each row) into the sink buffer, the rest into warm, warm overflow into cold (or evicted).
   Attention for the current step therefore always sees the current tokens exactly, and every
   token is quantized once per tier move.

Token index ranges (shared by all rows): evicted ``[0, e)``, cold ``[e, e + C)``, warm next,
hot ``[hot_start, seen)``. Per-row validity masks exclude pads and captured sinks.

Faults: a move is all-or-nothing. Tiers change copy-on-write, and the layer records how to undo
each change in a :class:`Journal` (a few references: the hot and sink buffers' old tensors,
blocks taken from a tier's front, counts pushed onto a tier's back). ``settle`` undoes its own
changes when a step fails; a :class:`~kvtier.TieredCache` keeps one journal per layer for a
whole forward call and undoes every layer's changes when the call fails anywhere in kvtier.

Crop (assisted and prompt-lookup decoding roll back rejected draft tokens): between calls,
:meth:`LayerState.crop` removes the latest tokens while they are still in the exact hot buffer
(every token of an exact layer) and refuses, changing nothing, beyond it; older tokens are coded.

With ``policy.adaptive`` the layer shares a :class:`~kvtier.cache.adaptive.Budget` with the other
layers of its cache: blocks entering warm are measured during the warm-up, the cold tier is created
with the widths the budget allocates to this layer, and the warm capacity follows the budget
(:meth:`Budget.warm_blocks`) instead of ``warm_tokens`` (which then only caps it, from the
allocation on: during the warm-up every block stays warm). A failed call puts the budget's
measurements back with the tiers (:meth:`Budget.snapshot`, taken by the cache). With the
eviction rung (``adaptive.keep < 1``) warm blocks step down ``g`` at a time and only ``keep`` of
their tokens, per sequence and KV head the ones the step's queries attend to most, enter cold
(:func:`~kvtier.cache.adaptive.select_by_attention`; the dropped ones count as ``evicted``). The
step's query rows are held only until its ``settle`` (no tensor outlives the call).
:meth:`demote_oldest` steps the oldest warm block down to the cold code (a byte cap's
``on_full="degrade"``).

With ``cold="offload"`` the cold tier is a :class:`~kvtier.offload.tier.OffloadTier` (same
interface: resident key sketches and a block table over a block store in host RAM or on disk),
and attention goes through :mod:`kvtier.attention.offloaded`.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..codecs import make_codecs, storage_dtype, value_group
from ..errors import KVTierError, StorageRangeError
from ..policy import TierPolicy
from ..stats import SparseStats, tensor_bytes
from ..tier import Tier
from .tiers import BlockTier, HotBuffer, SinkBuffer

ATTENTION_NAME = "kvtier"
HANDLE_KEY = "tiered_layer"
#: "fast" reads the packed tiers directly (decode: one fused C++ call per layer on the CPU);
#: "per-tier" the same without the fused call (a partial per tier, merged in torch);
#: "reference" decodes each tier and runs SDPA (the oracle); "torch", "cpu", "fused", "triton"
#: force that backend (kvtier.attention.plan, which reads this setting, says what each does).
ATTENTION_PATHS = ("fast", "per-tier", "reference", "torch", "cpu", "fused", "triton")

#: Ids of kvtier masks: transformers builds a model's mask once per forward call, before any layer
#: runs, in the thread that runs the call. Each build takes the next id (unique and increasing in
#: the process) and records it as its thread's latest (``kvtier.hf.mask.kvtier_mask`` calls
#: :func:`mark_forward`), so a cache sees a larger id in its calling thread exactly when that
#: thread's model ran kvtier's mask (and so kvtier's attention) since the cache's last call; a mask
#: built in another thread does not count.
_MASK_IDS = itertools.count(1)
_MASK_LOCK = threading.Lock()
_LATEST = threading.local()

#: Query tokens whose rows a layer keeps past its settle for :meth:`LayerState.rebalance` (the
#: SnapKV observation window: the last tokens of the prompt). Every settle that starts during the
#: warm-up scores with these rows only, so in the call that ends the warm-up the layer whose block
#: ends it evicts by the same window as the layers that rebalance after it.
REBALANCE_OBS_TOKENS = 64


def _last_tokens(obs: tuple[torch.Tensor, int] | None, n: int) -> tuple[torch.Tensor, int] | None:
    """The rows of the last ``n`` tokens of ``obs = (rows [B, H, G*q, D] head-major, q)``."""
    if obs is None or obs[1] <= n:
        return obs
    rows, q = obs
    B, H, R, D = rows.shape
    return rows.reshape(B, H, R // q, q, D)[:, :, :, -n:].reshape(B, H, R // q * n, D).clone(), n


def mark_forward() -> int:
    """Take the next mask id and record it as the calling thread's latest (see ``_MASK_IDS``)."""
    with _MASK_LOCK:
        _LATEST.id = next(_MASK_IDS)
    return _LATEST.id


def forward_epoch() -> int:
    """The id of the latest kvtier mask built in the calling thread (0: none yet; see ``_MASK_IDS``)."""
    return getattr(_LATEST, "id", 0)


class Journal:
    """How to undo what one layer did since the journal began (see the module doc).

    Counts and buffer references are taken at the start; tier changes add an undo step as they
    happen; ``on_commit`` steps run when the changes are kept (e.g. freeing store records of
    blocks that left a tier, which an undo would need back).
    """

    def __init__(self, layer: LayerState):
        self.initialized = layer.is_initialized
        self.seen, self.hot_start, self.evicted, self.batch = layer.seen, layer.hot_start, layer.evicted, layer.batch
        self.hot = layer.hot.state()
        self.sinks = layer.sinks.state()
        self.stats = dataclasses.replace(layer.sparse_stats)
        self.cold = None if layer.cold is None else layer.cold.state()
        self.undo: list[Callable[[], None]] = []
        self.on_commit: list[Callable[[], None]] = []

    def rollback(self, layer: LayerState) -> None:
        """Put ``layer`` back as it was when the journal began."""
        if not self.initialized:
            layer.reset()
            return
        for step in reversed(self.undo):
            step()
        layer.hot.restore(self.hot)
        layer.sinks.restore(self.sinks)
        if self.cold is not None:
            layer.cold.restore(self.cold)
        layer.seen, layer.hot_start, layer.evicted, layer.batch = self.seen, self.hot_start, self.evicted, self.batch
        layer.sparse_stats = self.stats
        layer.journal = None

    def commit(self, layer: LayerState) -> None:
        for step in self.on_commit:
            step()
        layer.journal = None


class LayerState:
    """One layer's sinks, hot, warm and cold tiers and their movement (see the module doc).

    Framework-free: it has the cache-layer methods transformers calls (``update``,
    ``get_seq_length``, ``get_mask_sizes``, ``reorder_cache``, ...), and
    :class:`kvtier.hf.layer.TieredLayer` adds transformers' ``CacheLayerMixin`` to them.

    Parameters
    ----------
    policy : the layer's :class:`~kvtier.TierPolicy`.
    owner : the cache the layer belongs to (a :class:`~kvtier.TieredCache`: ``begin_update``,
        ``layer_done``, ``abort``, ``check_usable``), held by weak reference; None for a layer used alone.
    attention : one of ``ATTENTION_PATHS``.
    layer_idx : the layer's index in its model (named in errors), or None.
    budget : the cache's :class:`~kvtier.cache.adaptive.Budget` when ``policy.adaptive`` is set
        (None: the layer makes its own, covering itself alone).
    """

    is_sliding = False
    is_compileable = False

    def __init__(
        self,
        policy: TierPolicy,
        owner: Any = None,
        attention: str = "fast",
        layer_idx: int | None = None,
        budget: Any = None,
    ):
        super().__init__()
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention={attention!r} is not allowed: expected one of {ATTENTION_PATHS}")
        self.policy = policy
        # a weak reference: a dropped cache is freed at once, not by the cyclic garbage collector
        self._owner = None if owner is None else weakref.ref(owner)
        self.attention = attention
        self.layer_idx = layer_idx
        self.offloader = None
        self.journal: Journal | None = None
        self.budget = budget
        if policy.adaptive is not None and budget is None:
            from .adaptive import Budget

            self.budget = Budget(policy, 1)
        if policy.cold == "offload" and not policy.is_exact:  # directories are checked here
            from ..offload.prefetch import Offloader

            shared = getattr(owner, "offloader", None)
            self.offloader = shared if shared is not None else Offloader([policy.offload])
        self.reset()

    @property
    def owner(self) -> Any:
        """The :class:`~kvtier.TieredCache` this layer belongs to (None for a layer used alone)."""
        return None if self._owner is None else self._owner()

    # --- cache-layer interface (what transformers calls) ------------------------------------
    def reset(self) -> None:
        old = getattr(self, "cold", None)
        if old is not None:
            old.close()  # an offloaded tier's records and files go now
        p = self.policy
        bound = None if p.hot_tokens is None else p.hot_tokens + p.block_tokens
        self.hot = HotBuffer(bound)
        self.sinks = SinkBuffer(0 if p.is_exact else p.sink_tokens)
        self.warm: BlockTier | None = None
        self.cold: Tier | None = None  # a BlockTier, or an OffloadTier (``cold="offload"``)
        self.sparse_stats = SparseStats()
        self.seen = 0
        self.hot_start = 0
        self.evicted = 0
        self.batch = 0
        self.keys = self.values = None
        self.is_initialized = False
        self.journal = None
        self._obs: tuple[torch.Tensor, int] | None = None  # this call's query rows and tokens
        # settled during its budget's warm-up in a call whose later layer ended it: what
        # ``rebalance`` needs (the call's last query rows and tokens, and its token mask)
        self._pending: tuple[tuple[torch.Tensor, int] | None, torch.Tensor | None] | None = None
        self._token_valid: torch.Tensor | None = None  # this call's padding mask (during settle)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.model_dtype = key_states.dtype
        self.dtype = storage_dtype(self.policy, key_states.dtype)
        self.batch, self.kv_heads, _, self.head_dim = key_states.shape
        warm, cold = make_codecs(self.policy, self.head_dim)
        T = self.policy.block_tokens
        self.warm = BlockTier(warm, T, self.head_dim)
        self.cold = None if cold is None else BlockTier(cold, T, self.head_dim)
        if self.budget is not None:  # the cold tier comes with the allocation (see _push_cold)
            self.budget.join(self._budget_idx, self.batch, self.kv_heads, self.head_dim, self.model_dtype)
            self.cold = None
        if self.offloader is not None:
            from ..offload.tier import OffloadTier

            self.cold = OffloadTier(
                self.policy,
                self.head_dim,
                self.dtype,
                self.device,
                value_group(self.policy, self.head_dim),
                self.offloader,
                self.layer_idx,
            )
        self.is_initialized = True

    def check_input(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Raise (changing nothing) unless ``key_states, value_states`` fit this layer."""
        where = "" if self.layer_idx is None else f" (layer {self.layer_idx})"
        if not isinstance(key_states, torch.Tensor) or not isinstance(value_states, torch.Tensor):
            raise TypeError(f"TieredCache{where}: key and value states must be tensors")
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ValueError(
                f"TieredCache{where}: expected key and value states of one shape [batch, kv_heads, tokens, "
                f"head_dim], got {tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if not key_states.is_floating_point():
            raise TypeError(f"TieredCache{where}: key states must be floating point, got {key_states.dtype}")
        if not self.is_initialized:
            return
        B, H, _, D = key_states.shape
        if (H, D) != (self.kv_heads, self.head_dim):
            raise ValueError(
                f"TieredCache{where}: this cache holds {self.kv_heads} KV heads of dim {self.head_dim}, but the "
                f"model gave {H} of dim {D}: a cache belongs to one model; build a new TieredCache for this one"
            )
        if B != self.batch:
            raise ValueError(
                f"TieredCache{where}: this cache holds {self.batch} sequences, but the call has {B}: "
                "build a new TieredCache for a new batch"
            )
        if key_states.device != self.device:
            raise ValueError(
                f"TieredCache{where}: this cache lives on {self.device}, but the call's states are on "
                f"{key_states.device}: keep model and cache on one device"
            )
        if key_states.dtype != self.model_dtype:
            raise TypeError(
                f"TieredCache{where}: this cache was filled by a {self.model_dtype} model, but the call's states "
                f"are {key_states.dtype}: build a new TieredCache after changing the model's dtype"
            )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            raise RuntimeError(
                "TieredCache needs the model to pass its attention kwargs to cache.update "
                "(transformers >= 5 models do); this model's attention does not."
            )
        self.check_input(key_states, value_states)
        if self.owner is not None:
            self.owner.begin_update(self)  # checks; starts this layer's journal of the call
        try:
            self.check_exact_range(key_states, value_states)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.hot.append(key_states.to(self.dtype), value_states.to(self.dtype))
            self.seen += key_states.shape[2]
        except BaseException as err:
            self.abort(err)
            raise
        attn_kwargs[HANDLE_KEY] = self
        return key_states, value_states

    def check_exact_range(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Raise :class:`~kvtier.errors.StorageRangeError` (changing nothing) when the exact storage
        (``policy.exact_dtype``: fp16 for an fp32 model under ``"half"``) cannot hold a finite value
        of the call's states: it would become ``inf`` in the sinks and hot ring and the logits
        ``NaN``. One max per key and value chunk, only when the storage is narrower than the model's
        dtype; values that are not finite come from the model and are left alone."""
        dtype = storage_dtype(self.policy, key_states.dtype)
        limit = torch.finfo(dtype).max
        if limit >= torch.finfo(key_states.dtype).max or not key_states.numel():
            return
        worst = [float(x.detach().abs().amax()) for x in (key_states, value_states)]
        if max(worst) <= limit:
            return
        for i, x in enumerate((key_states, value_states)):  # inf from the model: the finite values alone
            if worst[i] > limit and not math.isfinite(worst[i]):
                a = x.detach().abs()
                worst[i] = float(torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax())
        if max(worst) <= limit:
            return
        where = "" if self.layer_idx is None else f" (layer {self.layer_idx})"
        name = "keys" if worst[0] >= worst[1] else "values"
        raise StorageRangeError(
            f"TieredCache{where}: the model's {name} reach |x| = {max(worst):.4g}, beyond {limit:g}, the largest "
            f"{str(dtype).removeprefix('torch.')} value: exact_dtype={self.policy.exact_dtype!r} stores sinks and "
            f"hot tokens of this {str(key_states.dtype).removeprefix('torch.')} model in it, where they would become "
            "inf; the cache is unchanged: use exact_dtype='bfloat16' (float32's range in 2 bytes, e.g. "
            "kvtier.get_policy('default').replace(exact_dtype='bfloat16')) or 'model'"
        )

    def abort(self, err: BaseException) -> None:
        """A step of this call failed: undo the call's changes (every layer's, with an owner)."""
        if self.owner is not None:
            self.owner.abort(err)
        elif self.journal is not None:
            self.journal.rollback(self)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch, device=self.device).repeat_interleave(repeats))

    def _select_rows(self, index: torch.Tensor) -> None:
        if self.owner is not None:
            self.owner.check_usable()
        if not self.is_initialized:
            return
        for tier in (self.hot, self.sinks, self.warm, self.cold):
            if tier is not None:
                tier.index_select(index)
        self.batch = int(index.numel())

    # --- crop (assisted / prompt-lookup decoding roll back rejected draft tokens) ------------------
    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can roll back recent tokens: an exact layer holds every token in its
        hot buffer, a layer with a hot window at least the latest ``min(seen, hot_tokens)`` between
        calls (``hot_tokens=0`` keeps too few to promise anything)."""
        return self.policy.is_exact or bool(self.policy.hot_tokens)

    @property
    def croppable_tokens(self) -> int:
        """How many of the latest tokens :meth:`crop` can remove now: those still in the exact hot
        buffer (older ones are coded, captured as sinks or gone, and cannot be rolled back)."""
        return self.hot.length if self.is_initialized else 0

    def check_crop(self, tokens_to_remove: int) -> int:
        """The number of tokens ``crop(tokens_to_remove)`` removes; raises, changing nothing, if it cannot."""
        where = "" if self.layer_idx is None else f" (layer {self.layer_idx})"
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise TypeError(
                f"crop(tokens_to_remove={tokens_to_remove!r}) is not allowed: expected an int <= 0 "
                "(minus the number of latest tokens to remove)"
            )
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop(tokens_to_remove={tokens_to_remove}) is not allowed: expected an int <= 0 (minus the number "
                "of latest tokens to remove; a positive length to keep is refused, as transformers' DynamicCache does)"
            )
        if self.owner is not None:
            self.owner.check_usable()
        elif self.journal is not None:
            raise KVTierError(f"TieredCache{where} cannot crop in the middle of a forward call")
        n, most = -tokens_to_remove, self.croppable_tokens
        if n > most:
            raise KVTierError(
                f"TieredCache{where} cannot crop {n} tokens: only the latest {most} are still exact (the hot window); "
                f"older tokens are compressed and cannot be rolled back, so crop at most {most}"
            )
        return n

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the latest ``-tokens_to_remove`` tokens (transformers' convention: ``crop(-n)``),
        as assisted and prompt-lookup decoding do with rejected draft tokens. Only tokens still in
        the exact hot buffer can go (:attr:`croppable_tokens`); beyond them a
        :class:`~kvtier.errors.KVTierError` is raised and nothing changes. ``seen``, and with it
        ``get_seq_length()`` and the mask sizes, drops by ``n``. For an exact layer the result is
        what the cache held before those tokens; a layer with a hot window keeps the same tokens,
        but blocks the dropped tokens pushed out of the window stay coded (moved a few steps early)."""
        n = self.check_crop(tokens_to_remove)
        if n:
            self.hot.truncate(self.hot.length - n)
            self.seen -= n

    def offload(self) -> None:  # transformers' layer offloading does not apply to packed tiers
        return None

    def prefetch(self) -> None:
        return None

    def __deepcopy__(self, memo: dict) -> LayerState:
        if self.journal is not None:
            raise KVTierError("a TieredCache cannot be copied in the middle of a forward call")
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name == "_owner" and value is not None:  # the copy belongs to the copied cache
                owner = copy.deepcopy(value(), memo)
                value = None if owner is None else weakref.ref(owner)
            else:
                value = copy.deepcopy(value, memo)
            setattr(new, name, value)
        return new

    def __getstate__(self) -> dict:
        """For ``pickle``: the owner by strong reference (pickle keeps the cycle), not mid-call."""
        if self.journal is not None:
            raise KVTierError("a TieredCache cannot be pickled in the middle of a forward call")
        return {**self.__dict__, "_owner": self.owner}

    def __setstate__(self, state: dict) -> None:
        owner = state.pop("_owner", None)
        self.__dict__.update(state)
        self._owner = None if owner is None else weakref.ref(owner)

    # --- tier movement ------------------------------------------------------------------------
    def settle(self, token_valid: torch.Tensor | None) -> None:
        """Move the hot overflow down the tiers, all or nothing.

        Parameters
        ----------
        token_valid : bool ``[B, >= seen]`` real-token mask in index space, or None (all real).
        """
        own = self.journal is None  # no call journal (a layer used on its own): one for this move
        if own:
            self.journal = Journal(self)
        try:
            self._token_valid = token_valid
            self._pending = None
            if self.budget is not None and self.budget.measuring(self.seen):  # this move may end the
                # warm-up (then it evicts here): by the window ``rebalance`` uses, as every layer of the call
                self._obs = _last_tokens(self._obs, REBALANCE_OBS_TOKENS)
            self._move(token_valid)
            if self.budget is not None and self.budget.measuring(self.seen):
                self._pending = (self._obs, token_valid)
            if self.budget is not None:  # the call's query rows go; the warm-up's tensors once it ends
                self.budget.end_call(self._budget_idx, self.seen)
            if self.owner is not None:
                self.owner.layer_done(self)
        except BaseException as err:
            self._pending = None
            self.abort(err)
            if isinstance(err, StorageRangeError) and self.layer_idx is not None and not str(err).startswith("Tiered"):
                raise StorageRangeError(
                    f"TieredCache (layer {self.layer_idx}): {err}; the cache is unchanged: keep this layer exact "
                    f"(layer_overrides={{{self.layer_idx}: 'exact'}})"
                ) from err
            raise
        finally:
            self._obs = self._token_valid = None
            if self.budget is not None:
                self.budget.drop_queries(self._budget_idx)
        if own and self.journal is not None:
            self.journal.commit(self)

    def _move(self, token_valid: torch.Tensor | None) -> None:
        p = self.policy
        if p.hot_tokens is None or not self.is_initialized:
            return
        T = p.block_tokens
        nblk = (self.hot.length - p.hot_tokens) // T
        if nblk <= 0:
            return
        n = nblk * T
        start = self.hot_start
        k, v = self.hot.take_front(n)
        self.hot_start += n
        if token_valid is None:
            valid = torch.ones(self.batch, n, dtype=torch.bool, device=self.device)
        else:
            valid = token_valid[:, start : start + n].to(self.device, torch.bool)
        valid = self.sinks.capture(k, v, valid)
        self._push_warm(k, v, valid)

    def rebalance(self) -> bool:
        """An adaptive layer that settled while its budget was still measuring, in a call that a
        later layer's settle ended the warm-up of (a one-call prefill): apply the budget now, as
        that settle would have - step the warm overflow down, evicting by the call's last query
        rows - so the call ends within ``bits``. Part of the current journal; True when it ran
        (a no-op otherwise)."""
        pending, self._pending = self._pending, None
        if pending is None or self.budget is None or self.budget.measuring(self.seen) or self.warm is None:
            return False
        self._obs, self._token_valid = pending
        try:
            empty = torch.empty(self.batch, self.kv_heads, 0, self.head_dim, device=self.device)
            self._push_warm(empty, empty, torch.ones(self.batch, 0, dtype=torch.bool, device=self.device))
        finally:
            self._obs = self._token_valid = None
        return True

    def _push_warm(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        assert self.warm is not None and self.journal is not None
        warm = self.warm
        T = self.policy.block_tokens
        incoming = k.shape[2] // T
        cap = math.inf if self.policy.warm_tokens is None else self.policy.warm_tokens // T
        if self.budget is not None:
            if self.budget.measuring(self.seen):
                B = k.shape[0]
                bvalid = valid.reshape(B, 1, incoming, T)
                blocks = [x.reshape(B, x.shape[1], incoming, T, x.shape[3]) for x in (k, v)]
                self.budget.errors[self._budget_idx].observe_block(*blocks, bvalid)
            if self.budget.measuring(self.seen):
                # the warm-up keeps every block warm, ``warm_tokens`` too: a block stepping down now
                # would make the allocation before the other layers measured anything (they would
                # get the narrowest widths); the cap applies once allocated (here, or in rebalance)
                cap = math.inf
            else:
                cold_held = 0 if self.cold is None else math.ceil(self.cold.nblocks / self.budget.keep - 1e-9)
                held = warm.nblocks + incoming + cold_held  # cold blocks counted before eviction
                cap = min(cap, self.budget.warm_blocks(self.seen, held))
                group = self.budget.adaptive.keep_blocks[1]
                if group > 1:  # the eviction rung steps down whole groups: up to g - 1 wait in warm
                    cap = max(0, cap - (group - 1))
        overflow = int(max(0, warm.nblocks + incoming - cap))
        if self.budget is not None:
            overflow -= overflow % self.budget.adaptive.keep_blocks[1]
        from_warm = min(warm.nblocks, overflow)
        direct = overflow - from_warm  # incoming blocks that would overflow at once
        down = []  # (k, v, valid) stepping down, oldest first: one push (whole eviction groups)
        if from_warm:
            old = warm.drop_front(from_warm)
            self.journal.undo.append(lambda: warm.put_front(old))
            down.append(warm.decode_blocks(old, torch.float32))
        if direct:
            d = direct * T
            down.append((k[:, :, :d], v[:, :, :d], valid[:, :d]))
            k, v, valid = k[:, :, d:], v[:, :, d:], valid[:, d:]
        if len(down) == 1:
            self._push_cold(*down[0])
        elif down:
            (wk, wv, wvalid), (dk, dv, dvalid) = down
            self._push_cold(
                torch.cat([wk, dk.float()], 2), torch.cat([wv, dv.float()], 2), torch.cat([wvalid, dvalid], 1)
            )
        if k.shape[2]:
            before = warm.nblocks
            self.journal.undo.append(lambda: warm.truncate(before))
            warm.push(k, v, valid)

    @property
    def _budget_idx(self) -> int:
        return 0 if self.layer_idx is None else self.layer_idx

    def _make_cold(self) -> None:
        """An adaptive layer's cold tier, at the widths its budget allocates (undone with the journal)."""
        assert self.budget is not None and self.journal is not None
        self.cold = BlockTier(self.budget.cold_codec(self._budget_idx), self.policy.block_tokens, self.head_dim)
        self.journal.undo.append(lambda: setattr(self, "cold", None))

    def observe_queries(self, rows: torch.Tensor, tokens: int | None = None) -> None:
        """Scaled query rows ``[B, H, R, D]`` of this layer's attention (``R`` = query heads per KV
        head x ``tokens``, head-major): measured during an adaptive layer's warm-up (see
        :mod:`kvtier.cache.adaptive`), and held until this call's ``settle`` by the eviction rung,
        which scores the tokens stepping down with them; ignored otherwise."""
        if self.budget is None:
            return
        if self.budget.measuring(self.seen):
            self.budget.errors[self._budget_idx].observe_queries(rows)
        if self.budget.keep < 1:
            self._obs = (rows, rows.shape[2] if tokens is None else tokens)

    def demote_oldest(self, nblocks: int = 1) -> int:
        """Step up to ``nblocks`` of the oldest warm blocks down to the cold code (a byte cap's
        ``on_full="degrade"``); returns the blocks moved (0 without a cold code or warm blocks).
        Part of the current journal."""
        assert self.journal is not None
        warm = self.warm
        if warm is None or not warm.nblocks or self.policy.cold not in ("quant", "sign"):
            return 0
        if self.cold is None:
            if self.budget is None:
                return 0
            self._make_cold()
        take = min(nblocks, warm.nblocks)
        old = warm.drop_front(take)
        self.journal.undo.append(lambda: warm.put_front(old))
        self._push_cold(*warm.decode_blocks(old, torch.float32))
        return take

    def _evict_by_attention(
        self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The eviction rung: of each whole group of ``g`` blocks keep ``j`` blocks' worth of tokens
        per sequence and KV head (the ones this step's queries attend to most); a partial group at
        the end is kept whole. Counts the dropped tokens as evicted."""
        from .adaptive import attention_mass, select_by_attention

        assert self.budget is not None
        j, g = self.budget.adaptive.keep_blocks
        T = self.policy.block_tokens
        ngroups = k.shape[2] // (g * T)
        if j == g or not ngroups:
            return k, v, valid
        B, H, _, D = k.shape
        n = ngroups * g * T
        gk = k[:, :, :n].reshape(B, H, ngroups, g * T, D).transpose(1, 2).reshape(B * ngroups, H, g * T, D)
        gv = v[:, :, :n].reshape(B, H, ngroups, g * T, D).transpose(1, 2).reshape(B * ngroups, H, g * T, D)
        gvalid = valid[:, :n].reshape(B * ngroups, g * T)
        mass = None
        if self._obs is not None:
            rows, q = self._obs  # every token of the step (scoring with the warm tier in the
            # softmax too measured the same: BENCHMARKS.md, v4)
            weight = None
            if self._token_valid is not None:  # queries at pad positions do not vote
                tv = self._token_valid[:, self.seen - q : self.seen].to(rows.device, torch.float32)
                weight = tv.repeat(1, rows.shape[2] // q)
            context = []
            if self.sinks.k is not None:
                context.append((self.sinks.k, self.sinks.valid()))
            hk, _ = self.hot.view()
            if hk.shape[2]:
                hv = torch.ones(B, hk.shape[2], dtype=torch.bool, device=hk.device)
                if self._token_valid is not None:
                    hv = self._token_valid[:, self.hot_start : self.hot_start + hk.shape[2]].to(hk.device, torch.bool)
                context.append((hk, hv))
            rep = lambda x: x.repeat_interleave(ngroups, 0)  # noqa: E731 - rows of each group's sequence
            mass = attention_mass(
                rep(rows),
                gk,
                gvalid,
                None if weight is None else rep(weight),
                [(rep(ck), rep(cv)) for ck, cv in context],
            )
        kk, kv, kvalid = select_by_attention(gk, gv, gvalid, mass, j * T)
        kk = kk.reshape(B, ngroups, H, j * T, D).transpose(1, 2).reshape(B, H, ngroups * j * T, D)
        kv = kv.reshape(B, ngroups, H, j * T, D).transpose(1, 2).reshape(B, H, ngroups * j * T, D)
        kvalid = kvalid.reshape(B, ngroups * j * T)
        self.evicted += ngroups * (g - j) * T
        rest = (k[:, :, n:], v[:, :, n:], valid[:, n:])
        return torch.cat([kk, rest[0]], 2), torch.cat([kv, rest[1]], 2), torch.cat([kvalid, rest[2]], 1)

    def _push_cold(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        assert self.journal is not None
        if self.cold is None and self.budget is not None:
            self._make_cold()
        if self.budget is not None and self.budget.keep < 1:
            k, v, valid = self._evict_by_attention(k, v, valid)
        cold = self.cold
        if cold is None:
            self.evicted += k.shape[2]
            return
        before = cold.nblocks
        self.journal.undo.append(lambda: cold.truncate(before))
        cold.push(k, v, valid)

    def evict_oldest(self, nblocks: int = 1) -> int:
        """Drop up to ``nblocks`` of the oldest non-sink blocks (cold first, then warm) for a
        byte cap; returns the blocks dropped. Part of the current journal (undone with it)."""
        assert self.journal is not None
        dropped = 0
        for tier in (self.cold, self.warm):
            if tier is None or (tier is self.warm and self.cold is not None and self.cold.nblocks):
                continue
            take = min(nblocks - dropped, tier.nblocks)
            if take <= 0:
                continue
            old = tier.drop_front(take)
            self.journal.undo.append(lambda tier=tier, old=old: tier.put_front(old))
            if tier.is_offloaded:  # records of an offloaded tier: freed once the call is kept
                self.journal.on_commit.append(lambda tier=tier, old=old: tier.release(old))
            self.evicted += take * tier.block_tokens
            dropped += take
        return dropped

    # --- views for attention and reports --------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        """Whether the cold tier keeps its blocks in a block store (:attr:`kvtier.tier.Tier.is_offloaded`)."""
        return self.cold is not None and self.cold.is_offloaded

    def token_counts(self) -> dict[str, int]:
        """Token slots per tier (slots include pads and captured sinks in block tiers)."""
        return {
            "sink": self.sinks.size if self.sinks.k is not None else 0,
            "hot": self.hot.length,
            "warm": 0 if self.warm is None else self.warm.ntokens,
            "cold": 0 if self.cold is None else self.cold.ntokens,
            "evicted": self.evicted,
        }

    def tier_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor this layer holds next to the compute, by tier (an offloading cold tier:
        sketches, block table and checksums as ``cold``, prefetched blocks as ``staging``; an
        adaptive layer's warm-up statistics as ``measure``, until its budget allocates)."""
        out = {
            "sink": self.sinks.tensors(),
            "hot": self.hot.tensors(),
            "warm": [] if self.warm is None else self.warm.tensors(),
            "cold": [] if self.cold is None else self.cold.tensors(),
        }
        if self.offloaded:
            out["staging"] = self.cold.staging_tensors()
        if self.budget is not None:
            out["measure"] = self.budget.measure_tensors(self._budget_idx)
        return out

    def offloaded_bytes(self) -> int:
        """Bytes of this layer's blocks in a block store (host RAM or disk); 0 without offload."""
        return 0 if self.cold is None else self.cold.offloaded_bytes

    def nbytes(self) -> int:
        """Bytes this layer holds: its tensors (as :func:`kvtier.memory_report` counts them) plus
        its blocks in a store."""
        return tensor_bytes(t for ts in self.tier_tensors().values() for t in ts) + self.offloaded_bytes()
