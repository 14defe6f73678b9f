"""``TieredCache``: a transformers ``Cache`` whose full-attention layers are :class:`TieredLayer`.

Sliding-window and other non-full-attention layers of hybrid models (``config.layer_types``)
use transformers' own layer classes. The cache needs kvtier's attention function, which reads
the tiers directly; ``kvtier.enable(model)`` switches a model to it.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from ..policy import TierPolicy, get_policy
from .layer import ATTENTION_NAME, TieredLayer


class TieredCache(Cache):
    """Tiered hot / warm / cold KV cache.

    Parameters
    ----------
    config : the model's config (``model.config``) or the model itself.
    policy : a preset name (see ``kvtier.PRESETS``) or a :class:`TierPolicy`.
    attention : ``"fast"`` (attention on the packed data; decode on the CPU in one fused call per
        layer), ``"per-tier"`` (the same, one partial per tier merged in torch) or ``"reference"``
        (each tier decoded to dense K/V for one SDPA call; the oracle the fast paths are tested against).

    Example
    -------
    >>> with kvtier.enable(model):
    ...     out = model.generate(**inputs, cache=kvtier.TieredCache(model.config, "default"))
    """

    def __init__(
        self,
        config: PretrainedConfig | PreTrainedModel,
        policy: str | TierPolicy = "default",
        attention: str = "fast",
    ):
        if isinstance(config, PreTrainedModel):
            config = config.config
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"config must be a transformers config or model, got {type(config).__name__}")
        self.config = config
        self.policy = get_policy(policy)
        text = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        n = len(layer_types)
        for idx in self.policy.layer_overrides:
            if not -n <= idx < n:
                raise ValueError(f"layer_overrides key {idx} is not allowed: the model has {n} layers")
        policies = {i: self.policy.for_layer(i, n) for i, kind in enumerate(layer_types) if kind == "full_attention"}
        offloading = [p.offload for p in policies.values() if p.cold == "offload" and not p.is_exact]
        self.offloader = None
        if offloading:  # one worker and one private directory per disk path, shared by the layers
            from ..offload.prefetch import Offloader

            self.offloader = Offloader(offloading)
        layers: list[Any] = []
        for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs)):
            if kind == "full_attention":
                layers.append(TieredLayer(policies[i], owner=self, attention=attention, layer_idx=i))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
        super().__init__(layers=layers)
        self._attention_checked = False

    def check_attention(self) -> None:
        """Raise unless the model runs kvtier's attention (checked once)."""
        if self._attention_checked:
            return
        impl = getattr(self.config, "_attn_implementation", None)
        if impl is not None and impl != ATTENTION_NAME:
            raise RuntimeError(
                f"TieredCache reads its compressed tiers in kvtier's attention, but the model uses {impl!r}. "
                "Call kvtier.enable(model) (or `with kvtier.enable(model): ...`) and build the cache from "
                "model.config."
            )
        self._attention_checked = True

    @property
    def tiered_layers(self) -> list[TieredLayer]:
        return [layer for layer in self.layers if isinstance(layer, TieredLayer)]

    def sparse_stats(self):  # noqa: ANN201 - kvtier.diagnostics.SparseStats
        """Attention work of all tiered layers so far (see :class:`kvtier.diagnostics.SparseStats`)."""
        from ..diagnostics import SparseStats

        total = SparseStats()
        for layer in self.tiered_layers:
            total.add(layer.sparse_stats)
        return total

    def offload_stats(self):  # noqa: ANN201 - kvtier.diagnostics.OffloadStats
        """Block traffic of the offloading layers so far: hit rate, blocks and bytes moved, stall time."""
        from ..diagnostics import OffloadStats

        total = OffloadStats()
        for layer in self.tiered_layers:
            if getattr(layer.cold, "is_offloaded", False):
                total.add(layer.cold.stats)
        return total

    def close(self) -> None:
        """Release offloaded blocks: stop the prefetch worker, delete the store files (idempotent).
        Garbage collection does the same; the cache is empty afterwards."""
        if self.offloader is not None:
            self.offloader.close()
        for layer in self.tiered_layers:
            if getattr(layer.cold, "is_offloaded", False):
                layer.reset()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def memory_report(self):  # noqa: ANN201 - see kvtier.diagnostics.MemoryReport
        """Bytes held per tier and layer; see :class:`kvtier.diagnostics.MemoryReport`."""
        from ..diagnostics import memory_report

        return memory_report(self)
