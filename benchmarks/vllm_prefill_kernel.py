"""One layer's prefill attention of a chunk: kvtier's bf16 kernel vs vLLM's CPU kernel (bf16 and fp32).

A chunk of ``--chunk`` new tokens after ``--context`` earlier ones (SmolLM2-135M's shape: 9 query /
3 KV heads of 64, 128-token blocks), causal. vLLM's kernel reads its own paged cache (the chunk's
keys already written, as in vLLM's step); kvtier's kernel (``kvtier.kernels.prefill_cpu``, bf16 dot
products summed in fp32) reads the token-major rows. With a context of whole 128-token blocks,
``kvtier_paged`` is the same kernel reading the context from ``default``'s packed pages in place
(``prefill_cpu.attend_paged``; its error against the fp64 result over the pages' decoded values),
and ``decode_pages`` the cost of decoding those pages to fp32 rows (what the fp32 path through vLLM's
kernel adds before its attention). Best of ``--rounds`` rounds, alternating; the max error of each
against the fp64 result is printed too. vLLM venv:

    python benchmarks/vllm_prefill_kernel.py --threads 1,2 --chunks 2048,256 --context 0,2048

Prints ms per call and the ratio; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

H, HQ, D, T = 3, 9, 64, 128


def case(chunk: int, context: int, rounds: int) -> dict:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvtier.kernels import prefill_cpu

    torch.manual_seed(0)
    L = context + chunk
    q = torch.randn(chunk, HQ, D).bfloat16()
    k, v = torch.randn(L, H, D).bfloat16(), torch.randn(L, H, D).bfloat16()
    scale = D**-0.5
    ref = prefill_cpu.attend_reference(q.double(), k.double(), v.double(), scale)
    out = torch.empty(chunk, HQ, D, dtype=torch.bfloat16)
    calls = {"kvtier": lambda: prefill_cpu.attend(q, k, v, out, scale)}
    outs = {"kvtier": out}
    refs = {}
    if context and context % T == 0:  # the context from packed pages, read in place / decoded
        from kvtier.codecs.pages import PageFormat
        from kvtier.vllm.pages.attention import PagedAttention
        from kvtier.vllm.pages.policy import PagePolicy

        fmt = PageFormat(PagePolicy(block_size=T), H, D, torch.bfloat16)
        decode_rows = PagedAttention(fmt, "cpp").decode_rows
        n = context // T
        pages = fmt.encode(k[:context].view(n, T, H, D).transpose(1, 2), v[:context].view(n, T, H, D).transpose(1, 2))
        pids = torch.arange(n)
        kd, vd = decode_rows(pages, list(range(n)), torch.float32)
        kr, vr = torch.cat((kd, k[context:].float())), torch.cat((vd, v[context:].float()))
        refs["kvtier_paged"] = prefill_cpu.attend_reference(q.double(), kr.double(), vr.double(), scale)
        out_p = torch.empty_like(out)
        outs["kvtier_paged"] = out_p
        lay = fmt.layout()
        calls["kvtier_paged"] = lambda: prefill_cpu.attend_paged(
            q, k[context:], v[context:], out_p, scale, pages, pids, lay
        )
        calls["decode_pages"] = lambda: decode_rows(pages, list(range(n)), torch.float32)
    for dt in (torch.bfloat16, torch.float32):
        isa = _get_attn_isa(dt, T, D)
        blocks = -(-L // T)
        kc, vc = torch.zeros(blocks, H, 2 * T, D, dtype=dt).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k.to(dt), v.to(dt), kc, vc, torch.arange(L), isa)
        qsl, seq = torch.tensor([0, chunk], dtype=torch.int32), torch.tensor([L], dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=HQ, num_kv_heads=H, head_dim=D, seq_lens=seq, dtype=dt, query_start_loc=qsl,
            causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        )  # fmt: skip
        qd, o = q.to(dt), torch.empty(chunk, HQ, D, dtype=dt)
        table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
        name = f"vllm_{str(dt).split('.')[-1]}"
        outs[name] = o
        calls[name] = lambda qd=qd, kc=kc, vc=vc, o=o, qsl=qsl, seq=seq, table=table, meta=meta: (
            ops.cpu_attention_with_kv_cache(
                query=qd, key_cache=kc, value_cache=vc, output=o, query_start_loc=qsl, seq_lens=seq, scale=scale,
                causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                scheduler_metadata=meta, s_aux=None,
            )
        )  # fmt: skip
    best = dict.fromkeys(calls, float("inf"))
    iters = max(1, 2048 * 2048 // (chunk * (context + chunk // 2)))
    for _ in range(rounds):
        for name, f in calls.items():
            f()
            t = time.perf_counter()
            for _ in range(iters):
                f()
            best[name] = min(best[name], (time.perf_counter() - t) / iters * 1e3)
    err = {f"{n}_max_err": (o.double() - refs.get(n, ref)).abs().max().item() for n, o in outs.items()}
    return {**{f"{n}_ms": ms for n, ms in best.items()}, "ratio_bf16": best["vllm_bfloat16"] / best["kvtier"],
            "ratio_fp32": best["vllm_float32"] / best["kvtier"], **err}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--chunks", default="2048,256")
    ap.add_argument("--context", default="0,2048")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from kvtier.kernels import prefill_cpu

    if not prefill_cpu.available():
        raise SystemExit("kvtier's prefill kernel is not available here (needs AVX-512 BF16)")
    results = []
    for th in map(int, args.threads.split(",")):
        torch.set_num_threads(th)
        for chunk in map(int, args.chunks.split(",")):
            for context in map(int, args.context.split(",")):
                res = {"threads": th, "chunk": chunk, "context": context, **case(chunk, context, args.rounds)}
                print(
                    f"threads={th} chunk={chunk} context={context}: kvtier {res['kvtier_ms']:.2f} ms, "
                    f"vLLM bf16 {res['vllm_bfloat16_ms']:.2f} ms ({res['ratio_bf16']:.2f}x), "
                    f"vLLM fp32 {res['vllm_float32_ms']:.2f} ms ({res['ratio_fp32']:.2f}x); max err kvtier "
                    f"{res['kvtier_max_err']:.1e} vLLM bf16 {res['vllm_bfloat16_max_err']:.1e}"
                    + (
                        f"; kvtier over packed pages {res['kvtier_paged_ms']:.2f} ms (err "
                        f"{res['kvtier_paged_max_err']:.1e}), decoding them {res['decode_pages_ms']:.2f} ms"
                        if "kvtier_paged_ms" in res
                        else ""
                    ),
                    flush=True,
                )
                results.append(res)
    print(json.dumps({"bench": "vllm_prefill_kernel", "args": vars(args), "load": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
