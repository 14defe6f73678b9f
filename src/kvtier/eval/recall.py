"""Long-range recall: a fact planted at a depth inside a long text, asked for at the end.

Two needles, one protocol. In prose (``"number"``) the fact is a sentence, "The secret number is
48213", asked as "What is the secret number ...?" and primed with ``"The secret number is"``. In
source code (``"code"``) it is a definition a program could hold, planted at a line boundary:
a module constant (``_BRISK_HARBOR_LIMIT = 48213``) or a function returning a value
(``def brisk_harbor_port(): return 48213``), asked as "what is the value of ... / what does ...()
return?" and primed with ``"The value of `NAME` is"`` / ``"`NAME()` returns"``. Either way the
fact sits at a token depth (0 = start, 1 = end of the context) inside an excerpt of the text,
wrapped in the model's chat template, and the key is a random 5-digit number read off greedily.
A sink + window cache cannot answer when the fact lies outside its window, so the task tells real
recall from recency. :func:`needle_for` picks the needle from the text (``auto``).

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
#: The needles :func:`build_case` plants.
NEEDLES = ("number", "code")
_WORDS_A = ("brisk", "amber", "quiet", "hollow", "crimson", "silver", "narrow", "eager", "frozen", "gentle")
_WORDS_B = ("harbor", "lantern", "meadow", "anvil", "beacon", "cinder", "falcon", "garnet", "orchard", "quarry")
_CODE_STARTS = ("def ", "class ", "import ", "from ", "return", "if ", "elif ", "else:", "for ", "while ", "try:")
_CODE_STARTS += ("except", "with ", "raise ", "#", "@", "self.")
_WORDS_C = ("limit", "port", "offset", "seed", "quota", "timeout", "magic", "budget", "width", "retries")


def looks_like_code(text: str) -> bool:
    """Source code rather than prose: over a quarter of the first 600 non-blank lines start a
    statement (``def``, ``import``, ``return``, a comment, ...), assign (`` = ``) or end a header
    (``:``). CPython's sources score 0.63-0.76, the Gutenberg books 0.01-0.03."""
    lines = [ln.strip() for ln in text[:60000].splitlines() if ln.strip()][:600]
    code = sum(1 for ln in lines if ln.startswith(_CODE_STARTS) or " = " in ln or ln.endswith(":"))
    return bool(lines) and code > len(lines) / 4


def needle_for(text: str, needle: str = "auto") -> str:
    """``"code"`` or ``"number"``: ``needle`` itself, or for ``"auto"`` what :func:`looks_like_code` says."""
    if needle == "auto":
        return "code" if looks_like_code(text) else "number"
    if needle not in NEEDLES:
        raise ValueError(f"needle={needle!r} is not allowed: expected 'auto' or one of {NEEDLES}")
    return needle


def _code_fact(rnd: random.Random, key: str) -> tuple[str, str, str]:
    """``(definition lines, question, answer prefix)`` of one code needle."""
    a, b, c = rnd.choice(_WORDS_A), rnd.choice(_WORDS_B), rnd.choice(_WORDS_C)
    if rnd.random() < 0.5:
        name = f"_{a}_{b}_{c}".upper()
        fact = f"\n{name} = {key}\n\n"
        return fact, f"What is the value of `{name}` in the code above?", f"The value of `{name}` is"
    name = f"{a}_{b}_{c}"
    fact = f"\n\ndef {name}():\n    return {key}\n\n"
    return fact, f"What does `{name}()` return in the code above?", f"`{name}()` returns"


@dataclass
class RecallCase:
    """One prompt: ``input_ids [1, n]``, the planted ``key``, where it sits."""

    input_ids: torch.Tensor
    key: str
    depth: float
    context_tokens: int
    fact_position: int
    needle: str = "number"


def build_case(
    tokenizer, text: str, context_tokens: int, depth: float, seed: int, needle: str = "number"
) -> RecallCase:
    """Plant a random 5-digit key at ``depth`` of a ``context_tokens`` excerpt of ``text`` (at
    least ``MIN_CONTEXT_TOKENS``, and more than the fact's tokens), as a sentence (``"number"``) or
    a definition at a line boundary (``"code"``; ``"auto"``: :func:`needle_for`)."""
    if context_tokens < MIN_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens={context_tokens} is not allowed: expected at least {MIN_CONTEXT_TOKENS}")
    needle = needle_for(text, needle)
    rnd = random.Random(seed)
    key = str(rnd.randint(10000, 99999))
    if needle == "code":
        fact_text, question, answer_prefix = _code_fact(rnd, key)
    else:
        fact_text = f" The secret number is {key}. Remember it: {key}. "
        question, answer_prefix = QUESTION, ANSWER_PREFIX
    fact = tokenizer(fact_text, add_special_tokens=False).input_ids
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
    if needle == "code":
        head, tail = tokenizer.decode(body[:pos]), tokenizer.decode(body[pos:])
        cut = head.rfind("\n")  # a line boundary, so the definition stays a definition
        head, tail = (head[:cut], head[cut + 1 :] + tail) if cut >= 0 else (head, tail)
        doc = head + fact_text + tail
    else:
        head = tokenizer.decode(body[:pos])
        doc = tokenizer.decode(body[:pos] + fact + body[pos:])
    messages = [{"role": "user", "content": doc + "\n\n" + question}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + answer_prefix
    input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    prefix = tokenizer.apply_chat_template([{"role": "user", "content": head}], tokenize=False)
    fact_position = len(tokenizer(prefix, add_special_tokens=False).input_ids)
    return RecallCase(input_ids, key, depth, context_tokens, fact_position, needle)


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
    correct = is_correct(answer, case.key)
    return {"answer": answer, "correct": correct, "key": case.key, "margin": margin, "needle": case.needle}
