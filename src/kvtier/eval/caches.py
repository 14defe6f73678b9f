"""The caches every evaluation compares, built by name through one factory.

``dynamic`` is transformers' full ``DynamicCache``; ``quanto-int4`` / ``quanto-int2`` are
transformers' ``QuantizedCache`` (optimum-quanto backend, extra ``kvtier[baselines]``); ``hf-fp8`` is
``QuantizedCache(backend="fp8")`` (e4m3 with one scale per tensor, frozen at the first call; no extra); every
kvtier preset (``default``, ``kivi2``, ``sink-window``, ...) is a :class:`~kvtier.TieredCache`.
A :class:`~kvtier.TierPolicy` object is accepted too (sweeps). A preset name with the suffix
``:reference`` runs kvtier's reference attention (every tier decoded, one SDPA call) instead of
the fast path, e.g. ``default:reference``, and ``:per-tier`` the fast path without the fused
whole-layer decode kernel (one partial per tier, merged in torch); the suffix ``:dense`` runs the preset without its
sparse attention (``default:dense``), the baseline the sparsity is measured against. ``adaptive@B``
is the ``adaptive`` preset at a budget of ``B`` bits per element (e.g. ``adaptive@2.5``), with
optional fields of its :class:`~kvtier.policy.AdaptivePolicy` after a colon
(``adaptive@2.5:keep=0.5:fit_tokens=4096``).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..policy import PRESETS, TierPolicy

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
    if name.startswith("adaptive@"):
        import dataclasses

        bits_s, _, opts = name.removeprefix("adaptive@").partition(":")
        try:
            bits = float(bits_s)
            fields, policy_fields = {}, {}
            for item in filter(None, opts.split(":")):
                key, _, value = item.partition("=")
                if key == "sinks":  # the policy's exact sink tokens (the rest are AdaptivePolicy fields)
                    policy_fields["sink_tokens"] = int(value)
                elif key in ("keep", "fit_tokens", "warmup_tokens"):
                    fields[key] = float(value) if key == "keep" else int(value)
                elif key == "codes":
                    fields[key] = value
                else:
                    raise ValueError(key)
        except ValueError:
            raise ValueError(
                f"cache {name!r} is not allowed: expected adaptive@<bits>[:keep=<f>][:fit_tokens=<n>]"
                "[:warmup_tokens=<n>][:sinks=<n>][:codes=vq|affine+vq], e.g. adaptive@2.5 or adaptive@2.5:keep=0.5"
            ) from None
        p = PRESETS["adaptive"][1]()
        assert p.adaptive is not None
        adaptive = dataclasses.replace(p.adaptive, bits=bits, **fields)
        return CacheSpec(name, p.replace(adaptive=adaptive, name=name, **policy_fields))
    base, _, path = name.partition(":")
    if base in PRESETS and path in ("reference", "per-tier"):
        return CacheSpec(name, PRESETS[base][1](), attention=path)
    if base in PRESETS and path == "dense":
        return CacheSpec(name, PRESETS[base][1]().replace(sparse=None, name=name))
    if base in PRESETS and path.startswith("vq"):  # e.g. default:vq3/2: its cold tier in vector codes
        kb, _, vb = path.removeprefix("vq").partition("/")
        if not (kb.isdigit() and (vb == "" or vb.isdigit())):
            raise ValueError(
                f"cache {name!r} is not allowed: expected <preset>:vq<key bits>[/<value bits>], e.g. default:vq3/2"
            )
        vq = {"cold_codes": "vq", "cold_bits": int(kb), "cold_value_bits": int(vb) if vb else None}
        return CacheSpec(name, PRESETS[base][1]().replace(sparse=None, name=name, **vq))
    raise ValueError(f"cache {name!r} is not allowed: expected one of {[*BASELINES, *PRESETS]}")


def all_cache_names() -> list[str]:
    return [*BASELINES, *PRESETS]


def kv_bytes(cache: Any) -> int:
    """Bytes held by a cache's tensors (kvtier: its memory report; others: their layer tensors)."""
    from ..diagnostics import reachable_tensor_bytes
    from ..hf import TieredCache

    if isinstance(cache, TieredCache):
        return cache.memory_report().total_bytes
    return reachable_tensor_bytes(cache)
