"""CPU kernels over kvtier's packed vLLM pages with block tables: one attention call and one update
call per layer and step, and a page decoder for prefill chunks.

:func:`attend`: each (request, KV head) task runs an online softmax over the request's packed blocks
(4-bit keys per channel, 4- or 3-bit values per token, read straight from vLLM's pages, never
dequantized to memory) and then over its exact rows, read in place in the model dtype (the side buffer's rows of
its partly filled block, then the step's new K/V, causal); the output goes straight into the
caller's tensor. :func:`update`: packs the blocks a step fills (the bytes of
:meth:`kvtier.codecs.pages.PageFormat.encode`) and writes the other new tokens into the side
buffer. :func:`decode`: whole pages into token-major rows of the model dtype. The torch references
are the torch backend of :class:`kvtier.vllm.pages.attention.PagedAttention` (whose ``"cpp"`` backend
calls these) and :meth:`~kvtier.codecs.pages.PageFormat.decode`. The C++ is one file per call,
``csrc/vllm_paged_attend.cpp``, ``vllm_paged_encode.cpp`` and ``vllm_paged_decode.cpp`` (over
``vllm_paged.h``, the pieces they share, and ``page_codes.h``, the page), built as one module by
:mod:`kvtier.kernels.build`; when that fails :func:`available` is False and callers use the torch
path. Imports only torch and ``.build``.
"""

from __future__ import annotations

import functools

import torch

from . import build


@functools.lru_cache(maxsize=1)
def _module():
    return build.load(
        "kvtier_vllm_paged_v21",
        ("vllm_paged_attend.cpp", "vllm_paged_encode.cpp", "vllm_paged_decode.cpp"),
        ["vllm_paged_attend", "vllm_paged_update", "vllm_paged_decode"],
        ("-fno-math-errno",),
    )


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the kernel compiled (once per machine; cached by torch)."""
    return build.check(_module, "kvtier vLLM paged CPU kernel", "the torch path")


def attend(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    side: torch.Tensor,
    pages: torch.Tensor,
    reqs: torch.Tensor,
    pstart: torch.Tensor,
    pids: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    layout: list[int],
    level: float = 1.0,
    window: int = 0,
    max_query: int = 4,
    counts: torch.Tensor | None = None,
) -> None:
    """Write into ``out [N, Hq, D]`` (fp32 or the model dtype; rows of other requests untouched)
    the attention of each request ``r``'s new tokens ``q[qs:qe]`` (``reqs[r] = qs, qe, side slot,
    side rows, head block, head rows``; ``q [N, Hq, D]`` in the model dtype, scaled here by
    ``scale``) over its packed pages ``pages[pids[pstart[r]:pstart[r+1]]]`` (uint8 ``[B, page]``),
    the first ``head rows`` tokens of page ``head block`` (when > 0), and its exact rows:
    ``side[slot, :side rows]`` (``[slots, T, 2, H, D]``), then ``key, value [qs:qe]`` (``[N, H, D]``),
    causal. Rows of q / key / value / out need only be contiguous. ``layout``: H, D, T, key group,
    value group, sink tokens, page bytes, the byte offsets of kscale, kzero, vscale, vzero, sink,
    kcodes, vcodes, then the value code width (4 or 3; keys are 4-bit): see
    :meth:`kvtier.codecs.pages.PageFormat.layout`.

    ``level < 1``: sparse decode for requests of at most ``max_query`` new tokens (not split across
    threads): every packed token is scored, values are read only for the tokens kept by
    :func:`kvtier.vllm.pages.paged.select_packed` (row mass ``level``, the last ``window`` tokens before the
    new ones, the sinks), weights renormalized over them. ``counts`` (int64 ``[2]``, when given) is
    incremented by the (tokens valued, tokens scored) of those requests, summed over KV heads."""
    _module().vllm_paged_attend(
        q,
        key,
        value,
        side,
        pages,
        reqs,
        pstart,
        pids,
        out,
        float(scale),
        layout,
        float(level),
        int(window),
        int(max_query),
        torch.empty(0, dtype=torch.long) if counts is None else counts,
    )


def update(
    pages: torch.Tensor,
    side: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    enc: torch.Tensor,
    writes: torch.Tensor,
    layout: list[int],
) -> None:
    """Pack the blocks ``enc [E, 4]`` (page, side slot, side rows, first new token: the block's first
    ``side rows`` tokens from ``side[slot]``, the rest from ``key, value [first:]``) into
    pages, then copy new token ``writes[i, 1]`` into side row ``writes[i, 0]`` (``slot * T + offset``)."""
    _module().vllm_paged_update(pages, side, key, value, enc, writes, layout)


def decode(
    pages: torch.Tensor,
    pids: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dtype: torch.dtype,
    layout: list[int],
) -> None:
    """Write the pages ``pages[pids]`` of model dtype ``dtype`` decoded, token-major, into
    ``key, value [len(pids) * T, H, D]`` (contiguous, fp32 or ``dtype``):
    :meth:`kvtier.codecs.pages.PageFormat.decode` in that dtype, transposed."""
    _module().vllm_paged_decode(pages, pids, key, value, torch.empty(0, dtype=dtype), layout)
