"""What a user passes to vLLM: :func:`kv_transfer_config` and the :class:`StoreConfig` it carries.

The store's settings travel inside vLLM's ``KVTransferConfig.kv_connector_extra_config`` (plain
JSON, so the same dict works for ``vllm serve --kv-transfer-config``) and are validated again
where vLLM builds the spec (:meth:`StoreConfig.from_extra`). Imports vLLM only inside
:func:`kv_transfer_config`; :mod:`.policy` otherwise.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from .policy import POLICIES, StorePolicy, get_store_policy

SPEC_NAME = "KVTierOffloadingSpec"
SPEC_MODULE = "kvtier.vllm.store.spec"
_PREFIX = "kvtier_"


@dataclass(frozen=True)
class StoreConfig:
    """Validated settings of one engine's prefix store.

    Attributes
    ----------
    policy : preset name (see :data:`kvtier.vllm.store.policy.POLICIES`) or a :class:`StorePolicy`.
    cpu_bytes : host RAM budget of the stored records (bytes, > 0).
    disk_path : folder for write-through block files that outlive the process, or None.
    disk_bytes : budget of the block files in ``disk_path`` (least recently used removed), or None.
    """

    policy: str | StorePolicy = "default"
    cpu_bytes: int = 4 << 30
    disk_path: str | None = None
    disk_bytes: int | None = None

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
        )


def kv_transfer_config(
    policy: str | StorePolicy = "default",
    cpu_bytes: int = 4 << 30,
    disk_path: str | os.PathLike | None = None,
    *,
    disk_bytes: int | None = None,
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
    engine_id : vLLM's engine id (a fresh one by default); names the store in this process.
    """
    if policy not in POLICIES and not isinstance(policy, StorePolicy):
        get_store_policy(policy)  # raises the one-line error
    store = StoreConfig(policy, cpu_bytes, None if disk_path is None else os.fspath(disk_path), disk_bytes)
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
