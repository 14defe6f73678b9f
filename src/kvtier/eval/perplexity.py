"""Streamed perplexity and logit fidelity: tokens go through the model *with the cache* in chunks
of <= 64, so the compressed tiers shape every later prediction; scores are taken over the last
half of each window. The scored half may stream in smaller chunks (``score_chunk``): a cache whose
sparse attention applies to decode-sized calls only (``SparsePolicy.max_query_tokens``) is then
measured on every scored token.

All caches of a comparison run in lockstep over the same chunks: per chunk, the full cache's
log-probabilities are the reference for KL(full || cache) and top-1 agreement of every other
cache. One-shot full-prompt scoring never reads the compressed tiers, so it is not offered.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .caches import CacheSpec, cache_spec, kv_bytes

#: The shortest window that scores a prediction: of ``W`` tokens the last half after the first
#: ``W // 2`` is scored, ``W - 1 - W // 2`` predictions (none for ``W <= 2``).
MIN_WINDOW_TOKENS = 3


@dataclass
class StreamScore:
    """Scores of one cache on one window (sums; divide by ``tokens``)."""

    nll: float = 0.0
    kl: float = 0.0
    top1_agree: int = 0
    tokens: int = 0
    kv_bytes: int = 0
    #: bytes in this process's memory (an offloading cache's ``memory_report().resident_bytes``;
    #: ``kv_bytes`` for the others)
    resident_bytes: int = 0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def mean_kl(self) -> float:
        return self.kl / self.tokens

    @property
    def top1(self) -> float:
        return self.top1_agree / self.tokens


def book_windows(tokenizer, text: str, length: int, count: int = 1, offset_tokens: int = 2000) -> list[torch.Tensor]:
    """``count`` windows of ``length`` tokens from ``text`` (``[1, length]`` each), spread evenly
    after skipping ``offset_tokens`` (front matter)."""
    need = offset_tokens + length * count
    ids = tokenizer(text[: need * 6 + 10000], add_special_tokens=False).input_ids
    if len(ids) < offset_tokens + length:
        raise ValueError(f"text has {len(ids)} tokens, fewer than offset {offset_tokens} + window {length}")
    room = len(ids) - offset_tokens - length
    starts = [offset_tokens + (room * i // (count - 1) if count > 1 else 0) for i in range(count)]
    return [torch.tensor(ids[s : s + length])[None] for s in starts]


@torch.no_grad()
def stream_compare(
    model,
    ids: torch.Tensor,
    specs: list[CacheSpec],
    chunk: int = 64,
    eval_from: int | None = None,
    reference: CacheSpec | None = None,
    caches_out: dict | None = None,
    score_chunk: int | None = None,
    after_call: Callable[[str, Any], None] | None = None,
) -> dict[str, StreamScore]:
    """Feed ``ids: [1, W]`` in chunks through a fresh cache per spec, in lockstep.

    Scores predictions of tokens ``eval_from + 1 .. W - 1`` (default: the last half), fed in
    chunks of ``score_chunk`` (default ``chunk``) tokens; the context before them in chunks of
    ``chunk``. The ``reference`` (default: the full ``dynamic`` cache) provides the distribution
    for KL and top-1 agreement and is scored too.

    ``caches_out``, if given, receives the caches by name (to read their counters afterwards);
    ``after_call(name, cache)``, if given, runs after every call of every cache (e.g. to read its
    bytes at each step).

    Returns
    -------
    ``{spec.name: StreamScore}`` including the reference.
    """
    score_chunk = chunk if score_chunk is None else score_chunk
    for name, value in (("chunk", chunk), ("score_chunk", score_chunk)):
        if not 1 <= value <= 64:
            raise ValueError(f"{name}={value} is not allowed: expected 1..64 (streamed evaluation)")
    reference = reference or cache_spec("dynamic")
    specs = [reference] + [s for s in specs if s.name != reference.name]
    W = ids.shape[1]
    eval_from = W // 2 if eval_from is None else eval_from
    if not 0 <= eval_from < W - 1:
        raise ValueError(
            f"eval_from={eval_from} is not allowed with a window of {W} tokens: expected 0 <= eval_from < {W - 1} "
            f"(at least one scored prediction; by default windows need {MIN_WINDOW_TOKENS} tokens)"
        )
    caches = [s.build(model) for s in specs]
    if caches_out is not None:
        caches_out.update({s.name: c for s, c in zip(specs, caches)})
    scores = {s.name: StreamScore() for s in specs}
    bounds = [*range(0, eval_from, chunk), *range(eval_from, W - 1, score_chunk), W - 1]
    for s, e in zip(bounds[:-1], bounds[1:]):
        need = max(0, e - max(s, eval_from))  # positions in this chunk that are scored
        target = ids[0, e - need + 1 : e + 1]
        ref_logp = None
        for spec, cache in zip(specs, caches):
            ctx = spec.context(model) if spec.is_tiered else contextlib.nullcontext()
            with ctx:
                out = model(ids[:, s:e], cache=cache, use_cache=True, logits_to_keep=max(need, 1))
            if after_call is not None:
                after_call(spec.name, cache)
            if not need:
                continue
            logp = F.log_softmax(out.logits[0, -need:].float(), dim=-1)
            sc = scores[spec.name]
            sc.nll += -logp.gather(1, target[:, None]).sum().item()
            sc.tokens += need
            if ref_logp is None:
                ref_logp = logp
                sc.top1_agree += need
            else:
                sc.kl += F.kl_div(logp, ref_logp, log_target=True, reduction="sum").item()
                sc.top1_agree += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
    for spec, cache in zip(specs, caches):
        scores[spec.name].kv_bytes = kv_bytes(cache)
        report = cache.memory_report() if hasattr(cache, "memory_report") else None
        scores[spec.name].resident_bytes = report.resident_bytes if report is not None else kv_bytes(cache)
    return scores


def streamed_nll(
    model, ids: torch.Tensor, spec: CacheSpec, chunk: int = 64, score_chunk: int | None = None
) -> StreamScore:
    """Streamed score of one cache alone (no fidelity reference)."""
    return stream_compare(model, ids, [], chunk=chunk, reference=spec, score_chunk=score_chunk)[spec.name]
