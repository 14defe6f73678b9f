"""One layer of a :class:`~kvtier.TieredCache`: sinks, hot, warm and cold tiers.

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

With ``cold="offload"`` the cold tier is a :class:`~kvtier.offload.tier.OffloadTier` (same
interface: resident key sketches and a block table over a block store in host RAM or on disk),
and attention goes through :mod:`kvtier.offload.attention`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin

from ..diagnostics import SparseStats
from ..policy import TierPolicy
from .codecs import Codec, KBitCodec, SignCodec
from .tiers import BlockTier, HotBuffer, SinkBuffer

if TYPE_CHECKING:
    from .tiered import TieredCache

ATTENTION_NAME = "kvtier"
HANDLE_KEY = "tiered_layer"
#: "fast" reads the packed tiers directly (decode: one fused C++ call per layer on the CPU);
#: "per-tier" the same without the fused call (a partial per tier, merged in torch);
#: "reference" decodes each tier and runs SDPA (the oracle).
ATTENTION_PATHS = ("fast", "per-tier", "reference")

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def storage_dtype(policy: TierPolicy, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype sinks and hot tokens are stored in."""
    if policy.exact_dtype == "model":
        return model_dtype
    if policy.exact_dtype == "half":
        return torch.float16 if model_dtype == torch.float32 else model_dtype
    return _DTYPES[policy.exact_dtype]


def value_group(policy: TierPolicy, head_dim: int) -> int:
    g = min(policy.value_group_size, head_dim)
    if head_dim % g:
        raise ValueError(
            f"value_group_size={policy.value_group_size} is not allowed for head_dim={head_dim}: "
            "expected a divisor of head_dim"
        )
    return g


def make_codecs(policy: TierPolicy, head_dim: int) -> tuple[Codec, Codec | None]:
    """Warm and cold codecs of a policy (cold is None when evicted)."""
    g = value_group(policy, head_dim)
    warm = KBitCodec(policy.warm_bits, g)
    if policy.cold in ("evict", "offload"):  # offload: resident sketches, see kvtier.offload.tier
        return warm, None
    if policy.cold == "sign":
        return warm, SignCodec(g, rotate=policy.cold_rotation)
    return warm, KBitCodec(policy.cold_bits, g, rotate=policy.cold_rotation)


class TieredLayer(CacheLayerMixin):
    """A transformers cache layer holding sinks, hot, warm and cold tiers (see module doc)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        policy: TierPolicy,
        owner: TieredCache | None = None,
        attention: str = "fast",
        layer_idx: int | None = None,
    ):
        super().__init__()
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention={attention!r} is not allowed: expected one of {ATTENTION_PATHS}")
        self.policy = policy
        self.owner = owner
        self.attention = attention
        self.layer_idx = layer_idx
        self.offloader = None
        if policy.cold == "offload" and not policy.is_exact:  # directories are checked here
            from ..offload.prefetch import Offloader

            shared = getattr(owner, "offloader", None)
            self.offloader = shared if shared is not None else Offloader([policy.offload])
        self.reset()

    @property
    def fused(self) -> bool:
        """Whether decode calls may take the fused whole-layer kernel (``attention="fast"``)."""
        return self.attention == "fast"

    # --- transformers interface ---------------------------------------------------------------
    def reset(self) -> None:
        old = getattr(self, "cold", None)
        if getattr(old, "is_offloaded", False):
            old.close()  # its store's records and files go now
        p = self.policy
        bound = None if p.hot_tokens is None else p.hot_tokens + p.block_tokens
        self.hot = HotBuffer(bound)
        self.sinks = SinkBuffer(0 if p.is_exact else p.sink_tokens)
        self.warm: BlockTier | None = None
        self.cold: BlockTier | None = None
        self.sparse_stats = SparseStats()
        self.seen = 0
        self.hot_start = 0
        self.evicted = 0
        self.keys = self.values = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.model_dtype = key_states.dtype
        self.dtype = storage_dtype(self.policy, key_states.dtype)
        self.batch, self.kv_heads, _, self.head_dim = key_states.shape
        warm, cold = make_codecs(self.policy, self.head_dim)
        T = self.policy.block_tokens
        self.warm = BlockTier(warm, T, self.head_dim)
        self.cold = None if cold is None else BlockTier(cold, T, self.head_dim)
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

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            raise RuntimeError(
                "TieredCache needs the model to pass its attention kwargs to cache.update "
                "(transformers >= 5 models do); this model's attention does not."
            )
        if self.owner is not None:
            self.owner.check_attention()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.hot.append(key_states.to(self.dtype), value_states.to(self.dtype))
        self.seen += key_states.shape[2]
        attn_kwargs[HANDLE_KEY] = self
        return key_states, value_states

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
        if not self.is_initialized:
            return
        for tier in (self.hot, self.sinks, self.warm, self.cold):
            if tier is not None:
                tier.index_select(index)
        self.batch = int(index.numel())

    def crop(self, tokens_to_remove: int) -> None:
        """Not supported: quantized tokens cannot be restored (``is_croppable`` is False, so
        transformers does not attempt it, e.g. for assisted decoding)."""
        raise NotImplementedError("TieredCache cannot crop: its compressed tiers cannot be rolled back")

    def offload(self) -> None:  # transformers' layer offloading does not apply to packed tiers
        return None

    def prefetch(self) -> None:
        return None

    # --- tier movement ------------------------------------------------------------------------
    def settle(self, token_valid: torch.Tensor | None) -> None:
        """Move the hot overflow down the tiers.

        Parameters
        ----------
        token_valid : bool ``[B, >= seen]`` real-token mask in index space, or None (all real).
        """
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
        self.hot.shrink()
        if token_valid is None:
            valid = torch.ones(self.batch, n, dtype=torch.bool, device=self.device)
        else:
            valid = token_valid[:, start : start + n].to(self.device, torch.bool)
        valid = self.sinks.capture(k, v, valid)
        self._push_warm(k, v, valid)

    def _push_warm(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        assert self.warm is not None
        T = self.policy.block_tokens
        incoming = k.shape[2] // T
        cap = math.inf if self.policy.warm_tokens is None else self.policy.warm_tokens // T
        overflow = int(max(0, self.warm.nblocks + incoming - cap))
        from_warm = min(self.warm.nblocks, overflow)
        direct = overflow - from_warm  # incoming blocks that would overflow at once
        if from_warm:
            wk, wv, wvalid = self.warm.pop(from_warm, torch.float32)
            self._push_cold(wk, wv, wvalid)
        if direct:
            d = direct * T
            self._push_cold(k[:, :, :d], v[:, :, :d], valid[:, :d])
            k, v, valid = k[:, :, d:], v[:, :, d:], valid[:, d:]
        if k.shape[2]:
            self.warm.push(k, v, valid)

    def _push_cold(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        if self.cold is None:
            self.evicted += k.shape[2]
        else:
            self.cold.push(k, v, valid)

    # --- views for attention and reports --------------------------------------------------------
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
        sketches, block table and checksums as ``cold``, prefetched blocks as ``staging``)."""
        out = {
            "sink": self.sinks.tensors(),
            "hot": self.hot.tensors(),
            "warm": [] if self.warm is None else self.warm.tensors(),
            "cold": [] if self.cold is None else self.cold.tensors(),
        }
        if getattr(self.cold, "is_offloaded", False):
            out["staging"] = self.cold.staging_tensors()
        return out

    def offloaded_bytes(self) -> int:
        """Bytes of this layer's blocks in a block store (host RAM or disk); 0 without offload."""
        return self.cold.offloaded_bytes if getattr(self.cold, "is_offloaded", False) else 0
