"""kvtier's ``vllm.general_plugins`` entry point, for ``vllm serve``: :func:`register`.

vLLM runs an engine's core in a process of its own (``vllm serve`` always), where the
registration of :func:`kvtier.vllm.engine.attention_backend` in the parent does not exist. vLLM
calls every ``vllm.general_plugins`` entry point in each process it starts; :func:`register`
points ``CPU_ATTN`` at kvtier's per-engine selector (:data:`kvtier.vllm.engine.SELECT_PATH`,
resolved by :func:`kvtier.vllm.pages.backend.selected_backend` while an engine picks its backend): an
engine whose ``additional_config`` names a kvtier policy gets kvtier's packed pages, every other
engine vLLM's own ``CPU_ATTN`` class, so installing kvtier changes no engine that does not ask::

    vllm serve MODEL $(python -c 'from kvtier.vllm import serve_args; print(*serve_args())')

Leaves an existing override of ``CPU_ATTN`` (an :func:`~kvtier.vllm.engine.attention_backend`
block being entered, or another package's) in place. Idempotent. Imports vLLM's registry only
when called; :mod:`.engine` otherwise.
"""

from __future__ import annotations

from . import engine


def register() -> None:
    """Register kvtier's per-engine backend selector for ``CPU_ATTN`` (vLLM calls this)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    engine._plugin_path = engine.SELECT_PATH
    member = AttentionBackendEnum.CPU_ATTN
    if not member.is_overridden():
        register_backend(member, engine.SELECT_PATH)
