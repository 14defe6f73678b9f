"""The vLLM offloading prefix store: blocks that leave vLLM's pool, compressed, in host RAM, on disk and in Redis.

- :mod:`.config`: what a user passes to vLLM (:func:`~.config.kv_transfer_config`, :class:`~.config.StoreConfig`);
- :mod:`.policy`: what is kept (:class:`~.policy.StorePolicy`, presets);
- :mod:`.blocks`: the record format of one block (:class:`~.blocks.BlockFormat`, the codec);
- :mod:`.prefix`: :class:`~.prefix.PrefixStore` (byte budget, step-down LRU, write-through block files);
- :mod:`.remote`: :class:`~.remote.RemoteTier`, the store's Redis tier shared by many engines (AUTH,
  TLS, sealed records, bounded calls; imports redis / cryptography when built);
- :mod:`.spec`: vLLM's side, the ``OffloadingSpec`` its ``OffloadingConnector`` loads, and the probe
  of vLLM's page order (imports vLLM).

Owns the store's bytes and bookkeeping. May import torch, vLLM (only :mod:`.spec`, and
:func:`~.config.kv_transfer_config` when called), ``kvtier.codecs``, ``kvtier.quant``,
``kvtier.errors``, ``redis`` and ``cryptography`` (only :mod:`.remote`, when a tier is built);
never :mod:`kvtier.vllm.pages`, transformers or ``kvtier.hf``. Imports nothing itself: the public
names are in :mod:`kvtier.vllm`.
"""
