"""Quantizers: packing, k-bit and sign codes against plain references and their error bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.quant import (
    dequantize_kbit,
    dequantize_sign,
    pack_bits,
    packed_size,
    quantize_kbit,
    quantize_sign,
    rotation,
    unpack_bits,
)


def reference_pack(codes: torch.Tensor, bits: int) -> list[int]:
    """Plain bit-string reference: concatenated plane bits, little-endian within each byte."""
    from kvtier.quant.bits import planes

    n = codes.shape[-1]
    if bits == 8:
        return codes.tolist()
    n_pad = -(-n // 8) * 8
    vals = codes.flatten().tolist() + [0] * (n_pad - n)
    out, offset = [], 0
    for w in planes(bits):
        per = 8 // w
        for i in range(0, n_pad, per):
            byte = 0
            for j in range(per):
                byte |= ((vals[i + j] >> offset) & ((1 << w) - 1)) << (w * j)
            out.append(byte)
        offset += w
    return out


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 100])
def test_pack_matches_reference_and_roundtrips(bits, n):
    g = torch.Generator().manual_seed(bits * 100 + n)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape[-1] == packed_size(n, bits)
    assert packed.tolist() == reference_pack(codes, bits)
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_batched_shapes():
    codes = torch.randint(0, 8, (2, 3, 5, 24), dtype=torch.uint8)
    packed = pack_bits(codes, 3)
    assert packed.shape == (2, 3, 5, 9)
    assert torch.equal(unpack_bits(packed, 3, 24), codes)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 6, 8]),
    rows=st.integers(1, 5),
    group=st.integers(1, 40),
    offset=st.floats(-50, 50),
    spread=st.floats(0, 20),
    seed=st.integers(0, 10_000),
)
def test_kbit_roundtrip_bound(bits, rows, group, offset, spread, seed):
    g = torch.Generator().manual_seed(seed)
    x = offset + spread * torch.randn(rows, group, generator=g)
    q, s, z = quantize_kbit(x, bits, dim=1)
    assert q.dtype == torch.uint8 and int(q.max()) < (1 << bits)
    xh = dequantize_kbit(q, s, z)
    assert torch.isfinite(xh).all()
    err = (x - xh).abs()
    assert (err <= 0.75 * s.float() + 1e-6 * x.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("value", [0.0, 1.0, -3.5, 1e4, 1e-8])
def test_kbit_constant_and_zero_groups(bits, value):
    x = torch.full((3, 17), value)
    q, s, z = quantize_kbit(x, bits, dim=1)
    xh = dequantize_kbit(q, s, z)
    assert torch.isfinite(s.float()).all() and torch.isfinite(z.float()).all()
    assert torch.allclose(xh, x, atol=1e-5, rtol=2e-3)


def test_kbit_excludes_invalid_from_statistics():
    x = torch.tensor([[1.0, 2.0, 3.0, 1000.0]])
    valid = torch.tensor([[True, True, True, False]])
    q, s, z = quantize_kbit(x, 4, dim=1, valid=valid)
    xh = dequantize_kbit(q, s, z)
    assert (x[:, :3] - xh[:, :3]).abs().max() <= 0.75 * float(s)
    assert float(s) < 1.0  # the pad's 1000 did not stretch the range
    # a group with no valid entry at all stays finite
    q, s, z = quantize_kbit(x, 4, dim=1, valid=torch.zeros_like(valid))
    assert torch.isfinite(dequantize_kbit(q, s, z)).all()


def test_kbit_statistics_per_axis():
    # keys: per channel over tokens (dim=-2); values: per token over channels (dim=-1)
    x = torch.randn(2, 16, 8) * torch.logspace(-2, 2, 8)
    q, s, z = quantize_kbit(x, 4, dim=-2)
    assert s.shape == (2, 1, 8)
    q, s, z = quantize_kbit(x, 4, dim=-1)
    assert s.shape == (2, 16, 1)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), group=st.integers(1, 40), seed=st.integers(0, 10_000), offset=st.floats(-5, 5))
def test_sign_properties(rows, group, seed, offset):
    g = torch.Generator().manual_seed(seed)
    x = offset + torch.randn(rows, group, generator=g)
    signs, scale, mean = quantize_sign(x, dim=1)
    xh = dequantize_sign(signs, scale, mean)
    assert torch.isfinite(xh).all()
    dev = x - mean.float()
    # each reconstruction sits on the right side of the mean, at distance `scale`
    assert torch.equal(signs.bool(), dev >= 0)
    assert torch.allclose((xh - mean.float()).abs(), scale.float().expand_as(xh))
    assert ((x - xh).abs() <= dev.abs() + scale.float() + 1e-6).all()
    ref_scale = dev.abs().mean(1, keepdim=True)
    assert torch.allclose(scale.float(), ref_scale, rtol=2e-3, atol=1e-6)


def test_sign_constant_and_zero():
    for value in (0.0, 2.0):
        x = torch.full((2, 9), value)
        s, sc, m = quantize_sign(x, dim=1)
        assert torch.allclose(dequantize_sign(s, sc, m), x, atol=1e-5)


@pytest.mark.parametrize("d", [16, 64, 128, 48])
def test_rotation_orthogonal(d):
    r = rotation(d)
    assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)
    assert torch.equal(r, rotation(d))  # fixed


def test_quantizers_build_no_graph():
    x = torch.randn(4, 8, requires_grad=True)
    for out in (*quantize_kbit(x, 4, dim=0), *quantize_sign(x, dim=0)):
        assert out.grad_fn is None and not out.requires_grad


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("D", [64, 48])
def test_rotated_kbit_codec_decodes_the_rotated_grid_back(bits, D):
    """KBitCodec(rotate=True) quantizes x @ R and decodes (q - z) s @ R.T; an outlier channel,
    which inflates the per-token value grid of every channel, costs the rotated code less."""
    from kvtier.codecs import KBitCodec

    g = torch.Generator().manual_seed(bits + D)
    k = torch.randn(2, 3, 4, 16, D, generator=g)
    v = torch.randn(2, 3, 4, 16, D, generator=g)
    v[..., 5] *= 20  # one outlier channel
    valid = torch.ones(2, 1, 4, 16, dtype=torch.bool)
    plain, rot = KBitCodec(bits, D), KBitCodec(bits, D, rotate=True)
    f = rot.encode(k, v, valid)
    r = rotation(D)
    kq = unpack_bits(f["k_codes"], bits, D)
    expect_k = dequantize_kbit(kq, f["k_scale"], f["k_zero"], torch.float32) @ r.T
    assert torch.allclose(rot.decode_keys(f, D, torch.float32), expect_k, atol=1e-5)
    err = {c.name: (c.decode_values(c.encode(k, v, valid), D, torch.float32) - v).pow(2).mean() for c in (plain, rot)}
    assert err[rot.name] < 0.5 * err[plain.name], err
    assert rot.name == f"int{bits}-rot" and rot.nbytes(2, 3, 4, 16, D) == plain.nbytes(2, 3, 4, 16, D)
