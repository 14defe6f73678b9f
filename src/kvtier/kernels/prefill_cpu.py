"""CPU kernel of a prefill chunk's causal attention in bf16 (AVX-512 BF16 dot products, fp32 sums).

:func:`attend`: query ``i`` of the chunk's ``n`` new tokens (the last ``n`` of the ``L`` keys)
attends keys ``0 .. L - n + i`` with grouped query heads; ``q, k, v, out`` bf16. It is a
FlashAttention loop over blocks of 64 keys: scores are exact bf16 products summed in fp32, the
probabilities are rounded to bf16 for the sum over values (as FlashAttention does on GPUs), every
sum is fp32 and the output is rounded to bf16 once. :func:`attend_reference` is the plain-torch
reference (fp32 throughout). The C++ is ``csrc/prefill_attention.cpp``, built by
:mod:`kvtier.kernels.build`; :func:`available` is False where it does not build or the CPU has no
AVX-512 BF16, and callers keep their own path. :func:`attend_paged`: the same with the first keys
read from kvtier's packed vLLM pages (codes exact in bf16; the key scales go into the query as bf16
hi + lo, the value scales into the probabilities). Imports only torch and ``.build``.
"""

from __future__ import annotations

import functools

import torch

from . import build


@functools.lru_cache(maxsize=1)
def _module():
    return build.load(
        "kvtier_prefill_v10",
        "prefill_attention.cpp",
        ["prefill_attend", "prefill_attend_paged", "prefill_supported", "prefill_paged_supported"],
        ("-fno-math-errno",),
    )


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when the kernel compiled with its AVX-512 BF16 path (once per machine; cached by torch)."""
    return build.check(_module, "kvtier prefill CPU kernel", "vLLM's kernel") and bool(_module().prefill_supported())


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """Write into ``out [n, Hq, D]`` the causal attention of ``q [n, Hq, D]`` over ``k, v [L, H, D]``
    (``L >= n``; query ``i`` sees keys ``< L - n + i + 1``; ``Hq`` a multiple of ``H``). All bf16 on
    the CPU with a contiguous last dim; ``D`` 64 or 128."""
    _module().prefill_attend(q, k, v, out, float(scale))


def attend_paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    pages: torch.Tensor,
    pids: torch.Tensor,
    layout: list[int],
) -> None:
    """:func:`attend` over ``len(pids) * T`` keys read from packed pages ``pages[pids]`` (uint8
    ``[B, page]``, in order; ``layout`` = :meth:`kvtier.codecs.pages.PageFormat.layout`), then the exact
    ``k, v [Le, H, D]`` (bf16; the chunk's own keys last: ``Le >= n``). Query ``i`` sees every packed
    key and the exact keys ``< Le - n + i + 1``. Pages of ``T`` and key groups in multiples of 64, no
    sink tokens, one value group per row, 4-bit keys, 4- or 3-bit values (:func:`paged_supported`).
    Scores are those of the pages' fp32 keys to ~2^-17 of them (the query times the key scales split
    into bf16 hi + lo); each packed value is read as its centred code ``c - 2^(bits-1)`` times its
    probability times its scale, rounded to bf16 as probabilities are."""
    _module().prefill_attend_paged(q, k, v, out, float(scale), pages, pids, layout)


def paged_supported(layout: list[int]) -> bool:
    """Whether :func:`attend_paged` reads pages of this :meth:`~kvtier.codecs.pages.PageFormat.layout`
    (the kernel's own rule; False where the kernel is not built)."""
    return available() and bool(_module().prefill_paged_supported([int(x) for x in layout]))


def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`attend` in plain torch, fp32 throughout: ``[n, Hq, D]`` in fp32."""
    n, Hq, D = q.shape
    L, H, _ = k.shape
    G = Hq // H
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().transpose(0, 1).repeat_interleave(G, 0)  # [Hq, L, D]
    vf = v.float().transpose(0, 1).repeat_interleave(G, 0)
    s = qf @ kf.transpose(1, 2) * scale  # [Hq, n, L]
    visible = torch.arange(L).view(1, L) < (L - n + torch.arange(n) + 1).view(n, 1)
    s = s.masked_fill(~visible, float("-inf"))
    return (s.softmax(-1) @ vf).transpose(0, 1)
