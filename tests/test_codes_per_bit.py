"""``benchmarks/codes_per_bit.py``'s llama.cpp ``q4_0`` against a scalar port of llama.cpp's
``quantize_row_q4_0_ref`` / ``dequantize_row_q4_0`` (the rule the KV-cache type ``q4_0`` stores),
element by element: the baseline the vq codes are compared with must be llama.cpp's own rule."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "codes_per_bit.py"


def _module():
    spec = importlib.util.spec_from_file_location("codes_per_bit", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _q4_0_row(x: list[float]) -> list[float]:
    """One 32-element block, as llama.cpp's C: signed max, d = max / -8, fp16 d stored, codes
    MIN(15, (int8_t)(x * id + 8.5f)) with id from the fp32 d, decoded (code - 8) * d16."""
    amax, mx = 0.0, 0.0
    for v in x:
        if amax < abs(v):
            amax, mx = abs(v), v
    d = np.float32(mx) / np.float32(-8)
    inv = np.float32(1.0) / d if d else np.float32(0.0)
    d16 = float(np.float16(d))
    out = []
    for v in x:
        q = min(15, math.trunc(float(np.float32(v) * inv + np.float32(8.5))))
        out.append((q - 8) * d16)
    return out


def test_q4_0_matches_llama_cpp_reference():
    mod = _module()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 5, 64, generator=g) * 3
    x[0, 0, 0, :32] = 0.0  # an all-zero block: d = 0, every value decodes to 0
    x[0, 0, 1, 5] = -40.0  # the largest magnitude negative: the sign of d flips
    x[1, 1, 2, 40] = 1e-3  # a tiny block below
    x[1, 1, 2, 32:] *= 1e-4
    got = mod.q_0(x, 4)
    want = torch.tensor([_q4_0_row(row) for row in x.reshape(-1, 32).tolist()]).reshape(x.shape)
    assert torch.equal(got, want)
    assert mod.META_BITS["q"] == mod.META_BITS["qr"] == 16 / mod.Q_BLOCK  # one fp16 per 32 elements
    # qr: the same rule on the rotated coordinates, rotated back (an orthogonal map: same error energy)
    from kvtier.quant import rotation

    r = rotation(64)
    assert torch.allclose(mod.code(x, "qr", 4), mod.q_0(x @ r, 4) @ r.T)
