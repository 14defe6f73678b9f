"""kvtier inside vLLM: a compressed KV offloading store for prefix reuse, in host RAM and on disk.

>>> from vllm import LLM
>>> from kvtier.vllm import kv_transfer_config
>>> llm = LLM(model=path, kv_transfer_config=kv_transfer_config("default", cpu_bytes=8 << 30, disk_path="/var/kv"))

vLLM's ``OffloadingConnector`` keeps its scheduler logic and loads kvtier's out-of-tree
``OffloadingSpec`` (:mod:`.spec`), whose worker quantizes each offloaded block with kvtier's
codecs into a :class:`~kvtier.vllm.store.PrefixStore` (:mod:`.store`: byte budget, step-down LRU,
write-through block files with crc32; :mod:`.blocks`: the record format; :mod:`.policy`: what is
kept). This package owns all of it and may import torch, vLLM (only :mod:`.spec`, and
:func:`kv_transfer_config` when called), ``kvtier.cache.codecs``, ``kvtier.quant``, ``kvtier.errors``;
never transformers or ``kvtier.hf``. ``import kvtier`` never imports this package.
"""

from .blocks import BlockCodec, BlockFormat, RecordCorrupt
from .config import StoreConfig, kv_transfer_config
from .policy import POLICIES, StorePolicy, get_store_policy
from .store import PrefixStore

__all__ = [
    "POLICIES",
    "BlockCodec",
    "BlockFormat",
    "PrefixStore",
    "RecordCorrupt",
    "StoreConfig",
    "StorePolicy",
    "get_store_policy",
    "kv_transfer_config",
]
