"""Lazy access to the transformers adapter (:mod:`kvtier.hf`) from the framework-free packages.

``kvtier.TieredCache``, ``kvtier.TieredLayer``, ``kvtier.enable``, ``kvtier.disable`` and
``kvtier.register`` resolve through :func:`hf_attribute` on first use, so ``import kvtier``
(policies, the planner, codecs, tiers, the block store, kernels) works without transformers, and a
name that needs it raises a clear :class:`ImportError`. Only the top-level package forwards names;
the subpackages (``kvtier.cache``, ``kvtier.attention``) sit below the adapter and never reach up
to it. May import: ``kvtier.hf`` (lazily), nothing else.
"""

from __future__ import annotations

from typing import Any

#: Names the top-level package forwards to :mod:`kvtier.hf`.
HF_NAMES = ("TieredCache", "TieredLayer", "disable", "enable", "register")


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
