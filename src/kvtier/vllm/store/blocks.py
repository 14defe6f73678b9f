"""One offloaded prefix block as a self-checking byte record: encode, decode, verify.

A block is the KV of ``T`` tokens over all ``L`` attention layers of a model, as the vLLM CPU
attention backend lays out one page per layer: ``kv: [L, H, 2, T, D]`` (``kv[:, :, 0]`` keys,
``kv[:, :, 1]`` values, in the model's dtype). A *record* is that block encoded by one codec:
a fixed header (format, codec, sink tokens, payload length, crc32 of the payload) followed by the
payload. The same bytes live in host RAM and in a block file, so a record read back from disk is
checked (header against the expected format, length, crc32) before anything trusts it.

Codecs: ``bits=None`` keeps the exact bytes; otherwise :class:`kvtier.codecs.KBitCodec`
(KIVI layout, optionally after the Hadamard rotation) over the whole block, with the first
``sink`` tokens of a sequence's first block also kept exact (and left out of the quantization
statistics). In an engine on kvtier's packed pages a block is each layer's page as the engine
holds it (``BlockFormat.page_bytes``), stored as it is (header codec byte ``PAGES``). May import
torch, ``kvtier.codecs``, ``kvtier.quant``, ``kvtier.errors``; never vLLM, transformers or
``kvtier.hf``.
"""

from __future__ import annotations

import math
import struct
import threading
import zlib
from dataclasses import dataclass, field

import torch

from ...codecs import KBitCodec
from ...errors import KVTierError
from ...quant import rotation, unpack_words

MAGIC = b"KVTB"
#: 2: blocks in canonical [L, H, 2, T, D] order whatever vLLM's page layout (version 1 records of the
#: lossy policies were encoded over the CPU kernels' transposed/tiled page order: read as misses)
VERSION = 2
#: magic, version, bits (0: exact), rotate, dtype code, sink tokens, L, H, T, D, value group, key
#: group, payload bytes, crc32 of the payload; padded to 48 bytes so the payload stays 8-byte aligned.
_HEADER = struct.Struct("<4sHBBBxHHHIHHHQI")
HEADER_BYTES = 48
_DTYPES = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}
#: the header's rotate byte of a packed-pages record (exact records: 0; rotated k-bit: 1)
PAGES = 2


class RecordCorrupt(KVTierError):
    """A block record that fails its checks (format, length or crc32): treat the block as a miss."""


@dataclass(frozen=True)
class BlockFormat:
    """Shape of one block: ``kv: [layers, heads, 2, tokens, head_dim]`` in ``dtype``; or, in an
    engine whose KV lives in kvtier's packed pages (``page_bytes > 0``), ``kv: [layers, page_bytes]``
    uint8, each layer's page as the engine holds it (already compressed: stored as it is)."""

    layers: int
    heads: int
    tokens: int
    head_dim: int
    dtype: torch.dtype
    page_bytes: int = field(default=0, repr=False)  # repr as before packed pages: store folder names stay

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
        p = self.page_bytes
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= 1 << 30:
            raise ValueError(f"BlockFormat.page_bytes={p!r} is not allowed: expected an int in 0..2**30")

    @property
    def shape(self) -> tuple[int, ...]:
        if self.page_bytes:
            return (self.layers, self.page_bytes)
        return (self.layers, self.heads, 2, self.tokens, self.head_dim)

    @property
    def kv_dtype(self) -> torch.dtype:
        """dtype of a block's tensor: the model's, or uint8 for packed pages."""
        return torch.uint8 if self.page_bytes else self.dtype

    @property
    def dense_bytes(self) -> int:
        """Bytes of the block's keys and values in the model dtype."""
        return self.layers * self.heads * 2 * self.tokens * self.head_dim * self.dtype.itemsize

    @property
    def exact_bytes(self) -> int:
        """Bytes of the block as vLLM holds it (the model dtype, or the packed pages)."""
        return self.layers * self.page_bytes if self.page_bytes else self.dense_bytes


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
        self._scratch = threading.local()

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A scratch tensor kept per thread (two fp32 copies of a block at most): a fresh one each
        call costs more in page faults than the arithmetic that fills it."""
        bufs = self._scratch.__dict__.setdefault("bufs", {})
        buf, numel = bufs.get((name, dtype)), math.prod(shape)
        if buf is None or buf.numel() < numel:  # encode and decode view the same buffers differently
            buf = bufs[(name, dtype)] = torch.empty(numel, dtype=dtype)  # (encode packs K and V apart)
        return buf[:numel].view(shape)

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
        if tuple(kv.shape) != f.shape or kv.dtype != f.kv_dtype:
            raise ValueError(f"block of shape {tuple(kv.shape)} {kv.dtype}: expected {f.shape} {f.kv_dtype}")
        if f.page_bytes and bits is not None:
            raise ValueError(f"bits={bits} is not allowed for packed pages: they are stored as they are (bits=None)")
        sink = min(sink, f.tokens)
        if bits is None or sink >= f.tokens:
            bits, rotate, sink, kg = None, False, 0, f.tokens
        else:
            kg = self.key_group(key_group)
        record = torch.empty(self.record_bytes(bits, rotate, sink, kg), dtype=torch.uint8)
        payload = record[HEADER_BYTES:]
        if bits is None:
            payload.view(f.kv_dtype).view(f.shape).copy_(kv)
        else:  # the fields are written in place, as views of the payload
            L, H, _, _, D = f.shape
            off = self.sink_bytes(sink)
            if sink:
                payload[:off].view(f.dtype).view(L, H, 2, sink, D).copy_(kv[:, :, :, :sink])
            out = {}
            for name, dtype, shape, n in self._layout(bits, rotate, kg):
                out[name] = payload[off : off + n].view(dtype).view(shape)
                off += n
            self._encode_fields(kv, bits, rotate, kg, sink, out)
        header = _HEADER.pack(
            MAGIC, VERSION, bits or 0, PAGES if f.page_bytes else int(rotate), _DTYPE_CODES[f.dtype], sink,
            f.layers, f.heads, f.tokens, f.head_dim, self.value_group, kg,
            payload.numel(), zlib.crc32(payload.numpy()),
        )  # fmt: skip
        record[:HEADER_BYTES].zero_()
        record[: _HEADER.size] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        return record

    def _encode_all_valid(self, kv: torch.Tensor, bits: int, rotate: bool, kg: int) -> dict[str, torch.Tensor]:
        """:meth:`_encode_fields` of a block whose tokens are all valid (no sink)."""
        return self._encode_fields(kv, bits, rotate, kg, 0)

    def _encode_fields(
        self,
        kv: torch.Tensor,
        bits: int,
        rotate: bool,
        kg: int,
        sink: int,
        out: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """``KBitCodec.encode`` of the block (the first ``sink`` tokens left out of the statistics) by
        :meth:`KBitCodec.encode_into` (the same fields byte for byte, ``tests/vllm/test_vllm_store.py``)
        into ``out`` (the fields of :meth:`_layout`; default new tensors), with this codec's per-thread
        scratch buffers."""
        L, H, _, T, D = kv.shape
        n = T // kg
        if out is None:
            out = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape, _ in self._layout(bits, rotate, kg)}
        valid = (torch.arange(T) >= sink).view(1, 1, n, kg).expand(L, 1, n, kg) if sink else None
        k, v = (kv[:, :, i].view(L, H, n, kg, D) for i in (0, 1))
        return self._codec(bits, rotate).encode_into(k, v, valid, out, self._buffer)

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
        if f.page_bytes:  # packed pages: stored as they are, and said so in the header
            if bits_ is not None or rotate != PAGES or sink:
                raise RecordCorrupt(f"record header (bits={bits}, rotate={rotate}) is not a packed-pages record")
            rotate = 0
        elif (
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
            kv = payload.view(f.kv_dtype).view(f.shape)
            return kv.clone() if out is None else out.copy_(kv)
        off = self.sink_bytes(sink)
        fields, at = {}, {}
        for name, dtype, shape, n in self._layout(bits, rotate, kg):
            fields[name], at[name] = payload[off : off + n].view(dtype).view(shape), off
            off += n
        out = torch.empty(f.shape, dtype=f.dtype) if out is None else out
        L, H, _, T, D = f.shape
        k_codes, v_codes = fields["k_codes"], fields["v_codes"]
        if at["v_codes"] == at["k_codes"] + k_codes.numel():  # adjacent in the payload: no copy
            codes = payload[at["k_codes"] : at["v_codes"] + v_codes.numel()].view(2, *k_codes.shape)
        else:
            codes = torch.stack([k_codes, v_codes])
        x = self._dequantize(codes, fields, bits, rotate)
        out.copy_(x.view(2, L, H, T, D).permute(1, 2, 0, 3, 4))
        if sink:
            L, H, _, _, D = f.shape
            out[:, :, :, :sink] = payload[: self.sink_bytes(sink)].view(f.dtype).view(L, H, 2, sink, D)
        return out

    def _decode_fields(self, f: dict[str, torch.Tensor], bits: int, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``KBitCodec.decode_keys`` / ``decode_values``: the same values (``tests/vllm/test_vllm_store.py``).
        Keys and values ``[L, H, n, g, D]`` in the block dtype."""
        x = self._dequantize(torch.stack([f["k_codes"], f["v_codes"]]), f, bits, rotate).to(self.fmt.dtype)
        return x[0], x[1]

    def _dequantize(self, codes: torch.Tensor, f: dict[str, torch.Tensor], bits: int, rotate: bool) -> torch.Tensor:
        """Keys and values ``[2, L, H, n, g, D]`` of packed ``codes: [2, L, H, n, g, packed]`` in one fp32
        buffer (un-rotated in one matmul), as ``KBitCodec`` computes them before the cast."""
        D, G = self.fmt.head_dim, self.value_group
        q = unpack_words(codes, bits, D, self._buffer)
        x = self._buffer("x", q.shape).copy_(q)
        L, H, n, g = x.shape[1:5]
        x[0].sub_(f["k_zero"].float()).mul_(f["k_scale"].float())
        xv = x[1].view(L, H, n, g, D // G, G)
        xv.sub_(f["v_zero"].unsqueeze(-1).float()).mul_(f["v_scale"].unsqueeze(-1).float())
        if rotate:
            y = self._buffer("y", x.shape)
            x = torch.mm(x.view(-1, D), rotation(D, x.device).T, out=y.view(-1, D)).view(x.shape)
        return x

    def step_down(self, record: torch.Tensor, bits: int, rotate: bool, key_group: int | None = None) -> torch.Tensor:
        """The record re-encoded with a smaller codec (the exact sink tokens stay exact)."""
        sink = self.info(record)[2]
        return self.encode(self.decode(record), bits, rotate, sink, key_group)
