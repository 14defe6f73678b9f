"""kvtier inside vLLM: a compressed KV offloading store for prefix reuse, in host RAM and on disk.

>>> from vllm import LLM
>>> from kvtier.vllm import kv_transfer_config
>>> llm = LLM(model=path, kv_transfer_config=kv_transfer_config("default", cpu_bytes=8 << 30, disk_path="/var/kv"))

and packed KV pages in vLLM's own block pool: ~3.7x the tokens in the same ``VLLM_CPU_KVCACHE_SPACE``:

>>> with attention_backend("default"):
...     llm = LLM(model=path, **engine_kwargs("default"))

Two packages that import each other only where the store reads an engine's page policy
(:mod:`.pages.policy`, to keep blocks of packed pages as they are), and the shared top:

- :mod:`.store`: the offloading prefix store. vLLM's ``OffloadingConnector`` keeps its scheduler
  logic and loads kvtier's out-of-tree ``OffloadingSpec`` (:mod:`.store.spec`), whose worker
  quantizes each offloaded block with kvtier's codecs into a
  :class:`~kvtier.vllm.store.prefix.PrefixStore` (byte budget, step-down LRU, write-through block
  files with crc32; :mod:`.store.blocks`: the record format; :mod:`.store.policy`: what is kept;
  :mod:`.store.config`: what a user passes to vLLM).
- :mod:`.pages`: the packed-page attention backend (:mod:`.pages.backend`, whose metadata builder
  plans each step once through :class:`~kvtier.vllm.pages.attention.PagedAttention`; the page
  policy, the side buffer and step plan, the prefill kernels).
- here: :mod:`.engine` (opt an engine into the pages backend), :mod:`.plugin` (vLLM's
  ``general_plugins`` entry point), :mod:`.serve` (``kvtier serve``: a command, in the top layer)
  and the public names below.

This package may import torch, vLLM (only :mod:`.store.spec`, :mod:`.pages.backend`,
:class:`.pages.prefill.VllmPrefill` when made, and :func:`kv_transfer_config` /
:func:`attention_backend` when called), ``kvtier.codecs``, ``kvtier.quant``, ``kvtier.errors``,
``kvtier.kernels``, ``kvtier.attention.partials``, the top-level ``kvtier`` package (its version,
for the store's startup line); never transformers or ``kvtier.hf``. ``import kvtier`` never imports
this package.
"""

from .engine import attention_backend, engine_kwargs, kv_bytes_per_token, serve_args
from .pages.policy import PAGE_POLICIES, PagePolicy, get_page_policy
from .store.blocks import BlockCodec, BlockFormat, RecordCorrupt
from .store.config import StoreConfig, kv_transfer_config
from .store.policy import POLICIES, StorePolicy, get_store_policy
from .store.prefix import PrefixStore

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
