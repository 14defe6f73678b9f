"""Registration of kvtier's attention and mask functions with transformers, and enable/disable.

``kvtier.enable(model)`` registers both functions under the name ``"kvtier"`` (a name of our
own, so nothing of transformers' is replaced) and switches the model to it;
``kvtier.disable(model)`` switches the model back to the implementation it had. ``enable`` also
works as a context manager; nested ``enable`` blocks are counted, and the model switches back only
when the outermost one is left (or as many ``disable`` calls as ``enable`` calls were made).
Every ``enable`` leaves the model on kvtier attention, even if something switched it away
(``model.set_attn_implementation("sdpa")``) inside an open block; the outermost ``disable`` then
restores the implementation the model had before the first ``enable``. Enable and disable are
safe to call from several threads.

Part of the transformers adapter. May import: transformers, ``kvtier.attention.interface`` (the
attention function), ``kvtier.hf.mask``, ``kvtier.cache.state``.
"""

from __future__ import annotations

import threading
import weakref

from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from ..attention import interface
from ..cache.state import ATTENTION_NAME
from .mask import kvtier_mask

#: model -> [implementation before the first enable, open enables]
_PREVIOUS: weakref.WeakKeyDictionary[PreTrainedModel, list] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # guards _PREVIOUS and the switch of a model


def register() -> None:
    """Register kvtier's attention and mask functions under ``"kvtier"`` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, interface.kvtier_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvtier_mask)


def attn_implementation(config) -> str | None:  # noqa: ANN001
    """The attention implementation a transformers config selects: transformers keeps it in the
    private ``config._attn_implementation``, read here and nowhere else in kvtier."""
    return getattr(config, "_attn_implementation", None)


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
        with _LOCK:
            current = attn_implementation(model.config)
            if current != ATTENTION_NAME:  # also when switched away inside an open enable
                model.set_attn_implementation(ATTENTION_NAME)
            entry = _PREVIOUS.get(model)
            if entry is None:
                _PREVIOUS[model] = [current, 1]
            else:
                entry[1] += 1

    def __enter__(self) -> PreTrainedModel:
        return self.model

    def __exit__(self, *exc: object) -> None:
        disable(self.model)


def disable(model: PreTrainedModel) -> None:
    """Close one :class:`enable`; the last one restores the attention implementation ``model`` had
    before the first ``enable`` (whatever was set in between)."""
    with _LOCK:
        entry = _PREVIOUS.get(model)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _PREVIOUS[model]
            if attn_implementation(model.config) != entry[0]:
                model.set_attn_implementation(entry[0])
