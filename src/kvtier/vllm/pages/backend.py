"""kvtier's attention backend for vLLM's CPU platform: packed pages in vLLM's own block pool.

vLLM's CPU platform always picks ``CPU_ATTN`` for a non-MLA model, so kvtier's backend is
registered *over* ``CPU_ATTN`` (:func:`kvtier.vllm.engine.attention_backend`, only while an engine
is built). The backend class is made per :class:`~kvtier.vllm.pages.policy.PagePolicy`
(:func:`backend_class`) and named after it, so vLLM's registry, which holds class paths, resolves
the same policy in any process (module ``__getattr__`` rebuilds it from the name).

- ``exact`` (``bits=None``): vLLM's own pages, metadata builder and CPU kernels, unchanged.
- packed: ``customize_spec`` gives vLLM the packed page bytes (``state_content_bytes``: bytes per
  head and token), so ``VLLM_CPU_KVCACHE_SPACE`` holds ``exact / packed`` times the blocks. The
  metadata builder makes every path choice of a step, once: the side buffer's bookkeeping
  (:func:`kvtier.vllm.pages.paged.plan_step`) and which kernel attends each request
  (:meth:`kvtier.vllm.pages.attention.PagedAttention.plan`, of the engine's
  :meth:`~kvtier.vllm.pages.attention.PagedAttention.for_engine`: the C++ kernels and the prefill kernels
  where they are built, else the torch reference). The impl's ``forward`` only runs that plan on each
  layer (``run``, then ``update``). With ``PagePolicy.value_rotation`` the impl rotates each step's
  values before they are attended and stored, and rotates the output back after: every other part
  works in the rotated basis unaware.

This is the one module of kvtier that subclasses vLLM's attention classes; it imports vLLM at
module level and is imported only by vLLM's registry (or a test in vLLM's venv).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_interface import AttentionSpec

from ...codecs.pages import PageFormat
from ...quant.rotation import rotation
from ..page_events import listen
from .attention import PagedAttention, PagedPlan
from .paged import SideBuffer, plan_step
from .policy import _PREFIX, CONFIG_KEY, SELECT, PagePolicy, get_page_policy, parse_policy_name, policy_name

_SIDES: weakref.WeakSet[SideBuffer] = weakref.WeakSet()
_IMPLS: weakref.WeakSet = weakref.WeakSet()


def sparse_counts() -> tuple[int, int]:
    """(tokens valued, tokens scored), summed over KV heads, layers and steps, by the sparse decode of
    the live kvtier engines of this process (``PagePolicy.sparse_mass``; ``(0, 0)`` without it)."""
    counts = [impl.counts for impl in _IMPLS if impl.counts is not None]
    return tuple(int(sum(c[i] for c in counts)) for i in range(2)) if counts else (0, 0)


def side_buffer_bytes() -> int:
    """Bytes held by the side buffers of the live kvtier engines of this process (outside vLLM's pool)."""
    return sum(side.nbytes for side in _SIDES)


@dataclass
class KVTierMetadata:
    """One step's metadata: the engine's attention, the plan every layer runs (every request's path
    decided) and the engine's side buffer."""

    attention: PagedAttention
    plan: PagedPlan
    side: SideBuffer
    num_actual_tokens: int


class _PagedBuilder(AttentionMetadataBuilder[KVTierMetadata]):
    policy: ClassVar[PagePolicy]

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device) -> None:  # noqa: ANN001
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        asked = (vllm_config.additional_config or {}).get(CONFIG_KEY)
        if asked != policy_name(self.policy):
            raise ValueError(
                f"kvtier's attention backend is registered for {policy_name(self.policy)} but this engine asked "
                f"for {asked!r}: build it with kvtier.vllm.engine_kwargs(...) of the same policy"
            )
        if kv_cache_spec.block_size != self.policy.block_size:
            raise ValueError(
                f"vLLM block_size={kv_cache_spec.block_size} but the kvtier policy packs "
                f"{self.policy.block_size}-token pages: pass block_size from kvtier.vllm.engine_kwargs"
            )
        slots = self.policy.side_slots or vllm_config.scheduler_config.max_num_seqs
        self.side = SideBuffer(
            slots, kv_cache_spec.block_size, kv_cache_spec.num_kv_heads, kv_cache_spec.head_size, kv_cache_spec.dtype
        )
        _SIDES.add(self.side)
        transfer = vllm_config.kv_transfer_config  # the prefix store's loads write pages of this engine
        listen(None if transfer is None else transfer.engine_id, self.side)
        spec = kv_cache_spec
        heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        fmt = PageFormat(self.policy, spec.num_kv_heads, spec.head_size, spec.dtype)
        self.attention = PagedAttention.for_engine(fmt, heads)  # the kernels, chosen once per engine

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> KVTierMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        step = plan_step(
            self.side,
            m.query_start_loc_cpu[: n + 1].tolist(),
            m.seq_lens[:n].tolist(),
            m.block_table_tensor[:n],
            m.num_actual_tokens,
        )
        return KVTierMetadata(self.attention, self.attention.plan(step), self.side, m.num_actual_tokens)


class _PagedImpl(AttentionImpl):
    policy: ClassVar[PagePolicy]

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        if sliding_window is not None:  # a packed page attends its whole sequence: no window yet
            raise NotImplementedError(
                f"kvtier packed pages do not support sliding-window attention (window {sliding_window}; e.g. "
                "Gemma 3's local layers) yet: build this model's engine without kvtier's attention backend "
                "(policy='exact' keeps vLLM's own pages)"
            )
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            f"attn_type={attn_type}": attn_type != AttentionType.DECODER,
            "kv_sharing": kv_sharing_target_layer_name is not None,
            f"kv_cache_dtype={kv_cache_dtype}": kv_cache_dtype != "auto",
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"kvtier packed pages do not support {', '.join(bad)}: use policy='exact'")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        self.attn_type = attn_type
        self.sinks = None
        self.rotation: tuple[torch.Tensor, torch.Tensor] | None = None  # (R, R.T) fp32 [D, D]
        if self.policy.value_rotation:
            r = rotation(head_size)
            self.rotation = (r, r.T.contiguous())
        self.counts = torch.zeros(2, dtype=torch.long) if self.policy.sparse_mass is not None else None
        _IMPLS.add(self)

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KVTierMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvtier packed pages do not fuse output quantization")
        if attn_metadata is None:  # warm-up
            return output
        n = attn_metadata.num_actual_tokens
        att, plan = attn_metadata.attention, attn_metadata.plan
        fmt = att.fmt
        pages = kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)
        if pages.shape[1] != fmt.page_bytes or not kv_cache.is_contiguous() or key.dtype != fmt.dtype:
            raise RuntimeError(
                f"vLLM gave pages {tuple(kv_cache.shape)} and keys in {key.dtype}: expected {fmt.page_bytes} "
                f"contiguous bytes and {fmt.dtype}"
            )
        side = attn_metadata.side.layer(layer.layer_name)
        q, k, v = query[:n], key[:n], value[:n]
        out = output[:n].view(n, self.num_heads, self.head_size)
        if self.rotation is not None:  # values live in the rotated basis (PagePolicy.value_rotation)
            v = torch.matmul(v.float(), self.rotation[0]).to(v.dtype)
        att.run(plan, pages, side, q, k, v, self.scale, out=out, counts=self.counts)  # into vLLM's output
        if self.rotation is not None:  # the output back from the rotated basis
            out.copy_(torch.matmul(out.float(), self.rotation[1]))
        att.update(plan, pages, side, k, v)
        return output


class _PagedBackend(CPUAttentionBackend):
    """Base of the packed-page backends (one subclass per policy, see :func:`backend_class`)."""

    policy: ClassVar[PagePolicy]
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """vLLM's page of this backend: ``state_content_bytes`` = packed bytes per (head, token)."""
        if spec.state_content_bytes is not None:
            return spec
        fmt = PageFormat(cls.policy, spec.num_kv_heads, spec.head_size, spec.dtype)
        return replace(spec, state_content_bytes=fmt.cell_bytes)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False


_CLASSES: dict[str, type] = {}


def backend_class(policy: str | PagePolicy) -> type:
    """The attention backend class of ``policy`` (made once per policy, named by :func:`policy_name`)."""
    policy = get_page_policy(policy)
    name = policy_name(policy)
    if name not in _CLASSES:
        if policy.packed:
            attrs = {"policy": policy, "__module__": __name__}
            impl = type(name + "_Impl", (_PagedImpl,), dict(attrs))
            builder = type(name + "_Builder", (_PagedBuilder,), dict(attrs))
            cls = type(
                name,
                (_PagedBackend,),
                {
                    **attrs,
                    "get_impl_cls": staticmethod(lambda: impl),
                    "get_builder_cls": staticmethod(lambda: builder),
                },
            )
        else:  # vLLM's own backend, under kvtier's name
            cls = type(name, (CPUAttentionBackend,), {"policy": policy, "__module__": __name__})
        cls.__qualname__ = name
        _CLASSES[name] = cls
    return _CLASSES[name]


def selected_backend() -> type:
    """The backend of the engine vLLM is building (the class path :data:`kvtier.vllm.engine.SELECT_PATH`
    resolves to this): kvtier's for the policy its ``additional_config`` names
    (:func:`kvtier.vllm.engine.engine_kwargs`, :func:`~kvtier.vllm.engine.serve_args`), else vLLM's
    own ``CPU_ATTN`` class, unchanged."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    asked = ((cfg.additional_config or {}) if cfg is not None else {}).get(CONFIG_KEY)
    if asked is None:
        return CPUAttentionBackend
    try:
        return backend_class(parse_policy_name(asked))
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise ValueError(
            f"additional_config[{CONFIG_KEY!r}]={asked!r} names no kvtier policy: "
            "take it from kvtier.vllm.engine_kwargs(...) or serve_args(...)"
        ) from err


def __getattr__(name: str):  # noqa: ANN202
    """Resolve a backend class path (``kvtier.vllm.pages.backend.<policy_name>``, or the per-engine
    selector ``kvtier.vllm.pages.backend.KVTierSelect``) in any process."""
    if name == SELECT:
        return selected_backend()
    if name.startswith(_PREFIX):
        return backend_class(parse_policy_name(name))
    raise AttributeError(name)
