"""Transfer slots: where a block crosses between vLLM's scheduler process and its workers.

The prefix store (:class:`kvtier.vllm.store.prefix.PrefixStore`: index, budget, codecs, files,
Redis) lives whole in vLLM's scheduler process, the engine core; the KV pages live in the workers,
one process each under vLLM's default multiprocessing and one per tensor-parallel rank. A block
crosses between them through one *slot* of a shared-memory file, in canonical order
``kv: [L, H, 2, T, D]`` over all KV heads (or ``[L, page_bytes]`` packed pages):

- store: the scheduler gives a store job its slots (:meth:`SlotPool.take_store`), each worker
  copies its pages into them (a tensor-parallel rank writes its own heads ``[h0, h1)`` of every
  slot, so records do not depend on the parallel layout), and when every worker has reported the
  job the scheduler copies the block out of the slot, frees it, and the store encodes the copy on
  its own thread;
- load: a hit at lookup promises a slot (:meth:`SlotPool.promise`; a lookup with none left is a
  miss, because a load cannot fail after a hit), the scheduler decodes the record into it when
  vLLM prepares the load, and the workers copy it into their pages.

:class:`SlotArea` is the file (a JSON header with the block format, then ``count`` slots): rank 0's
worker creates it in ``/dev/shm`` (``posix_fallocate``: a short shared-memory volume is refused
at engine build, never a SIGBUS later) under a unique name, the other ranks receive the name over
vLLM's tensor-parallel group, and the scheduler, built after every worker registered its KV cache,
opens it through the engine's pointer and removes both names (the mappings stay; nothing is left
behind when the engine exits or dies afterwards). :class:`SlotPool` is the scheduler's
bookkeeping of which slots are free. Imports torch, :mod:`.blocks` and ``kvtier.errors``; never vLLM.
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

from ...errors import KVTierError
from .blocks import BlockFormat

MAGIC = "kvtier-slots/1"
HEADER_BYTES = 4096
#: schedule steps a slot of a job vLLM discarded (``reset_prefix_cache``) waits before reuse: the
#: worker may still copy into it in the step after the reset (two with asynchronous scheduling)
QUARANTINE_STEPS = 3
_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32)}


def slot_dir() -> Path:
    """``/dev/shm`` where the system has one, else the temporary folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def pointer_path(directory: Path, engine_id: str) -> Path:
    """The name under which an engine's scheduler finds its slot file."""
    return directory / f"kvtier-{re.sub(r'[^A-Za-z0-9_.-]', '_', engine_id)}.slots"


def _file_bytes(fmt: BlockFormat, count: int) -> int:
    """Size of a slot file: the header, then ``count`` exact blocks."""
    return HEADER_BYTES + count * fmt.exact_bytes


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(directory: Path) -> None:
    """Slot files of dead creators and pointers to nothing (an engine that died before its
    scheduler opened them)."""
    for path in directory.glob("kvtier-*.slots"):
        m = re.fullmatch(r"kvtier-slots-(\d+)-[0-9a-f]+\.slots", path.name)
        try:
            if (path.is_symlink() and not path.exists()) or (m and not _pid_alive(int(m.group(1)))):
                path.unlink()
        except OSError:
            pass


class SlotArea:
    """A shared-memory file of ``count`` block slots, ``[count, *fmt.shape]`` of ``fmt.kv_dtype``.

    Built by :meth:`create` (rank 0's worker) or :meth:`open` (other ranks, the scheduler).
    ``info`` is the JSON the creator stored with the format (the page policy's name, ...).
    """

    def __init__(self, path: Path, fmt: BlockFormat, count: int, info: dict[str, Any]):
        self.path, self.fmt, self.count, self.info = path, fmt, count, info
        raw = torch.from_file(str(path), shared=True, size=_file_bytes(fmt, count), dtype=torch.uint8)
        self.slots = raw[HEADER_BYTES:].view(fmt.kv_dtype).view(count, *fmt.shape)

    def slot(self, i: int) -> torch.Tensor:
        """Slot ``i``: ``kv: [L, H, 2, T, D]`` (or ``[L, page_bytes]``), shared with the other processes."""
        return self.slots[i]

    @classmethod
    def create(cls, fmt: BlockFormat, nbytes: int, info: dict[str, Any], directory: Path | None = None) -> SlotArea:
        """A new slot file of ``nbytes // fmt.exact_bytes`` slots (at least two), its space allocated now."""
        directory = directory or slot_dir()
        count = nbytes // fmt.exact_bytes
        if count < 2:
            raise KVTierError(
                f"kvtier's prefix store: transfer_bytes={nbytes} holds {count} block(s) of {fmt.exact_bytes} bytes: "
                "give it at least two blocks (512 MiB by default)"
            )
        _remove_stale(directory)
        path = directory / f"kvtier-slots-{os.getpid()}-{uuid.uuid4().hex[:12]}.slots"
        fields = {
            "magic": MAGIC,
            "count": count,
            "fmt": [fmt.layers, fmt.heads, fmt.tokens, fmt.head_dim, str(fmt.dtype), fmt.page_bytes],
            "info": info,
        }
        header = json.dumps(fields).encode()
        if len(header) > HEADER_BYTES:
            raise KVTierError(f"kvtier's slot file header is {len(header)} bytes (at most {HEADER_BYTES})")
        size = _file_bytes(fmt, count)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.EFBIG, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                raise KVTierError(
                    f"kvtier's prefix store could not allocate its {size / 2**20:.0f} MiB transfer area in {directory} "
                    f"({os.strerror(err.errno)}): free space there (docker: --shm-size / --ipc=host) or pass a "
                    "smaller transfer_bytes"
                ) from None
            os.pwrite(fd, header, 0)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(path, fmt, count, info)

    @classmethod
    def open(cls, path: str | os.PathLike) -> SlotArea:
        """The slot file at ``path`` (a pointer is followed), checked against its header."""
        real = Path(os.path.realpath(path))
        try:
            with open(real, "rb") as f:
                raw = f.read(HEADER_BYTES)
                size = os.fstat(f.fileno()).st_size
            fields = json.loads(raw.rstrip(b"\0"))
            layers, heads, tokens, head_dim, dtype, page_bytes = fields["fmt"]
            fmt = BlockFormat(layers, heads, tokens, head_dim, _DTYPES[dtype], page_bytes)
            count = int(fields["count"])
            if fields["magic"] != MAGIC or size != _file_bytes(fmt, count):
                raise ValueError("header and size disagree")
        except FileNotFoundError:
            raise KVTierError(
                f"kvtier's prefix store found no transfer area at {path}: vLLM's worker did not build the store "
                "(the engine's KV connector is not kvtier's, or its workers failed)"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise KVTierError(f"kvtier's transfer area {real} is not one kvtier wrote ({err})") from None
        return cls(real, fmt, count, dict(fields.get("info") or {}))

    def publish(self, pointer: Path) -> None:
        """Point ``pointer`` (the engine's name, :func:`pointer_path`) at this file, atomically."""
        tmp = pointer.with_name(pointer.name + f".{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        os.symlink(self.path, tmp)
        os.replace(tmp, pointer)

    @staticmethod
    def unlink(*paths: Path) -> None:
        """Remove names (the mapped memory stays until every process unmaps it)."""
        for p in paths:
            try:
                p.unlink()
            except FileNotFoundError:
                pass


class SlotPool:
    """The scheduler's free list of a :class:`SlotArea`'s slots.

    Loads may use every slot; stores at most those above ``count // 2`` held back for loads
    (a burst of stores must not turn every lookup into a miss). A lookup's hit is a *promise*
    (:meth:`promise`), kept until :meth:`end_step`; :meth:`take_load` turns one into a slot.
    Used on the scheduler's thread only (a stored block leaves its slot there, before encoding).
    """

    def __init__(self, count: int):
        self.count = count
        self.reserve = count // 2
        self._free = list(range(count - 1, -1, -1))
        self._promised = 0
        self._quarantine: list[tuple[int, list[int]]] = []  # (steps left, slots)

    @property
    def free(self) -> int:
        return len(self._free)

    def promise(self) -> bool:
        """Hold a slot for a lookup's hit in this step; False when none is left."""
        if self._promised >= len(self._free):
            return False
        self._promised += 1
        return True

    def take_load(self) -> int:
        """A slot for a load (a promised one where this step made promises)."""
        if not self._free:
            raise KVTierError("kvtier's prefix store has no transfer slot for a load lookup promised")
        self._promised = max(0, self._promised - 1)
        return self._free.pop()

    def take_store(self, n: int) -> list[int]:
        """Up to ``n`` slots for a store (none below the loads' reserve or this step's promises)."""
        k = max(0, min(n, len(self._free) - self._promised - self.reserve))
        return [self._free.pop() for _ in range(k)]

    def release(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def retire(self, slots: list[int]) -> None:
        """Free ``slots`` only after :data:`QUARANTINE_STEPS` steps (their jobs were discarded)."""
        if slots:
            self._quarantine.append((QUARANTINE_STEPS, list(slots)))

    def end_step(self) -> None:
        """A schedule step ended: its promises lapse, quarantined slots age."""
        self._promised = 0
        kept = []
        for steps, slots in self._quarantine:
            if steps <= 1:
                self._free.extend(slots)
            else:
                kept.append((steps - 1, slots))
        self._quarantine = kept
