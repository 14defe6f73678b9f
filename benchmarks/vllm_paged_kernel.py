"""One layer's decode attention: kvtier's fused kernel over packed 4-bit pages vs vLLM's bf16 CPU kernel.

``--reqs`` requests of ``--length`` tokens each (SmolLM2-135M's shape: 9 query / 3 KV heads of 64,
128-token blocks) decode one token; both kernels read their own pages through block tables and
write a bf16 output; best of ``--rounds`` rounds of ``--iters`` calls, alternating. vLLM venv:

    flock /tmp/kvtier-bench.lock python benchmarks/vllm_paged_kernel.py --threads 1,2 --reqs 1,48

``--sparse 0.98,0.5`` adds kvtier with sparse decode (``PagePolicy.sparse_mass``) at those levels,
timed in the same rounds, with the share of packed tokens whose values were read. On these random
keys the weights are flat (a level keeps most tokens): it shows the selection's cost, not what it
saves on a model's attention (``benchmarks/vllm_serve.py`` reports that share for real runs).

``--policies compact`` adds kvtier over the pages of those presets (their own bytes, the same keys and
values), timed in the same rounds; with ``value_rotation`` the call includes the backend's two
rotations (the new values in, the output back).

Prints ms per call and the ratio; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

H, HQ, D, T = 3, 9, 64, 128


def case(reqs: int, length: int, iters: int, rounds: int, levels: tuple[float, ...] = (), policies: tuple = ()) -> dict:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvtier.codecs.pages import PageFormat
    from kvtier.quant.rotation import rotation
    from kvtier.vllm.pages.attention import PagedAttention
    from kvtier.vllm.pages.paged import SideBuffer, plan_step
    from kvtier.vllm.pages.policy import PagePolicy, get_page_policy

    torch.manual_seed(0)
    fmt = PageFormat(PagePolicy(block_size=T), H, D, torch.bfloat16)
    nb = -(-length // T)
    k = torch.randn(reqs * nb * T, H, D).bfloat16()
    v = torch.randn_like(k)
    pages = torch.zeros(reqs * nb + 1, fmt.page_bytes, dtype=torch.uint8)
    pages[1:] = fmt.encode(k.view(-1, T, H, D).transpose(1, 2), v.view(-1, T, H, D).transpose(1, 2))
    side = SideBuffer(64, T, H, D, torch.bfloat16)
    table = torch.tensor([[1 + r * nb + j for j in range(nb)] for r in range(reqs)])
    # every full block before the new token is packed; the new token starts or continues the last block
    side.packed.update(table[:, : (length - 1) // T].flatten().tolist())
    for r in range(reqs):
        if (length - 1) % T:
            side.assign(int(table[r, (length - 1) // T]), set())
    plan = plan_step(side, list(range(reqs + 1)), [length] * reqs, table, reqs)
    q = torch.randn(reqs, HQ, D).bfloat16()
    kn, vn = torch.randn(reqs, H, D).bfloat16(), torch.randn(reqs, H, D).bfloat16()
    layer = side.layer("l")
    out = torch.empty(reqs, HQ, D, dtype=torch.bfloat16)

    isa = _get_attn_isa(torch.bfloat16, T, D, "auto")
    cache = torch.zeros(reqs * nb + 1, H, T, 2 * D, dtype=torch.bfloat16).view(-1, H, 2 * T, D)
    kc, vc = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(T, T + k.shape[0]), isa)
    qsl = torch.arange(reqs + 1, dtype=torch.int32)
    seq = torch.full((reqs,), length, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=reqs, num_heads=HQ, num_kv_heads=H, head_dim=D, seq_lens=seq, dtype=torch.bfloat16,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
    )  # fmt: skip
    out2 = torch.empty_like(out)
    bt = table.to(torch.int32)

    att = PagedAttention(fmt, "cpp")
    step = att.plan(plan)

    def kvtier() -> None:
        att.run(step, pages, layer, q, kn, vn, D**-0.5, out=out)

    counts = {lv: torch.zeros(2, dtype=torch.long) for lv in levels}

    def sparse(level: float):  # noqa: ANN202
        satt = PagedAttention(PageFormat(PagePolicy(block_size=T, sparse_mass=level), H, D, torch.bfloat16), "cpp")
        sstep = satt.plan(plan)
        return lambda: satt.run(sstep, pages, layer, q, kn, vn, D**-0.5, out=out, counts=counts[level])

    def vllm() -> None:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=out2, query_start_loc=qsl, seq_lens=seq,
            scale=D**-0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt, softcap=0.0,
            scheduler_metadata=meta, s_aux=None,
        )  # fmt: skip

    def preset(name: str):  # noqa: ANN202
        pfmt = PageFormat(get_page_policy(name), H, D, torch.bfloat16)
        r = rotation(D)
        vr = torch.matmul(v.float(), r).to(v.dtype) if pfmt.policy.value_rotation else v
        ppages = torch.zeros(pages.shape[0], pfmt.page_bytes, dtype=torch.uint8)
        ppages[1:] = pfmt.encode(k.view(-1, T, H, D).transpose(1, 2), vr.view(-1, T, H, D).transpose(1, 2))
        patt = PagedAttention(pfmt, "cpp")
        pstep = patt.plan(plan)

        def run() -> None:
            vv = torch.matmul(vn.float(), r).to(vn.dtype) if pfmt.policy.value_rotation else vn
            patt.run(pstep, ppages, layer, q, kn, vv, D**-0.5, out=out)
            if pfmt.policy.value_rotation:
                out.copy_(torch.matmul(out.float(), r.T))

        return run

    fns = {
        "kvtier": kvtier,
        "vllm": vllm,
        **{f"sparse{lv}": sparse(lv) for lv in levels},
        **{name: preset(name) for name in policies},
    }
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, f in fns.items():
            for _ in range(3):
                f()
            t = time.perf_counter()
            for _ in range(iters):
                f()
            best[name] = min(best[name], (time.perf_counter() - t) / iters * 1e3)
    res = {"kvtier_ms": best["kvtier"], "vllm_ms": best["vllm"], "ratio": best["kvtier"] / best["vllm"], "isa": isa}
    for lv in levels:
        res[f"sparse{lv}_ms"] = best[f"sparse{lv}"]
        res[f"sparse{lv}_valued_share"] = (counts[lv][0] / counts[lv][1]).item()
    for name in policies:
        res[f"{name}_ms"] = best[name]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reqs", default="1,48")
    ap.add_argument("--length", type=int, default=2049)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sparse", default="", help="comma-separated PagePolicy.sparse_mass levels to time too")
    ap.add_argument("--policies", default="", help="comma-separated page presets to time too (e.g. compact)")
    args = ap.parse_args()
    policies = tuple(x for x in args.policies.split(",") if x)
    levels = tuple(float(x) for x in args.sparse.split(",") if x)
    results = []
    for th in map(int, args.threads.split(",")):
        torch.set_num_threads(th)
        for reqs in map(int, args.reqs.split(",")):
            res = {
                "threads": th,
                "reqs": reqs,
                **case(reqs, args.length, 200 // reqs + 5, args.rounds, levels, policies),
            }
            sp = "".join(
                f", sparse {lv}: {res[f'sparse{lv}_ms']:.3f} ms ({res[f'sparse{lv}_valued_share']:.0%} valued)"
                for lv in levels
            ) + "".join(f", {name}: {res[f'{name}_ms']:.3f} ms" for name in policies)
            print(
                f"threads={th} reqs={reqs}: kvtier {res['kvtier_ms']:.3f} ms, vLLM bf16 {res['vllm_ms']:.3f} ms,"
                f" kvtier/vLLM {res['ratio']:.2f}{sp}",
                flush=True,
            )
            results.append(res)
    print(json.dumps({"bench": "vllm_paged_kernel", "args": vars(args), "load": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
