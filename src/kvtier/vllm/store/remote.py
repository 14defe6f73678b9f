"""The prefix store's remote tier: block records in a Redis server that many engines share.

:class:`RemoteTier` owns everything about the pool: the connection (``redis://`` or TLS
``rediss://``, AUTH from the URL or from ``KVTIER_REDIS_USERNAME``/``KVTIER_REDIS_PASSWORD``),
the key of a block (``kvtier:<namespace>:<block key hex>:<part>``; the namespace hashes model, block
format and policy, so engines of another model or policy never read each other's records; a
record is split at the allocator's size classes, :func:`split_sizes`, and written in one
MULTI/EXEC, read in one MGET), the
optional sealing of records (AES-256-GCM, :class:`Sealer`; the Redis key is the associated data,
so a record moved to another key does not open), the bounded time of every call, and the health
state (``up``, ``down``, ``auth``, ``full``) with one log line per change.

What it promises the store (:mod:`kvtier.vllm.store.prefix`):

- :meth:`RemoteTier.get` runs on the caller's thread (vLLM's scheduler, at lookup) and never
  waits longer than ``timeout`` seconds; an unreachable, refusing or slow server makes it return
  None (a miss) at once for the next ``RETRY_S`` seconds, after which one call tries again.
- :meth:`RemoteTier.put` never waits on the network: it queues the write on the tier's own
  thread (at most ``MAX_QUEUED`` waiting; more are dropped and counted).
- Nothing here raises on a server fault or a bad record: faults are counted in ``counters``
  (the store's :class:`collections.Counter`) and said once per state change. A record that does
  not open (wrong key, tampered, sealed when no key is set, plain when one is) is a miss.

The tier never assumes a block is still there: Redis's own eviction (``maxmemory`` with an LRU
policy) and ``ttl`` bound the pool. Imports ``redis`` (and ``cryptography`` for sealing) when a
tier is built; never vLLM, transformers or torch.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

from ...errors import KVTierError
from ...inputs import read_input

logger = logging.getLogger(__name__)

#: seconds a failed server is left alone before one call tries it again
RETRY_S = 2.0
#: writes waiting for the tier's thread; more are dropped (counted ``remote_dropped``)
MAX_QUEUED = 256
#: default bound of one Redis call, seconds
TIMEOUT_S = 0.25
#: environment variables read for AUTH when the URL carries no password
USER_ENV, PASSWORD_ENV = "KVTIER_REDIS_USERNAME", "KVTIER_REDIS_PASSWORD"

#: a record is stored as at most this many string values (see :func:`split_sizes`)
MAX_PARTS = 3
_SDS_HEADER = 10  # bytes Redis adds to a string value's allocation (sdshdr32 + terminator)

_SEALED = b"KVTS\x01"  # a sealed record: magic + version, 12-byte nonce, AES-GCM ciphertext + 16-byte tag
_NONCE = 12
_TAG = 16


def split_sizes(n: int) -> list[int]:
    """Lengths of the parts a record of ``n`` bytes is stored in (at most MAX_PARTS, summing to ``n``).

    Redis allocates a string value in jemalloc's smallest size class that holds it (4 classes per
    doubling above 4 KiB), so one value of a 4-bit SmolLM2 block record (806,448 bytes) takes
    917,504 (+13.8 %). Parts cut at class boundaries (here 786,422 + 16,374 + 3,652 bytes) waste
    under 1 % at the cost of two more keys (~200 bytes each).
    """
    sizes = []
    while n > 0:
        total = n + _SDS_HEADER
        if len(sizes) == MAX_PARTS - 1 or total <= 4096:
            sizes.append(n)
            break
        base = 1 << (total.bit_length() - 1)
        size = base + (total - base) // (base >> 2) * (base >> 2) - _SDS_HEADER
        sizes.append(size)
        n -= size
    return sizes


def redact(url: str) -> str:
    """``url`` without its password (what kvtier logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def redact_text(text: str) -> str:
    """``text`` with the password of every ``redis://`` / ``rediss://`` URL in it replaced by ``***``."""
    return re.sub(r"(rediss?://[^:/@\s\"']*:)[^@/\s\"']*@", r"\1***@", text)


def check_url(url: object) -> str:
    """``url`` if it names a Redis server (``redis://`` or ``rediss://``, a host); else ValueError."""
    if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss") or not urlsplit(url).hostname:
        shown = redact(url) if isinstance(url, str) else repr(url)
        raise ValueError(
            f"remote={shown!r} is not allowed: expected redis://[user:password@]host:port/db or rediss://..."
        )
    return url


def check_key_source(source: object) -> str:
    """``source`` if it is ``"env:NAME"`` or ``"file:PATH"``; else ValueError (the key itself is never accepted:
    vLLM logs its configuration)."""
    if not isinstance(source, str) or not (source.startswith("env:") or source.startswith("file:")) or len(source) < 5:
        raise ValueError(
            "remote_key is not allowed: expected 'env:VARIABLE' or 'file:PATH' naming where the 32-byte key is "
            "(64 hex digits or base64), never the key itself"
        )
    return source


def load_key(source: str) -> bytes:
    """The 32-byte AES key that ``source`` (``env:NAME`` / ``file:PATH``) names; KVTierError in one line."""
    check_key_source(source)
    kind, _, where = source.partition(":")
    if kind == "env":
        text = os.environ.get(where)
        if text is None:
            raise KVTierError(f"remote_key={source!r}: the environment variable {where} is not set")
    else:
        try:  # a regular file of a few bytes: a FIFO or /dev/zero is refused, not read
            text = read_input(where, "key file", limit=4096).decode("ascii", "replace")
        except (OSError, ValueError) as err:
            raise KVTierError(f"remote_key={source!r}: the key file cannot be read ({err})") from None
    text = text.strip()
    for decode in (bytes.fromhex, lambda t: base64.b64decode(t, validate=True)):
        try:
            key = decode(text)
        except (ValueError, binascii.Error):
            continue
        if len(key) == 32:
            return key
    raise KVTierError(f"remote_key={source!r}: expected a 32-byte key as 64 hex digits or base64")


class Sealer:
    """AES-256-GCM over a record, bound to the Redis key it is stored under (associated data)."""

    def __init__(self, key: bytes):
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            raise KVTierError("remote_key needs the cryptography package: pip install cryptography") from None
        self._aead = AESGCM(key)

    def seal(self, name: bytes, data: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        return _SEALED + nonce + self._aead.encrypt(nonce, data, name)

    def open(self, name: bytes, data: bytes) -> bytes | None:
        """The record, or None when it does not open (wrong key, tampered, not sealed)."""
        from cryptography.exceptions import InvalidTag

        if len(data) < len(_SEALED) + _NONCE + _TAG or not data.startswith(_SEALED):
            return None
        nonce = data[len(_SEALED) : len(_SEALED) + _NONCE]
        try:
            return self._aead.decrypt(nonce, data[len(_SEALED) + _NONCE :], name)
        except InvalidTag:
            return None


class RemoteTier:
    """Block records of one store namespace in a Redis server shared by many engines.

    Parameters
    ----------
    url : ``redis://[user:password@]host:port/db`` or ``rediss://...`` (TLS; certificate options as
        redis-py's URL query, e.g. ``?ssl_ca_certs=/path/ca.pem``).
    namespace : the store's namespace (model, format and policy hash).
    counters : where this tier counts (``remote_*`` keys); the store passes its own.
    ttl : seconds a record lives in Redis after its last write or hit, or None (Redis's eviction only).
    timeout : bound of one call (connect, read or write), seconds.
    key : the AES-256-GCM key that seals records, or None (records stored as they are).
    """

    def __init__(
        self,
        url: str,
        namespace: str,
        counters: Counter[str] | None = None,
        *,
        ttl: int | None = None,
        timeout: float = TIMEOUT_S,
        key: bytes | None = None,
    ):
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise KVTierError("the remote tier needs the redis package: pip install redis") from None
        self._errors = redis.exceptions
        self.url = check_url(url)
        self.shown = redact(url)
        self.ttl = ttl
        self.timeout = timeout
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.prefix = f"kvtier:{namespace}:".encode()
        self.sealer = None if key is None else Sealer(key)
        auth = {}
        parts = urlsplit(url)
        if parts.password is None and os.environ.get(PASSWORD_ENV):
            auth = {"password": os.environ[PASSWORD_ENV], "username": os.environ.get(USER_ENV) or parts.username}
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            **auth,
        )
        self.state = "new"
        self._retry_at = 0.0
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._queued = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-remote")
        self._closed = False

    def name(self, key: bytes) -> bytes:
        """The name of a block (its parts are ``name:0`` ...; the seal's associated data)."""
        return self.prefix + key.hex().encode()

    @staticmethod
    def part_names(name: bytes) -> list[bytes]:
        return [name + b":%d" % i for i in range(MAX_PARTS)]

    # --- health -----------------------------------------------------------------------------
    def _available(self) -> bool:
        return self.state in ("new", "up", "full") or time.monotonic() >= self._retry_at

    def _set_state(self, state: str, why: str = "") -> None:
        with self._lock:
            old, self.state = self.state, state
        if old == state:
            return
        self.counters["remote_state_changes"] += old != "new"
        if state == "up":
            if old != "new":
                logger.warning("kvtier: Redis %s is back: the shared block pool is in use again", self.shown)
            return
        what = {
            "down": "cannot be reached",
            "auth": "refused the credentials",
            "full": "is full (its maxmemory policy refuses writes)",
        }[state]
        logger.warning(
            "kvtier: Redis %s %s (%s): blocks are served from RAM and disk and computed again; retried every %.0f s",
            self.shown,
            what,
            why,
            RETRY_S,
        )

    def _failed(self, err: Exception) -> None:
        """Count a failed call and leave the server alone for RETRY_S (one line per state change)."""
        self.counters["remote_errors"] += 1
        e = self._errors
        if isinstance(err, getattr(e, "OutOfMemoryError", ())) or (
            isinstance(err, e.ResponseError) and "OOM" in str(err)
        ):
            self._set_state("full", "OOM")
            return  # reads still work on a full server
        if isinstance(err, (e.AuthenticationError, e.AuthenticationWrongNumberOfArgsError)) or (
            isinstance(err, e.ResponseError) and ("NOAUTH" in str(err) or "WRONGPASS" in str(err))
        ):
            state = "auth"
        else:
            state = "down"
        self._retry_at = time.monotonic() + RETRY_S
        self._set_state(state, type(err).__name__)

    def warn_once(self, kind: str, message: str, *args: object) -> None:
        """A warning said once per kind of bad record (a wrong key would otherwise say it per block)."""
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)

    def ping(self) -> bool:
        """Try the server now (at the store's start); True when it answered."""
        try:
            self.client.ping()
        except (self._errors.RedisError, OSError) as err:
            self._failed(err)
            return False
        self._set_state("up")
        return True

    # --- reads (caller's thread) ------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        """The record stored for ``key`` (opened when sealed), or None: absent, server failed or
        skipped, or the record does not open. Waits at most ``timeout`` seconds."""
        if not self._available():
            self.counters["remote_skipped"] += 1
            return None
        name = self.name(key)
        try:
            if self.ttl:
                pipe = self.client.pipeline(transaction=False)
                for part in self.part_names(name):
                    pipe.getex(part, ex=self.ttl)
                parts = pipe.execute()
            else:
                parts = self.client.mget(self.part_names(name))
        except (self._errors.RedisError, OSError) as err:
            self._failed(err)
            return None
        if self.state != "full":
            self._set_state("up")
        if parts[0] is None:
            return None
        data = b"".join(p for p in parts if p is not None)  # a part Redis evicted: the checks fail, a miss
        if self.sealer is not None:
            opened = self.sealer.open(name, data)
            if opened is None:
                self.counters["remote_rejected"] += 1
                self.warn_once(
                    "seal",
                    "kvtier: a record in Redis %s does not open with this engine's remote_key (another key, "
                    "tampered, or stored unsealed): a miss",
                    self.shown,
                )
            return opened
        if data.startswith(_SEALED):
            self.counters["remote_rejected"] += 1
            self.warn_once(
                "sealed", "kvtier: Redis %s holds sealed records and this engine has no remote_key: a miss", self.shown
            )
            return None
        return data

    # --- writes (the tier's thread) ---------------------------------------------------------
    def put(self, key: bytes, data: bytes) -> None:
        """Queue ``data`` for ``key`` (never waits on the network; dropped when the server is
        failing or the queue is full)."""
        if self._closed or not self._available():
            self.counters["remote_skipped"] += 1
            return
        with self._lock:
            if self._queued >= MAX_QUEUED:
                self.counters["remote_dropped"] += 1
                return
            self._queued += 1
        self._pool.submit(self._write, key, data)

    def _write(self, key: bytes, data: bytes) -> None:
        try:
            if not self._available():
                self.counters["remote_skipped"] += 1
                return
            name = self.name(key)
            value = data if self.sealer is None else self.sealer.seal(name, data)
            pipe = self.client.pipeline(transaction=True)  # all parts or none (MULTI/EXEC)
            offset = 0
            for part, size in zip(self.part_names(name), split_sizes(len(value))):
                pipe.set(part, value[offset : offset + size], ex=self.ttl)
                offset += size
            try:
                pipe.execute()
            except (self._errors.RedisError, OSError) as err:
                self._failed(err)
                return
            self._set_state("up")
            self.counters["remote_writes"] += 1
            self.counters["remote_bytes_written"] += len(value)
        finally:
            with self._lock:
                self._queued -= 1

    def flush(self) -> None:
        """Wait until every queued write has run."""
        if not self._closed:
            self._pool.submit(lambda: None).result()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
            self.client.close()

    def describe(self) -> str:
        ttl = "no TTL" if self.ttl is None else f"TTL {self.ttl} s"
        sealed = "sealed (AES-256-GCM)" if self.sealer is not None else "not sealed"
        return f"remote {self.shown} ({ttl}, records {sealed}, {self.state})"
