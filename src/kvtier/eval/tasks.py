"""Long-context tasks in RULER's families: generated prompts, their JSONL form and the scorer.

Written here from the public description of RULER (Hsieh et al. 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?", repository NVIDIA/RULER, Apache-2.0); no code
of it is copied. The families (task ids as RULER names them):

==================== ============================================================================
``niah_single_1``    one needle in a haystack of one repeated passage (the passkey noise)
``niah_single_2``    one needle in an essay haystack (the books of ``../shared/data/pg``)
``niah_single_3``    one needle whose value is a UUID, essay haystack
``niah_multikey_1``  four needles of four keys in an essay, one key asked
``niah_multikey_2``  the haystack is needles: many key-value lines, one key asked
``niah_multikey_3``  the same with UUID keys and values
``niah_multivalue``  four needles with four values of one key, all asked
``niah_multiquery``  four needles of four keys, all four asked at once
``vt``               variable tracking: ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) in noise;
                     name every variable holding the value
``cwe``              common words: a numbered word list where 10 words appear 30 times and the rest
                     3 times; name the 10
``fwe``              frequent words: coded words drawn from a Zipf law (exponent 2); name the 3 most
                     frequent
==================== ============================================================================

A needle reads "One of the special magic numbers for {key} is: {value}." (``uuids`` for UUID
values); keys are an adjective and a noun of wonderwords' lists (``"gentle-harbor"``), numbers have
7 digits. Every essay-haystack retrieval task also runs over a **code haystack** (``TASK@code``: the
CPython sources of ``../shared/data/code``, the needle a comment line), since the real model is a
code model. ``vt``, ``cwe`` and ``fwe`` carry one short worked example before the real one, as RULER
does, so that a small model answers in the expected form.

A prompt is the model's chat template around one user turn (instruction, haystack, question), then
the answer prefix (primed, question-specific). It is kept in two parts, as the kvpress leaderboard's
question-agnostic protocol needs: ``context`` (template start, instruction, haystack: what a cache
compresses) and ``question`` (the question, the end of the turn, the assistant's start, the answer
prefix), each as text and as token ids of the model's tokenizer (``context_ids``, ``question_ids``:
what is run; any other system runs exactly those). A prompt of length ``L`` is the longest whose two
parts plus the task's answer budget (``max_new_tokens``) fit ``L`` tokens (a binary search over the
haystack's units: sentences, code lines, needles, words).

Scoring as RULER's ``string_match_all``: a prediction scores the fraction of its expected strings
it contains (case-insensitive substring); a task's score is 100 x the mean over its samples.

Everything is drawn from ``random.Random`` seeded with the text ``"{seed}:{task}:{length}:{index}"``
(stable across runs and Python versions), the haystack texts and wonderwords' word lists (pinned:
``WONDERWORDS_VERSION``), so the JSONL of a seed is reproducible byte for byte for one tokenizer.

Imports: the standard library, :mod:`kvtier.eval.texts`, :mod:`kvtier.inputs`; a tokenizer object is
passed in (nothing here imports torch or transformers).
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
import string
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ..inputs import read_input
from .texts import default_data_dir, strip_gutenberg

#: The wonderwords release whose word lists the prompts are made from (reproducibility).
WONDERWORDS_VERSION = "2.2.0"
#: Version of the prompt layout written to JSONL (bumped when a generated prompt changes).
FORMAT_VERSION = 1
LENGTHS = (4096, 8192, 16384)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

#: Tasks whose haystack is an essay: they also run over code (``TASK@code``).
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")


@dataclass(frozen=True)
class Family:
    """A task family: how its prompts are drawn (``build``), its answer budget and category."""

    name: str
    category: str  # retrieval | multi-hop | aggregation
    max_new_tokens: int
    build: Callable[..., Prompt]


@dataclass(frozen=True)
class Prompt:
    """What a family's builder returns for ``units`` haystack units (before the template)."""

    instruction: str
    document: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSample:
    """One generated prompt with its expected answers (one JSONL line).

    ``context_ids`` then ``question_ids`` are the prompt's tokens (lists of ints); ``context`` and
    ``question`` their text (``context + question`` is the whole prompt)."""

    task: str
    length: int
    index: int
    seed: int
    category: str
    answers: list[str]
    max_new_tokens: int
    context: str
    question: str
    context_ids: list[int]
    question_ids: list[int]
    meta: dict
    tokenizer: str
    format: int = FORMAT_VERSION

    @property
    def prompt_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)

    @property
    def key(self) -> tuple[str, int, int]:
        return self.task, self.length, self.index


# --- word lists and haystacks ---------------------------------------------------------------------
def _wonderwords(name: str) -> list[str]:
    try:
        version = metadata.version("wonderwords")
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"kvtier eval tasks needs wonderwords=={WONDERWORDS_VERSION} (its word lists make the prompts): "
            "pip install 'kvtier[tasks]'"
        ) from None
    if version != WONDERWORDS_VERSION:
        raise ImportError(
            f"kvtier eval tasks needs wonderwords=={WONDERWORDS_VERSION} (the prompts are drawn from its word lists, "
            f"so another release makes other prompts); found {version}: "
            f"pip install 'wonderwords=={WONDERWORDS_VERSION}'"
        )
    spec = importlib.util.find_spec("wonderwords")  # its folder, without importing the package
    assert spec is not None and spec.submodule_search_locations
    text = (Path(next(iter(spec.submodule_search_locations))) / "assets" / name).read_text(encoding="utf-8")
    return sorted({w.strip().lower() for w in text.split() if w.strip().isalpha() and w.strip().isascii()})


_WORDS: dict[str, list[str]] = {}


def words(kind: str) -> list[str]:
    """wonderwords' ``adjectives``, ``nouns`` or ``verbs`` (lowercase, alphabetic, sorted, unique)."""
    if kind not in _WORDS:
        _WORDS[kind] = _wonderwords(
            {"adjectives": "adjectivelist.txt", "nouns": "nounlist.txt"}.get(kind, "verblist.txt")
        )
    return _WORDS[kind]


def _sentences(text: str) -> list[str]:
    flat = " ".join(text.split())
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", flat) if s]


@dataclass
class Haystacks:
    """The texts haystacks are cut from: ``essay`` sentences per book, ``code`` lines per file.

    ``books`` / ``code``: folders of ``.txt`` files (default ``../shared/data/pg`` and
    ``../shared/data/code``, found from the current directory upward)."""

    books: Path | None = None
    code: Path | None = None
    _cache: dict[str, list[tuple[str, list[str]]]] = field(default_factory=dict, repr=False)

    def units(self, kind: str) -> list[tuple[str, list[str]]]:
        """``[(name, units)]`` sorted by name: sentences of each book, lines of each code file."""
        if kind not in self._cache:
            folder = self.books if kind == "essay" else self.code
            folder = folder or default_data_dir("pg" if kind == "essay" else "code")
            if folder is None:
                sub = "pg" if kind == "essay" else "code"
                raise FileNotFoundError(f"no {kind} haystack: ../shared/data/{sub} not found (pass the folder)")
            out = []
            for path in sorted(Path(folder).glob("*.txt")):
                if path.name.isupper() or "LICENSE" in path.name:
                    continue
                text = read_input(path, "haystack text").decode("utf-8", errors="replace")
                if kind == "essay":
                    out.append((path.stem, _sentences(strip_gutenberg(text))))
                else:
                    out.append((path.stem, [ln.rstrip() for ln in text.splitlines()]))
            if not out:
                raise FileNotFoundError(f"no .txt file in {folder} for the {kind} haystack")
            self._cache[kind] = out
        return self._cache[kind]

    def excerpt(self, kind: str, rng: random.Random, units: int) -> tuple[str, int, list[str]]:
        """``units`` consecutive units of a drawn text from a drawn start: (name, start, units)."""
        texts = self.units(kind)
        name, all_units = texts[rng.randrange(len(texts))]
        if units > len(all_units):
            raise ValueError(f"{name} has {len(all_units)} {kind} units; {units} asked")
        start = rng.randrange(len(all_units) - units + 1)
        return name, start, all_units[start : start + units]


# --- draws --------------------------------------------------------------------------------------
def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        k = f"{rng.choice(words('adjectives'))}-{rng.choice(words('nouns'))}"
        if k not in taken:
            taken.add(k)
            return k


def _number(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = str(rng.randrange(10**6, 10**7))
        if v not in taken:
            taken.add(v)
            return v


def _uuid(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if v not in taken:
            taken.add(v)
            return v


def _insert(units: list[str], items: list[str], rng: random.Random) -> tuple[list[str], list[float]]:
    """``items`` inserted between ``units`` at drawn depths (kept in order); the depths (0-1)."""
    n = len(units)
    spots = sorted(rng.randint(0, n) for _ in items)
    out, last = [], 0
    for spot, item in zip(spots, items):
        out += units[last:spot] + [item]
        last = spot
    out += units[last:]
    return out, [round(s / max(1, n), 4) for s in spots]


_NIAH_INSTRUCTION = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards."
)


@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # noise | essay | needles
    keys: int = 1  # needles with distinct keys
    values: int = 1  # values per key
    queries: int = 1  # keys asked
    value_kind: str = "numbers"  # numbers | uuids
    key_kind: str = "words"  # words | uuids


NIAH = {
    "niah_single_1": NiahSpec("noise"),
    "niah_single_2": NiahSpec("essay"),
    "niah_single_3": NiahSpec("essay", value_kind="uuids"),
    "niah_multikey_1": NiahSpec("essay", keys=4),
    "niah_multikey_2": NiahSpec("needles"),
    "niah_multikey_3": NiahSpec("needles", value_kind="uuids", key_kind="uuids"),
    "niah_multivalue": NiahSpec("essay", values=4),
    "niah_multiquery": NiahSpec("essay", keys=4, queries=4),
}


def _niah(spec: NiahSpec, code: bool) -> Callable[..., Prompt]:
    def build(rng: random.Random, units: int, hay: Haystacks) -> Prompt:
        taken: set[str] = set()
        draw_key = _uuid if spec.key_kind == "uuids" else _key
        draw_value = _uuid if spec.value_kind == "uuids" else _number
        keys = [draw_key(rng, taken) for _ in range(spec.keys)]
        needles, values = [], {}
        for k in keys:
            values[k] = [draw_value(rng, taken) for _ in range(spec.values)]
            needles += [(k, v) for v in values[k]]
        rng.shuffle(needles)
        kind = spec.value_kind
        comment = "# " if code else ""  # in code, a needle is a comment line

        def say(k: str, v: str) -> str:
            return f"{comment}One of the special magic {kind} for {k} is: {v}."

        meta: dict[str, Any] = {}
        if spec.haystack == "needles":  # the haystack is distractor needles, the real ones among them
            filler = [say(draw_key(rng, taken), draw_value(rng, taken)) for _ in range(units)]
            doc_units, meta["depths"] = _insert(filler, [say(k, v) for k, v in needles], rng)
            joiner = "\n"
        elif spec.haystack == "noise":
            doc_units, meta["depths"] = _insert([NOISE] * units, [say(k, v) for k, v in needles], rng)
            joiner = "\n"
        else:
            kind_h = "code" if code else "essay"
            name, start, text_units = hay.excerpt(kind_h, rng, units)
            meta["source"], meta["start"] = name, start
            doc_units, meta["depths"] = _insert(text_units, [say(k, v) for k, v in needles], rng)
            joiner = "\n" if code else " "
        asked = keys[: spec.queries]
        query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
        what = "the provided code" if code else "the provided text"
        return Prompt(
            _NIAH_INSTRUCTION.format(kind=kind),
            joiner.join(doc_units),
            f"What are all the special magic {kind} for {query} mentioned in {what}?",
            f"The special magic {kind} for {query} mentioned in {what} are",
            tuple(v for k in asked for v in values[k]),
            meta,
        )

    return build


def _var_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        v = "".join(rng.choices(string.ascii_uppercase, k=5))
        if v not in taken:
            taken.add(v)
            return v


_VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
_VT_ANSWER = "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are assigned the value {value}, they are:"  # noqa: E501


def _vt_chain(rng: random.Random, hops: int, taken: set[str]) -> tuple[list[str], str, list[str]]:
    value = str(rng.randrange(10**4, 10**5))
    names = [_var_name(rng, taken) for _ in range(hops + 1)]
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
    return lines, value, names


def _vt(rng: random.Random, units: int, hay: Haystacks) -> Prompt:
    taken: set[str] = set()
    ex_lines, ex_value, ex_names = _vt_chain(rng, 4, taken)
    example_units, _ = _insert([NOISE] * 6, ex_lines, rng)
    example = (
        _VT_INSTRUCTION
        + "\n"
        + "\n".join(example_units)
        + "\n"
        + _VT_QUESTION.format(value=ex_value)
        + " "
        + _VT_ANSWER.format(n=len(ex_names), value=ex_value)
        + " "
        + " ".join(ex_names)
        + "\n\n"
    )
    lines, value, names = _vt_chain(rng, 4, taken)
    doc_units, depths = _insert([NOISE] * units, lines, rng)
    return Prompt(
        _VT_INSTRUCTION,
        "\n".join(doc_units),
        _VT_QUESTION.format(value=value),
        _VT_ANSWER.format(n=len(names), value=value),
        tuple(names),
        {"depths": depths, "example": example},
    )


_CWE_INSTRUCTION = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
_CWE_QUESTION = "Question: What are the {n} most common words in the above list?"
_CWE_ANSWER = "Answer: The top {n} words that appear most often in the list are:"


def _word_pool() -> list[str]:
    return sorted(set(words("nouns")) | set(words("adjectives")) | set(words("verbs")))


def _cwe_list(rng: random.Random, pool: list[str], common: int, freq: int, rare: int, rare_freq: int):
    chosen = rng.sample(pool, common + rare)
    items = [w for w in chosen[:common] for _ in range(freq)] + [w for w in chosen[common:] for _ in range(rare_freq)]
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), chosen[:common]


def _cwe(rng: random.Random, units: int, hay: Haystacks) -> Prompt:
    pool = _word_pool()
    ex_list, ex_common = _cwe_list(rng, pool, 10, 4, 20, 1)
    example = (
        _CWE_INSTRUCTION
        + "\n"
        + ex_list
        + "\n"
        + _CWE_QUESTION.format(n=10)
        + " "
        + _CWE_ANSWER.format(n=10)
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_common))
        + "\n\n"
    )
    doc, common = _cwe_list(rng, pool, 10, 30, units, 3)
    return Prompt(
        _CWE_INSTRUCTION,
        doc,
        _CWE_QUESTION.format(n=10),
        _CWE_ANSWER.format(n=10),
        tuple(common),
        {"example": example, "rare_words": units},
    )


_FWE_INSTRUCTION = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words."
)
_FWE_QUESTION = "Question: What are the three most frequently appeared words in the above coded text?"
_FWE_ANSWER = "Answer: According to the coded text above, the three most frequently appeared words are:"


def _zipf_words(rng: random.Random, n: int, alpha: float = 2.0, vocab: int = 2000) -> tuple[list[str], list[str]]:
    """``n`` coded words drawn by rank with P(rank r) ~ r^-alpha over ``vocab`` ranks; redrawn
    until the three most frequent are strictly ahead of the rest. (words, top three)."""
    letters = string.ascii_lowercase
    codes: list[str] = []
    seen: set[str] = set()
    while len(codes) < vocab:
        w = "".join(rng.choices(letters, k=rng.randint(3, 6)))
        if w not in seen:
            seen.add(w)
            codes.append(w)
    weights = [r**-alpha for r in range(1, vocab + 1)]
    for _ in range(100):
        drawn = rng.choices(codes, weights=weights, k=n)
        counts = Counter(drawn).most_common()
        if len(counts) > 3 and counts[0][1] > counts[1][1] > counts[2][1] > counts[3][1]:
            return drawn, [w for w, _ in counts[:3]]
    raise ValueError(f"no strict top three in 100 draws of {n} coded words")  # pragma: no cover


def _fwe(rng: random.Random, units: int, hay: Haystacks) -> Prompt:
    ex_words, ex_top = _zipf_words(rng, 60)
    example = (
        _FWE_INSTRUCTION
        + "\n"
        + " ".join(ex_words)
        + "\n"
        + _FWE_QUESTION
        + " "
        + _FWE_ANSWER
        + " "
        + " ".join(ex_top)
        + "\n\n"
    )
    drawn, top = _zipf_words(rng, units)
    return Prompt(_FWE_INSTRUCTION, " ".join(drawn), _FWE_QUESTION, _FWE_ANSWER, tuple(top), {"example": example})


FAMILIES: dict[str, Family] = {
    **{name: Family(name, "retrieval", 128, _niah(spec, False)) for name, spec in NIAH.items()},
    **{f"{name}@code": Family(f"{name}@code", "retrieval", 128, _niah(NIAH[name], True)) for name in ESSAY_TASKS},
    "vt": Family("vt", "multi-hop", 30, _vt),
    "cwe": Family("cwe", "aggregation", 120, _cwe),
    "fwe": Family("fwe", "aggregation", 50, _fwe),
}
#: RULER's thirteen-task set less its two QA tasks (no offline QA data here).
RULER_TASKS = (*NIAH, "vt", "cwe", "fwe")
CODE_TASKS = tuple(f"{t}@code" for t in ESSAY_TASKS)
SUITES = {"ruler": RULER_TASKS, "code": CODE_TASKS, "all": (*RULER_TASKS, *CODE_TASKS)}


def task_names(spec: str | Iterable[str]) -> list[str]:
    """Task ids from a suite name (``ruler``, ``code``, ``all``) or comma-separated ids / suites."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for p in (p.strip() for p in parts):
        names = SUITES.get(p, (p,))
        for n in names:
            if n not in FAMILIES:
                raise ValueError(
                    f"task {n!r} is not allowed: expected a suite {sorted(SUITES)} or one of {list(FAMILIES)}"
                )
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError("no task named: expected a suite or task ids")
    return out


# --- prompts ------------------------------------------------------------------------------------
def _render(tok, prompt: Prompt) -> tuple[str, str]:
    """(context, question) text of the whole prompt: chat template around one user turn."""
    example = prompt.meta.get("example", "")
    marker = "\n\n" + prompt.question
    user = f"{example}{prompt.instruction}\n\n{prompt.document}{marker}"
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    else:
        text = user + "\n"
    cut = text.rfind(marker)
    assert cut >= 0, "the chat template changed the question"
    return text[:cut], text[cut:] + prompt.answer_prefix


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


def _count(tok, prompt: Prompt) -> int:
    context, question = _render(tok, prompt)
    return len(_ids(tok, context)) + len(_ids(tok, question))


def _least_units(task: str) -> int:
    """The fewest haystack units a prompt of ``task`` has (the search starts there)."""
    return {"cwe": 0, "fwe": 50}.get(task, 1)


def generate_sample(
    tok, task: str, length: int, index: int, seed: int = 0, haystacks: Haystacks | None = None
) -> TaskSample:
    """The ``index``-th prompt of ``task`` at ``length`` tokens for ``seed`` (see the module doc)."""
    family = FAMILIES.get(task)
    if family is None:
        raise ValueError(f"task {task!r} is not allowed: expected one of {list(FAMILIES)}")
    if not isinstance(length, int) or length < 256:
        raise ValueError(f"length={length!r} is not allowed: expected an int >= 256 (tokens)")
    hay = haystacks or Haystacks()
    budget = length - family.max_new_tokens

    def draw(units: int) -> Prompt:
        return family.build(random.Random(f"{seed}:{task}:{length}:{index}"), units, hay)

    def fits(units: int) -> bool:
        try:
            return _count(tok, draw(units)) <= budget
        except ValueError:  # more units than the drawn text has
            return False

    lo = _least_units(task)
    if not fits(lo):
        raise ValueError(f"length={length} is too short for {task}: its smallest prompt does not fit")
    hi = max(1, 2 * lo)
    while fits(hi):  # gallop up to a size that does not fit, then bisect: the most units that fit
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    prompt = draw(lo)
    context, question = _render(tok, prompt)
    meta = {k: v for k, v in prompt.meta.items() if k != "example"} | {"units": lo}
    return TaskSample(
        task=task,
        length=length,
        index=index,
        seed=seed,
        category=family.category,
        answers=list(prompt.answers),
        max_new_tokens=family.max_new_tokens,
        context=context,
        question=question,
        context_ids=_ids(tok, context),
        question_ids=_ids(tok, question),
        meta=meta,
        tokenizer=str(getattr(tok, "name_or_path", "")),
    )


def generate(
    tok,
    tasks: Iterable[str],
    lengths: Iterable[int],
    samples: int | dict[int, int],
    seed: int = 0,
    haystacks: Haystacks | None = None,
) -> Iterator[TaskSample]:
    """Every prompt: for each length (shortest first), task and index < ``samples`` (an int, or
    ``{length: count}``)."""
    hay = haystacks or Haystacks()
    for length in sorted(set(lengths)):
        n = samples if isinstance(samples, int) else samples.get(length, 0)
        for task in tasks:
            for i in range(n):
                yield generate_sample(tok, task, length, i, seed, hay)


# --- JSONL --------------------------------------------------------------------------------------
def to_json(sample: TaskSample) -> str:
    """One JSONL line (keys sorted: the same sample gives the same bytes)."""
    return json.dumps(asdict(sample), sort_keys=True, ensure_ascii=False)


def from_json(line: str) -> TaskSample:
    d = json.loads(line)
    if d.get("format") != FORMAT_VERSION:
        raise ValueError(f"task prompts of format {d.get('format')!r}; this kvtier reads format {FORMAT_VERSION}")
    return TaskSample(**d)


def write_jsonl(samples: Iterable[TaskSample], path: str | Path) -> int:
    """Write ``samples`` to ``path`` (replaced whole: a temporary file renamed); returns the count."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(to_json(s) + "\n")
            n += 1
    tmp.replace(path)
    return n


def read_jsonl(path: str | Path) -> list[TaskSample]:
    data = read_input(Path(path), "task prompts file", limit=1 << 30).decode("utf-8")
    return [from_json(line) for line in data.splitlines() if line.strip()]


# --- scoring ------------------------------------------------------------------------------------
def score(prediction: str, answers: Iterable[str]) -> float:
    """RULER's ``string_match_all`` for one sample: the fraction of ``answers`` found in ``prediction``
    (case-insensitive substrings)."""
    answers = list(answers)
    if not answers:
        raise ValueError("a sample without expected answers cannot be scored")
    low = prediction.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def bootstrap_ci(
    values: list[float] | list[list[float]], reps: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (resampled ``reps`` times). Given
    groups (a list of lists: a suite's tasks), of the mean of group means, each group resampled
    within itself."""
    groups = [list(g) for g in values] if values and isinstance(values[0], list) else [list(values)]
    groups = [g for g in groups if g]
    if not groups:
        return math.nan, math.nan
    rng = random.Random(seed)
    means = sorted(sum(sum(rng.choices(g, k=len(g))) / len(g) for g in groups) / len(groups) for _ in range(reps))
    lo = means[int((1 - level) / 2 * reps)]
    hi = means[min(reps - 1, int((1 + level) / 2 * reps))]
    return lo, hi


def paired_sign_flip(a: list[float], b: list[float], reps: int = 10000, seed: int = 0) -> float:
    """Two-sided p-value of a paired sign-flip permutation test of mean(a - b) = 0 (same prompts)."""
    if len(a) != len(b):
        raise ValueError(f"paired scores of different lengths: {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    observed = abs(sum(d))
    if observed == 0:
        return 1.0
    rng = random.Random(seed)
    hits = sum(abs(sum(x if rng.random() < 0.5 else -x for x in d)) >= observed - 1e-12 for _ in range(reps))
    return (hits + 1) / (reps + 1)
