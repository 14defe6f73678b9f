"""Building the C++ CPU kernels: compiled once per machine on first use (torch caches the build),
and a check that turns any build failure into a warning and a fallback to the torch path."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

#: Flags every kernel is built with: vectorized loops for this machine.
BASE_CFLAGS = ("-O3", "-march=native", "-fopenmp-simd")


def load(name: str, source: str, functions: list[str], cflags: tuple[str, ...] = ()) -> Any:
    """``torch.utils.cpp_extension.load_inline`` of one C++ source (needs a compiler and ninja)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name=name, cpp_sources=[source], functions=functions, extra_cflags=[*BASE_CFLAGS, *cflags], verbose=False
    )


def check(module: Callable[[], Any], what: str, fallback: str) -> bool:
    """True when ``module()`` builds; otherwise warn that ``what`` is unavailable and ``fallback`` runs."""
    try:
        module()
        return True
    except Exception as err:  # noqa: BLE001 - any build failure means: use the fallback
        warnings.warn(f"{what} unavailable, using {fallback}: {err}", stacklevel=3)
        return False
