"""Alias kept for existing imports: ``kvtier.cache.layer.TieredLayer`` and the per-layer helpers.

The per-layer logic now lives in :mod:`kvtier.cache.state` (:class:`LayerState`, framework-free)
and the transformers cache layer in :mod:`kvtier.hf.layer` (:class:`TieredLayer`), so importing
this module needs transformers. New code imports from those modules; nothing in kvtier imports
this one.
"""

from ..hf.layer import TieredLayer
from .codecs import Codec, KBitCodec, SignCodec, make_codecs, storage_dtype, value_group
from .state import (
    ATTENTION_NAME,
    ATTENTION_PATHS,
    HANDLE_KEY,
    Journal,
    LayerState,
    forward_epoch,
    mark_forward,
)

__all__ = [
    "ATTENTION_NAME",
    "ATTENTION_PATHS",
    "HANDLE_KEY",
    "Codec",
    "Journal",
    "KBitCodec",
    "LayerState",
    "SignCodec",
    "TieredLayer",
    "forward_epoch",
    "mark_forward",
    "make_codecs",
    "storage_dtype",
    "value_group",
]
