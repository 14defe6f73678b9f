"""The caches every evaluation compares, built by name through one factory.

``dynamic`` is transformers' full ``DynamicCache``; ``quanto-int4`` / ``quanto-int2`` are
transformers' ``QuantizedCache`` (optimum-quanto backend, extra ``kvtier[baselines]``); ``hf-fp8`` is
``QuantizedCache(backend="fp8")`` (e4m3 with one scale per tensor, frozen at the first call; no extra); every
kvtier preset (``default``, ``kivi2``, ``sink-window``, ...) is a :class:`~kvtier.TieredCache`.
A :class:`~kvtier.TierPolicy` object is accepted too (sweeps). A preset name with the suffix
``:reference`` runs kvtier's reference attention (every tier decoded, one SDPA call) instead of
the fast path, e.g. ``default:reference``, and ``:per-tier`` the fast path without the fused
whole-layer decode kernel (one partial per tier, merged in torch). Preset variants are named as
:func:`kvtier.policy.get_policy` names them (``TieredCache`` and ``kvtier plan`` take the same
names): ``default:dense`` (the preset without its sparse attention, the baseline the sparsity is
measured against), ``adaptive@2.5[:keep=0.5:fit_tokens=4096:codes=vq]`` (the ``adaptive`` preset
at a budget of 2.5 bits per element, fields of its :class:`~kvtier.policy.AdaptivePolicy`),
``default:vq3/3`` (its cold tier in vector codes).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..policy import PRESETS, VARIANT_FORMS, TierPolicy, preset_variant

BASELINES = ("dynamic", "quanto-int4", "quanto-int2", "hf-fp8")


class Unavailable(RuntimeError):
    """A cache that cannot run here (a missing optional dependency); the message says why."""


@dataclass
class CacheSpec:
    """A named cache: ``build(model)`` gives a fresh cache; ``context(model)`` the attention to run it with."""

    name: str
    policy: TierPolicy | None = None
    attention: str = "fast"

    @property
    def is_tiered(self) -> bool:
        return self.policy is not None

    def build(self, model: Any) -> Any:
        from transformers import DynamicCache, QuantizedCache

        from ..hf import TieredCache

        if self.policy is not None:
            return TieredCache(model.config, self.policy, attention=self.attention)
        if self.name == "dynamic":
            return DynamicCache(config=model.config)
        if self.name.startswith("quanto-int"):
            if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
                raise Unavailable(f"{self.name} needs optimum-quanto: pip install 'kvtier[baselines]'")
            bits = int(self.name.removeprefix("quanto-int"))
            return QuantizedCache(backend="quanto", config=model.config, nbits=bits)
        if self.name == "hf-fp8":
            return QuantizedCache(backend="fp8", config=model.config)
        raise ValueError(f"unknown cache {self.name!r}")

    @contextlib.contextmanager
    def context(self, model: Any) -> Iterator[None]:
        if self.policy is None:
            yield
            return
        from ..hf import enable

        with enable(model):
            yield


def cache_spec(name: str | TierPolicy) -> CacheSpec:
    """A spec from a baseline name, a preset name, or a policy."""
    if isinstance(name, TierPolicy):
        return CacheSpec(name.name, name)
    if name in BASELINES:
        return CacheSpec(name)
    if name in PRESETS:
        return CacheSpec(name, PRESETS[name][1]())
    base, _, path = name.partition(":")
    if base in PRESETS and path in ("reference", "per-tier"):
        return CacheSpec(name, PRESETS[base][1](), attention=path)
    variant = preset_variant(name)  # adaptive@2.5:codes=vq, default:vq3/3, default:dense, ...
    if variant is not None:
        return CacheSpec(name, variant)
    raise ValueError(
        f"cache {name!r} is not allowed: expected one of {[*BASELINES, *PRESETS]}, a preset with :reference or "
        f":per-tier, or a variant ({' | '.join(VARIANT_FORMS)})"
    )


def all_cache_names() -> list[str]:
    return [*BASELINES, *PRESETS]


def kv_bytes(cache: Any) -> int:
    """Bytes held by a cache's tensors (kvtier: its memory report; others: their layer tensors)."""
    from ..diagnostics import reachable_tensor_bytes
    from ..hf import TieredCache

    if isinstance(cache, TieredCache):
        return cache.memory_report().total_bytes
    return reachable_tensor_bytes(cache)
