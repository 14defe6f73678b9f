"""The transformers adapter: kvtier's cache and attention as transformers objects.

Owns :class:`TieredLayer` (``LayerState`` + ``CacheLayerMixin``, :mod:`.layer`),
:class:`TieredCache` (a transformers ``Cache``, :mod:`.cache`), kvtier's mask function
(:mod:`.mask`) and the registration of the mask and attention functions with ``enable`` /
``disable`` (:mod:`.attention`). This is the only package that imports transformers at module
level; it needs ``pip install 'kvtier[hf]'``.

May import: transformers and every kvtier module below it (``cache``, ``attention``, ``offload``,
``policy``, ``stats``, ``diagnostics``, ``errors``); nothing in kvtier's core imports it except
through the lazy names of :mod:`kvtier.adapters` (``kvtier.TieredCache`` and friends).
"""

from ..attention.interface import kvtier_attention
from ..attention.mask import KVMask
from .attention import disable, enable, register
from .cache import TieredCache
from .layer import TieredLayer
from .mask import kvtier_mask

__all__ = [
    "KVMask",
    "TieredCache",
    "TieredLayer",
    "disable",
    "enable",
    "kvtier_attention",
    "kvtier_mask",
    "register",
]
