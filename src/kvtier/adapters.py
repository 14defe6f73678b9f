"""Lazy access to the transformers adapter (:mod:`kvtier.hf`) from the framework-free packages.

``kvtier.TieredCache``, ``kvtier.enable``, ``kvtier.cache.TieredLayer``, ``kvtier.attention.enable``
and the like resolve through :func:`hf_attribute` on first use, so ``import kvtier`` (policies, the
planner, codecs, tiers, the block store, kernels) works without transformers, and a name that
needs it raises a clear :class:`ImportError`. May import: ``kvtier.hf`` (lazily), nothing else.
"""

from __future__ import annotations

from typing import Any

#: Names each package forwards to :mod:`kvtier.hf`.
HF_NAMES = ("TieredCache", "TieredLayer", "disable", "enable", "kvtier_mask", "register")


def hf_attribute(owner: str, name: str) -> Any:
    """``kvtier.hf.<name>``; an :class:`ImportError` naming ``<owner>.<name>`` without transformers."""
    try:
        from . import hf
    except ImportError as err:
        if not (err.name or "").split(".")[0] == "transformers":
            raise
        raise ImportError(
            f"{owner}.{name} needs transformers>=5.24: pip install 'kvtier[hf]' ({err})", name=err.name
        ) from err
    return getattr(hf, name)
