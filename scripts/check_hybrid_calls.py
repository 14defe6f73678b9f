"""All-or-nothing calls on a real hybrid model: Gemma 3 270M (15 sliding-window layers of window
512, 3 full-attention layers), the checks of tests/test_calls.py on the real weights (issue 51, K1).

For each fault: prefill a book prefix through the model in chunks with a ``TieredCache("default")``,
then one more chunk that fails (a byte cap below what the cache holds, refused at the first full
layer; ``KeyboardInterrupt`` from a forward hook on decoder layer 1, a sliding layer before any
tiered one; an exception in the final norm; one in ``lm_head``); then the cache must hold the
same tokens in every layer as before, the sliding layers' tensors must be bit for bit the same, and
the same chunk again must give bit for bit the logits of a cache that never failed.
Needs ``kvtier models install gemma3-270m``.

    python scripts/check_hybrid_calls.py [--prefix 1500 --chunk 256]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import kvtier
from kvtier.errors import CacheFullError
from kvtier.hf.layer import TieredLayer
from kvtier.models import load_model

BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pg" / "dracula.txt"


FAULTS = ("cap", "ctrl-c in layer 1", "exception in the final norm", "exception in lm_head")


class Injected(Exception):
    pass


def feed(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:  # noqa: ANN001
    out = None
    for s in range(0, ids.shape[1], chunk):
        with torch.no_grad():
            out = model(ids[:, s : s + chunk], cache=cache, use_cache=True).logits
    return out


def sliding(cache) -> list[tuple]:  # noqa: ANN001
    return [
        (layer.cumulative_length, layer.keys.clone(), layer.values.clone())
        for layer in cache.layers
        if not isinstance(layer, TieredLayer) and layer.is_initialized
    ]


def same_sliding(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(
        n == m and torch.equal(k, k2) and torch.equal(v, v2) for (n, k, v), (m, k2, v2) in zip(a, b)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=1500)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--next", type=int, default=200, help="tokens of the call that fails")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {FAULTS}")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    model, tok = load_model("gemma3-270m")
    ids = tok(BOOK.read_text(encoding="utf-8")[20_000:60_000], return_tensors="pt")["input_ids"]
    prefix, nxt = ids[:, : args.prefix], ids[:, args.prefix : args.prefix + args.next]
    types = model.config.get_text_config(decoder=True).layer_types
    print(
        f"Gemma 3 270M: {len(types)} layers, {types.count('full_attention')} full; prefix {prefix.shape[1]}, "
        f"failing call {nxt.shape[1]} tokens",
        flush=True,
    )
    rows = []
    with kvtier.enable(model):
        ref = kvtier.TieredCache(model.config, "default")
        feed(model, ref, prefix, args.chunk)
        want = feed(model, ref, nxt, args.chunk)
        for fault in args.faults.split(","):
            t0 = time.perf_counter()
            cache = kvtier.TieredCache(model.config, "default")
            feed(model, cache, prefix, args.chunk)
            lengths, before = [layer.get_seq_length() for layer in cache.layers], sliding(cache)
            handle, err = None, None
            if fault == "cap":
                cache.max_bytes = cache.memory_report().total_bytes // 2  # any call would end above it
                expected: type[BaseException] = CacheFullError
            else:
                module = {
                    "ctrl-c in layer 1": model.model.layers[1],
                    "exception in the final norm": model.model.norm,
                    "exception in lm_head": model.lm_head,
                }[fault]
                expected = KeyboardInterrupt if fault.startswith("ctrl-c") else Injected

                def hook(*a, _e=expected):  # noqa: ANN002, ANN202
                    raise _e("injected")

                handle = module.register_forward_hook(hook)
            try:
                feed(model, cache, nxt, args.next)
            except expected as e:
                err = e
            finally:
                if handle is not None:
                    handle.remove()
            cache.max_bytes = None
            after = [layer.get_seq_length() for layer in cache.layers]
            row = {
                "fault": fault,
                "raised": type(err).__name__ if err is not None else None,
                "lengths_kept": after == lengths,
                "sliding_bit_identical": same_sliding(before, sliding(cache)),
            }
            got = feed(model, cache, nxt, args.chunk)
            row["retry_logits_bit_identical"] = bool(torch.equal(got, want))
            row["s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(row, flush=True)
    ok = all(
        r["raised"] and r["lengths_kept"] and r["sliding_bit_identical"] and r["retry_logits_bit_identical"]
        for r in rows
    )
    print(json.dumps({"model": "gemma3-270m", "prefix": prefix.shape[1], "next": nxt.shape[1], "ok": ok, "rows": rows}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
