"""The vq tier's C++ kernel against the affine cold tier's kernel and exact attention, one tier of
``--tokens`` at a decode step (issue 38: "decode with the vq tiers; the kernels' share").

One process, one thread count, calls alternating round by round: per round each contender attends
the same query rows (``B=1``, Qwen2.5-Coder-1.5B's shape by default: 2 KV heads, 6 query rows per
head, head dim 128) over the same random keys and values (channel offsets like a real model's
key biases), stored as

* ``exact-bf16``: torch's CPU flash attention over bf16 keys and values (what ``DynamicCache`` reads),
* ``affine3``: ``default``'s cold codec (3-bit keys and values, rotated) through the fused layer
  call that decode makes (:mod:`kvtier.kernels.fused_cpu`),
* ``vqK/V``: :class:`kvtier.codecs.VqCodec` at each ``--vq`` width pair through
  :mod:`kvtier.kernels.vq_cpu`;
* a decode step's layer with the first vq pair's tier beside ``--hot`` exact bf16 tokens:
  ``layer-vq-fused`` in one fused layer call (the vq tier read inside it, as decode does now) and
  ``layer-vq-apart`` as decode did before: the fused call over the exact tokens, the vq kernel's
  own call, merged by log-sum-exp in torch.

Prints the median milliseconds per call and the ratio to ``affine3``, then one JSON line.

    python benchmarks/vq_kernel.py --tokens 8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvtier.attention.backends.cpu import CpuBackend
from kvtier.attention.partials import Partial, merge
from kvtier.codecs import VqCodec
from kvtier.codecs.registry import make_codecs
from kvtier.policy import get_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=2, help="KV heads")
    ap.add_argument("--rows", type=int, default=6, help="query rows per KV head (GQA ratio x queries)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=64, help="tokens per block")
    ap.add_argument("--vq", default="3/3,2/2,4/4,2/1", help="vq key/value width pairs")
    ap.add_argument("--hot", type=int, default=128, help="exact tokens beside the tier in the layer rows")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    H, R, D, T = args.heads, args.rows, args.dim, args.block
    n = -(-args.tokens // T)
    offset = torch.randn(1, H, 1, 1, D, generator=g) * 3
    k = torch.randn(1, H, n, T, D, generator=g) + offset
    v = torch.randn(1, H, n, T, D, generator=g)
    valid = torch.zeros(1, 1, n, T, dtype=torch.bool)
    valid.view(-1)[: args.tokens] = True
    rows = torch.randn(1, H, R, D, generator=g) * D**-0.5
    backend = CpuBackend()

    def stored(codec) -> dict:
        f = codec.encode(k, v, valid)
        f["valid"] = valid
        return f

    def tier(codec, fused=False):
        f = stored(codec)
        if fused:  # the decode path's whole-layer call, here with this one segment
            return lambda: backend.layer(rows, [], [(f, codec, 0)])
        return lambda: backend.tier(rows, f, codec, D)

    kx = k.reshape(1, H, -1, D)[:, :, : args.tokens].to(torch.bfloat16)
    vx = v.reshape(1, H, -1, D)[:, :, : args.tokens].to(torch.bfloat16)
    qx = rows.to(torch.bfloat16)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    calls = {
        "exact-bf16": lambda: flash(qx, kx, vx, 0.0, False, scale=1.0),
        "affine3": tier(make_codecs(get_policy("default"), D)[1], fused=True),
    }
    layer_tier = None  # the first vq pair's codec and stored tier, for the layer rows
    for pair in args.vq.split(","):
        kb, vb = (int(x) for x in pair.split("/"))
        codec = VqCodec(kb, vb, D)
        f = stored(codec)
        layer_tier = layer_tier or (codec, f)
        calls[f"vq{kb}/{vb}"] = lambda f=f, codec=codec: backend.tier(rows, f, codec, D)
    vq_codec, fv = layer_tier
    hot = [(kx[:, :, : args.hot], vx[:, :, : args.hot], torch.ones(1, 1, args.hot, dtype=torch.bool))]
    calls["layer-vq-fused"] = lambda: backend.layer(rows, hot, [(fv, vq_codec, 0)])
    calls["layer-vq-apart"] = lambda: merge(
        [Partial(*backend.layer(rows, hot, [])[:2]), backend.tier(rows, fv, vq_codec, D)]
    )
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm: builds the kernels
        call()
    for _ in range(args.rounds):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t0) * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    print(f"{args.tokens} tokens, {H} KV heads x {R} rows, head dim {D}, {args.threads} threads", end="")
    print(f", median of {args.rounds}")
    for name, m in ms.items():
        print(f"  {name:>14}: {m:8.3f} ms  ({m / ms['affine3']:.2f}x affine3)")
    print(
        json.dumps(
            {
                "bench": "vq_kernel",
                "tokens": args.tokens,
                "heads": H,
                "rows": R,
                "dim": D,
                "threads": args.threads,
                "hot": args.hot,
                "ms": {k_: round(m, 4) for k_, m in ms.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
