"""Which codec vLLM's pool should hold: page policies screened in transformers, quality vs bytes.

SmolLM2-135M (fp32, transformers, 2 threads) reads each book in chunks of 256 tokens (teacher
forcing, a ``DynamicCache``); after every chunk, each full 128-token block of every layer is replaced
once by its :class:`kvtier.codecs.pages.PageFormat` round trip (values in the rotated basis when the
policy has ``value_rotation``), so later chunks attend packed blocks and exact recent rows, as in
a vLLM engine with chunked prefill of 256. Reported per policy: bytes per head and token in the
pool and the ratio to bf16, the next-64 NLL after a 3k prefix and the 4k perplexity, as deltas from
the same run without quantization (books ``dracula``, ``moby_dick`` from ``../shared/data/pg``).
A screening tool (~40 s a policy; fp32 model where the engine runs bf16): the engine's own numbers
come from ``vllm_serve.py``; on ``default`` and ``compact`` this screen's deltas were within 0.025
nats and 0.6 percentage points of the engine's (BENCHMARKS.md).

    python benchmarks/vllm_page_codecs.py --policies default,compact,v3,v3g32r,v2r,b3

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from kvtier.codecs.pages import PageFormat
from kvtier.quant.rotation import rotation
from kvtier.vllm.pages.policy import PAGE_POLICIES, PagePolicy

#: candidates besides the presets (names for the command line)
CANDIDATES = {
    "v3": PagePolicy(value_bits=3),
    "v3g32r": PagePolicy(value_bits=3, value_group=32, value_rotation=True),
    "v2": PagePolicy(value_bits=2),
    "v2r": PagePolicy(value_bits=2, value_rotation=True),
    "v2g32r": PagePolicy(value_bits=2, value_group=32, value_rotation=True),
    "b3": PagePolicy(bits=3),
    "b3k32": PagePolicy(bits=3, key_group=32),
}
BOOKS = ("dracula", "moby_dick")
T, CHUNK = 128, 256


def policy_of(name: str) -> PagePolicy:
    if name in PAGE_POLICIES:
        return PAGE_POLICIES[name][0]
    if name in CANDIDATES:
        return CANDIDATES[name]
    raise SystemExit(f"unknown policy {name!r}: expected one of {sorted(PAGE_POLICIES) + sorted(CANDIDATES)}")


@torch.no_grad()
def nll_of(model, ids: list[int], fmt: PageFormat | None) -> list[float]:  # noqa: ANN001
    """NLL of every token after the first, read in CHUNK-token chunks, full blocks packed once."""
    from transformers import DynamicCache

    cache, x, out = DynamicCache(), torch.tensor([ids]), []
    r = rotation(fmt.head_dim) if fmt is not None and fmt.policy.value_rotation else None
    done: dict[int, int] = {}
    for s in range(0, len(ids) - 1, CHUNK):
        e = min(s + CHUNK, len(ids) - 1)
        lp = model(x[:, s:e], past_key_values=cache, use_cache=True).logits[0].float().log_softmax(-1)
        out += (-lp.gather(1, x[0, s + 1 : e + 1, None])[:, 0]).tolist()
        if fmt is None:
            continue
        for i, layer in enumerate(cache.layers):
            K, V = layer.keys, layer.values  # [1, H, L, D]
            a, full = done.get(i, 0), K.shape[2] // T * T
            if full == a:
                continue
            H, D = K.shape[1], K.shape[3]
            k = K[0, :, a:full].float().view(H, -1, T, D).transpose(0, 1)  # [blocks, H, T, D]
            v = V[0, :, a:full].float().view(H, -1, T, D).transpose(0, 1)
            kd, vd = fmt.decode(fmt.encode(k, v if r is None else v @ r))
            if r is not None:
                vd = vd @ r.T
            K[0, :, a:full] = kd.transpose(0, 1).reshape(H, -1, D).to(K.dtype)
            V[0, :, a:full] = vd.transpose(0, 1).reshape(H, -1, D).to(V.dtype)
            done[i] = full
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="default,compact")
    ap.add_argument("--prefix", type=int, default=3072)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.length < args.prefix + 64:
        raise SystemExit("--length must hold the prefix and the 64 scored tokens")
    from kvtier.models import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model()
    model.eval()
    pg = Path(__file__).resolve().parents[2] / "shared" / "data" / "pg"
    books = {
        b: tok((pg / f"{b}.txt").read_text(encoding="utf-8")[20_000:120_000])["input_ids"][: args.length] for b in BOOKS
    }
    cfg = model.config
    H, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads

    def measure(fmt: PageFormat | None) -> dict:
        res = {}
        for b, ids in books.items():
            nll = nll_of(model, ids, fmt)
            res[f"nll64_{b}"] = statistics.fmean(nll[args.prefix - 1 : args.prefix + 63])
            res[f"ppl_{b}"] = math.exp(statistics.fmean(nll))
        return res

    base = measure(None)
    results = {"full": base}
    for name in args.policies.split(","):
        fmt = PageFormat(policy_of(name), H, D, torch.bfloat16)
        t = time.perf_counter()
        res = measure(fmt)
        res["cell_bytes"] = fmt.cell_bytes
        res["vs_bf16"] = fmt.exact_page_bytes / fmt.page_bytes
        res["dnll64"] = {b: res[f"nll64_{b}"] - base[f"nll64_{b}"] for b in BOOKS}
        res["dppl_pct"] = {b: 100 * (res[f"ppl_{b}"] / base[f"ppl_{b}"] - 1) for b in BOOKS}
        results[name] = res
        print(
            f"{name:>8}: {fmt.cell_bytes} B/cell ({res['vs_bf16']:.2f}x bf16)  dNLL64 "
            + " / ".join(f"{res['dnll64'][b]:+.4f}" for b in BOOKS)
            + "  dppl "
            + " / ".join(f"{res['dppl_pct'][b]:+.2f}%" for b in BOOKS)
            + f"  ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    print(json.dumps({"bench": "vllm_page_codecs", "args": vars(args), "load": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
