"""Reading a command's input file safely: a leaf module (pure Python, imports nothing of kvtier).

``kvtier plan --model``, ``kvtier eval --text``, ``kvtier report`` and the prefix store's
``remote_key=file:PATH`` read their files through :func:`read_input`, which refuses what is not a
regular file (a FIFO would block, ``/dev/zero`` never ends) and caps the size, in one line.
"""

from __future__ import annotations

import stat
from pathlib import Path

#: bytes read from a file a command is given (a config, a text, a results file): the largest book in
#: ../shared/data/pg is 1.8 MB; a wrong path (a weights file, a disk image) is refused, not loaded
MAX_INPUT_BYTES = 64 << 20


def read_input(path: str | Path, what: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes, for a command's input
    (``what`` names it in the message: ``"text file"``, ``"results file"``, ``"--model"``).

    Checked before it is opened: a FIFO would block the open, ``/dev/zero`` never ends.

    Raises
    ------
    FileNotFoundError : missing. IsADirectoryError : a folder. ValueError : not a regular file (a
        FIFO, a device, a socket) or over ``limit`` bytes. OSError : unreadable.
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except OSError as err:
        raise type(err)(f"{what} {path}: {err.strerror or err}") from None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(f"{what} {path} is a folder")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what} {path} is not a regular file (a FIFO, a device or a socket)")
    if st.st_size > limit:
        raise ValueError(f"{what} {path} is {st.st_size:,} bytes: more than the {limit:,} allowed")
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)  # bounded even if it grew since (or is a /proc file that says 0 bytes)
    except OSError as err:
        raise type(err)(f"{what} {path}: {err.strerror or err}") from None
    if len(data) > limit:
        raise ValueError(f"{what} {path} is more than the {limit:,} bytes allowed")
    return data
