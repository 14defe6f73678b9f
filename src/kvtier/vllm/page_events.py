"""Whole pages written from outside the attention: how the prefix store tells the packed-page backend.

The prefix store (:mod:`kvtier.vllm.store`) loads full blocks into vLLM's pages; the packed-page
backend (:mod:`kvtier.vllm.pages`) keeps, per engine, the exact tokens of partly filled blocks in a
side buffer keyed by vLLM block id. A loaded block's id may still have a side slot from its last,
partial use, or none while the block is not known to be packed; vLLM recomputes the last token of a
prompt the store held whole, so the next step reads the loaded block in part, and that read must come
from the page. The two packages never import each other: the backend registers a listener here per
engine (:func:`listen`), the store's worker calls :func:`pages_loaded` after each load.

Pure Python; imports nothing of kvtier.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Protocol


class Listener(Protocol):
    def pages_loaded(self, blocks: list[int]) -> None: ...


#: listeners by vLLM engine id (a process may build several engines; block ids are an engine's own),
#: held weakly
_LISTENERS: dict[str | None, weakref.WeakSet] = {}


def listen(engine_id: str | None, listener: Listener) -> None:
    """Call ``listener.pages_loaded(blocks)`` whenever whole pages of ``engine_id`` are loaded, while it lives."""
    _LISTENERS.setdefault(engine_id, weakref.WeakSet()).add(listener)


def pages_loaded(engine_id: str | None, blocks: Iterable[int]) -> None:
    """vLLM blocks of engine ``engine_id`` whose pages were just written whole (full packed pages)."""
    blocks = [int(b) for b in blocks]
    for listener in list(_LISTENERS.get(engine_id, ())):
        listener.pages_loaded(blocks)
