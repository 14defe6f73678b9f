"""Soak: 1,000 generate calls per preset in one process, through the memory doctor (kvtier.doctor).

A serving loop in miniature: every call builds a fresh ``TieredCache`` (closed at the end of the
call), prefills the prompt and decodes ``--new-tokens`` tokens greedily. For each preset it prints
the RSS drift after the warm-up (median of the last tenth of the calls vs the first tenth), the
robust RSS slope and the doctor's verdict, the most caches alive at once, and the threads,
descriptors, offload files and ``*.kv`` maps left after the last ``close()``. Target: drift < 2%
and "no leak" for every preset.

The model is a tiny random Llama built in code by default (4 layers, hidden 64, 2 KV heads of
dimension 16, vocabulary 97: the tests' ``tiny_llama``) and the prompt random token ids, long
enough (1,280 tokens) to fill every tier of every preset; ``--model smollm2`` runs the offline
SmolLM2-135M on the first book (100 calls by default: a 512-token call took ~4 s on a busy
2-core machine). One torch thread.

    python benchmarks/soak.py                       # tiny model, 1,000 calls x 4 presets
    python benchmarks/soak.py --model smollm2 --calls 100 --plot-dir soak-plots

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvtier.doctor import diagnose, plot_memory, prompt_ids

PRESETS = ("default", "max-compression", "offload-disk", "adaptive")
TARGET_DRIFT_PCT = 2.0


def tiny_llama(seed: int = 0):  # noqa: ANN201 - LlamaForCausalLM
    """The tests' tiny random Llama (``kvtier.testing``)."""
    from kvtier.testing import tiny_llama as build

    return build(seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated preset names")
    ap.add_argument("--calls", type=int, default=None, help="per preset (default 1,000 tiny, 100 smollm2)")
    ap.add_argument("--warmup", type=int, default=None, help="calls left out of the trend (default calls/5)")
    ap.add_argument("--prompt-tokens", type=int, default=1280)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--plot-dir", help="write <preset>.png (memory over the calls) here")
    ap.add_argument("--gc", action="store_true", help="gc.collect() after each call (frees dropped caches at once)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    if args.model == "tiny":
        model = tiny_llama()
        g = torch.Generator().manual_seed(0)
        ids, source = torch.randint(3, 97, (1, args.prompt_tokens), generator=g), "random token ids"
        model_name = "tiny random Llama (4 layers, hidden 64, 2 KV heads x 16)"
    else:
        from kvtier.models import load_model

        model, tok = load_model()
        ids, source = prompt_ids(tok, args.prompt_tokens)
        model_name = "SmolLM2-135M"
    calls = args.calls or (1000 if args.model == "tiny" else 100)
    print(
        f"soak: {model_name}, prompt {ids.shape[1]} tokens ({source}) + {args.new_tokens} new, {calls} calls per"
        f" preset, a fresh cache per call{', gc.collect() after each' if args.gc else ''}, 1 torch thread",
        flush=True,
    )

    results = []
    for preset in args.presets.split(","):
        t0 = time.perf_counter()
        bar = sys.stderr.isatty()
        kw = {"new_tokens": args.new_tokens, "warmup": args.warmup, "progress": bar, "collect": args.gc}
        rep = diagnose(model, ids, preset, calls=calls, **kw)
        wall = time.perf_counter() - t0
        if args.plot_dir:
            Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
            plot_memory(rep, Path(args.plot_dir) / f"{preset}.png")
        window = rep.rows[rep.warmup :]
        res = {
            "preset": preset,
            "calls": calls,
            "warmup": rep.warmup,
            "rss_mib_after_warmup": window[0].rss_bytes / 2**20,
            "rss_mib_end": window[-1].rss_bytes / 2**20,
            "rss_drift_pct": rep.rss_drift_pct,
            "slope_kib_per_call": rep.rss.slope / 1024,
            "tail_slope_kib_per_call": rep.rss.tail_slope / 1024,
            "fitted_drift_pct": rep.rss.drift_pct,
            "verdict": rep.verdict,
            "cache_kib": rep.rows[-1].cache_bytes / 1024,
            "max_caches_alive": max(r.caches_alive for r in rep.rows),
            "max_alive_cache_mib": max(r.alive_cache_bytes for r in rep.rows) / 2**20,
            "autograd": len(rep.autograd),
            "threads_left": rep.threads_left,
            "fds_left": rep.fds_left,
            "files_left": rep.files_left,
            "maps_left": rep.maps_left,
            "ms_per_call": 1000 * sum(r.seconds for r in rep.rows) / calls,
            "wall_s": wall,
        }
        res["target_met"] = res["verdict"] == "no leak" and abs(res["rss_drift_pct"]) < TARGET_DRIFT_PCT
        results.append(res)
        print(
            f"{preset:<16} RSS {res['rss_mib_after_warmup']:.1f} -> {res['rss_mib_end']:.1f} MiB after warm-up"
            f" (drift {res['rss_drift_pct']:+.2f}%), slope {res['slope_kib_per_call']:+.2f} KiB/call"
            f" (last half {res['tail_slope_kib_per_call']:+.2f}): {res['verdict']}; caches alive <="
            f" {res['max_caches_alive']} ({res['max_alive_cache_mib']:.1f} MiB); left:"
            f" {len(res['threads_left'])} threads, {len(res['fds_left'])} fds,"
            f" {len(res['files_left'])} offload dirs, {len(res['maps_left'])} maps;"
            f" {res['ms_per_call']:.0f} ms/call; target {'met' if res['target_met'] else 'NOT met'}",
            flush=True,
        )
    ok = all(r["target_met"] and not (r["threads_left"] or r["fds_left"] or r["files_left"]) for r in results)
    print(
        json.dumps(
            {
                "kind": "soak",
                "model": args.model,
                "prompt_tokens": int(ids.shape[1]),
                "new_tokens": args.new_tokens,
                "calls": calls,
                "threads": 1,
                "gc_each_call": args.gc,
                "target_drift_pct": TARGET_DRIFT_PCT,
                "all_met": ok,
                "presets": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
