"""Long-range recall: a secret number planted at a depth inside book text, asked for at the end.

The fact is planted at a token depth (0 = start, 1 = end of the context) inside an excerpt of
a book, wrapped in the model's chat template, and the answer is primed with
``"The secret number is"`` so it can be read off greedily. A sink + window cache cannot answer
when the fact lies outside its window, so the task tells real recall from recency.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

QUESTION = "What is the secret number mentioned in the text above?"
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
    """Plant a random 5-digit number at ``depth`` of a ``context_tokens`` excerpt of ``text``."""
    rnd = random.Random(seed)
    key = str(rnd.randint(10000, 99999))
    fact = tokenizer(f" The secret number is {key}. Remember it: {key}. ", add_special_tokens=False).input_ids
    body_len = max(1, context_tokens - len(fact))
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
        out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
    return {"answer": answer, "correct": is_correct(answer, case.key), "key": case.key}
