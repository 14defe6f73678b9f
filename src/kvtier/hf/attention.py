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

``enable`` also wraps the ``forward`` of the model and of every transformers model inside it (the
base model of a ``*ForCausalLM``): a call given a :class:`~kvtier.TieredCache` (any argument, e.g.
``cache=``) runs inside the cache's ``model_call``, which opens the cache's call when the forward is
entered, keeps it when the forward returns, and undoes it if the forward raises anything (so a
failure after the last layer, in the final norm or ``lm_head``, is undone too). The wrapper is an
attribute of the model object, keeps the wrapped forward's signature, and is removed by the
outermost ``disable`` (left inert if something wrapped the forward again after it).

Part of the transformers adapter. May import: transformers, ``kvtier.attention.interface`` (the
attention function), ``kvtier.hf.mask``, ``kvtier.cache.state``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from ..attention import interface
from ..cache.state import ATTENTION_NAME
from .mask import kvtier_mask

#: model -> [implementation before the first enable, open enables, the forward wrappers installed]
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
                _PREVIOUS[model] = [current, 1, _wrap_models(model)]
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
            for wrapper in entry[2]:
                wrapper.remove()
            if attn_implementation(model.config) != entry[0]:
                model.set_attn_implementation(entry[0])


class _ForwardWrapper:
    """``module.forward`` under :class:`enable` (see the module doc); ``remove`` undoes it.

    A deep copy or a pickle of the model carries a wrapper of the copy (``__deepcopy__``, ``__reduce__``)."""

    def __init__(self, module: PreTrainedModel, previous: Callable | None, active: bool = True):
        self.module = weakref.ref(module)  # the model holds the wrapper: no reference cycle
        self.previous = previous  # an instance attribute ``forward`` it replaced, or None (the class's)
        self.active = active
        self.__signature__ = inspect.signature(self._inner(module))  # what transformers reads (``generate``)
        functools.update_wrapper(
            self, type(module).forward, assigned=("__name__", "__qualname__", "__doc__"), updated=()
        )

    def _inner(self, module: PreTrainedModel) -> Callable:
        return self.previous if self.previous is not None else type(module).forward.__get__(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        inner = self._inner(module)
        cache = _tiered_cache(args, kwargs) if self.active else None
        if cache is None:
            return inner(*args, **kwargs)
        with cache.model_call(module):
            return inner(*args, **kwargs)

    def remove(self) -> None:
        self.active = False
        module = self.module()
        if module is not None and module.__dict__.get("forward") is self:
            if self.previous is None:
                del module.forward
            else:
                module.forward = self.previous

    def __deepcopy__(self, memo: dict) -> _ForwardWrapper:
        module = self.module()
        copied = memo.get(id(module))  # the model being copied (registered before its attributes are)
        if copied is None:
            return self
        return _ForwardWrapper(copied, copy.deepcopy(self.previous, memo), self.active)

    def __reduce__(self) -> tuple:
        return _ForwardWrapper, (self.module(), self.previous, self.active)


def _wrap_models(model: PreTrainedModel) -> list[_ForwardWrapper]:
    """Wrap the forward of ``model`` and of every transformers model in it; a wrapper a copied or
    unpickled model already carries is taken over (and removed with the others)."""
    out = []
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            current = m.__dict__.get("forward")
            if isinstance(current, _ForwardWrapper) and current.module() is m:
                current.active = True
                out.append(current)
            else:
                m.forward = _ForwardWrapper(m, current)
                out.append(m.forward)
    return out


def _tiered_cache(args: tuple, kwargs: dict) -> Any:
    """The TieredCache among a forward call's arguments, or None (duck-typed: ``model_call``)."""
    for value in (*kwargs.values(), *args):
        if callable(getattr(type(value), "model_call", None)):
            return value
    return None
