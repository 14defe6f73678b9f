"""Evaluation texts: the public-domain books in ``../shared/data/pg``, files, or PG-19 online.

Without a ``../shared/data/pg`` folder, the book shipped with the package (``kvtier/data/``: the
first twelve chapters of Bram Stoker's *Dracula*, ~95k tokens, from Project Gutenberg) stands in,
so ``kvtier demo`` and short evaluations run on a fresh clone.

Project Gutenberg files carry a licence header and footer; :func:`strip_gutenberg` keeps the
body between the ``*** START OF`` and ``*** END OF`` markers when they are present.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from ..inputs import read_input

#: The book shipped as package data (``kvtier/data/<name>.txt``).
SHIPPED_BOOK = "dracula"

_START = re.compile(r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG[^\n]*\n", re.I)
_END = re.compile(r"\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG", re.I)


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg text (header and licence removed when marked)."""
    m = _START.search(text)
    if m:
        text = text[m.end() :]
    m = _END.search(text)
    if m:
        text = text[: m.start()]
    return text.strip()


def default_data_dir(kind: str = "pg") -> Path | None:
    """``../shared/data/<kind>`` (``pg``: the books, ``code``: CPython sources) next to the current
    directory or above it, if present with ``.txt`` files."""
    for base in (Path.cwd(), *Path.cwd().parents):
        for cand in (base / "shared" / "data" / kind, base.parent / "shared" / "data" / kind):
            if cand.is_dir() and any(cand.glob("*.txt")):
                return cand
    return None


def default_book_dir() -> Path | None:
    """``../shared/data/pg`` next to the current directory or above it, if present."""
    return default_data_dir("pg")


def shipped_book() -> dict[str, str]:
    """``{SHIPPED_BOOK: body}``: the excerpt shipped with the package, header and footer removed."""
    text = resources.files("kvtier").joinpath("data", f"{SHIPPED_BOOK}.txt").read_text(encoding="utf-8")
    return {SHIPPED_BOOK: strip_gutenberg(text)}


def load_texts(paths: list[str | Path] | None = None, limit: int | None = None) -> dict[str, str]:
    """``{name: body}`` for the given files, else the books of :func:`default_book_dir`, else the
    package's own book (:func:`shipped_book`).

    Raises
    ------
    FileNotFoundError : a given file is missing. IsADirectoryError : it is a folder. ValueError : it
        is not a regular file (a FIFO, a device) or is over ``kvtier.sizing.MAX_INPUT_BYTES``.
    """
    if not paths:
        folder = default_book_dir()
        if folder is None:
            return shipped_book()
        paths = sorted(folder.glob("*.txt"))
    out = {}
    for p in paths[: limit or None]:
        p = Path(p)
        out[p.stem] = strip_gutenberg(read_input(p, "text file").decode("utf-8", errors="replace"))
    return out


def load_pg19(split: str = "test", limit: int = 4, dataset: str = "deepmind/pg19", **kwargs) -> dict[str, str]:
    """PG-19 books through the ``datasets`` library (online, or a local copy via ``data_files``).

    Parameters
    ----------
    split : dataset split.
    limit : number of books.
    dataset : dataset name or builder (``"json"``/``"text"`` with ``data_files=`` for local files).
    """
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("PG-19 loading needs `pip install datasets`") from err
    ds = datasets.load_dataset(dataset, split=split, streaming=True, **kwargs)
    out = {}
    for i, row in enumerate(ds):
        if i >= limit:
            break
        name = str(row.get("short_book_title") or row.get("title") or f"pg19-{i}")
        out[name] = strip_gutenberg(row["text"])
    return out
