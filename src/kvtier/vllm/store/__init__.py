"""The vLLM offloading prefix store: blocks that leave vLLM's pool, compressed, in host RAM and on disk.

- :mod:`.config`: what a user passes to vLLM (:func:`~.config.kv_transfer_config`, :class:`~.config.StoreConfig`);
- :mod:`.policy`: what is kept (:class:`~.policy.StorePolicy`, presets);
- :mod:`.blocks`: the record format of one block (:class:`~.blocks.BlockFormat`, the codec);
- :mod:`.prefix`: :class:`~.prefix.PrefixStore` (byte budget, step-down LRU, write-through block files);
- :mod:`.spec`: vLLM's side, the ``OffloadingSpec`` its ``OffloadingConnector`` loads (imports vLLM).

Owns the store's bytes and bookkeeping. May import torch, vLLM (only :mod:`.spec`, and
:func:`~.config.kv_transfer_config` when called), ``kvtier.codecs``, ``kvtier.quant``,
``kvtier.errors``; never :mod:`kvtier.vllm.pages`, transformers or ``kvtier.hf``. Imports nothing
itself: the public names are in :mod:`kvtier.vllm`.
"""
