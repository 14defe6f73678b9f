"""kvtier's mask function, registered with transformers under ``"kvtier"``.

Part of the transformers adapter. May import: transformers, ``kvtier.attention.mask`` (the
:class:`KVMask` it returns), ``kvtier.cache.state`` (:func:`mark_forward`, the mask ids).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.masking_utils import causal_mask_function, prepare_padding_mask

from ..attention.mask import KVMask
from ..cache.state import mark_forward


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

    transformers builds it once per forward call, before the layers run, in the thread of the
    call; each build takes a new mask id for that thread (``kvtier.cache.state.mark_forward``),
    which tells a cache that this call runs kvtier attention."""
    mark_forward()
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
