"""A short prefill chunk over packed pages: kvtier's fused kernel vs the prefill path, one layer.

One request with ``--context`` tokens already packed (4-bit pages, SmolLM2-135M's shape: 9 query /
3 KV heads of 64, 128-token blocks) and a chunk of ``--chunks`` new tokens: through the fused
kernel (``PagedAttention(fmt, "cpp")`` of ``kvtier.vllm.pages.attention``, pages read in place) and through
``kvtier.vllm.pages.prefill.VllmPrefill`` (pages decoded to fp32, vLLM's fp32 CPU kernel). This is what
``kvtier.vllm.pages.attention.KERNEL_MAX_CHUNK`` is set from. Best of ``--rounds`` rounds, alternating. vLLM venv:

    python benchmarks/vllm_chunk_path.py --threads 2 --chunks 17,32,48,64

Prints ms per call and the ratio; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

H, HQ, D, T = 3, 9, 64, 128


def case(chunk: int, context: int, rounds: int, iters: int = 50) -> dict:
    from kvtier.codecs.pages import PageFormat
    from kvtier.vllm.pages.attention import PagedAttention
    from kvtier.vllm.pages.paged import SideBuffer, plan_step
    from kvtier.vllm.pages.policy import PagePolicy
    from kvtier.vllm.pages.prefill import VllmPrefill

    torch.manual_seed(0)
    fmt = PageFormat(PagePolicy(block_size=T), H, D, torch.bfloat16)
    nb = context // T + 1
    k = torch.randn(nb * T, H, D).bfloat16()
    v = torch.randn_like(k)
    pages = torch.zeros(nb + 1, fmt.page_bytes, dtype=torch.uint8)
    pages[1:] = fmt.encode(k.view(-1, T, H, D).transpose(1, 2), v.view(-1, T, H, D).transpose(1, 2))
    pre = VllmPrefill(HQ, H, D, T, torch.bfloat16)
    side = SideBuffer(8, T, H, D, torch.bfloat16)
    table = torch.tensor([[1 + j for j in range(nb)]])
    side.packed.update(table[:, : context // T].flatten().tolist())
    q = torch.randn(chunk, HQ, D).bfloat16()
    kn, vn = torch.randn(chunk, H, D).bfloat16(), torch.randn(chunk, H, D).bfloat16()
    layer = side.layer("l")
    outs = {name: torch.empty(chunk, HQ, D, dtype=torch.bfloat16) for name in ("fused", "prefill")}
    best = dict.fromkeys(outs, float("inf"))
    limit = {"fused": 1 << 30, "prefill": 0}  # the C++ kernel takes the chunk, or leaves it to the prefill
    atts = {
        name: PagedAttention(fmt, "cpp", pre, kernel_max_query=n, kernel_max_chunk=n, bf16_prefill=False)
        for name, n in limit.items()
    }
    for _ in range(rounds):
        for name, out in outs.items():
            att = atts[name]
            plan = att.plan(plan_step(side, [0, chunk], [context + chunk], table, chunk))

            def run(att=att, plan=plan, out=out) -> None:
                att.run(plan, pages, layer, q, kn, vn, D**-0.5, out=out)

            run()
            t = time.perf_counter()
            for _ in range(iters):
                run()
            best[name] = min(best[name], (time.perf_counter() - t) / iters * 1e3)
    diff = (outs["fused"].float() - outs["prefill"].float()).abs().max().item()
    return {"fused_ms": best["fused"], "prefill_ms": best["prefill"], "speedup": best["prefill"] / best["fused"],
            "max_abs_diff": diff}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="2")
    ap.add_argument("--chunks", default="17,32,48,64")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    results = []
    for th in map(int, args.threads.split(",")):
        torch.set_num_threads(th)
        for chunk in map(int, args.chunks.split(",")):
            res = {"threads": th, "chunk": chunk, "context": args.context, **case(chunk, args.context, args.rounds)}
            print(
                f"threads={th} chunk={chunk} over {args.context} packed: fused kernel {res['fused_ms']:.3f} ms, "
                f"prefill path {res['prefill_ms']:.3f} ms ({res['speedup']:.2f}x), max diff {res['max_abs_diff']:.1e}",
                flush=True,
            )
            results.append(res)
    print(json.dumps({"bench": "vllm_chunk_path", "args": vars(args), "load": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
