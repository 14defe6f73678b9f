"""Long-context decode: ms/token at several context lengths for the full cache, ``default`` and the
offload presets, side by side in one process, with resident bytes and the offload selection's
quality (fraction of blocks read and scored per step, reuse hit rate, attention mass skipped).

The prompt is prefilled *once*, at the longest length, with ``DynamicCache`` in 2,048-token chunks
(a 32k x 32k score matrix does not fit; SmolLM2 on 2 CPU cores takes many minutes at 32k), and its
keys and values are kept (``--kv-file``: saved there as fp16 and loaded by later runs). Every cache
at every length is then filled from those keys and values - the full cache by ``update``, the
tiered caches layer by layer as their own prefill would (``update`` + ``settle``, 4,096 tokens at a
time) - so no cache pays the prefill again. The tiered caches thus hold the full cache's keys and
values, not the ones their own (lossy) prefill would have produced: this measures speed and
bytes; quality at 8k is measured by ``kvtier eval ppl`` / ``kvtier eval recall``.

Decode: greedy from the token after the prompt, ``--threads`` torch threads (default 1), caches
interleaved round-robin over ``--rounds`` bursts of ``--new-tokens``; the median burst is
reported. ``--max-blocks M ...`` adds offload-cpu rows with other read budgets (``none``: no
cap). ``--drop-page-cache``: before every decode step of a disk cache its files are written
back and dropped from the page cache (outside the timing). ``--quality N``: after the timing, N
more decode steps per offload cache with the skipped-mass diagnostic on (reads every block: slow,
not timed).

SmolLM2-135M is trained to 8,192 positions: beyond it the model's outputs are not meaningful and
only speed and bytes are reported.

    python benchmarks/long_context_bench.py --lengths 8192 16384 32768 --kv-file /tmp/kv32k.pt

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch
from transformers import DynamicCache

from kvtier import get_policy
from kvtier.eval.caches import CacheSpec, cache_spec
from kvtier.eval.perplexity import book_windows
from kvtier.eval.texts import load_texts
from kvtier.models import load_model

PREFILL_CHUNK = 2048
FILL_CHUNK = 4096


def prefill_kv(model, ids: torch.Tensor, threads: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values ``[1, H, N, D]`` per layer of ``ids [1, N]`` (fp16), by a chunked full-cache prefill."""
    torch.set_num_threads(threads)
    cache = DynamicCache()
    t0 = time.perf_counter()
    with torch.no_grad():
        for s in range(0, ids.shape[1], PREFILL_CHUNK):
            model(ids[:, s : s + PREFILL_CHUNK], cache=cache, use_cache=True, logits_to_keep=1)
            print(f"prefill {s + PREFILL_CHUNK} tokens: {time.perf_counter() - t0:.0f} s", flush=True)
    return [layer.keys.half() for layer in cache.layers], [layer.values.half() for layer in cache.layers]


def fill(spec: CacheSpec, model, ks: list[torch.Tensor], vs: list[torch.Tensor], n: int, dtype: torch.dtype):
    """A cache of ``spec`` holding the first ``n`` tokens of ``ks, vs``, filled without a forward call."""
    cache = spec.build(model)
    layers = getattr(cache, "tiered_layers", None)
    if layers is None:
        for i in range(len(ks)):
            cache.update(ks[i][:, :, :n].to(dtype), vs[i][:, :, :n].to(dtype), i)
        return cache
    # chunk by chunk, every layer per chunk (as a forward call would): an adaptive budget ends its
    # warm-up once every layer has measured a block
    for s in range(0, n, FILL_CHUNK):
        e = min(n, s + FILL_CHUNK)
        for i, layer in enumerate(layers):
            owner, layer._owner = layer._owner, None  # a layer on its own: no forward call to join
            try:
                layer.update(ks[i][:, :, s:e].to(dtype), vs[i][:, :, s:e].to(dtype), kwargs={})
                layer.settle(None)
            finally:
                layer._owner = owner
    return cache


def offload_spec(preset: str, **changes) -> CacheSpec:
    pol = get_policy(preset)
    if not changes:
        return cache_spec(preset)
    name = preset + "(" + ",".join(f"{k}={v}" for k, v in changes.items()) + ")"
    return CacheSpec(name, pol.replace(offload=dataclasses.replace(pol.offload, **changes), name=name))


def offload_layers(cache) -> list:
    return [layer for layer in getattr(cache, "tiered_layers", []) if layer.offloaded]


def selection_row(d: dict) -> dict:
    """Selection quality from an :class:`~kvtier.stats.OffloadStats` delta (as a dict)."""
    tot = d["blocks_total"]
    return {
        "read_fraction": d["needed"] / tot if tot else None,
        "scored_fraction": d["blocks_scored"] / tot if tot else None,
        "reuse_hit_rate": d["reuse_hits"] / d["reuse_needed"] if d["reuse_needed"] else None,
        "reused_calls": d["reused"],
        "in_place": d["in_place"],
        "hits": d["hits"],
        "misses": d["misses"],
        "stall_ms_per_call": 1000 * d["stall_s"] / max(1, d["calls"]),
        "est_skipped_mean": d["est_skipped_mass"] / d["est_skipped_rows"] if d["est_skipped_rows"] else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill-threads", type=int, default=2)
    ap.add_argument("--presets", nargs="+", default=["dynamic", "default", "offload-cpu", "offload-disk"])
    ap.add_argument("--reuse-steps", type=int, nargs="*", default=[], help="extra offload-cpu rows with reuse")
    ap.add_argument(
        "--max-blocks",
        nargs="*",
        default=[],
        type=lambda a: None if a == "none" else int(a),
        help="extra offload-cpu rows with this read budget ('none': the mass rule alone)",
    )
    ap.add_argument("--kv-file", default=None, help="load the prefilled keys/values from here, or save them")
    ap.add_argument("--drop-page-cache", action="store_true", help="disk caches read every block from the device")
    ap.add_argument("--quality", type=int, default=0, help="untimed steps measuring the skipped attention mass")
    args = ap.parse_args()
    model, tok = load_model()
    top = max(args.lengths)
    if args.kv_file and os.path.exists(args.kv_file):
        saved = torch.load(args.kv_file, weights_only=True)
        ids, ks, vs = saved["ids"], saved["k"], saved["v"]
        assert ids.shape[1] > top, f"{args.kv_file} holds {ids.shape[1]} tokens, fewer than {top} + 1"
    else:
        ids = book_windows(tok, next(iter(load_texts(limit=1).values())), top + 1)[0]
        ks, vs = prefill_kv(model, ids[:, :top], args.prefill_threads)
        if args.kv_file:
            torch.save({"ids": ids, "k": ks, "v": vs}, args.kv_file)
    dtype = model.dtype
    specs = [cache_spec(p) if not p.startswith("offload") else offload_spec(p) for p in args.presets]
    specs += [offload_spec("offload-cpu", reuse_steps=r) for r in args.reuse_steps]
    specs += [offload_spec("offload-cpu", max_blocks=m) for m in args.max_blocks]
    results = []
    for n in args.lengths:
        states = {}
        for spec in specs:
            cache = fill(spec, model, ks, vs, n, dtype)
            states[spec.name] = {"cache": cache, "next": ids[:, n : n + 1], "times": []}
        torch.set_num_threads(args.threads)
        before = {
            name: dataclasses.asdict(st["cache"].offload_stats())
            for name, st in states.items()
            if offload_layers(st["cache"])
        }
        for _ in range(args.rounds):
            for spec in specs:
                st = states[spec.name]
                stores = [layer.cold.store for layer in offload_layers(st["cache"])]
                with spec.context(model), torch.no_grad():
                    busy = 0.0
                    for _ in range(args.new_tokens):
                        if args.drop_page_cache:
                            for store in stores:
                                store.drop_page_cache()
                        t0 = time.perf_counter()
                        out = model(st["next"], cache=st["cache"], use_cache=True)
                        st["next"] = out.logits[:, -1:].argmax(-1)
                        busy += time.perf_counter() - t0
                    st["times"].append(busy / args.new_tokens)
        rows = []
        for spec in specs:
            st = states[spec.name]
            cache = st["cache"]
            ms = 1000 * statistics.median(st["times"])
            row = {"tokens": n, "cache": spec.name, "ms_per_token": ms, "tok_s": 1000 / ms}
            if hasattr(cache, "memory_report"):
                r = cache.memory_report()
                row.update(
                    resident_bytes=r.resident_bytes,
                    offloaded_bytes=r.offloaded_bytes,
                    dense_fp16_bytes=r.dense_fp16_bytes,
                    resident_vs_fp16=r.resident_bytes / r.dense_fp16_bytes,
                )
            if spec.name in before:
                now = dataclasses.asdict(cache.offload_stats())
                row.update(selection_row({k: now[k] - before[spec.name][k] for k in now}))
                row["est_skipped_max"] = now["est_skipped_max"]
                if args.quality:
                    layers = offload_layers(cache)
                    for layer in layers:
                        layer.cold.measure_skipped = True
                    mark = dataclasses.asdict(cache.offload_stats())
                    with spec.context(model), torch.no_grad():
                        for _ in range(args.quality):
                            st["next"] = model(st["next"], cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    now = dataclasses.asdict(cache.offload_stats())
                    rows_n = now["skipped_rows"] - mark["skipped_rows"]
                    row["skipped_mass_mean"] = (now["skipped_mass"] - mark["skipped_mass"]) / max(1, rows_n)
                    row["skipped_mass_max"] = now["skipped_max"]
                cache.close()
            rows.append(row)
        base = rows[0]["tok_s"]
        print(
            f"\n{n} tokens, decode with {args.threads} thread(s)"
            + (", page cache dropped" if args.drop_page_cache else "")
        )
        print(
            f"{'cache':<34}{'ms/tok':>8}{'vs full':>8}{'resident/fp16':>14}{'read':>7}{'scored':>7}"
            f"{'reuse hit':>10}{'est skip':>9}"
        )
        for r in rows:
            r["vs_dynamic"] = r["tok_s"] / base
            f = {k: float("nan") if r.get(k) is None else r[k] for k in ("resident_vs_fp16", "read_fraction")}
            f.update(
                {
                    k: float("nan") if r.get(k) is None else r[k]
                    for k in ("scored_fraction", "reuse_hit_rate", "est_skipped_mean")
                }
            )
            print(
                f"{r['cache']:<34}{r['ms_per_token']:>8.1f}{r['vs_dynamic']:>8.2f}{f['resident_vs_fp16']:>14.4f}"
                f"{f['read_fraction']:>7.3f}{f['scored_fraction']:>7.3f}{f['reuse_hit_rate']:>10.3f}"
                f"{f['est_skipped_mean']:>9.4f}",
                flush=True,
            )
        results += rows
        del states
    config = {"lengths": args.lengths, "threads": args.threads, "drop_page_cache": args.drop_page_cache}
    print(json.dumps({**config, "rows": results}))


if __name__ == "__main__":
    main()
