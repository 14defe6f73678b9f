"""Building the C++ CPU kernels: compiled once per machine on first use (torch caches the build),
and a check that turns any build failure into a warning and a fallback to the torch path.

Owns reading the kernel sources in ``kernels/csrc/`` (shipped as package data) and the flags they
are built with; imports only the standard library and, when a kernel is built, ``torch`` and
:mod:`kvtier.codecs.constants`. A source is handed to ``torch.utils.cpp_extension.load_inline`` as
text, with every ``#include "x.h"`` of a ``csrc/`` file replaced by that file's text: the compiled
text then depends only on the sources, not on where the package is installed, so every checkout and
install shares one cached build (one per torch installation: see :func:`load`). A module may be
built from several sources (one translation unit, their texts in order: :func:`sources`); a header
then comes in once, at its first include, as ``#pragma once`` would have it.

A header in :func:`generated` (``codec_constants.h``: the codec constants, written from their Python
definitions) is no file: its text comes from Python when a kernel is built, and a hash of it is part
of the built module's name (:func:`module_name`), so a changed constant builds a new module.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import warnings
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

#: Flags every kernel is built with: vectorized loops for this machine.
BASE_CFLAGS = ("-O3", "-march=native", "-fopenmp-simd")

#: Flags that make ATen's ``parallel_for`` in a kernel run on torch's threads. ATen's OpenMP backend
#: expands ``parallel_for`` inline in the kernel's own code as ``#pragma omp parallel``: without
#: ``-fopenmp`` the pragma is ignored and every task runs on the calling thread (measured: the vLLM
#: paged kernel took the same 14.9 ms per layer at 1 and 2 threads, 5.9 ms at 2 with these flags).
#: The kernel then uses torch's own OpenMP runtime (torch's ``lib/libgomp.so.1``, already loaded),
#: so ``torch.set_num_threads`` governs it. A compiler without OpenMP gets a serial build (warned).
OPENMP_FLAGS = ("-fopenmp",)

#: A line including a file of ``csrc/`` (``#include "common.h"``); system headers use ``<...>``.
_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)


def cpu_has_avx512() -> bool:
    """True when this CPU reports AVX-512F (``/proc/cpuinfo``): ``-march=native`` then builds the
    kernels' AVX-512 paths. False where the file is unreadable (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


def generated() -> dict[str, Callable[[], str]]:
    """Headers written from Python when a kernel is built (no file in ``csrc/``): name -> its text."""
    from ..codecs import constants

    return {constants.HEADER: constants.header}


def source(filename: str, seen: set[str] | None = None) -> str:
    """The C++ text of ``csrc/<filename>`` as compiled, its ``#include "..."`` lines replaced by those
    files (or by a :func:`generated` header's text). ``seen``: the headers already in the text this
    one joins (updated); an include of one of them becomes a comment."""
    made = generated()
    if filename in made:
        return made[filename]()
    text = (resources.files(__package__) / "csrc" / filename).read_text(encoding="utf-8")
    seen = set() if seen is None else seen

    def include(m: re.Match) -> str:
        header = m.group(1)
        if header in seen:
            return f'// #include "{header}": above'
        seen.add(header)
        return source(header, seen).rstrip("\n")

    return _LOCAL_INCLUDE.sub(include, text)


def sources(filenames: str | Sequence[str]) -> str:
    """The C++ text a module of ``csrc/<filename>`` (one name or several) is built from: each file's
    :func:`source` in order, a header once (at its first include)."""
    seen: set[str] = set()
    return "\n".join(source(f, seen) for f in _names(filenames))


def _names(filenames: str | Sequence[str]) -> tuple[str, ...]:
    return (filenames,) if isinstance(filenames, str) else tuple(filenames)


def _generated_in(filename: str) -> list[str]:
    """The :func:`generated` headers the compiled text of ``csrc/<filename>`` includes, in order."""
    made = generated()
    if filename in made:
        return [filename]
    text = (resources.files(__package__) / "csrc" / filename).read_text(encoding="utf-8")
    return [h for include in _LOCAL_INCLUDE.findall(text) for h in _generated_in(include)]


def module_name(name: str, filename: str | Sequence[str]) -> str:
    """The name ``csrc/<filename>`` (one name or several) is built as: ``name``, the torch tag
    (:func:`_torch_tag`) and, when it includes a :func:`generated` header, 8 hex digits of that
    header's text."""
    built = f"{name}_{_torch_tag()}"
    made = generated()
    headers = "".join(made[h]() for h in dict.fromkeys(h for f in _names(filename) for h in _generated_in(f)))
    if headers:
        built += "_" + hashlib.sha1(headers.encode()).hexdigest()[:8]
    return built


def load(name: str, filename: str | Sequence[str], functions: list[str], cflags: tuple[str, ...] = ()) -> Any:
    """Build (or load torch's cached build of) ``csrc/<filename>`` (one source, or several built as one:
    :func:`sources`) as module ``name`` exposing ``functions``.

    Needs a C++ compiler and ninja; ``torch.utils.cpp_extension.load_inline`` generates the Python
    bindings. ``name`` carries a version suffix, bumped whenever the compiled text changes; the
    module is built as ``<module_name>_omp`` with :data:`OPENMP_FLAGS` (its tasks on torch's
    threads) or, where that build fails, as ``<module_name>`` without them (one thread, with a
    warning); the torch tag in :func:`module_name` keeps environments with their own torch apart.
    """
    from torch.utils.cpp_extension import load_inline

    text = sources(filename)
    built = module_name(name, filename)
    try:
        return _load(load_inline, built + "_omp", text, functions, (*cflags, *OPENMP_FLAGS), OPENMP_FLAGS)
    except Exception as err:  # noqa: BLE001 - e.g. a compiler without OpenMP: the serial build below
        omp_error = err
    module = _load(load_inline, built, text, functions, cflags, ())
    warnings.warn(
        f"kvtier: {name} built without OpenMP (its build with {' '.join(OPENMP_FLAGS)} failed: "
        f"{str(omp_error).splitlines()[0] if str(omp_error) else type(omp_error).__name__}); "
        "it runs on one thread",
        stacklevel=3,
    )
    return module


def _torch_tag() -> str:
    """8 hex digits of where torch is installed. torch's build command names its include folders,
    so two environments with their own torch (kvtier's ``.venv`` and ``.venv-vllm``) would rebuild a
    shared module on every switch; with the tag each keeps its own build, and checkouts and installs
    using the same torch still share one."""
    import torch

    return hashlib.sha1(os.path.dirname(os.path.realpath(torch.__file__)).encode()).hexdigest()[:8]


def _load(load_inline, name: str, text: str, functions, cflags, ldflags) -> Any:  # noqa: ANN001
    waiting = lock_notice(name)
    if waiting:
        warnings.warn(waiting, stacklevel=3)
    return load_inline(
        name=name,
        cpp_sources=[text],
        functions=functions,
        extra_cflags=[*BASE_CFLAGS, *cflags],
        extra_ldflags=list(ldflags),
        verbose=False,
    )


def lock_notice(name: str) -> str | None:
    """A message when torch's build lock of module ``name`` exists, else None.

    torch waits, silently and without end, while ``<build dir>/lock`` exists: a build of the same
    module in another process holds it, or a build that was killed left it behind.
    """
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: skip the notice if it moves

        lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    except Exception:  # noqa: BLE001 - the notice is a courtesy, never a failure
        return None
    if not os.path.exists(lock):
        return None
    age = (time.time() - os.path.getmtime(lock)) / 60
    return (
        f"kvtier: waiting for the build lock {lock} ({age:.0f} min old): another process is building "
        f"{name}, or a killed build left the file; if no build is running, delete it"
    )


def check(module: Callable[[], Any], what: str, fallback: str) -> bool:
    """True when ``module()`` builds; otherwise warn that ``what`` is unavailable and ``fallback`` runs."""
    try:
        module()
        return True
    except Exception as err:  # noqa: BLE001 - any build failure means: use the fallback
        warnings.warn(f"{what} unavailable, using {fallback}: {err}", stacklevel=3)
        return False
