"""``KVMask``: a compact mask description instead of a dense ``[B, 1, q, kv]`` tensor.

kvtier's mask function (:func:`kvtier.hf.mask.kvtier_mask`, registered with transformers) returns
one per forward call, built from the 2D padding mask and the sizes the cache reports. Tiered
layers need only the per-token padding row and the query offset (causality inside the current
chunk is positional), so :class:`KVMask` keeps those and builds the dense boolean mask lazily,
for layers that are not tiered (sliding-window layers of hybrid models, or a model run with
kvtier attention but a plain cache).

Framework-free: transformers' ``sdpa_mask`` is imported only when a dense mask is built.
May import: torch (and transformers inside :meth:`KVMask.dense`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class KVMask:
    """Mask of one forward call.

    Attributes
    ----------
    batch_size, q_length, kv_length, q_offset, kv_offset : sizes as transformers computed them.
    padding : bool ``[B, kv_length]`` (True = real token) in index space, or None if no padding.
    causal : the mask is plain causal (+ padding); tiered layers require this.
    mask_function : transformers' mask function of the call (None: plain causal).
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    padding: torch.Tensor | None
    causal: bool
    mask_function: Callable | None = None
    device: Any = "cpu"
    _extra: dict = field(default_factory=dict, repr=False)
    _dense: torch.Tensor | None = field(default=None, repr=False)
    #: attention plans of this call per layer layout (:func:`kvtier.attention.plan.plan_for`)
    plans: dict = field(default_factory=dict, repr=False, compare=False)

    def dense(self) -> torch.Tensor:
        """bool ``[B, 1, q_length, kv_length]`` (True = attend), built once."""
        if self._dense is None:
            from transformers.masking_utils import causal_mask_function, sdpa_mask

            self._dense = sdpa_mask(
                batch_size=self.batch_size,
                q_length=self.q_length,
                kv_length=self.kv_length,
                q_offset=self.q_offset,
                kv_offset=self.kv_offset,
                mask_function=self.mask_function or causal_mask_function,
                attention_mask=self._extra.get("attention_mask"),
                allow_is_causal_skip=False,
                use_vmap=self._extra.get("use_vmap", False),
                device=self.device,
            )
        return self._dense
