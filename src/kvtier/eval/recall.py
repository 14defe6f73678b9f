"""Long-range recall: a secret number planted at a depth inside book text, asked for at the end.

The fact is planted at a token depth (0 = start, 1 = end of the context) inside an excerpt of
a book, wrapped in the model's chat template, and the answer is primed with
``"The secret number is"`` so it can be read off greedily. A sink + window cache cannot answer
when the fact lies outside its window, so the task tells real recall from recency.

Besides right or wrong, each case records its *margin*: along the key's tokens, the logit of the
right token minus the best other logit, minimum over the tokens up to the first wrong one
(negative: the greedy answer went wrong there). A small model answers many cases by a hair (on
SmolLM2 at 4k, margins of 0.02-0.1 logits occur), so a cache that flips such a case has not lost a
fact the model knew; comparing margins case by case tells that apart from a real loss.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

QUESTION = "What is the secret number mentioned in the text above?"
#: The shortest context a case is built for: the planted fact takes 22 tokens of SmolLM2 (at most
#: ~48 in any tokenizer: 48 bytes), and the text around it at least one. Shorter contexts are
#: refused, not silently lengthened.
MIN_CONTEXT_TOKENS = 64
ANSWER_PREFIX = "The secret number is"


@dataclass
class RecallCase:
    """One prompt: ``input_ids [1, n]``, the planted ``key``, where it sits."""

    input_ids: torch.Tensor
    key: str
    depth: float
    context_tokens: int
    fact_position: int


def build_case(tokenizer, text: str, context_tokens: int, depth: float, seed: int) -> RecallCase:
    """Plant a random 5-digit number at ``depth`` of a ``context_tokens`` excerpt of ``text``
    (at least ``MIN_CONTEXT_TOKENS``, and more than the fact's tokens)."""
    if context_tokens < MIN_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens={context_tokens} is not allowed: expected at least {MIN_CONTEXT_TOKENS}")
    rnd = random.Random(seed)
    key = str(rnd.randint(10000, 99999))
    fact = tokenizer(f" The secret number is {key}. Remember it: {key}. ", add_special_tokens=False).input_ids
    body_len = context_tokens - len(fact)
    if body_len < 1:
        raise ValueError(
            f"context_tokens={context_tokens} is not allowed: the planted fact alone takes {len(fact)} tokens "
            f"of this tokenizer; expected at least {len(fact) + 1}"
        )
    ids = tokenizer(text[: body_len * 8 + 20000], add_special_tokens=False).input_ids
    if len(ids) < body_len + 10:
        raise ValueError(f"text too short for a {context_tokens}-token recall case")
    start = rnd.randint(0, len(ids) - body_len)
    body = ids[start : start + body_len]
    pos = int(round(len(body) * depth))
    doc = tokenizer.decode(body[:pos] + fact + body[pos:])
    messages = [{"role": "user", "content": doc + "\n\n" + QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + ANSWER_PREFIX
    input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": tokenizer.decode(body[:pos])}], tokenize=False)
    return RecallCase(input_ids, key, depth, context_tokens, len(tokenizer(prefix, add_special_tokens=False).input_ids))


def answer_margin(step_logits, generated: torch.Tensor, target: list[int]) -> float:
    """Minimum over the key's tokens ``target`` of ``logit(right) - max logit(other)`` at each greedy
    step, up to and including the first step whose greedy token is not the right one.

    Parameters
    ----------
    step_logits : per generated token, logits ``[1, V]`` (``generate(output_logits=True)``).
    generated : the greedy tokens ``[n]``.
    """
    margins = []
    for i, t in enumerate(target[: len(step_logits)]):
        lg = step_logits[i][0].float().clone()
        right = lg[t].item()
        lg[t] = float("-inf")
        margins.append(right - lg.max().item())
        if int(generated[i]) != t:
            break
    return min(margins) if margins else float("nan")


def is_correct(answer: str, key: str) -> bool:
    """The answer's first number is the key."""
    digits = "".join(ch if ch.isdigit() else " " for ch in answer).split()
    return bool(digits) and digits[0] == key


@torch.no_grad()
def run_case(model, tokenizer, case: RecallCase, spec, new_tokens: int = 8, prefill_chunk: int = 512) -> dict:
    """Answer one case greedily with a fresh cache of ``spec``; the prompt is prefilled in chunks
    of ``prefill_chunk`` tokens so the tiers form as in a long streamed context."""
    cache = spec.build(model)
    ids = case.input_ids
    with spec.context(model):
        for s in range(0, ids.shape[1] - 1, prefill_chunk):
            model(ids[:, s : min(s + prefill_chunk, ids.shape[1] - 1)], cache=cache, use_cache=True, logits_to_keep=1)
        out = model.generate(
            ids,
            cache=cache,
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[0, ids.shape[1] :]
    answer = tokenizer.decode(generated, skip_special_tokens=True).strip()
    target = tokenizer(" " + case.key, add_special_tokens=False).input_ids
    margin = answer_margin(out.logits, generated, target)
    return {"answer": answer, "correct": is_correct(answer, case.key), "key": case.key, "margin": margin}
