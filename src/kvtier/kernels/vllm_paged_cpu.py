"""CPU kernel: attention over kvtier's packed vLLM pages with block tables, one call per layer.

Each (request, KV head) task runs an online softmax over the request's packed blocks (4-bit keys
per channel and values per token, read straight from vLLM's pages, never dequantized to memory)
and then over its exact rows (side buffer and the step's new tokens, causal). The torch path in
:func:`kvtier.vllm.paged.attend_layer` is the reference it is tested against. The C++ is
``csrc/vllm_paged_attention.cpp``, built by :mod:`kvtier.kernels.build`; when that fails
:func:`available` is False and callers use the torch path. Imports only torch and ``.build``.
"""

from __future__ import annotations

import functools

import torch

from . import build


@functools.lru_cache(maxsize=1)
def _module():
    return build.load(
        "kvtier_vllm_paged_v3", "vllm_paged_attention.cpp", ["vllm_paged_attention"], ("-fno-math-errno",)
    )


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the kernel compiled (once per machine; cached by torch)."""
    return build.check(_module, "kvtier vLLM paged CPU kernel", "the torch path")


def paged_attention(
    q: torch.Tensor,
    pages: torch.Tensor,
    qstart: torch.Tensor,
    pstart: torch.Tensor,
    pids: torch.Tensor,
    ek: torch.Tensor,
    ev: torch.Tensor,
    estart: torch.Tensor,
    layout: list[int],
) -> torch.Tensor:
    """``out [N, Hq, D]`` fp32 of pre-scaled ``q [N, Hq, D]`` fp32 for each request's new tokens
    ``q[qstart[r, 0]:qstart[r, 1]]`` (rows of ``out`` outside every request are left unset) over its packed pages
    ``pages[pids[pstart[r]:pstart[r+1]]]`` (uint8 ``[B, page]``) and exact rows
    ``ek, ev [estart[r]:estart[r+1]]`` (fp32 ``[E, H, D]``, causal over its last ``q`` rows).
    ``layout``: H, D, T, key group, value group, sink tokens, page bytes, then the byte offsets of
    kscale, kzero, vscale, vzero, sink, kcodes, vcodes (see :meth:`kvtier.vllm.pages.PageFormat.layout`)."""
    out = torch.empty_like(q)
    _module().vllm_paged_attention(q, pages, qstart, pstart, pids, ek, ev, estart, out, layout)
    return out
