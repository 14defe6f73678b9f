"""Opt one vLLM engine into kvtier's packed KV pages: :func:`engine_kwargs`, :func:`serve_args`,
:func:`attention_backend`.

>>> from vllm import LLM
>>> from kvtier.vllm import attention_backend, engine_kwargs
>>> with attention_backend("default"):            # kvtier over CPU_ATTN while this engine is built
...     llm = LLM(model=path, **engine_kwargs("default"))

Nothing changes in vLLM until :func:`attention_backend` is entered, and everything is restored
when it exits (vLLM's registry override and its backend-selection cache); such an engine must be
built in this process (on the CPU platform: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). For ``vllm
serve`` (and engines in processes of their own), kvtier's ``vllm.general_plugins`` entry point
(:func:`kvtier.vllm.plugin.register`, loaded by vLLM in each of its processes) registers a
per-engine selector, :data:`SELECT_PATH`: an engine whose ``additional_config`` names a kvtier
policy (the flags of :func:`serve_args`) gets kvtier's backend, every other engine vLLM's own
``CPU_ATTN`` class. Imports vLLM only inside functions; :mod:`.pages.policy` and
:mod:`kvtier.codecs.pages` otherwise.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from ..codecs.pages import PageFormat
from .pages.policy import CONFIG_KEY, SELECT, PagePolicy, get_page_policy, policy_name

#: class path of the per-engine backend selector (:func:`kvtier.vllm.pages.backend.selected_backend`)
SELECT_PATH = f"kvtier.vllm.pages.backend.{SELECT}"

#: what the ``vllm serve`` plugin registered for ``CPU_ATTN`` in this process (None: not loaded);
#: :func:`attention_backend` restores it on exit when nothing was registered before it
_plugin_path: str | None = None


def engine_kwargs(policy: str | PagePolicy = "default", *, max_num_seqs: int | None = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM(...)`` that make the engine store and attend its KV through
    kvtier's backend for ``policy`` (registered by :func:`attention_backend`).

    ``block_size`` is the policy's page; ``max_num_seqs`` (default: the policy's ``side_slots``,
    else vLLM's default) bounds the requests running at once, each holding one exact partly
    filled block in the side buffer. For ``vllm serve`` and engines in processes of their own,
    :func:`serve_args` gives the same settings as flags; kvtier's plugin picks the backend there.
    """
    p = get_page_policy(policy)
    out: dict[str, Any] = {"additional_config": {CONFIG_KEY: policy_name(p)}, "block_size": p.block_size}
    if not p.packed:
        return out
    # named explicitly so that vLLM's backend-selection cache never hands this engine the class
    # of an engine that did not ask for kvtier (the cache key holds the backend, not the config)
    out["attention_backend"] = "CPU_ATTN"
    seqs = max_num_seqs or p.side_slots
    if seqs is not None:
        if p.side_slots is not None and seqs > p.side_slots:
            raise ValueError(f"max_num_seqs={seqs} is not allowed: the policy's side buffer holds {p.side_slots}")
        out["max_num_seqs"] = seqs
    return out


def serve_args(policy: str | PagePolicy = "default", *, max_num_seqs: int | None = None) -> list[str]:
    """The ``vllm serve`` flags of :func:`engine_kwargs` (kvtier's plugin, installed with kvtier,
    picks the backend in the server's engine process):

    >>> " ".join(serve_args("default"))  # doctest: +SKIP
    '--additional-config {"kvtier_attention":"KVTierAttention_b4_..."} --block-size 128 ...'

    e.g. ``vllm serve MODEL $(python -c 'from kvtier.vllm import serve_args; print(*serve_args())')``.
    """
    import json

    out = []
    for key, value in engine_kwargs(policy, max_num_seqs=max_num_seqs).items():
        # compact JSON (no spaces), so the flags survive the shell's word splitting of $(...)
        out += [
            "--" + key.replace("_", "-"),
            json.dumps(value, separators=(",", ":")) if isinstance(value, dict) else str(value),
        ]
    return out


@contextmanager
def attention_backend(policy: str | PagePolicy = "default"):
    """Register kvtier's backend for ``policy`` over vLLM's ``CPU_ATTN`` for the engines built inside
    this block; restore vLLM's previous choice on exit. Yields the backend class."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum, register_backend

    from .pages.backend import backend_class

    cls = backend_class(policy)
    member = AttentionBackendEnum.CPU_ATTN
    previous = _ATTN_OVERRIDES.get(member)
    register_backend(member, f"{cls.__module__}.{cls.__qualname__}")
    selector._cached_get_attn_backend.cache_clear()
    try:
        yield cls
    finally:
        restore = previous if previous is not None else _plugin_path
        if restore is None:
            member.clear_override()
        else:
            register_backend(member, restore)
        selector._cached_get_attn_backend.cache_clear()


def kv_bytes_per_token(policy: str | PagePolicy, *, layers: int, heads: int, head_dim: int, dtype) -> float:  # noqa: ANN001
    """Bytes of vLLM's block pool per token under ``policy`` (all layers; vLLM's exact page for ``exact``)."""
    p = get_page_policy(policy)
    exact = 2 * heads * head_dim * dtype.itemsize * layers
    if not p.packed:
        return float(exact)
    fmt = PageFormat(p, heads, head_dim, dtype)
    return fmt.page_bytes * layers / p.block_size
