"""Whether the C++ kernels run their tasks on torch's threads: a probe built like every kernel.

Each kernel splits its work with ATen's ``parallel_for``, which runs on ``torch.get_num_threads()``
threads only when the kernel is built with OpenMP (:data:`kvtier.kernels.build.OPENMP_FLAGS`);
:func:`threads` reports how many threads a probe built with the same flags actually used, so a
serial build (a compiler without OpenMP) shows up in every results file's ``env``
(``kernel_threads``) and in the tests instead of as a silent slowdown. The C++ is
``csrc/parallel_probe.cpp``. Imports only ``.build`` (and torch through it).
"""

from __future__ import annotations

import functools

from . import build


@functools.lru_cache(maxsize=1)
def _module():
    return build.load("kvtier_probe_v1", "parallel_probe.cpp", ["parallel_threads"], ())


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the probe compiled (once per machine; cached by torch)."""
    return build.check(_module, "kvtier parallel probe", "nothing (no C++ kernels either)")


def threads(tasks: int = 64) -> int:
    """Distinct threads ATen's ``parallel_for`` ran ``tasks`` short tasks on (at most
    ``torch.get_num_threads()``); 0 when no kernel can be built."""
    if not available():
        return 0
    return int(_module().parallel_threads(int(tasks)))
