"""The transformers adapter: kvtier's cache and attention as transformers objects.

Owns :class:`TieredLayer` (``LayerState`` + ``CacheLayerMixin``, :mod:`.layer`),
:class:`TieredCache` (a transformers ``Cache``, :mod:`.cache`), kvtier's mask function
(:mod:`.mask`) and the registration of the mask and attention functions with ``enable`` /
``disable`` (:mod:`.attention`). This is the only package that imports transformers at module
level; it needs ``pip install 'kvtier[hf]'``.

May import: transformers and every kvtier module below it (``diagnostics``, ``attention``,
``cache``, ``offload``, ``codecs``, ``policy`` and the leaf modules ``stats``, ``errors``); never
``kvtier.vllm``, ``eval``, ``cli``, ``doctor`` or ``models``. Nothing in kvtier's core imports it
except through the lazy names of :mod:`kvtier.adapters` (``kvtier.TieredCache`` and friends).
"""

import re

import transformers

#: The oldest transformers whose models pass their attention kwargs to ``cache.update`` (which
#: :class:`TieredLayer` needs to hand itself to kvtier's attention); 5.19-5.23 do not.
MIN_TRANSFORMERS = (5, 24)
_found = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
if _found < MIN_TRANSFORMERS:
    raise ImportError(
        f"kvtier's transformers adapter needs transformers>=5.24, found {transformers.__version__} "
        "(older models do not pass their attention kwargs to cache.update)",
        name="transformers",
    )

from ..attention.interface import kvtier_attention  # noqa: E402
from ..attention.mask import KVMask  # noqa: E402
from .attention import disable, enable, register  # noqa: E402
from .cache import TieredCache  # noqa: E402
from .layer import TieredLayer  # noqa: E402
from .mask import kvtier_mask  # noqa: E402

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
