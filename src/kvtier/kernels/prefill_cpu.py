"""CPU kernel of a prefill chunk's causal attention in bf16 (AVX-512 BF16 dot products, fp32 sums).

:func:`attend`: query ``i`` of the chunk's ``n`` new tokens (the last ``n`` of the ``L`` keys)
attends keys ``0 .. L - n + i`` with grouped query heads; ``q, k, v, out`` bf16. It is a
FlashAttention loop over blocks of 64 keys: scores are exact bf16 products summed in fp32, the
probabilities are rounded to bf16 for the sum over values (as FlashAttention does on GPUs), every
sum is fp32 and the output is rounded to bf16 once. :func:`attend_reference` is the plain-torch
reference (fp32 throughout). The C++ is ``csrc/prefill_attention.cpp``, built by
:mod:`kvtier.kernels.build`; :func:`available` is False where it does not build or the CPU has no
AVX-512 BF16, and callers keep their own path. Imports only torch and ``.build``.
"""

from __future__ import annotations

import functools

import torch

from . import build


@functools.lru_cache(maxsize=1)
def _module():
    return build.load(
        "kvtier_prefill_v5", "prefill_attention.cpp", ["prefill_attend", "prefill_supported"], ("-fno-math-errno",)
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
