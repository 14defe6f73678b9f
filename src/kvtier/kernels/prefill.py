"""Exact prefill attention that also returns the log-sum-exp, so its output merges with tier partials.

A prefill chunk attends to itself (exact, causal) and to whatever the cache already holds; with
``(out, lse)`` from each part, :func:`kvtier.attention.partials.merge` combines them. The fastest
exact kernel is used where it exists, behind one API:

* CUDA with the ``flash_attn`` package: ``flash_attn_func(..., return_attn_probs=True)``, which
  returns the lse itself (GQA native, causal aligned to the bottom right).
* otherwise: PyTorch SDPA for the output, and the lse from a plain torch pass over query chunks
  whose score tensors stay under :data:`SCORE_BUDGET` elements (SDPA does not return it).

Queries are the last ``L`` positions of the ``N`` keys (a chunk after a prefix of ``N - L``), so the
causal mask is ``key <= N - L + query``. Rows that attend nothing give zeros and ``lse = -inf``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

#: Max score elements (batch x heads x query rows x keys) of one chunk of the torch lse pass.
SCORE_BUDGET = 1 << 24


@functools.lru_cache(maxsize=1)
def flash_available() -> bool:
    """True when the ``flash_attn`` package imports (it needs CUDA)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or built for another torch: use SDPA
        return False
    return True


def _allowed(L: int, N: int, causal: bool, padding: torch.Tensor | None, device) -> torch.Tensor | None:
    """bool ``[B or 1, 1, L, N]`` (True = attend), or None when everything is allowed."""
    mask = None
    if causal:
        q_pos = N - L + torch.arange(L, device=device)
        mask = (torch.arange(N, device=device)[None, :] <= q_pos[:, None])[None, None]
    if padding is not None:
        pad = padding[:, None, None, :].to(device=device, dtype=torch.bool)
        mask = pad if mask is None else mask & pad
    return mask


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    causal: bool = True,
    padding: torch.Tensor | None = None,
    with_out: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Plain torch attention over query chunks: output (optional) and lse, fp32, memory-bounded.

    Parameters
    ----------
    q : ``[B, Hq, L, D]``; k, v : ``[B, Hkv, N, D]`` (``Hkv`` divides ``Hq``; no ``repeat_kv``).
    scaling : softmax scale.
    causal : queries are the last ``L`` of the ``N`` positions.
    padding : bool ``[B, N]`` real keys, or None.
    with_out : also compute the output (else only the lse).

    Returns
    -------
    out : fp32 ``[B, Hq, L, D]`` or None; lse : fp32 ``[B, Hq, L]``.
    """
    B, Hq, L, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kf = k.float().transpose(-1, -2).unsqueeze(2)  # [B, Hkv, 1, D, N]
    vf = v.float().unsqueeze(2) if with_out else None
    mask = _allowed(L, N, causal, padding, q.device)
    step = max(1, SCORE_BUDGET // max(1, B * Hq * N))
    outs, lses = [], []
    for s in range(0, L, step):
        qc = q[:, :, s : s + step].float().reshape(B, Hkv, G, -1, D) * scaling
        scores = qc @ kf  # [B, Hkv, G, l, N]
        if mask is not None:
            scores = scores.masked_fill(~mask[:, :, s : s + step].unsqueeze(2), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        lses.append(lse.reshape(B, Hq, -1))
        if with_out:
            finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            outs.append((torch.exp(scores - finite.unsqueeze(-1)) @ vf).reshape(B, Hq, -1, D))
    return (torch.cat(outs, 2) if with_out else None), torch.cat(lses, 2)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float | None = None,
    causal: bool = True,
    padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of a query chunk with its log-sum-exp.

    Parameters
    ----------
    q : ``[B, Hq, L, D]``; k, v : ``[B, Hkv, N, D]``, ``N >= L`` when causal, same dtype.
    scaling : softmax scale (default ``D ** -0.5``).
    causal : queries are the last ``L`` of the ``N`` positions.
    padding : bool ``[B, N]`` real keys, or None.

    Returns
    -------
    out : ``[B, Hq, L, D]`` in ``q.dtype`` (zeros for rows that attend nothing).
    lse : fp32 ``[B, Hq, L]`` (``-inf`` for rows that attend nothing).
    """
    B, Hq, L, D = q.shape
    N = k.shape[2]
    if scaling is None:
        scaling = D**-0.5
    if causal and N < L:
        raise ValueError(f"causal prefill needs at least as many keys as queries, got N={N} < L={L}")
    if q.is_cuda and padding is None and q.dtype in (torch.float16, torch.bfloat16) and flash_available():
        from flash_attn import flash_attn_func

        out, lse, _ = flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scaling, causal=causal,
            return_attn_probs=True,
        )  # fmt: skip
        return out.transpose(1, 2), lse[..., :L].float()
    mask = _allowed(L, N, causal, padding, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    _, lse = attention_lse(q, k, v, scaling, causal, padding, with_out=False)
    empty = ~torch.isfinite(lse)
    if bool(empty.any()):  # SDPA gives NaN for rows with nothing to attend
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse
