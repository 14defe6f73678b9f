"""Registration of kvtier's attention and mask functions with transformers, and enable/disable.

``kvtier.enable(model)`` registers both functions under the name ``"kvtier"`` (a name of our
own, so nothing of transformers' is replaced) and switches the model to it;
``kvtier.disable(model)`` switches the model back to the implementation it had. ``enable`` also
works as a context manager; nested ``enable`` blocks are counted, and the model switches back only
when the outermost one is left (or as many ``disable`` calls as ``enable`` calls were made).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from ..cache.layer import ATTENTION_NAME, HANDLE_KEY, TieredLayer
from .mask import KVMask, kvtier_mask
from .reference import reference_attention
from .tiered import tiered_attention

#: model -> [implementation before the first enable, open enables]
_PREVIOUS: weakref.WeakKeyDictionary[PreTrainedModel, list] = weakref.WeakKeyDictionary()


def dense_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, scaling: float | None
) -> torch.Tensor:
    """SDPA over dense K/V (layers that are not tiered). Returns ``[B, q, H, D]``."""
    if isinstance(attention_mask, KVMask):
        mask = attention_mask.dense()
    else:
        mask = attention_mask
    is_causal = mask is None and query.shape[2] > 1 and query.shape[2] == key.shape[2]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()


def kvtier_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"kvtier"``.

    With a :class:`TieredLayer` handle in ``kwargs`` it attends over the layer's tiers (``key``
    and ``value`` are then only the new tokens, already stored in the hot tier) and moves the
    hot overflow down the tiers afterwards; without one it is plain SDPA.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer = kwargs.get(HANDLE_KEY)
    if not isinstance(layer, TieredLayer):
        return dense_attention(query, key, value, attention_mask, scaling), None
    if attention_mask is not None and not isinstance(attention_mask, KVMask):
        raise NotImplementedError("tiered layers need kvtier's mask function; got a precomputed mask tensor")
    try:
        if layer.attention == "reference":
            out = reference_attention(layer, query, attention_mask, scaling)
        else:
            out = tiered_attention(layer, query, attention_mask, scaling)
    except BaseException as err:  # undo this call's changes to the cache, then let it through
        layer.abort(err)
        raise
    layer.settle(None if attention_mask is None else attention_mask.padding)  # all or nothing itself
    return out, None


def register() -> None:
    """Register kvtier's attention and mask functions under ``"kvtier"`` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvtier_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvtier_mask)


class enable:
    """Switch ``model`` to kvtier attention; undo with :func:`disable` or by leaving the ``with``.

    >>> with kvtier.enable(model):
    ...     model.generate(**inputs, cache=kvtier.TieredCache(model.config))
    """

    def __init__(self, model: PreTrainedModel):
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"kvtier.enable expects a transformers model, got {type(model).__name__}")
        register()
        self.model = model
        entry = _PREVIOUS.get(model)
        if entry is None:
            current = model.config._attn_implementation
            if current != ATTENTION_NAME:
                model.set_attn_implementation(ATTENTION_NAME)
            _PREVIOUS[model] = [current, 1]
        else:
            entry[1] += 1

    def __enter__(self) -> PreTrainedModel:
        return self.model

    def __exit__(self, *exc: object) -> None:
        disable(self.model)


def disable(model: PreTrainedModel) -> None:
    """Close one :class:`enable`; the last one restores the attention implementation ``model`` had."""
    entry = _PREVIOUS.get(model)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _PREVIOUS[model]
        if entry[0] != ATTENTION_NAME:
            model.set_attn_implementation(entry[0])
