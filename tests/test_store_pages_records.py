"""Prefix-store records of an engine on kvtier's packed pages (no vLLM needed): a block is each
layer's packed page as the engine holds it, stored as it is, checked like every record, and told
apart from the records of a model-dtype format."""

from __future__ import annotations

import pytest
import torch

from kvtier.codecs.pages import PageFormat
from kvtier.vllm.pages.policy import get_page_policy
from kvtier.vllm.store.blocks import HEADER_BYTES, BlockCodec, BlockFormat, RecordCorrupt
from kvtier.vllm.store.policy import get_store_policy
from kvtier.vllm.store.prefix import PrefixStore

PAGE = PageFormat(get_page_policy("default"), 2, 128, torch.bfloat16).page_bytes
FMT = BlockFormat(layers=3, heads=2, tokens=128, head_dim=128, dtype=torch.bfloat16, page_bytes=PAGE)
DENSE = BlockFormat(layers=3, heads=2, tokens=128, head_dim=128, dtype=torch.bfloat16)


def pages(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, FMT.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def test_format_sizes():
    assert FMT.shape == (3, PAGE) and FMT.kv_dtype == torch.uint8
    assert FMT.exact_bytes == 3 * PAGE and FMT.dense_bytes == DENSE.exact_bytes
    assert FMT.exact_bytes < 0.3 * FMT.dense_bytes  # 4-bit pages
    assert repr(FMT) == repr(DENSE)  # store folder names of model-dtype formats did not change
    with pytest.raises(ValueError, match="page_bytes"):
        BlockFormat(3, 2, 128, 128, torch.bfloat16, page_bytes=-1)


def test_round_trip_is_the_bytes_and_checked():
    codec = BlockCodec(FMT)
    kv = pages(0)
    record = codec.encode(kv, None, False)
    assert record.numel() == HEADER_BYTES + FMT.exact_bytes
    assert codec.verify(record) == (None, False, 0, 128)
    assert torch.equal(codec.decode(record), kv)
    with pytest.raises(ValueError, match="stored as they are"):
        codec.encode(kv, 4, False)
    bad = record.clone()
    bad[-1] ^= 1
    with pytest.raises(RecordCorrupt, match="crc32"):
        codec.verify(bad)


def test_pages_and_model_dtype_records_are_told_apart():
    """Same L, H, T, D and dtype in the header: the header's codec byte and the length tell them apart."""
    page_record = BlockCodec(FMT).encode(pages(1), None, False)
    dense_record = BlockCodec(DENSE).encode(torch.randn(DENSE.shape).to(torch.bfloat16), None, False)
    with pytest.raises(RecordCorrupt):
        BlockCodec(DENSE).info(page_record)
    with pytest.raises(RecordCorrupt):
        BlockCodec(FMT).info(dense_record)


def test_store_keeps_pages_in_ram_and_on_disk(tmp_path):
    store = PrefixStore(get_store_policy("exact"), FMT, cpu_bytes=1 << 22, disk_path=tmp_path, namespace="ns")
    try:
        for i in range(3):
            for k in store.reserve([key(i)], [0]):
                store.put(k, pages(i))
        assert all(torch.equal(store.read(key(i)), pages(i)) for i in range(3))
        store.flush()
        assert "as the engine's packed pages" in store.describe()
    finally:
        store.close()
    again = PrefixStore(get_store_policy("exact"), FMT, cpu_bytes=1 << 22, disk_path=tmp_path, namespace="ns")
    try:
        assert again.lookup(key(2)) == "hit"
        assert torch.equal(again.read(key(2)), pages(2))
    finally:
        again.close()
