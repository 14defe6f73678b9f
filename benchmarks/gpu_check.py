"""GPU check of kvtier's Triton path: correctness at realistic sizes, then what it buys.

One command on a CUDA machine (needs only torch, triton and transformers; no network, no weights):

1. correctness: each Triton kernel (k-bit 2/3/4/8, 1-bit sign with and without rotation, CSR
   block-sparse with row masks, exact hot tokens) against the fp32 torch path and an fp64
   reference, with the flash-attention rule ``err(kernel) <= 2 * err(torch fp32) + 1e-5``; and
   kvtier's own decode attention on a CUDA ``TieredLayer`` (which routes to the kernels);
2. kernel bandwidth: achieved GB/s on the bytes each kernel reads (packed codes, parameters,
   validity; exact K/V for the hot kernel), against the device's peak (``--peak-gbps``);
3. decode attention step of one Llama-2-7B-shaped layer (32 heads, head_dim 128, batch 1) at 8k,
   32k and 128k tokens: kvtier (hot exact + warm 4-bit + cold 1-bit) against bf16 SDPA (and
   FlashAttention when installed) over the dense cache;
4. end-to-end decode tokens/s of a randomly initialized small Llama (built from ``LlamaConfig``):
   ``kvtier.TieredCache`` + ``kvtier.enable(model)`` against ``DynamicCache``;
5. vLLM packed pages (``kvtier.kernels.triton_pages``, the page format of ``kvtier.vllm``): one
   step of decode rows and a prefill chunk over pages, side rows and a block read in part against
   the torch path, then a decode step of 48 requests x 2k tokens (SmolLM2 and Llama-3-8B layer
   shapes) and a step of 8 prefill chunks of 256 tokens after 2k against bf16 SDPA over the same
   requests' exact K/V.

It prints a table per part and ends with one JSON line; exit status 1 when a check fails.
``--dry-run`` runs every code path on the CPU (Triton's interpreter, tiny sizes; times mean nothing).

    python benchmarks/gpu_check.py                       # H200: peak 4800 GB/s, about 2-3 minutes
    python benchmarks/gpu_check.py --peak-gbps 3350      # H100 SXM
    python benchmarks/gpu_check.py --dry-run             # CPU, well under a minute
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H200_PEAK_GBPS = 4800.0


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run (full on CUDA, tiny for the dry run)."""

    check_batch: int
    check_heads: int
    check_gqa: int
    check_blocks: int
    block: int
    head_dim: int
    group: int
    bw_tokens: int
    bw_heads: tuple[tuple[int, int], ...]
    step_heads: int
    contexts: tuple[int, ...]
    hot: int
    warm: int
    sinks: int
    model: dict
    prompts: tuple[int, ...]
    new_tokens: int
    iters: int
    page_reqs: int = 48
    page_context: int = 2048
    page_block: int = 128
    page_shapes: tuple[tuple[int, int, int], ...] = ((3, 9, 64), (8, 32, 128))  # (KV heads, query heads, D)
    page_chunk_reqs: int = 8
    page_chunk: int = 256


FULL = Sizes(
    check_batch=2, check_heads=8, check_gqa=4, check_blocks=48, block=128, head_dim=128, group=64,
    bw_tokens=32768, bw_heads=((32, 1), (8, 4)), step_heads=32, contexts=(8192, 32768, 131072),
    hot=128, warm=4096, sinks=32,
    model=dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=8, num_attention_heads=16,
               num_key_value_heads=4, head_dim=128, vocab_size=32000),
    prompts=(4096, 16384), new_tokens=64, iters=50,
)  # fmt: skip
DRY = Sizes(
    check_batch=2, check_heads=2, check_gqa=4, check_blocks=3, block=8, head_dim=16, group=8,
    bw_tokens=32, bw_heads=((2, 1), (1, 4)), step_heads=2, contexts=(72, 120), hot=8, warm=16, sinks=2,
    model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=97),
    prompts=(40,), new_tokens=3, iters=1, page_reqs=3, page_context=64, page_block=32, page_shapes=((2, 4, 16),),
    page_chunk_reqs=2, page_chunk=40,
)  # fmt: skip


# table columns: (key, header, format)
CHECK_COLS = [
    ("check", "check", "s"),
    ("err_kernel", "kernel", ".2e"),
    ("err_torch", "torch fp32", ".2e"),
    ("ok", "ok", ""),
]  # noqa: E501
KERNEL_COLS = [
    ("kernel", "kernel", "s"), ("heads", "KV heads", "d"), ("rows", "rows/head", "d"), ("tokens", "tokens", "d"),
    ("MB", "MB read", ".1f"), ("ms", "ms", ".4f"), ("GB/s", "GB/s", ".0f"), ("% peak", "% peak", ".1f"),
]  # fmt: skip
STEP_COLS = [
    ("tokens", "tokens", "d"), ("dense MB", "bf16 MB", ".1f"), ("kvtier MB", "kvtier MB", ".1f"),
    ("sdpa bf16 ms", "sdpa ms", ".4f"), ("flash ms", "flash ms", ".4f"), ("kvtier ms", "kvtier ms", ".4f"),
    ("kernels ms", "kernels-only ms", ".4f"), ("speedup vs sdpa", "x sdpa", ".2f"),
    ("speedup vs flash", "x flash", ".2f"),
]  # fmt: skip
PAGE_COLS = [
    ("shape", "H/Hq/D", "s"), ("policy", "policy", "s"), ("err", "err vs torch", ".2e"), ("ok", "ok", ""),
    ("MB", "pages MB", ".1f"), ("dense MB", "bf16 MB", ".1f"), ("ms", "kvtier ms", ".4f"),
    ("sdpa ms", "sdpa bf16 ms", ".4f"), ("x sdpa", "x sdpa", ".2f"), ("GB/s", "GB/s", ".0f"),
]  # fmt: skip
COMPILE_COLS = [("kernel", "kernel", "s"), ("ok", "ok", ""), ("registers", "registers", "d"), ("stack", "spill B", "d"),
                ("s", "compile s", ".1f")]  # fmt: skip
E2E_COLS = [
    ("prompt", "prompt", "d"), ("cache", "cache", "s"), ("prefill s", "prefill s", ".3f"), ("tok/s", "tok/s", ".1f"),
    ("ms/token", "ms/token", ".2f"), ("vs dynamic", "x dynamic", ".2f"), ("peak MB", "peak MB", ".0f"),
]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peak-gbps", type=float, default=None, help="device peak bandwidth (default 4800, an H200)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny sizes")
    ap.add_argument(
        "--compile-only", type=int, metavar="SM", nargs="?", const=90, default=None,
        help="only compile the kernel variants for CUDA compute capability SM (default 90) with Triton's own "
        "ptxas; needs no GPU; prints registers and spills",
    )  # fmt: skip
    return ap.parse_args(argv)


class Timer:
    """Median time of a callable: CUDA events with the L2 cache flushed before each call, or wall time."""

    def __init__(self, device, iters: int):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.iters = iters
        # 256 MiB, written before each timed call so nothing is read from a warm L2 (H200: 60 MiB)
        self.flush = torch.empty(64 << 20, dtype=torch.int32, device=device) if self.cuda else None

    def __call__(self, fn) -> float:
        """Median milliseconds of ``fn()`` after two warm-up calls (which also compile kernels)."""
        torch = self.torch
        fn()
        fn()
        times = []
        for _ in range(self.iters):
            if self.cuda:
                self.flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)


def flash_attn_available() -> bool:
    """True when the ``flash_attn`` package imports (a baseline to compare with; it needs CUDA)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or built for another torch
        return False
    return True


def table(title: str, rows: list[dict], cols: list[tuple[str, str, str]]) -> None:
    """Print ``rows`` under ``title``; ``cols``: (key, header, format)."""
    print(f"\n== {title}")
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        cells.append([("-" if r.get(k) is None else format(r[k], f)) for k, _, f in cols])
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    for i, line in enumerate(cells):
        print("  ".join(s.rjust(w) if i and j else s.ljust(w) for j, (s, w) in enumerate(zip(line, widths))))


# --- building blocks ---------------------------------------------------------------------------------


def make_tier(codec, B, H, n, T, D, device, pad_tokens=0, seed=0):
    """Encoded fields of a tier with ``n`` blocks of ``T`` tokens (row 1's first ``pad_tokens`` invalid)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    k = (torch.randn(B, H, n, T, D, generator=g) * torch.linspace(0.2, 3, D) + torch.randn(D, generator=g)).to(device)
    v = torch.randn(B, H, n, T, D, generator=g).to(device)
    valid = torch.ones(B, 1, n * T, dtype=torch.bool)
    if B > 1:
        valid[1, :, :pad_tokens] = False
    valid = valid.reshape(B, 1, n, T).to(device)
    fields = codec.encode(k, v, valid)
    fields["valid"] = valid
    return fields


def tier_bytes(fields) -> int:
    """Bytes of every tensor of a tier (what a kernel reading all blocks reads, valid counted once)."""
    return sum(t.numel() * t.element_size() for t in fields.values())


def reference64(rows, fields, codec, dim, keep=None):
    """fp64 attention over a tier decoded from its stored codes and parameters."""

    from kvtier.codecs import KBitCodec, VqCodec
    from kvtier.quant import rotation, unpack_bits

    if isinstance(codec, VqCodec):  # codebook coordinates x stored scales, widened to fp64
        B, H, n, T = fields["k_rms"].shape
        r = rotation(dim, rows.device).double()
        k = codec.stored_keys(fields, dim).double().reshape(B, H, n * T, dim) @ r.T
        v = codec.stored_values(fields, dim).double().reshape(B, H, n * T, dim) @ r.T
        v = v + fields["v_mean"].double().reshape(B, H, n * T, 1)
        return _attend64(rows, k, v, fields["valid"].reshape(B, 1, 1, n * T), keep, T)
    name = "k_codes" if isinstance(codec, KBitCodec) else "k_signs"
    B, H, n, T, _ = fields[name].shape
    NG = fields["v_scale"].shape[-1]
    f = {k: v.double() for k, v in fields.items() if v.is_floating_point()}
    if isinstance(codec, KBitCodec):
        kq = unpack_bits(fields["k_codes"], codec.bits, dim).double()
        vq = unpack_bits(fields["v_codes"], codec.bits, dim).double().reshape(B, H, n, T, NG, -1)
        k = (kq - f["k_zero"]) * f["k_scale"]
        v = (vq - f["v_zero"][..., None]) * f["v_scale"][..., None]
    else:
        ks = unpack_bits(fields["k_signs"], 1, dim).double()
        vs = unpack_bits(fields["v_signs"], 1, dim).double().reshape(B, H, n, T, NG, -1)
        k = f["k_mean"] + f["k_scale"] * (2 * ks - 1)
        v = f["v_mean"][..., None] + f["v_scale"][..., None] * (2 * vs - 1)
    k, v = k.reshape(B, H, n * T, dim), v.reshape(B, H, n * T, dim)
    if not isinstance(codec, KBitCodec) and codec.rotate:
        r = rotation(dim, rows.device).double()
        k, v = k @ r.T, v @ r.T
    return _attend64(rows, k, v, fields["valid"].reshape(B, 1, 1, n * T), keep, T)


def _attend64(rows, k, v, allowed, keep, T):
    """fp64 attention of ``rows`` over ``k, v [B, H, N, D]`` where ``allowed`` (and ``keep``'s blocks)."""
    import torch

    if keep is not None:
        allowed = allowed & keep.repeat_interleave(T, dim=-1)
    scores = (rows.double() @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(scores - finite[..., None]) @ v, lse


def errors(got, ref64) -> float:
    """Max abs error of ``(out, lse)`` against the fp64 reference; inf if empty rows disagree."""
    import torch

    out, lse = got
    out64, lse64 = ref64
    empty = torch.isinf(lse64)
    if not torch.equal(torch.isinf(lse), empty) or not bool(torch.isfinite(out).all()):
        return float("inf")
    d_lse = (lse.double() - lse64)[~empty]
    return max((out.double() - out64).abs().max().item(), d_lse.abs().max().item() if d_lse.numel() else 0.0)


def check_row(name: str, got, fp32, ref64) -> dict:
    e_k, e_t = errors(got, ref64), errors(fp32, ref64)
    return {"check": name, "err_kernel": e_k, "err_torch": e_t, "ok": e_k <= 2 * e_t + 1e-5}


# --- 1. correctness ----------------------------------------------------------------------------------


def run_checks(sz: Sizes, device) -> list[dict]:
    import torch

    from kvtier import TierPolicy
    from kvtier.attention.partials import exact_partial, packed_partial, vq_partial
    from kvtier.attention.plan import plan_for
    from kvtier.attention.reference import reference_attention
    from kvtier.attention.tiered import tiered_attention
    from kvtier.codecs import KBitCodec, SignCodec, VqCodec
    from kvtier.hf.layer import TieredLayer
    from kvtier.kernels import dispatch

    B, H, R, n, T, D = sz.check_batch, sz.check_heads, sz.check_gqa, sz.check_blocks, sz.block, sz.head_dim
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = (torch.randn(B, H, R, D, generator=g) * D**-0.5).to(device)
    rows_checks = []
    codecs = [KBitCodec(b, sz.group) for b in (2, 3, 4, 8)] + [SignCodec(sz.group), SignCodec(sz.group, rotate=True)]
    for i, codec in enumerate(codecs):
        fields = make_tier(codec, B, H, n, T, D, device, pad_tokens=T + T // 2, seed=i)
        p = packed_partial(rows, fields, codec, D, None)
        got = dispatch.gpu_partial(rows, fields, codec, D)
        rows_checks.append(check_row(f"packed {codec.name}", got, (p.out, p.lse), reference64(rows, fields, codec, D)))
    # block-sparse: a quarter of the blocks per head, random per-row masks, one head with none
    for i, codec in enumerate([KBitCodec(4, sz.group), SignCodec(sz.group)]):
        fields = make_tier(codec, B, H, n, T, D, device, seed=10 + i)
        k = max(1, n // 4)
        blocks = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(B * H)]).reshape(B, H, k)
        blocks[0, 0] = -1
        row_mask = torch.rand(B, H, R, k, generator=g) > 0.3
        keep = torch.zeros(B, H, R, n, dtype=torch.bool)
        keep.scatter_(-1, blocks.clamp(min=0)[:, :, None].expand(B, H, R, k), row_mask & (blocks >= 0)[:, :, None])
        blocks, row_mask, keep = blocks.to(device), row_mask.to(device), keep.to(device)
        p = packed_partial(rows, fields, codec, D, keep)
        got = dispatch.gpu_partial(rows, fields, codec, D, blocks, row_mask)
        ref = reference64(rows, fields, codec, D, keep)
        rows_checks.append(check_row(f"csr {codec.name}", got, (p.out, p.lse), ref))
    # vq tiers (dense): 6-bit indices in two planes (3 bits, 2-D) and 8-bit ones (2 bits 4-D, 1 bit 8-D)
    for i, (kb, vb) in enumerate(((3, 3), (2, 1))):
        codec = VqCodec(kb, vb, sz.group)
        fields = make_tier(codec, B, H, n, T, D, device, pad_tokens=T + T // 2, seed=20 + i)
        p = vq_partial(rows, fields, codec, D, None)
        got = dispatch.gpu_partial(rows, fields, codec, D)
        rows_checks.append(check_row(f"vq {codec.name}", got, (p.out, p.lse), reference64(rows, fields, codec, D)))
    # exact tokens: a strided view of a larger buffer, padding in row 1
    N = n * T
    for dtype in (torch.bfloat16, torch.float16):
        buf = torch.randn(2, B, H, N + 64, D, generator=g).to(device, dtype)
        k, v = buf[0, :, :, :N], buf[1, :, :, :N]
        allowed = (torch.arange(N) >= torch.tensor([0, N // 3])[:B, None])[:, None, None, :].to(device)
        p = exact_partial(rows, k, v, allowed)
        scores = (rows.double() @ k.double().transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        lse64 = torch.logsumexp(scores, -1)
        ref = (torch.softmax(scores, -1) @ v.double(), lse64)
        got = dispatch.gpu_exact(rows, k, v, allowed)
        rows_checks.append(check_row(f"exact {str(dtype)[6:]}", got, (p.out, p.lse), ref))
    # kvtier's decode attention on a TieredLayer on this device (routes to the kernels on CUDA)
    policy = TierPolicy(
        hot_tokens=sz.hot, warm_tokens=sz.warm, block_tokens=T, warm_bits=4, cold="sign", cold_rotation=True,
        sink_tokens=sz.sinks, value_group_size=sz.group, exact_dtype="model", layer_overrides={},
    )  # fmt: skip
    layer = TieredLayer(policy)
    total = sz.contexts[0]
    kk = torch.randn(B, H, total, D, generator=g).to(device, torch.bfloat16)
    vv = torch.randn(B, H, total, D, generator=g).to(device, torch.bfloat16)
    layer.update(kk[:, :, :-1], vv[:, :, :-1], kwargs={})
    layer.settle(None)
    layer.update(kk[:, :, -1:], vv[:, :, -1:], kwargs={})
    query = torch.randn(B, H * R, 1, D, generator=g).to(device)
    fast = tiered_attention(layer, query, None, D**-0.5)
    ref32 = reference_attention(layer, query, None, D**-0.5)
    ref64 = reference_attention(layer, query.double(), None, D**-0.5)
    e_k, e_t = ((x.double() - ref64).abs().max().item() for x in (fast, ref32))
    backend = plan_for(layer, query).chunks[0].packed.name
    name = "kvtier tiered_attention" + (" (Triton)" if backend == "triton" else f" ({backend} path)")
    rows_checks.append({"check": name, "err_kernel": e_k, "err_torch": e_t, "ok": e_k <= 2 * e_t + 1e-5})
    return rows_checks


# --- 2. kernel bandwidth -----------------------------------------------------------------------------


def run_bandwidth(sz: Sizes, device, timer: Timer, peak: float) -> list[dict]:
    """Llama-2-7B layer shape (32 KV heads, one query row per head), and an 8-KV-head GQA-4 variant
    (``sz.bw_heads``)."""
    import torch

    from kvtier.attention.partials import to_rows
    from kvtier.codecs import KBitCodec, SignCodec, VqCodec
    from kvtier.kernels import dispatch
    from kvtier.kernels import triton_decode as td

    T, D, N = sz.block, sz.head_dim, sz.bw_tokens
    n = N // T
    out = []

    def add(name, H, R, nbytes, fn, *args):
        ms = timer(functools.partial(fn, *args))
        gbps = nbytes / ms / 1e6
        out.append({"kernel": name, "heads": H, "rows": R, "tokens": N, "MB": nbytes / 1e6, "ms": ms,
                    "GB/s": gbps, "% peak": 100 * gbps / peak})  # fmt: skip

    for H, R in sz.bw_heads:
        rows = to_rows(torch.randn(1, H * R, 1, D, device=device), H, D**-0.5)
        for codec in (KBitCodec(4, sz.group), KBitCodec(2, sz.group), SignCodec(sz.group), VqCodec(3, 3, sz.group)):
            if R > 1 and codec not in (KBitCodec(4, sz.group), VqCodec(3, 3, sz.group)):
                continue
            f = make_tier(codec, 1, H, n, T, D, device)
            add(f"packed {codec.name}", H, R, tier_bytes(f) + rows.numel() * 4, dispatch.gpu_partial, rows, f, codec, D)
        if R == 1:
            codec = KBitCodec(4, sz.group)
            f = make_tier(codec, 1, H, n, T, D, device)
            k = max(1, n // 4)
            blocks = torch.stack([torch.randperm(n, device=device)[:k].sort().values for _ in range(H)])[None]
            indptr, indices = td.padded_to_csr(blocks)  # the plan: once per step, reused by every layer
            nbytes = (tier_bytes(f) - f["valid"].numel()) * k // n + f["valid"].numel() + indices.numel() * 4
            add("csr int4 (25% blocks)", H, R, nbytes, dispatch.gpu_csr_partial, rows, f, codec, D, indptr, indices)
            kv = torch.randn(2, 1, H, N, D, device=device, dtype=torch.bfloat16)
            add("exact bf16", H, R, kv.numel() * 2, dispatch.gpu_exact, rows, kv[0], kv[1])
    return out


# --- 3. decode attention step ------------------------------------------------------------------------


def run_decode_step(sz: Sizes, device, timer: Timer) -> list[dict]:
    """One decode step of one layer (B=1, ``sz.step_heads`` heads): kvtier vs bf16 SDPA / FlashAttention."""
    import torch
    import torch.nn.functional as F

    from kvtier import TierPolicy
    from kvtier.attention.partials import Partial, merge, to_rows
    from kvtier.attention.tiered import tiered_attention
    from kvtier.hf.layer import TieredLayer
    from kvtier.kernels import dispatch

    H, D = sz.step_heads, sz.head_dim
    policy = TierPolicy(
        hot_tokens=sz.hot, warm_tokens=sz.warm, block_tokens=sz.block, warm_bits=4, cold="sign", cold_rotation=True,
        sink_tokens=sz.sinks, value_group_size=sz.group, exact_dtype="model", layer_overrides={},
    )  # fmt: skip
    out = []
    for N in sz.contexts:
        k = torch.randn(1, H, N, D, device=device, dtype=torch.bfloat16)
        v = torch.randn(1, H, N, D, device=device, dtype=torch.bfloat16)
        q = torch.randn(1, H, 1, D, device=device, dtype=torch.bfloat16)
        dense_bytes = 2 * k.numel() * 2
        row = {"tokens": N, "dense MB": dense_bytes / 1e6}
        row["sdpa bf16 ms"] = timer(functools.partial(F.scaled_dot_product_attention, q, k, v, scale=D**-0.5))
        if device.type == "cuda" and flash_attn_available():
            from flash_attn import flash_attn_func

            qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            try:
                row["flash ms"] = timer(functools.partial(flash_attn_func, qf, kf, vf, softmax_scale=D**-0.5))
            except Exception as err:  # noqa: BLE001 - a flash-attn build that does not match torch
                print(f"  flash-attn failed: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
            del qf, kf, vf
        layer = TieredLayer(policy)
        layer.update(k[:, :, :-1], v[:, :, :-1], kwargs={})
        layer.settle(None)
        layer.update(k[:, :, -1:], v[:, :, -1:], kwargs={})
        del k, v
        kv_bytes = sum(t.numel() * t.element_size() for ts in layer.tier_tensors().values() for t in ts)
        row["kvtier MB"] = kv_bytes / 1e6
        row["kvtier ms"] = timer(functools.partial(tiered_attention, layer, q, None, D**-0.5))

        def kernels_only(layer=layer, q=q):
            rows = to_rows(q, H, D**-0.5)
            parts = [dispatch.gpu_exact(rows, layer.sinks.k, layer.sinks.v)] if layer.sinks.k is not None else []
            tiers = [t for t in (layer.cold, layer.warm) if t is not None and t.nblocks]
            parts += [dispatch.gpu_partial(rows, t.fields, t.codec, D) for t in tiers]
            parts.append(dispatch.gpu_exact(rows, *layer.hot.view()))
            return merge([Partial(o, lse) for o, lse in parts])

        row["kernels ms"] = timer(kernels_only)
        row["speedup vs sdpa"] = row["sdpa bf16 ms"] / row["kvtier ms"]
        if "flash ms" in row:
            row["speedup vs flash"] = row["flash ms"] / row["kvtier ms"]
        out.append(row)
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# --- 4. end to end -----------------------------------------------------------------------------------


def run_e2e(sz: Sizes, device) -> list[dict]:
    """Greedy decode of ``new_tokens`` after a random prompt; prefill excluded from tokens/s."""
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    import kvtier
    from kvtier import TierPolicy

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = LlamaConfig(max_position_embeddings=max(sz.prompts) + sz.new_tokens + 8, pad_token_id=0, **sz.model)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    policy = TierPolicy(
        hot_tokens=sz.hot, warm_tokens=sz.warm, block_tokens=sz.block, warm_bits=4, cold="sign", cold_rotation=True,
        sink_tokens=sz.sinks, value_group_size=sz.group, exact_dtype="model", layer_overrides={},
    )  # fmt: skip
    variants = [("dynamic (sdpa)", "sdpa", False), ("kvtier", "sdpa", True)]
    if device.type == "cuda" and flash_attn_available():
        variants.insert(1, ("dynamic (flash)", "flash_attention_2", False))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def one(ids, impl, tiered, new_tokens):
        model.set_attn_implementation(impl)
        cache = kvtier.TieredCache(model.config, policy) if tiered else DynamicCache(config=model.config)
        ctx = kvtier.enable(model) if tiered else None
        if ctx is not None:
            ctx.__enter__()
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
            nxt = logits[:, -1:].argmax(-1)
            sync()
            t1 = time.perf_counter()
            for _ in range(new_tokens):
                nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            sync()
            t2 = time.perf_counter()
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        peak = torch.cuda.max_memory_allocated() / 1e6 if device.type == "cuda" else None
        return t1 - t0, t2 - t1, peak

    rows = []
    for L in sz.prompts:
        ids = torch.randint(3, cfg.vocab_size, (1, L), device=device)
        for name, impl, tiered in variants:
            try:
                one(ids, impl, tiered, 2)  # warm-up at full length: every tier's kernels compiled
                prefill_s, decode_s, peak = one(ids, impl, tiered, sz.new_tokens)
            except Exception as err:  # noqa: BLE001 - e.g. a flash-attn build that does not match torch
                rows.append({"prompt": L, "cache": name, "error": f"{type(err).__name__}: {str(err)[:200]}"})
                print(f"  {name} at {L}: {rows[-1]['error']}", file=sys.stderr)
                continue
            rows.append({"prompt": L, "cache": name, "prefill s": prefill_s, "tok/s": sz.new_tokens / decode_s,
                         "ms/token": 1000 * decode_s / sz.new_tokens, "peak MB": peak})  # fmt: skip
        base = next((r.get("tok/s") for r in rows if r["prompt"] == L and r["cache"] == "dynamic (sdpa)"), None)
        for r in rows:
            if r["prompt"] == L and "tok/s" in r and base:
                r["vs dynamic"] = r["tok/s"] / base
    return rows


# --- 5. vLLM packed pages -------------------------------------------------------------------------------


def page_step(fmt, T: int, lengths: list[int], news: list[int], device, seed: int = 0):
    """A step of ``len(lengths)`` requests over packed pages: request ``r`` has ``lengths[r]`` tokens from
    earlier steps (full blocks packed, the rest exact in a side slot) and ``news[r]`` new ones.
    Returns ``(plan, pages, side, new tokens)``; tensors on ``device``."""
    import torch

    from kvtier.vllm.pages.paged import SideBuffer, plan_step

    g = torch.Generator().manual_seed(seed)
    H, D, dt = fmt.heads, fmt.head_dim, fmt.dtype
    nblocks = [-(-(c + n) // T) for c, n in zip(lengths, news)]
    sidebuf = SideBuffer(len(lengths), T, H, D, dt, device)
    pages = torch.zeros(sum(nblocks) + 1, fmt.page_bytes, dtype=torch.uint8, device=device)
    table, writes, nxt = [], [], 1
    for c, nb in zip(lengths, nblocks):
        ids = list(range(nxt, nxt + nb))
        nxt += nb
        table.append(ids)
        full = c // T
        if full:
            k = (torch.randn(full, H, T, D, generator=g) * torch.linspace(0.2, 3, D)).to(dt)
            v = torch.randn(full, H, T, D, generator=g).to(dt)
            pages[ids[:full]] = fmt.encode(k.to(device), v.to(device))
        if c % T:
            writes.append((sidebuf.assign(ids[full], set()), c % T))
    width = max(nblocks)
    bt = torch.tensor([ids + [0] * (width - len(ids)) for ids in table])
    qsl = [0]
    for n in news:
        qsl.append(qsl[-1] + n)
    plan = plan_step(sidebuf, qsl, [c + n for c, n in zip(lengths, news)], bt, qsl[-1])
    side = sidebuf.layer("layer0")
    for slot, rows in writes:
        side[slot, :rows] = torch.randn(rows, 2, H, D, generator=g).to(device, dt)
    return plan, pages, side, qsl[-1]


def run_vllm_pages(sz: Sizes, device, timer: Timer) -> list[dict]:
    """The Triton page kernel against the torch path (one awkward step), then a decode step's time."""
    import torch
    import torch.nn.functional as F

    from kvtier.codecs.pages import PageFormat
    from kvtier.vllm.pages.attention import PagedAttention
    from kvtier.vllm.pages.policy import PagePolicy

    T, C, R = sz.page_block, sz.page_context, sz.page_reqs
    policies = {
        "default": PagePolicy(block_size=T),
        "compact": PagePolicy(block_size=T, value_bits=3),  # the rotation happens outside the kernel
        "sinks+kg32": PagePolicy(block_size=T, sink_tokens=4, key_group=32),
    }
    rows = []
    for H, Hq, D in sz.page_shapes:
        for name, policy in policies.items():
            fmt = PageFormat(policy, H, D, torch.bfloat16)
            triton, reference = PagedAttention(fmt, "triton"), PagedAttention(fmt, "torch")
            # correctness: decode rows, a prefill chunk, lengths off block boundaries, a short request
            lengths = [C + 3, C // 2 + T - 1, 5, 2 * T]
            news = [1, 37, 1, 4]
            plan, pages, side, N = page_step(fmt, T, lengths, news, device, seed=1)
            g = torch.Generator().manual_seed(2)
            q, k, v = (torch.randn(N, h, D, generator=g).bfloat16() for h in (Hq, H, H))
            tp = triton.plan(plan, device)
            got = triton.run(tp, pages, side, q.to(device), k.to(device), v.to(device), D**-0.5)
            ref = reference.run(reference.plan(plan), pages.cpu(), side.cpu(), q, k, v, D**-0.5)
            err = (got.cpu().double() - ref.double()).abs().max().item()
            row = {"shape": f"{H}/{Hq}/{D}", "policy": name, "err": err, "ok": err <= 1e-4}
            # speed: R decode rows over C tokens each (all full blocks) + 1 new token
            plan, pages, side, N = page_step(fmt, T, [C] * R, [1] * R, device, seed=3)
            q = torch.randn(R, Hq, D, device=device, dtype=torch.bfloat16)
            kn, vn = torch.randn(2, R, H, D, device=device, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            attend = functools.partial(triton.run, triton.plan(plan, device), pages, side, q, kn, vn, D**-0.5, out=out)
            row["ms"] = timer(attend)
            row["MB"] = (R * (C // T) * fmt.page_bytes + 2 * kn.numel() * 2 + 2 * q.numel() * 2) / 1e6
            row["GB/s"] = row["MB"] / row["ms"]
            kd = torch.randn(R, H, C + 1, D, device=device, dtype=torch.bfloat16)
            vd = torch.randn(R, H, C + 1, D, device=device, dtype=torch.bfloat16)
            qd = q.view(R, Hq, 1, D)
            row["dense MB"] = 2 * kd.numel() * 2 / 1e6
            sdpa = functools.partial(F.scaled_dot_product_attention, qd, kd, vd, scale=D**-0.5, enable_gqa=True)
            row["sdpa ms"] = timer(sdpa)
            row["x sdpa"] = row["sdpa ms"] / row["ms"]
            rows.append(row)
            del kd, vd, pages
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(_chunk_row(sz, device, timer, PageFormat(policies["default"], H, D, torch.bfloat16), Hq))
    return rows


def _chunk_row(sz: Sizes, device, timer: Timer, fmt, Hq: int) -> dict:
    """A chunked-prefill step: ``sz.page_chunk_reqs`` requests of ``sz.page_chunk`` new tokens after
    ``sz.page_context`` packed ones (row tiles through ``tl.dot``), against bf16 SDPA with the causal
    suffix mask over the same requests' exact K/V."""
    import torch
    import torch.nn.functional as F

    from kvtier.vllm.pages.attention import PagedAttention

    T, C, R, n = sz.page_block, sz.page_context, sz.page_chunk_reqs, sz.page_chunk
    H, D = fmt.heads, fmt.head_dim
    plan, pages, side, N = page_step(fmt, T, [C] * R, [n] * R, device, seed=4)
    q = torch.randn(N, Hq, D, device=device, dtype=torch.bfloat16)
    kn, vn = torch.randn(2, N, H, D, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    row = {"shape": f"{H}/{Hq}/{D}", "policy": f"default, {R} x {n}-token chunks"}
    triton = PagedAttention(fmt, "triton")
    row["ms"] = timer(
        functools.partial(triton.run, triton.plan(plan, device), pages, side, q, kn, vn, D**-0.5, out=out)
    )
    row["MB"] = (R * (C // T) * fmt.page_bytes + 2 * kn.numel() * 2 + 2 * q.numel() * 2) / 1e6
    kd = torch.randn(R, H, C + n, D, device=device, dtype=torch.bfloat16)
    vd = torch.randn(R, H, C + n, D, device=device, dtype=torch.bfloat16)
    qd = q.view(R, n, Hq, D).transpose(1, 2)
    mask = torch.ones(n, C + n, dtype=torch.bool, device=device).tril(C)
    row["dense MB"] = 2 * kd.numel() * 2 / 1e6
    sdpa = functools.partial(F.scaled_dot_product_attention, qd, kd, vd, attn_mask=mask, scale=D**-0.5, enable_gqa=True)
    row["sdpa ms"] = timer(sdpa)
    row["x sdpa"] = row["sdpa ms"] / row["ms"]
    return row


# --- 0. ahead-of-time compilation (no GPU) ------------------------------------------------------------


def _page_variants() -> list[tuple]:
    """The vLLM page kernels (``kvtier.kernels.triton_pages``) as launched for the two layer shapes of
    part 5, decode rows and a prefill chunk: (name, kernel, signature types, constants, warps)."""
    import torch

    from kvtier.codecs.pages import PageFormat
    from kvtier.kernels import triton_pages as tp
    from kvtier.vllm.pages.policy import PagePolicy

    out = []
    for (H, Hq, D), policy, R in (
        ((3, 9, 64), PagePolicy(), 1),
        ((3, 9, 64), PagePolicy(), 2),
        ((3, 9, 64), PagePolicy(value_bits=3), 256),
        ((8, 32, 128), PagePolicy(value_bits=3), 1),
        ((8, 32, 128), PagePolicy(sink_tokens=4, key_group=32), 256),
    ):
        fmt = PageFormat(policy, H, D, torch.bfloat16)
        types = {a: "*bf16" for a in ("Q", "KN", "VN", "Side", "PagesS")}
        types |= {"Pages": "*u8", "Pages16": "*fp16", "OutPart": "*fp32", "LsePart": "*fp32", "scale": "fp32"}
        types |= {a: "*i64" for a in ("Reqs", "Pstart", "Pids")}
        types |= {a: "i32" for a in ("row_tiles", "num_splits", "page_bytes", "side_slot_stride")}
        G = Hq // H
        split, merge_consts = tp.constants(fmt.layout(), policy.bits, G, G * R, 2)
        warps = split.pop("num_warps")
        merge_consts = dict(merge_consts, OUT_BF16=True)
        merge_consts.pop("num_warps")
        name = f"pages b{policy.bits}/{policy.vbits} s{policy.sink_tokens} {H}/{Hq}/{D} rows {G * R}"
        out.append((name, tp._page_split_kernel, types, split, warps))
        merge = {"OutPart": "*fp32", "LsePart": "*fp32", "Out": "*bf16", "Reqs": "*i64", "row_tiles": "i32",
                 "num_splits": "i32"}  # fmt: skip
        out.append((f"pages merge {H}/{Hq}/{D} rows {G * R}", tp._page_merge_kernel, merge, merge_consts, warps))
    return out


def run_compile_only(sm: int) -> list[dict]:
    """Compile representative variants of every kernel for ``sm_<sm>``: a GPU compile error (types,
    layouts, unsupported ops) shows here on any machine, with the register use of each variant."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvtier.codecs.vq import SUBVECTOR, index_widths
    from kvtier.kernels import triton_decode as td
    from kvtier.quant import planes

    target = GPUTarget("cuda", sm, 32)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    packed = {"Rows": "*fp32", "OutPart": "*fp32", "LsePart": "*fp32", "Indptr": "*i64", "Indices": "*i32"}
    packed |= {a: "*u8" for a in ("KC", "VC", "Valid", "RowMask")}
    packed |= {a: "i32" for a in ("H", "R", "n", "T", "P", "NG", "G", "num_splits")}
    exact = {"Rows": "*fp32", "Mask": "*u8", "OutPart": "*fp32", "LsePart": "*fp32"}
    exact |= {a: "i32" for a in ("H", "R", "N", "num_splits", "skb", "skh", "skn", "skd", "svb", "svh", "svn", "svd")}
    exact |= {a: "i32" for a in ("smb", "smh", "smr", "smn")}
    merge = {"OutPart": "*fp32", "LsePart": "*fp32", "Out": "*fp32", "Lse": "*fp32", "R": "i32", "num_splits": "i32"}
    D, BD = 128, 128
    variants = []
    # (bits, affine mode, CSR + row mask, rows per head); 'ab' reads fp32 parameters, the others fp16 fields
    for bits, affine, sparse, R in (
        (4, 1, False, 1),
        (3, 1, True, 4),
        (1, 2, False, 1),
        (1, 2, True, 8),
        (8, 0, False, 4),
    ):  # noqa: E501
        BR = max(2, R)
        consts = dict(D=D, AFFINE=affine, SPARSE=sparse, ROW_MASK=sparse, BLOCK_R=BR, BLOCK_D=BD)
        consts |= td._plane_spec(bits, D) | {"BLOCK_T": max(2, min(128, td.TILE_ELEMENTS // (BR * BD)))}
        types = packed | {a: "*fp32" if affine == 0 else "*fp16" for a in ("KA", "KB", "VA", "VB")}
        mode = ["ab", "scale_zero", "scale_mean"][affine]
        name = f"packed {bits}-bit {mode}{' csr+row mask' if sparse else ''} R={R}"
        variants.append((name, td._packed_split_kernel, types, consts, 4))
    for dt, mask in (("bf16", True), ("fp16", False), ("fp32", True)):
        BN = max(2, min(64, td.TILE_ELEMENTS // (2 * BD)))
        consts = dict(D=D, HAS_MASK=mask, BLOCK_R=2, BLOCK_N=BN, BLOCK_D=BD)
        types = exact | {"K": f"*{dt}", "V": f"*{dt}"}
        variants.append((f"exact {dt}{' mask' if mask else ''}", td._exact_split_kernel, types, consts, 4))
    variants.append(("merge splits", td._merge_splits_kernel, merge, dict(D=D, BLOCK_R=2, BLOCK_D=BD), 4))
    vq = {a: "*fp32" for a in ("Rows", "KBook", "VBook", "Ones", "F8", "OutPart", "LsePart")} | {"KMean": "*fp16"}
    vq |= {a: "*u8" for a in ("KI", "KRms", "VI", "VRms", "VMean", "Valid")}
    vq |= {a: "i32" for a in ("H", "R", "n", "T", "KS", "VS", "num_splits")}
    for kb, vb, R in ((3, 3, 6), (2, 1, 1)):  # 6-bit indices in two planes, 2-D; 8-bit indices, 4-D and 8-D
        BR = max(2, td._pow2(R))
        consts = dict(D=D, KSUB=SUBVECTOR[kb], VSUB=SUBVECTOR[vb], BLOCK_R=BR, BLOCK_D=BD)
        consts |= td._index_spec("K", planes(index_widths(kb)[0]), D // SUBVECTOR[kb])
        consts |= td._index_spec("V", planes(index_widths(vb)[0]), D // SUBVECTOR[vb])
        consts |= {"BLOCK_T": max(2, min(128, td.TILE_ELEMENTS // (BR * BD)))}
        variants.append((f"vq k{kb}v{vb} R={R}", td._vq_split_kernel, vq, consts, 4))
    variants += _page_variants()
    rows = []
    for name, fn, types, consts, warps in variants:
        sig = {a: types[a] if a in types else "constexpr" for a in fn.arg_names}
        t0 = time.perf_counter()
        row = {"kernel": name, "sm": sm}
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs=consts)
            compiled = triton.compile(src, target=target, options={"num_warps": warps})
            row["ok"] = True
        except Exception as err:  # noqa: BLE001 - reported per variant
            row["ok"], row["error"] = False, f"{type(err).__name__}: {str(err)[:300]}"
        row["s"] = time.perf_counter() - t0
        if row["ok"] and cuobjdump.exists():
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True)
            m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage.stdout)
            if m:
                row["registers"], row["stack"] = int(m.group(1)), int(m.group(2))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_only is not None:
        os.environ.pop("TRITON_INTERPRET", None)  # real compilation
        try:
            import kvtier  # noqa: F401
        except ImportError:
            sys.path.insert(0, str(ROOT / "src"))
        rows = run_compile_only(args.compile_only)
        table(f"ahead-of-time compilation for sm_{args.compile_only} (no GPU needed)", rows, COMPILE_COLS)
        for r in rows:
            if not r["ok"]:
                print(f"  {r['kernel']}: {r['error']}")
        ok = all(r["ok"] for r in rows)
        print(json.dumps({"compile_only": True, "sm": args.compile_only, "correct": ok, "kernels": rows}))
        return 0 if ok else 1
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported (importing kvtier imports it)
    try:
        import kvtier  # noqa: F401
    except ImportError:  # run from a checkout without installing
        sys.path.insert(0, str(ROOT / "src"))
    import torch

    from kvtier.kernels import dispatch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU path", file=sys.stderr)
        return 2
    if not dispatch.available():
        print("Triton is not importable: pip install triton", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    sz = DRY if args.dry_run else FULL
    peak = args.peak_gbps if args.peak_gbps is not None else H200_PEAK_GBPS
    peak_src = "from --peak-gbps" if args.peak_gbps is not None else "default, H200; --peak-gbps for another device"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name} | peak bandwidth {peak:.0f} GB/s ({peak_src})" + (" | DRY RUN" if args.dry_run else ""))
    timer = Timer(device, sz.iters)
    t_start = time.perf_counter()

    checks = run_checks(sz, device)
    table("correctness (error vs fp64; ok: kernel <= 2 x torch fp32 + 1e-5)", checks, CHECK_COLS)
    kernels = run_bandwidth(sz, device, timer, peak)
    table(f"kernel bandwidth (bytes read / time; peak {peak:.0f} GB/s)", kernels, KERNEL_COLS)
    steps = run_decode_step(sz, device, timer)
    title = f"decode attention step, one layer (B=1, {sz.step_heads} heads, D={sz.head_dim})"
    table(f"{title}; kvtier: sinks + hot exact, warm int4, cold sign", steps, STEP_COLS)
    e2e = run_e2e(sz, device)
    title = f"end to end: random Llama, {sz.model['num_hidden_layers']} layers, {sz.new_tokens} new tokens"
    table(title, e2e, E2E_COLS)
    pages = run_vllm_pages(sz, device, timer)
    title = f"vLLM packed pages: correctness, then a decode step of {sz.page_reqs} requests x {sz.page_context} tokens"
    table(title, pages, PAGE_COLS)
    correct = all(c["ok"] for c in checks) and all(r.get("ok", True) for r in pages)
    print(f"\ncorrectness: {'all ok' if correct else 'FAILED'} | total {time.perf_counter() - t_start:.1f} s")
    result = {
        "device": name, "dry_run": args.dry_run, "peak_gbps": peak, "peak_source": peak_src, "correct": correct,
        "checks": checks, "kernels": kernels, "decode_step": steps, "e2e": e2e, "vllm_pages": pages,
    }  # fmt: skip
    print(json.dumps(result, default=float))
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
