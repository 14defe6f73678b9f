"""``KBitCodec.encode_into`` (the in-place path the vLLM store's block codec uses) writes
``KBitCodec.encode``'s fields byte for byte: awkward lengths, GQA head counts, every code width,
rotation on and off, masks, strided inputs and outputs that are views into one flat buffer."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.codecs import KBitCodec
from kvtier.errors import StorageRangeError


def _inputs(B, H, n, T, D, dtype, seed, strided=False):  # noqa: ANN001, ANN202
    """``k, v: [B, H, n, T, D]`` with outlier channels; ``strided``: views of one ``[B, H, 2, n, T, D]``."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.1, 4, D)
    if strided:
        kv = (torch.randn(B, H, 2, n, T, D, generator=g) * scale).to(dtype)
        return kv[:, :, 0], kv[:, :, 1]
    return ((torch.randn(B, H, n, T, D, generator=g) * scale).to(dtype) for _ in range(2))


def _flat_out(fields: dict[str, torch.Tensor], pad: int) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like ``fields``, as views into one uint8 buffer (``pad`` bytes before the
    first field; fp16 fields first, as a record lays them out), filled with garbage."""
    order = sorted(fields, key=lambda name: fields[name].dtype == torch.uint8)
    sizes = [fields[name].numel() * fields[name].element_size() for name in order]
    flat = torch.randint(0, 256, (pad + sum(sizes),), dtype=torch.uint8)
    out, off = {}, pad
    for name, size in zip(order, sizes):
        out[name] = flat[off : off + size].view(fields[name].dtype).view(fields[name].shape)
        off += size
    return out


def _all_valid(k: torch.Tensor) -> torch.Tensor:
    return torch.ones(k.shape[0], 1, *k.shape[2:4], dtype=torch.bool)


def _check(codec: KBitCodec, k, v, valid, pad=0, buffer=None):  # noqa: ANN001, ANN202
    ref_valid = _all_valid(k) if valid is None else valid
    ref = codec.encode(k, v, ref_valid)
    out = _flat_out(ref, pad)
    got = codec.encode_into(k, v, valid, out, buffer)
    assert got is out
    for name in ref:
        assert got[name].dtype == ref[name].dtype and got[name].shape == ref[name].shape, name
        assert torch.equal(got[name], ref[name]), (codec, name)


# B, H (GQA: the codec sees the KV heads only), n blocks, T tokens per block, D, value group
SHAPES = [
    (1, 1, 1, 1, 16, 16),
    (2, 3, 2, 5, 48, 16),  # 5-token blocks: off every group boundary
    (3, 2, 3, 13, 64, 32),
    (1, 4, 1, 64, 128, 64),
    (2, 1, 2, 7, 12, 4),  # D not a multiple of 8: the pack falls back to pack_bits
]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rot"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_encode_into_matches_encode_bytes(bits, rotate, shape):
    B, H, n, T, D, G = shape
    codec = KBitCodec(bits, G, rotate)
    k, v = _inputs(B, H, n, T, D, torch.bfloat16, seed=bits + 10 * rotate)
    _check(codec, k, v, None)
    _check(codec, k, v, torch.ones(B, 1, n, T, dtype=torch.bool), pad=2)
    # a left-padded batch: a different number of leading tokens out of the statistics per sequence,
    # whole blocks among them (their key groups empty), tokens counted over the blocks of a sequence
    pos = torch.arange(n * T).view(1, 1, n, T)
    pads = torch.tensor([(b * (T + 1)) % (n * T + 1) for b in range(B)]).view(B, 1, 1, 1)
    _check(codec, k, v, pos >= pads, pad=6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits,rotate", [(2, True), (3, False), (4, True), (6, False), (8, True)])
def test_encode_into_random_masks_strided_inputs_and_a_reused_buffer(dtype, bits, rotate):
    B, H, n, T, D, G = 2, 3, 3, 9, 64, 32
    codec = KBitCodec(bits, G, rotate)
    bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = bufs.get((name, dtype))
        if buf is None or buf.numel() != math.prod(shape):
            buf = bufs[(name, dtype)] = torch.empty(math.prod(shape), dtype=dtype)
        return buf.fill_(7 if dtype == torch.uint8 else 123.0).view(shape)  # stale contents must not leak

    g = torch.Generator().manual_seed(5)
    for seed in range(3):
        k, v = _inputs(B, H, n, T, D, dtype, seed, strided=True)
        valid = torch.rand(B, 1, n, T, generator=g) > 0.3
        valid[0, 0, 1] = False  # an empty key group
        _check(codec, k, v, valid, pad=4, buffer=buffer)
        _check(codec, k, v, None, pad=4, buffer=buffer)


def test_encode_into_constant_and_zero_blocks():
    for value in (0.0, 1.0, -3.5, 1e4):
        k = torch.full((1, 2, 2, 8, 16), value)
        _check(KBitCodec(4, 8), k, k.clone(), None)


def test_encode_into_refuses_what_encode_refuses():
    codec = KBitCodec(4, 8)
    k = torch.randn(1, 1, 1, 8, 16) * 3e6
    out = {name: torch.empty_like(f) for name, f in codec.encode(k / 1e6, k / 1e6, _all_valid(k)).items()}
    with pytest.raises(StorageRangeError):
        codec.encode(k, k, _all_valid(k))
    with pytest.raises(StorageRangeError):
        codec.encode_into(k, k, None, out)
