"""What a user passes to vLLM: :func:`kv_transfer_config` and the :class:`StoreConfig` it carries.

The store's settings travel inside vLLM's ``KVTransferConfig.kv_connector_extra_config`` (plain
JSON, so the same dict works for ``vllm serve --kv-transfer-config``) and are validated again
where vLLM builds the spec (:meth:`StoreConfig.from_extra`). Imports vLLM only inside
:func:`kv_transfer_config`; :mod:`.policy` and :mod:`.remote` (its checks; no Redis) otherwise.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from .policy import POLICIES, StorePolicy, get_store_policy
from .remote import TIMEOUT_S, check_key_source, check_url

SPEC_NAME = "KVTierOffloadingSpec"
SPEC_MODULE = "kvtier.vllm.store.spec"
_PREFIX = "kvtier_"
TRANSFER_BYTES = 512 << 20


@dataclass(frozen=True)
class StoreConfig:
    """Validated settings of one engine's prefix store.

    Attributes
    ----------
    policy : preset name (see :data:`kvtier.vllm.store.policy.POLICIES`) or a :class:`StorePolicy`.
    cpu_bytes : host RAM budget of the stored records (bytes, > 0).
    disk_path : folder for write-through block files that outlive the process, or None.
    disk_bytes : budget of the block files in ``disk_path`` (least recently used removed), or None.
    remote : ``redis://[user:password@]host:port/db`` (or ``rediss://`` for TLS): a Redis server whose
        block records every engine pointed at it shares, or None.
    remote_ttl : seconds a record lives in Redis after its last write or hit, or None.
    remote_timeout : bound of one Redis call, seconds.
    remote_key : ``"env:NAME"`` or ``"file:PATH"``: where the 32-byte key that seals the records
        (AES-256-GCM) is, or None (records stored as they are).
    transfer_bytes : shared memory (``/dev/shm``) through which blocks cross between vLLM's
        scheduler and its worker processes: this many bytes of exact blocks, allocated at engine
        build. Loads may use all of it, stores half; a lookup that finds no slot left is a miss.
    """

    policy: str | StorePolicy = "default"
    cpu_bytes: int = 4 << 30
    disk_path: str | None = None
    disk_bytes: int | None = None
    remote: str | None = None
    remote_ttl: int | None = None
    remote_timeout: float = TIMEOUT_S
    remote_key: str | None = None
    transfer_bytes: int = TRANSFER_BYTES

    def __post_init__(self) -> None:
        get_store_policy(self.policy)
        if isinstance(self.cpu_bytes, bool) or not isinstance(self.cpu_bytes, int) or self.cpu_bytes <= 0:
            raise ValueError(f"cpu_bytes={self.cpu_bytes!r} is not allowed: expected an int > 0 (bytes of host RAM)")
        if self.disk_path is not None:
            if not isinstance(self.disk_path, (str, os.PathLike)) or not str(self.disk_path):
                raise ValueError(f"disk_path={self.disk_path!r} is not allowed: expected a folder path or None")
            object.__setattr__(self, "disk_path", os.fspath(self.disk_path))
        if self.disk_bytes is not None:
            if isinstance(self.disk_bytes, bool) or not isinstance(self.disk_bytes, int) or self.disk_bytes <= 0:
                raise ValueError(
                    f"disk_bytes={self.disk_bytes!r} is not allowed: expected an int > 0 (bytes of block files) or None"
                )
            if self.disk_path is None:
                raise ValueError("disk_bytes is not allowed without disk_path: it bounds the block files there")
        t = self.transfer_bytes
        if isinstance(t, bool) or not isinstance(t, int) or t <= 0:
            raise ValueError(f"transfer_bytes={t!r} is not allowed: expected an int > 0 (bytes of shared memory)")
        self._check_remote()

    def _check_remote(self) -> None:
        if self.remote is not None:
            check_url(self.remote)
        elif (self.remote_ttl, self.remote_key) != (None, None):
            raise ValueError("remote_ttl and remote_key are not allowed without remote: they set the Redis tier")
        ttl = self.remote_ttl
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0):
            raise ValueError(f"remote_ttl={ttl!r} is not allowed: expected an int > 0 (seconds) or None")
        t = self.remote_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 60:
            raise ValueError(f"remote_timeout={t!r} is not allowed: expected seconds in (0, 60]")
        if self.remote_key is not None:
            check_key_source(self.remote_key)

    @property
    def store_policy(self) -> StorePolicy:
        return get_store_policy(self.policy)

    def policy_fields(self) -> dict[str, Any]:
        return asdict(self.store_policy)

    def to_extra(self) -> dict[str, Any]:
        """The JSON-able entries for ``kv_connector_extra_config``."""
        policy = self.policy if isinstance(self.policy, str) else self.policy_fields()
        return {
            "spec_name": SPEC_NAME,
            "spec_module_path": SPEC_MODULE,
            _PREFIX + "policy": policy,
            _PREFIX + "cpu_bytes": self.cpu_bytes,
            _PREFIX + "disk_path": self.disk_path,
            _PREFIX + "disk_bytes": self.disk_bytes,
            _PREFIX + "remote": self.remote,
            _PREFIX + "remote_ttl": self.remote_ttl,
            _PREFIX + "remote_timeout": self.remote_timeout,
            _PREFIX + "remote_key": self.remote_key,
            _PREFIX + "transfer_bytes": self.transfer_bytes,
        }

    @classmethod
    def from_extra(cls, extra: Any) -> StoreConfig:
        policy = extra.get(_PREFIX + "policy", "default")
        if isinstance(policy, dict):
            try:
                policy = StorePolicy(**policy)
            except TypeError as err:
                raise ValueError(f"kvtier_policy={policy!r} is not allowed: {err}") from None
        return cls(
            policy,
            extra.get(_PREFIX + "cpu_bytes", 4 << 30),
            extra.get(_PREFIX + "disk_path"),
            extra.get(_PREFIX + "disk_bytes"),
            extra.get(_PREFIX + "remote"),
            extra.get(_PREFIX + "remote_ttl"),
            extra.get(_PREFIX + "remote_timeout", TIMEOUT_S),
            extra.get(_PREFIX + "remote_key"),
            extra.get(_PREFIX + "transfer_bytes", TRANSFER_BYTES),
        )


def kv_transfer_config(
    policy: str | StorePolicy = "default",
    cpu_bytes: int = 4 << 30,
    disk_path: str | os.PathLike | None = None,
    *,
    disk_bytes: int | None = None,
    remote: str | None = None,
    remote_ttl: int | None = None,
    remote_timeout: float = TIMEOUT_S,
    remote_key: str | None = None,
    transfer_bytes: int = TRANSFER_BYTES,
    engine_id: str | None = None,
    as_json: bool = False,
) -> Any:
    """vLLM's ``KVTransferConfig`` that runs kvtier's compressed prefix store.

    Pass it as ``vllm.LLM(..., kv_transfer_config=kv_transfer_config("default", 8 << 30))``;
    ``as_json=True`` gives the string for ``vllm serve --kv-transfer-config``.

    Parameters
    ----------
    policy : ``"exact"``, ``"default"``, ``"chat"``, ``"compact"``, ``"code"``, or a StorePolicy.
    cpu_bytes : host RAM budget of the stored blocks.
    disk_path : folder for block files (a restart with the same folder hits), or None.
    disk_bytes : budget of the block files in ``disk_path``, shared by the engines using the folder
        (least recently used files removed), or None (no limit).
    remote : a Redis server shared by many engines (``redis://host:port/db``, ``rediss://`` for TLS;
        a password in the URL is never logged by kvtier, but vLLM prints its configuration: prefer
        ``KVTIER_REDIS_PASSWORD`` in the environment), or None. Looked up after RAM and disk.
    remote_ttl : seconds a record lives in Redis after its last write or hit, or None.
    remote_timeout : bound of one Redis call, seconds (a slow or dead server costs a lookup at most this).
    remote_key : ``"env:NAME"`` / ``"file:PATH"`` of a 32-byte key (64 hex digits or base64) that seals
        the records in Redis (AES-256-GCM); records that do not open are misses.
    transfer_bytes : shared memory through which blocks cross between vLLM's scheduler and its
        workers (512 MiB: the loads of one step can bring ~23k tokens of SmolLM2-135M, ~18k of
        Qwen2.5-1.5B, in vLLM's 128-token CPU blocks; stores ~11k / ~9k, held one step each).
    engine_id : vLLM's engine id (a fresh one by default); names the store in this process.
    """
    if policy not in POLICIES and not isinstance(policy, StorePolicy):
        get_store_policy(policy)  # raises the one-line error
    store = StoreConfig(
        policy,
        cpu_bytes,
        None if disk_path is None else os.fspath(disk_path),
        disk_bytes,
        remote,
        remote_ttl,
        remote_timeout,
        remote_key,
        transfer_bytes,
    )
    engine_id = engine_id or f"kvtier-{uuid.uuid4().hex[:12]}"
    fields = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": store.to_extra(),
    }
    if as_json:
        return json.dumps(fields)
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**fields)
