"""kvtier's mask function: a compact mask description instead of a dense ``[B, 1, q, kv]`` tensor.

transformers calls the registered mask function once per forward with the 2D padding mask and
the sizes the cache reports. Tiered layers need only the per-token padding row and the query
offset (causality inside the current chunk is positional), so :class:`KVMask` keeps those and
builds the dense boolean mask lazily, for layers that are not tiered (sliding-window layers of
hybrid models, or a model run with kvtier attention but a plain cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

from ..cache.layer import FORWARDS


@dataclass
class KVMask:
    """Mask of one forward call.

    Attributes
    ----------
    batch_size, q_length, kv_length, q_offset, kv_offset : sizes as transformers computed them.
    padding : bool ``[B, kv_length]`` (True = real token) in index space, or None if no padding.
    causal : the mask is plain causal (+ padding); tiered layers require this.
    """

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    padding: torch.Tensor | None
    causal: bool
    mask_function: Callable = causal_mask_function
    device: Any = "cpu"
    _extra: dict = field(default_factory=dict, repr=False)
    _dense: torch.Tensor | None = field(default=None, repr=False)

    def dense(self) -> torch.Tensor:
        """bool ``[B, 1, q_length, kv_length]`` (True = attend), built once."""
        if self._dense is None:
            self._dense = sdpa_mask(
                batch_size=self.batch_size,
                q_length=self.q_length,
                kv_length=self.kv_length,
                q_offset=self.q_offset,
                kv_offset=self.kv_offset,
                mask_function=self.mask_function,
                attention_mask=self._extra.get("attention_mask"),
                allow_is_causal_skip=False,
                use_vmap=self._extra.get("use_vmap", False),
                device=self.device,
            )
        return self._dense


def kvtier_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    device: Any = "cpu",
    **kwargs: Any,
) -> KVMask:
    """Mask function registered under the name ``"kvtier"`` (signature of ``sdpa_mask``).

    transformers builds it once per forward call, before the layers run; each build advances
    ``kvtier.cache.layer.FORWARDS``, which tells a cache that this call runs kvtier attention."""
    FORWARDS[0] += 1
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None and bool(padding.all()):
        padding = None
    return KVMask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=int(q_offset),
        kv_offset=int(kv_offset),
        padding=padding,
        causal=mask_function is causal_mask_function,
        mask_function=mask_function,
        device=device,
        _extra={"attention_mask": attention_mask, "use_vmap": use_vmap},
    )
