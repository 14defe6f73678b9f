"""Codes per bit: how much model fidelity a K/V code format buys at a given width (issue 17's
"better bits per bit" question), measured on the real model with the cache's codes simulated.

A design experiment, not a cache: :class:`CodedCache` is transformers' ``DynamicCache`` whose
tokens between the exact sinks and the exact recent ring are replaced, once, when a whole block of
``--block`` tokens has left the ring, by their coded-then-decoded values (each token coded once, as
kvtier's tiers do). Nothing is stored packed, so the bytes below are *computed from the format*
(codes + parameters per element), not held; the fidelity is the model's, streamed as in
``benchmarks/adaptive_ppl.py`` (chunks of 64, NLL over the second half, KL and top-1 against the
full cache in lockstep). No eviction: every token keeps a code.

Formats (all on Hadamard-rotated coordinates, :func:`kvtier.quant.rotation`):

* ``ab``: kvtier's cold format - keys per channel over a block, values per token over 64
  channels, ``x = a * code + b`` with ``(a, b)`` in fp8 and the grid clipped to the best of
  :data:`kvtier.quant.groups.AB_CLIPS` (:func:`kvtier.quant.quantize_ab`). Parameters: 0.25 bit
  per element for keys and for values.
* ``lm``: scalar Lloyd-Max codes for N(0, 1) (the rotated coordinates' shape), per token scaled
  by its RMS after removing the block's per-channel key mean (keys) or the token's mean
  (values); mean and RMS in fp8: also 0.25 bit per element.
* ``vq``: the same normalization, then 4-dimensional vector codes: a k-means codebook of
  ``2**(4 w)`` centers fitted once to N(0, I_4) samples (seeded; model-independent, no
  calibration), nearest center per 4 coordinates.
* ``q`` / ``qr``: llama.cpp's ``q{w}_0`` KV-cache type (``q4_0`` at width 4: what
  ``--cache-type-k/-v q4_0`` stores): every token's head-dim row in blocks of 32, one fp16 scale
  ``d = m / -2**(w-1)`` per block (``m`` the block's value of largest magnitude, sign kept), codes
  ``round(x / d) + 2**(w-1)`` clamped to ``[0, 2**w)``; ``w + 0.5`` bits per element. ``q`` codes
  the raw coordinates (as llama.cpp does), ``qr`` the Hadamard-rotated ones ("q4_0 with rotation").

A name ``fmt:K/V`` sets the key and value widths (``vq:3/2``); ``--ring`` the exact recent tokens.

    python benchmarks/codes_per_bit.py --length 4096 --book dracula \
        --codes ab:2/2,lm:2/2,vq:2/2,ab:3/2,vq:3/2,ab:3/3,vq:3/3 --out benchmarks/results/codes-per-bit-4k.json
    python benchmarks/codes_per_bit.py --plot benchmarks/results/codes-per-bit-*.json   # KL vs bits, PNG

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvtier.eval.caches import CacheSpec
from kvtier.eval.perplexity import book_windows, stream_compare
from kvtier.models import load_model
from kvtier.quant import quantize_ab, rotation

F8 = torch.float8_e4m3fn
#: parameter bits per element: two 8-bit parameters per 64 elements; llama.cpp's one fp16 per 32
META_BITS = {"ab": 0.25, "lm": 0.25, "vq": 0.25, "q": 0.5, "qr": 0.5}
Q_BLOCK = 32  # llama.cpp's QK4_0 (and QK8_0): elements per scale


def _f8(x: torch.Tensor) -> torch.Tensor:
    return x.to(F8).float()


@functools.lru_cache(maxsize=8)
def lloyd_max(bits: int) -> torch.Tensor:
    """Sorted ``[2**bits]`` levels minimizing E(x - level)^2 for x ~ N(0, 1) (Lloyd iterations)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 21, generator=g, dtype=torch.float64).sort().values
    n = 1 << bits
    levels = torch.linspace(-2.0, 2.0, n, dtype=torch.float64)
    for _ in range(200):
        edges = (levels[1:] + levels[:-1]) / 2
        idx = torch.bucketize(x, edges)
        levels = torch.stack([x[idx == i].mean() for i in range(n)])
    return levels.float()


@functools.lru_cache(maxsize=8)
def kmeans_codebook(bits: int, dim: int = 4) -> torch.Tensor:
    """``[2**(bits*dim), dim]`` centers of k-means on seeded N(0, I) samples (model-independent)."""
    n = 1 << (bits * dim)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(max(64 * n, 1 << 16), dim, generator=g)
    c = x[torch.randperm(x.shape[0], generator=g)[:n]].clone()
    for _ in range(40):
        idx = _nearest(x, c)
        s = torch.zeros_like(c).index_add_(0, idx, x)
        cnt = torch.bincount(idx, minlength=n).float()[:, None]
        c = torch.where(cnt > 0, s / cnt.clamp_min(1), c)
    return c


def _nearest(x: torch.Tensor, c: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    cc = (c * c).sum(1)
    out = []
    for i in range(0, x.shape[0], chunk):
        xs = x[i : i + chunk]
        out.append((cc[None, :] - 2 * xs @ c.T).argmin(1))
    return torch.cat(out)


def _normalized(x: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x - mean`` over its RMS per token (last axis), both parameters through fp8."""
    mean = _f8(mean)
    xc = x - mean
    rms = _f8(xc.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(2.0**-9))
    return xc / rms, mean, rms


def _code_unit(z: torch.Tensor, fmt: str, bits: int) -> torch.Tensor:
    """Coded-decoded ``z`` (unit-variance coordinates, last axis a multiple of 4)."""
    if fmt == "lm":
        lv = lloyd_max(bits)
        idx = torch.bucketize(z, (lv[1:] + lv[:-1]) / 2)
        return lv[idx]
    c = kmeans_codebook(bits)
    flat = z.reshape(-1, c.shape[1])
    return c[_nearest(flat, c)].reshape(z.shape)


def q_0(x: torch.Tensor, bits: int) -> torch.Tensor:
    """llama.cpp's ``q{bits}_0`` coded and decoded over the last axis (a multiple of 32): per block of
    32, ``d = m / -2**(bits-1)`` (stored in fp16) with ``m`` the entry of largest magnitude (its sign kept),
    codes ``floor(x / d + 2**(bits-1) + 0.5)`` clamped to ``[0, 2**bits)`` (``quantize_row_q4_0_ref``'s
    rule at width 4), decoded as ``(code - 2**(bits-1)) * d``."""
    half = 1 << (bits - 1)
    xb = x.float().reshape(*x.shape[:-1], -1, Q_BLOCK)
    m = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))
    d = m / -half
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))  # from the fp32 scale, as llama.cpp
    q = (xb * inv + (half + 0.5)).floor().clamp(0, 2 * half - 1)
    return ((q - half) * d.half().float()).reshape(x.shape)  # the stored fp16 scale


def code(x: torch.Tensor, fmt: str, bits: int, block: int | None = None) -> torch.Tensor:
    """Rows ``x: [B, H, N, D]`` rotated, coded, decoded and rotated back. Keys (``block`` given,
    ``N`` a multiple of it): parameters per channel over each block's tokens; values (``block``
    None): per token over the head dim. Either way the parameters run over axis 3 of the (blocked)
    rotated tensor; the RMS scale of ``lm`` / ``vq`` is per token."""
    B, H, N, D = x.shape
    if fmt == "q":  # llama.cpp: raw coordinates, per token
        return q_0(x, bits).to(x.dtype)
    r = rotation(D)
    xr = x.float() @ r
    if fmt == "qr":
        return (q_0(xr, bits) @ r.T).to(x.dtype)
    if block is not None:
        xr = xr.reshape(B, H, N // block, block, D)
    if fmt == "ab":
        q, a, b = quantize_ab(xr, bits, dim=3, dtype=F8, clip=True)
        xh = q.float() * a.float() + b.float()
    else:
        z, mean, rms = _normalized(xr, xr.mean(3, keepdim=True))
        xh = _code_unit(z, fmt, bits) * rms + mean
    return (xh.reshape(B, H, N, D) @ r.T).to(x.dtype)


class CodedCache(DynamicCache):
    """``DynamicCache`` whose tokens past ``sinks`` and before the last ``ring`` are coded once,
    a whole ``block`` at a time (see the module docstring)."""

    def __init__(self, config, fmt: str, kbits: int, vbits: int, sinks: int, ring: int, block: int):
        super().__init__(config=config)
        self.fmt, self.kbits, self.vbits = fmt, kbits, vbits
        self.sinks, self.ring, self.block = sinks, ring, block
        self.coded: dict[int, int] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        n = keys.shape[2]
        start = self.coded.get(layer_idx, self.sinks)
        end = start + max(0, (n - self.ring - start) // self.block) * self.block
        if end > start:
            with torch.no_grad():
                keys[:, :, start:end] = code(keys[:, :, start:end], self.fmt, self.kbits, self.block)
                values[:, :, start:end] = code(values[:, :, start:end], self.fmt, self.vbits)
            self.coded[layer_idx] = end
        return keys, values


class CodedSpec(CacheSpec):
    def __init__(self, name: str, sinks: int, ring: int, block: int):
        super().__init__(name)
        fmt, _, widths = name.partition(":")
        kb, _, vb = widths.partition("/")
        if fmt not in META_BITS or kb not in ("1", "2", "3", "4") or vb not in ("1", "2", "3", "4"):
            raise ValueError(f"{name!r}: expected {'|'.join(META_BITS)}:K/V with widths 1..4")
        kb, vb = int(kb), int(vb)
        self.args = (fmt, kb, vb, sinks, ring, block)

    def build(self, model):
        return CodedCache(model.config, *self.args)


def plot(paths: list[str]) -> Path:
    """KL vs code + parameter bits per format, one line per (format, run); PNG next to the first run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = sorted((json.loads(Path(p).read_text()) for p in sorted(paths)), key=lambda d: -len(d["rows"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    marks = {"ab": "o", "lm": "s", "vq": "^", "q": "x", "qr": "D"}
    labels: set[str] = set()
    for i, doc in enumerate(docs):
        for fmt, mark in marks.items():
            pts = sorted((r["code_bits"], r["kl"]) for n, r in doc["rows"].items() if n.startswith(fmt + ":"))
            if pts:
                label = f"{fmt} {doc['book']} {doc['length']}"
                ax.plot(
                    *zip(*pts),
                    marker=mark,
                    color=f"C{i}",
                    linestyle={"ab": "-", "lm": ":", "vq": "--", "q": "-.", "qr": "-."}[fmt],
                    label=None if label in labels else label,  # a run re-measuring a point: no second entry
                )
                labels.add(label)
    ax.axhline(0.01, color="grey", linewidth=0.8)
    ax.text(2.3, 0.0105, "issue 17's KL target", color="grey", fontsize=8)
    # what bits=2.5 leaves at 8k after the runs' exact sinks and ring (fp16)
    room = 2.5 - 16 * (docs[0]["sinks"] + docs[0]["ring"]) / 8192
    ax.axvline(room, color="grey", linewidth=0.8, linestyle=":")
    ax.text(room + 0.02, 0.003, f"bits=2.5 at 8k leaves {room:.2f}", color="grey", fontsize=8, rotation=90)
    ax.set_yscale("log")
    ax.set_xlabel("code + parameter bits per K/V element (exact sinks and ring not counted)")
    ax.set_ylabel("KL vs full cache, nats/token")
    ax.set_title("SmolLM2-135M, every token past the exact ring coded once, no eviction", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    out = Path(sorted(paths)[0]).with_name("codes-per-bit.png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", nargs="+", default=None, help="result files to plot (then nothing runs)")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--book", default="dracula")
    ap.add_argument("--codes", default="ab:2/2,vq:2/2")
    ap.add_argument("--sinks", type=int, default=32)
    ap.add_argument("--ring", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--data", default="../shared/data/pg")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.plot:
        print(json.dumps({"plot": str(plot(args.plot))}))
        return
    torch.set_num_threads(args.threads)
    model, tok = load_model()
    specs = [CodedSpec(name, args.sinks, args.ring, args.block) for name in args.codes.split(",")]
    for s in specs:  # fit codebooks before timing anything
        if s.args[0] == "vq":
            kmeans_codebook(s.args[1]), kmeans_codebook(s.args[2])
    ids = book_windows(tok, Path(args.data, f"{args.book}.txt").read_text(), args.length)[0]
    L = args.length
    t0 = time.time()
    scores = stream_compare(model, ids, specs)
    full = scores["dynamic"]
    exact_bits = 16 * (args.sinks + args.ring) / L
    rows = {}
    for s in specs:
        sc = scores[s.name]
        fmt, kb, vb = s.args[:3]
        code_bits = (kb + vb) / 2 + META_BITS[fmt]
        rows[s.name] = {
            "dppl": sc.ppl / full.ppl - 1,
            "kl": sc.mean_kl,
            "top1": sc.top1,
            "code_bits": code_bits,
            "bits_at_length": code_bits * (1 - (args.sinks + args.ring) / L) + exact_bits,
        }
        r = rows[s.name]
        print(
            f"{args.book} {L} {s.name:<8} dppl={100 * r['dppl']:+.2f}% kl={r['kl']:.4f} top1={r['top1']:.3f} "
            f"code+param bits={code_bits:.2f} all-in at {L}={r['bits_at_length']:.2f}",
            flush=True,
        )
    out = {"length": L, "book": args.book, "ring": args.ring, "sinks": args.sinks, "full_ppl": full.ppl, "rows": rows}
    out["seconds"] = time.time() - t0
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({"length": L, "book": args.book, "kl": {n: round(r["kl"], 5) for n, r in rows.items()}}))


if __name__ == "__main__":
    main()
