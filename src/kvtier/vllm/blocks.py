"""One offloaded prefix block as a self-checking byte record: encode, decode, verify.

A block is the KV of ``T`` tokens over all ``L`` attention layers of a model, as the vLLM CPU
attention backend lays out one page per layer: ``kv: [L, H, 2, T, D]`` (``kv[:, :, 0]`` keys,
``kv[:, :, 1]`` values, in the model's dtype). A *record* is that block encoded by one codec:
a fixed header (format, codec, sink tokens, payload length, crc32 of the payload) followed by the
payload. The same bytes live in host RAM and in a block file, so a record read back from disk is
checked (header against the expected format, length, crc32) before anything trusts it.

Codecs: ``bits=None`` keeps the exact bytes; otherwise :class:`kvtier.cache.codecs.KBitCodec`
(KIVI layout, optionally after the Hadamard rotation) over the whole block, with the first
``sink`` tokens of a sequence's first block also kept exact (and left out of the quantization
statistics). May import torch, ``kvtier.cache.codecs``, ``kvtier.quant``, ``kvtier.errors``; never
vLLM, transformers or ``kvtier.hf``.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from ..cache.codecs import KBitCodec
from ..errors import KVTierError
from ..quant import dequantize_kbit, pack_bits, planes, quantize_kbit, rotation, unpack_bits

MAGIC = b"KVTB"
VERSION = 1
#: magic, version, bits (0: exact), rotate, dtype code, sink tokens, L, H, T, D, value group, key
#: group, payload bytes, crc32 of the payload; padded to 48 bytes so the payload stays 8-byte aligned.
_HEADER = struct.Struct("<4sHBBBxHHHIHHHQI")
HEADER_BYTES = 48
_DTYPES = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}


class RecordCorrupt(KVTierError):
    """A block record that fails its checks (format, length or crc32): treat the block as a miss."""


@dataclass(frozen=True)
class BlockFormat:
    """Shape of one block: ``kv: [layers, heads, 2, tokens, head_dim]`` in ``dtype``."""

    layers: int
    heads: int
    tokens: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "tokens", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
                raise ValueError(f"BlockFormat.{name}={value!r} is not allowed: expected an int in 1..2**20")
        if self.dtype not in _DTYPE_CODES:
            raise ValueError(
                f"BlockFormat.dtype={self.dtype} is not allowed: expected float16, bfloat16 or float32 "
                "(vLLM's kv_cache_dtype='auto')"
            )

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, self.heads, 2, self.tokens, self.head_dim)

    @property
    def exact_bytes(self) -> int:
        """Bytes of the block in the model dtype (what vLLM holds for it)."""
        return self.layers * self.heads * 2 * self.tokens * self.head_dim * self.dtype.itemsize


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``kvtier.quant.pack_bits`` (planes of 4/2/1 bits, each packed densely along the last axis, low
    bits first) written with strided slices instead of a broadcast shift per code: the same bytes
    (``tests/vllm/test_vllm_store.py``), 3-5x faster on the CPU."""
    if bits == 8 or codes.shape[-1] % 8:
        return pack_bits(codes, bits)
    out, offset = [], 0
    for w in planes(bits):
        per, mask = 8 // w, (1 << w) - 1
        plane = (codes >> offset) & mask if bits != w else codes
        packed = plane[..., 0::per].clone()
        for j in range(1, per):
            packed |= plane[..., j::per] << (j * w)
        out.append(packed)
        offset += w
    return torch.cat(out, dim=-1) if len(out) > 1 else out[0]


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack` (``kvtier.quant.unpack_bits``, same values)."""
    if bits == 8 or n % 8:
        return unpack_bits(packed, bits, n)
    codes, start, offset = None, 0, 0
    for w in planes(bits):
        per, mask = 8 // w, (1 << w) - 1
        chunk = packed[..., start : start + n // per]
        plane = torch.stack([(chunk >> (j * w)) & mask for j in range(per)], dim=-1).view(*chunk.shape[:-1], n)
        codes = plane if codes is None else codes | (plane << offset)
        start += n // per
        offset += w
    return codes


class BlockCodec:
    """Encodes ``kv: [L, H, 2, T, D]`` blocks of one :class:`BlockFormat` into records and back."""

    def __init__(self, fmt: BlockFormat, value_group: int = 64):
        self.fmt = fmt
        self.value_group = min(value_group, fmt.head_dim)
        if fmt.head_dim % self.value_group:
            raise ValueError(
                f"value_group={value_group} is not allowed for head_dim={fmt.head_dim}: expected a divisor"
            )
        self._layouts: dict[tuple[int, bool, int], list[tuple[str, torch.dtype, tuple[int, ...], int]]] = {}

    # --- sizes ------------------------------------------------------------------------------
    def _codec(self, bits: int, rotate: bool) -> KBitCodec:
        return KBitCodec(bits, self.value_group, rotate)

    def key_group(self, key_group: int | None) -> int:
        """Tokens per key group (``None``: the whole block); must divide the block's tokens."""
        g = self.fmt.tokens if key_group is None else min(key_group, self.fmt.tokens)
        if g < 1 or self.fmt.tokens % g:
            raise ValueError(
                f"key_group={key_group} is not allowed for {self.fmt.tokens}-token blocks: expected a divisor"
            )
        return g

    def _layout(self, bits: int, rotate: bool, kg: int) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
        """Fields of a ``bits``-bit payload: name, dtype, shape, bytes (fp16 fields first: aligned views)."""
        key = (bits, rotate, kg)
        if key not in self._layouts:
            L, H, _, T, D = self.fmt.shape
            n, g = T // kg, kg
            k = torch.zeros(L, H, n, g, D)
            fields = self._codec(bits, rotate).encode(k, k, torch.ones(L, 1, n, g, dtype=torch.bool))
            order = sorted(fields, key=lambda n: fields[n].dtype == torch.uint8)
            self._layouts[key] = [
                (n, fields[n].dtype, tuple(fields[n].shape), fields[n].numel() * fields[n].element_size())
                for n in order
            ]
        return self._layouts[key]

    def sink_bytes(self, sink: int) -> int:
        f = self.fmt
        return f.layers * f.heads * 2 * sink * f.head_dim * f.dtype.itemsize

    def record_bytes(self, bits: int | None, rotate: bool, sink: int, key_group: int | None = None) -> int:
        """Bytes of a record (header included) of this format and codec."""
        if bits is None or sink >= self.fmt.tokens:
            return HEADER_BYTES + self.fmt.exact_bytes
        kg = self.key_group(key_group)
        return HEADER_BYTES + self.sink_bytes(sink) + sum(n for *_, n in self._layout(bits, rotate, kg))

    # --- encode / decode --------------------------------------------------------------------
    @torch.no_grad()
    def encode(
        self, kv: torch.Tensor, bits: int | None, rotate: bool, sink: int = 0, key_group: int | None = None
    ) -> torch.Tensor:
        """Record of ``kv: [L, H, 2, T, D]`` (model dtype): uint8 ``[record_bytes]``.

        ``sink``: this many leading tokens stay exact (a sequence's first block); ``key_group``:
        tokens per key quantization group (``None``: the block).
        """
        f = self.fmt
        if tuple(kv.shape) != f.shape or kv.dtype != f.dtype:
            raise ValueError(f"block of shape {tuple(kv.shape)} {kv.dtype}: expected {f.shape} {f.dtype}")
        sink = min(sink, f.tokens)
        if bits is None or sink >= f.tokens:
            bits, rotate, sink, kg = None, False, 0, f.tokens
            parts = [kv.contiguous().view(torch.uint8).reshape(-1)]
        else:
            L, H, _, T, D = f.shape
            kg = self.key_group(key_group)
            if sink:
                n, g = T // kg, kg
                valid = (torch.arange(T) >= sink).view(n, g).expand(L, 1, n, g)
                k, v = (kv[:, :, i].reshape(L, H, n, g, D) for i in (0, 1))
                fields = self._codec(bits, rotate).encode(k, v, valid)
            else:
                fields = self._encode_all_valid(kv, bits, rotate, kg)
            parts = [fields[n].contiguous().view(torch.uint8).reshape(-1) for n, *_ in self._layout(bits, rotate, kg)]
            if sink:
                parts.insert(0, kv[:, :, :, :sink].contiguous().view(torch.uint8).reshape(-1))
        payload = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        header = _HEADER.pack(
            MAGIC, VERSION, bits or 0, int(rotate), _DTYPE_CODES[f.dtype], sink,
            f.layers, f.heads, f.tokens, f.head_dim, self.value_group, kg,
            payload.numel(), zlib.crc32(payload.numpy()),
        )  # fmt: skip
        head = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        head[: _HEADER.size] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        return torch.cat([head, payload])

    def _encode_all_valid(self, kv: torch.Tensor, bits: int, rotate: bool, kg: int) -> dict[str, torch.Tensor]:
        """``KBitCodec.encode`` of a block whose tokens are all valid, without the validity masks
        (3x cheaper statistics; the same fields, byte for byte: ``tests/vllm/test_store.py``)."""
        L, H, _, T, D = kv.shape
        G, n, g = self.value_group, T // kg, kg
        k, v = (kv[:, :, i].reshape(L, H, n, g, D) for i in (0, 1))
        if rotate:
            r = rotation(D, kv.device)
            k, v = k.float() @ r, v.float() @ r
        kq, ks, kz = quantize_kbit(k, bits, dim=3)
        vq, vs, vz = quantize_kbit(v.reshape(L, H, n, g, D // G, G), bits, dim=5)
        return {
            "k_codes": _pack(kq, bits),
            "k_scale": ks,
            "k_zero": kz,
            "v_codes": _pack(vq.reshape(L, H, n, g, D), bits),
            "v_scale": vs.squeeze(-1),
            "v_zero": vz.squeeze(-1),
        }

    def info(self, record: torch.Tensor) -> tuple[int | None, bool, int, int]:
        """``(bits, rotate, sink, key_group)`` of a record, after checking its header against this format
        and its length; raises :class:`RecordCorrupt` (the crc is checked by :meth:`verify`)."""
        if record.dtype != torch.uint8 or record.dim() != 1 or record.numel() < HEADER_BYTES:
            raise RecordCorrupt(f"record of {record.numel()} bytes is shorter than its {HEADER_BYTES}-byte header")
        magic, version, bits, rotate, dcode, sink, L, H, T, D, G, KG, n, _ = _HEADER.unpack(
            record[: _HEADER.size].numpy().tobytes()
        )
        f = self.fmt
        got = (magic, version, _DTYPES.get(dcode), L, H, T, D, G)
        want = (MAGIC, VERSION, f.dtype, f.layers, f.heads, f.tokens, f.head_dim, self.value_group)
        if got != want:
            raise RecordCorrupt(f"record header {got} does not match the expected format {want}")
        bits_ = bits or None
        if (
            (bits_ is not None and bits_ not in (2, 3, 4, 6, 8))
            or rotate > 1
            or (bits_ is not None and sink >= T)
            or not 1 <= KG <= T
            or T % KG
        ):
            raise RecordCorrupt(f"record header names an unknown codec (bits={bits}, rotate={rotate}, sink={sink})")
        if record.numel() != HEADER_BYTES + n or n != self.record_bytes(bits_, bool(rotate), sink, KG) - HEADER_BYTES:
            raise RecordCorrupt(f"record holds {record.numel()} bytes, its header says {HEADER_BYTES + n}")
        return bits_, bool(rotate), sink, KG

    def verify(self, record: torch.Tensor) -> tuple[int | None, bool, int, int]:
        """:meth:`info` plus the crc32 of the payload; raises :class:`RecordCorrupt`."""
        out = self.info(record)
        crc = _HEADER.unpack(record[: _HEADER.size].numpy().tobytes())[-1]
        if zlib.crc32(record[HEADER_BYTES:].numpy()) != crc:
            raise RecordCorrupt("record payload fails its crc32 check")
        return out

    @torch.no_grad()
    def decode(self, record: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``kv: [L, H, 2, T, D]`` (model dtype) of a record (checked by :meth:`info`, not the crc)."""
        bits, rotate, sink, kg = self.info(record)
        f = self.fmt
        payload = record[HEADER_BYTES:]
        if bits is None:
            kv = payload.view(f.dtype).view(f.shape)
            return kv.clone() if out is None else out.copy_(kv)
        off = self.sink_bytes(sink)
        fields = {}
        for name, dtype, shape, n in self._layout(bits, rotate, kg):
            fields[name] = payload[off : off + n].view(dtype).view(shape)
            off += n
        out = torch.empty(f.shape, dtype=f.dtype) if out is None else out
        L, H, _, T, D = f.shape
        k, v = self._decode_fields(fields, bits, rotate)
        out[:, :, 0] = k.view(L, H, T, D)
        out[:, :, 1] = v.view(L, H, T, D)
        if sink:
            L, H, _, _, D = f.shape
            out[:, :, :, :sink] = payload[: self.sink_bytes(sink)].view(f.dtype).view(L, H, 2, sink, D)
        return out

    def _decode_fields(self, f: dict[str, torch.Tensor], bits: int, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``KBitCodec.decode_keys`` / ``decode_values`` with the strided unpack of :func:`_unpack`: the same values
        (``tests/vllm/test_vllm_store.py``). Keys and values ``[L, H, n, g, D]`` in the block dtype."""
        D, G, dtype = self.fmt.head_dim, self.value_group, self.fmt.dtype
        out = torch.float32 if rotate else dtype
        k = dequantize_kbit(_unpack(f["k_codes"], bits, D), f["k_scale"], f["k_zero"], out)
        vq = _unpack(f["v_codes"], bits, D)
        shape = vq.shape
        vq = vq.view(*shape[:-1], D // G, G)
        v = dequantize_kbit(vq, f["v_scale"].unsqueeze(-1), f["v_zero"].unsqueeze(-1), out).view(shape)
        if rotate:
            r = rotation(D, k.device).T
            k, v = (k @ r).to(dtype), (v @ r).to(dtype)
        return k, v

    def step_down(self, record: torch.Tensor, bits: int, rotate: bool, key_group: int | None = None) -> torch.Tensor:
        """The record re-encoded with a smaller codec (the exact sink tokens stay exact)."""
        sink = self.info(record)[2]
        return self.encode(self.decode(record), bits, rotate, sink, key_group)
