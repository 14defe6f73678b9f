"""Evaluation texts: the public-domain books in ``../shared/data/pg``, files, or PG-19 online.

Project Gutenberg files carry a licence header and footer; :func:`strip_gutenberg` keeps the
body between the ``*** START OF`` and ``*** END OF`` markers when they are present.
"""

from __future__ import annotations

import re
from pathlib import Path

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


def default_book_dir() -> Path | None:
    """``../shared/data/pg`` next to the current directory or above it, if present."""
    for base in (Path.cwd(), *Path.cwd().parents):
        cand = base / "shared" / "data" / "pg"
        if cand.is_dir() and any(cand.glob("*.txt")):
            return cand
        cand = base.parent / "shared" / "data" / "pg"
        if cand.is_dir() and any(cand.glob("*.txt")):
            return cand
    return None


def load_texts(paths: list[str | Path] | None = None, limit: int | None = None) -> dict[str, str]:
    """``{name: body}`` for the given files, else the books of :func:`default_book_dir`.

    Raises
    ------
    FileNotFoundError : when no text is given and no book folder is found, or a file is missing.
    """
    if not paths:
        folder = default_book_dir()
        if folder is None:
            raise FileNotFoundError("no texts: pass --text FILE... (no ../shared/data/pg folder found)")
        paths = sorted(folder.glob("*.txt"))
    out = {}
    for p in paths[: limit or None]:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"text file {p} does not exist")
        out[p.stem] = strip_gutenberg(p.read_text(encoding="utf-8", errors="replace"))
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
