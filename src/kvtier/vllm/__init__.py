"""kvtier inside vLLM: a compressed KV offloading store for prefix reuse, in host RAM and on disk.

>>> from vllm import LLM
>>> from kvtier.vllm import kv_transfer_config
>>> llm = LLM(model=path, kv_transfer_config=kv_transfer_config("default", cpu_bytes=8 << 30, disk_path="/var/kv"))

and packed KV pages in vLLM's own block pool (:mod:`.engine`, :mod:`.backend`, :mod:`.pages`,
:mod:`.paged`, :mod:`.prefill`): ~3.7x the tokens in the same ``VLLM_CPU_KVCACHE_SPACE``:

>>> with attention_backend("default"):
...     llm = LLM(model=path, **engine_kwargs("default"))

vLLM's ``OffloadingConnector`` keeps its scheduler logic and loads kvtier's out-of-tree
``OffloadingSpec`` (:mod:`.spec`), whose worker quantizes each offloaded block with kvtier's
codecs into a :class:`~kvtier.vllm.store.PrefixStore` (:mod:`.store`: byte budget, step-down LRU,
write-through block files with crc32; :mod:`.blocks`: the record format; :mod:`.policy`: what is
kept). This package owns all of it and may import torch, vLLM (only :mod:`.spec`,
:mod:`.backend`, :class:`.prefill.VllmPrefill` when made, and :func:`kv_transfer_config` /
:func:`attention_backend` when called),
``kvtier.codecs``, ``kvtier.quant``, ``kvtier.errors``, ``kvtier.kernels``; never
transformers or ``kvtier.hf``. ``import kvtier`` never imports this package.
"""

from .blocks import BlockCodec, BlockFormat, RecordCorrupt
from .config import StoreConfig, kv_transfer_config
from .engine import attention_backend, engine_kwargs, kv_bytes_per_token, serve_args
from .pages import PAGE_POLICIES, PagePolicy, get_page_policy
from .policy import POLICIES, StorePolicy, get_store_policy
from .store import PrefixStore

__all__ = [
    "PAGE_POLICIES",
    "POLICIES",
    "PagePolicy",
    "attention_backend",
    "engine_kwargs",
    "get_page_policy",
    "kv_bytes_per_token",
    "serve_args",
    "BlockCodec",
    "BlockFormat",
    "PrefixStore",
    "RecordCorrupt",
    "StoreConfig",
    "StorePolicy",
    "get_store_policy",
    "kv_transfer_config",
]
