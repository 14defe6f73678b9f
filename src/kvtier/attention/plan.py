"""``AttentionPlan``: which backend attends which segment of a layer, decided once per forward step.

FlashInfer's ``plan()`` once per step and ``run()`` per layer, vLLM's one selector with a log line
per fallback: :func:`plan_for` is the only code that reads the thresholds below, the query length,
the device and the kernels' availability (the C++ per-tier, fused and sketch kernels, Triton, and
torch's flash op with lse). It returns an :class:`AttentionPlan`, memoized in the forward call's
:class:`~kvtier.attention.mask.KVMask` per layer layout (policy, heads, tokens, codecs), so every
layer of a step reuses the same object. :mod:`.tiered` and :mod:`kvtier.attention.offloaded` only
follow it.

``force=`` picks a backend: ``"reference"`` (decode every tier, one SDPA call: the oracle),
``"torch"``, ``"cpu"`` (the per-tier C++ kernel for every packed tier, any row count),
``"fused"`` (the whole-layer C++ call for every query chunk it covers), ``"triton"``. A forced
backend that cannot run here raises a one-line :class:`ValueError`; where it does not cover a
segment (codes without an affine rule, a selection kind it lacks) that segment falls back to
torch and the fallback is logged once, as every automatic fallback is (``logging``, logger
``kvtier.attention``). ``TieredCache(..., attention=...)`` maps onto it: ``"fast"`` is the
automatic plan, ``"per-tier"`` the same without the fused call, the other values force.

May import: torch, ``kvtier.attention.backends``, ``kvtier.kernels`` (availability probes),
``kvtier.policy``; never ``kvtier.offload`` or ``kvtier.hf``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass

import torch

from ..policy import SparsePolicy
from .backends.base import Backend
from .backends.cpu import CpuBackend
from .backends.torch import TorchBackend

log = logging.getLogger("kvtier.attention")

#: Query rows per KV head up to which the kernels run (decode); longer chunks (prefill) go to
#: chunk-wise decoding + GEMMs, which amortize better over many rows. On the CPU the fused C++ call
#: still beats decode + GEMM at 24 rows (4 query tokens of a 6:1 GQA model, Qwen2.5's shape: 75 vs
#: 139 ms per 4-layer call at 8k, bf16, 1 thread) and breaks even near 36, hence 32 there; the
#: Triton kernels keep 16 (their row tiles).
KERNEL_MAX_ROWS = 16
CPU_KERNEL_MAX_ROWS = 32
#: Max score elements (rows x tokens) per pass; longer query calls are split into chunks.
SCORE_BUDGET = 1 << 23
#: Where every segment of a long dense call goes through torch's CPU flash op (no score matrix),
#: only the exact tokens' boolean mask grows with rows x tokens: passes are this many elements
#: (64 MiB of mask) instead of ``SCORE_BUDGET``, so the packed tiers are decoded once per pass,
#: not once per ``SCORE_BUDGET`` slice (a 2,048-token prefill chunk of a 6:1 GQA model over 8k
#: tokens: 2 passes instead of 12).
FLASH_PASS_BUDGET = 1 << 26
#: Tokens decoded at a time by the torch backend's chunked path.
DECODE_CHUNK_TOKENS = 1024

#: Backends ``force=`` accepts.
FORCE = ("reference", "torch", "cpu", "fused", "triton")
#: ``TieredCache(..., attention=...)`` values -> ``force`` (``"per-tier"``: automatic, no fused call).
ATTENTION_FORCE = {"fast": None, "per-tier": None, **{name: name for name in FORCE}}

_logged: set[str] = set()


def _fallback(message: str) -> None:
    """Log an automatic fallback once per process."""
    if message not in _logged:
        _logged.add(message)
        log.info("kvtier attention: %s", message)


@functools.lru_cache(maxsize=1)
def flash_lse_op():
    """torch's fused CPU flash attention that also returns the log-sum-exp (a private aten op:
    used when present and behaving as expected, else None and the plain GEMM path is taken)."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        return None
    try:
        q, k = torch.ones(1, 1, 2, 8), torch.ones(1, 1, 3, 8)
        out, lse = op(q, k, k, 0.0, False, attn_mask=torch.zeros(1, 1, 1, 3), scale=1.0)[:2]
        ok = lse.shape == (1, 1, 2) and torch.allclose(lse, torch.full_like(lse, 8 + torch.log(torch.tensor(3.0))))
    except (RuntimeError, TypeError):
        return None
    return op if ok else None


def sketch_kernel_available() -> bool:
    from ..kernels import sketch_cpu

    return sketch_cpu.available()


@functools.lru_cache(maxsize=1)
def _triton() -> Backend | None:
    """The Triton backend when Triton imports (its module is loaded only here, on demand)."""
    from .backends.triton import TritonBackend

    return TritonBackend() if TritonBackend.available() else None


def _triton_runs_on(device: torch.device) -> bool:
    """CUDA, or CPU tensors under Triton's interpreter (how the tests run the kernels)."""
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


_CPU = CpuBackend()
_TORCH = {chunked: TorchBackend(chunked, DECODE_CHUNK_TOKENS) for chunked in (False, True)}


@dataclass(frozen=True)
class ChunkPlan:
    """One query chunk ``[start, stop)`` of a call and the backends that attend it.

    Attributes
    ----------
    rows : query rows per KV head (``Gq * (stop - start)``).
    exact : backend of the exact segments (sinks, hot).
    packed : backend of packed tiers whose codes the kernels read (``codec.AFFINE`` set).
    other : backend of the other packed tiers (torch, chunk-wise decoding).
    fused : the whole layer in one C++ call (:meth:`CpuBackend.layer`), vq tiers included.
    sketch_kernel : offloaded layers score their key sketches in C++.
    offload_kernel : an offloaded layer's cold tier takes the C++ two-level path (select and attend
        in :mod:`kvtier.kernels.offload_cpu`): few rows on the CPU (``sketch_kernel``), exact
        records of a dtype the kernel reads, the kernel built.
    offload_fused : besides, its sinks and hot go through one fused C++ call
        (:func:`kvtier.kernels.fused_cpu.layer_attention`) when no warm block is held.
    """

    start: int
    stop: int
    rows: int
    exact: Backend
    packed: Backend
    other: Backend
    fused: bool
    sketch_kernel: bool
    offload_kernel: bool = False
    offload_fused: bool = False

    def backend(self, codec) -> Backend:
        """The backend of a packed tier with this codec."""
        return self.packed if self.packed.reads(codec) else self.other


@dataclass(frozen=True)
class AttentionPlan:
    """How one layer layout is attended in one forward call.

    Attributes
    ----------
    path : ``"reference"`` (dense oracle), ``"sdpa"`` (only hot tokens: the plain SDPA call,
        bit-identical to ``DynamicCache``), ``"tiered"`` (per-segment partials) or ``"offload"``.
    selection : ``"dense"``, ``"blocks"`` or ``"tokens"``: the sparse selection of this call;
        on an offloaded layer ``"sketch"`` (cold blocks chosen per row from their key sketches)
        or ``"dense"`` (a call longer than ``OffloadPolicy.max_query_tokens``: every cold block).
    sparse : the sparse policy applied (None: dense).
    dense_call : the layer's policy is sparse but this call attends densely (a long chunk, or a
        backend without its selection): its work is counted apart.
    chunks : the query chunks and their backends.
    force : the forced backend, or None.
    """

    path: str
    selection: str
    sparse: SparsePolicy | None
    dense_call: bool
    chunks: tuple[ChunkPlan, ...]
    force: str | None = None


def check_force(force: str, device: torch.device) -> None:
    """Raise a one-line error when the forced backend cannot run on ``device`` here."""
    if force in ("cpu", "fused"):
        if device.type != "cpu":
            raise ValueError(f"attention backend {force!r} runs on CPU tensors; these are on {device.type}")
        if not CpuBackend.available() or (force == "fused" and not CpuBackend.layer_available()):
            raise ValueError(f"attention backend {force!r} is unavailable: its C++ kernel did not build here")
    elif force == "triton":
        if not _triton_runs_on(device):
            raise ValueError("attention backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
        if _triton() is None:
            raise ValueError("attention backend 'triton' is unavailable: Triton does not import here")
    elif force not in FORCE:
        raise ValueError(f"attention backend {force!r} is not allowed: expected one of {FORCE}")


def flash_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the CPU flash op reads for a query of ``dtype``: the model's own bf16 / fp16 (what its
    SDPA reads; the op accumulates in fp32, and bf16 runs on AMX / AVX-512 BF16 at ~4x fp32's
    speed), else fp32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def _chunk(start, stop, rows, device, selection, force, fused_layer, codecs_affine, dtype) -> ChunkPlan:
    """Backends of one query chunk of ``rows`` rows per KV head (query ``dtype``)."""
    few = rows <= (CPU_KERNEL_MAX_ROWS if device.type == "cpu" else KERNEL_MAX_ROWS)
    flash = flash_lse_op() if device.type == "cpu" else None
    fd = flash_dtype(dtype)
    torch_b = (
        TorchBackend(not few, DECODE_CHUNK_TOKENS, flash, SCORE_BUDGET, fd)
        if flash is not None and not few
        else _TORCH[not few]
    )
    other = TorchBackend(True, DECODE_CHUNK_TOKENS, flash, SCORE_BUDGET, fd) if flash is not None else _TORCH[True]
    exact, packed, fused = _TORCH[False], torch_b, False
    if flash is not None and not few and force in (None, "torch"):
        exact = torch_b  # sinks and hot of a long chunk through the flash op too
    sketch = device.type == "cpu" and few and force != "torch" and sketch_kernel_available()
    if force == "torch":
        pass
    elif force in ("cpu", "fused"):
        packed = _CPU
        fused = force == "fused" and selection != "blocks" and codecs_affine
        if force == "fused" and not fused:
            _fallback("the fused kernel has no block selection (or a codec without affine codes): per-tier C++")
    elif force == "triton":
        exact = packed = _triton()
    elif device.type == "cpu":
        cpu_ok = CpuBackend.available()
        if not cpu_ok:
            _fallback("the C++ CPU kernels are unavailable: packed tiers use torch")
        if cpu_ok and (few or selection == "tokens"):  # token selection in C++ is faster at any row count
            packed = _CPU
        fused = fused_layer and few and selection != "blocks" and codecs_affine
        if fused and not CpuBackend.layer_available():
            _fallback("the fused C++ kernel is unavailable: per-tier partials")
            fused = False
    elif device.type == "cuda" and few:
        triton = _triton()
        if triton is None:
            _fallback("Triton is unavailable: CUDA tiers use torch")
        else:
            exact = packed = triton
    return ChunkPlan(start, stop, rows, exact, packed, other, fused, sketch)


def _layout(layer, query: torch.Tensor) -> tuple:
    """What a plan depends on, cheap to hash (read once per layer and call): the layer's policy
    (sparse policy, codecs, offloading: fixed per policy object), whether it holds more than hot
    tokens, heads, query length, tokens held, device type, the dtype the flash op would read."""
    warm, cold = layer.warm, layer.cold
    has_prefix = layer.sinks.k is not None or bool(
        (warm is not None and warm.nblocks) or (cold is not None and cold.nblocks)
    )
    return (
        layer.attention,
        id(layer.policy),
        has_prefix,
        query.shape[1],
        query.shape[2],
        layer.kv_heads,
        layer.seen - layer.evicted,
        query.device.type,
        flash_dtype(query.dtype),
    )


def plan_for(layer, query: torch.Tensor, mask=None, force: str | None = None) -> AttentionPlan:
    """The plan of ``layer`` for ``query [B, Hq, q, D]`` in this forward call, memoized in ``mask``
    (a :class:`~kvtier.attention.mask.KVMask`, built once per forward call) per layer layout.

    ``force`` overrides the layer's ``attention`` setting (see the module docstring).
    """
    if force is None:
        force = ATTENTION_FORCE[layer.attention]
    key = (force, *_layout(layer, query))
    memo = None if mask is None else mask.plans
    if memo is not None:
        plan = memo.get(key)
        if plan is not None:
            return plan
    plan = _build(layer, force, *key[3:])
    if memo is not None:
        memo[key] = plan
    return plan


def _build(
    layer, force: str | None, has_prefix: bool, Hq: int, q: int, H: int, tokens: int, device: str, dtype: torch.dtype
):
    attention = layer.attention
    policy_sparse = layer.policy.sparse
    tiers = [t for t in (layer.cold, layer.warm) if t is not None]
    offloaded = layer.offloaded
    device = torch.device(device)
    # the fused call reads affine codes and, on the CPU, vector codes (the routine of the vq kernel)
    affine = all(
        t.codec.AFFINE is not None or (device.type == "cpu" and _CPU.reads(t.codec))
        for t in tiers
        if not t.is_offloaded
    )
    if force is not None:
        check_force(force, device)
    if force == "reference":
        return AttentionPlan("reference", "dense", None, False, (), force)
    if not has_prefix:
        return AttentionPlan("sdpa", "dense", None, False, (), force)
    sp = policy_sparse
    offload_dense = False
    if offloaded:
        sp = None  # offloaded layers select by their OffloadPolicy, not by SparsePolicy
        limit = layer.cold.policy.max_query_tokens
        offload_dense = limit is not None and q > limit  # a long chunk (prefill): every cold block
    if sp is not None and sp.max_query_tokens is not None and q > sp.max_query_tokens:
        sp = None  # a long chunk (prefill): dense
    triton_used = force == "triton" or (force is None and device.type == "cuda" and _triton() is not None)
    if sp is not None and sp.select == "tokens" and triton_used:
        _fallback("Triton kernels select blocks, not tokens: token-sparse calls attend densely on Triton")
        sp = None
    selection = "dense" if sp is None else sp.select
    if offloaded and not offload_dense:
        selection = "sketch"
    G = Hq // H
    step = max(1, SCORE_BUDGET // max(1, tokens * G))
    flash_pass = (
        device.type == "cpu" and selection == "dense" and force in (None, "torch") and flash_lse_op() is not None
    )
    if flash_pass and G * q > CPU_KERNEL_MAX_ROWS:  # a long call, no score matrix: longer passes
        step = max(step, FLASH_PASS_BUDGET // max(1, tokens * G))
    fused_layer = attention == "fast" or force == "fused"
    chunks = tuple(
        _chunk(s, min(s + step, q), G * (min(s + step, q) - s), device, selection, force, fused_layer, affine, dtype)
        for s in range(0, q, step)
    )
    if offloaded and selection == "sketch":
        chunks = _offload_chunks(layer, chunks)
    path = "offload" if offloaded else "tiered"
    dense_call = policy_sparse is not None and sp is None and not offloaded
    return AttentionPlan(path, selection, sp, dense_call, chunks, force)


def _offload_chunks(layer, chunks: tuple[ChunkPlan, ...]) -> tuple[ChunkPlan, ...]:
    """The chunks of a sketch-selected offloaded call with their C++ paths decided (see
    :class:`ChunkPlan`): exact records (``store_bits=None``) of a dtype the kernel reads, built."""
    if not any(c.sketch_kernel for c in chunks) or layer.cold.policy.store_bits is not None:
        return chunks
    from ..kernels import fused_cpu, offload_cpu

    if layer.dtype not in offload_cpu.DTYPES or not offload_cpu.available():
        return chunks
    fused = fused_cpu.available()
    return tuple(
        dataclasses.replace(c, offload_kernel=True, offload_fused=fused) if c.sketch_kernel else c for c in chunks
    )
