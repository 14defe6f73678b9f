"""Unit tests of the prefix store without an engine: records, budget and step-down, block files."""

import pytest

# "vllm.v1", not "vllm": without vLLM, tests/vllm itself would import as a namespace package "vllm"
pytest.importorskip("vllm.v1")

import json  # noqa: E402

import torch  # noqa: E402

from kvtier.codecs import KBitCodec  # noqa: E402
from kvtier.vllm import (  # noqa: E402
    POLICIES,
    BlockCodec,
    BlockFormat,
    PrefixStore,
    RecordCorrupt,
    StoreConfig,
    StorePolicy,
    get_store_policy,
    kv_transfer_config,
)

SMALL = BlockFormat(layers=2, heads=3, tokens=32, head_dim=64, dtype=torch.bfloat16)
SMOL = BlockFormat(layers=30, heads=3, tokens=128, head_dim=64, dtype=torch.bfloat16)  # SmolLM2-135M


def block(fmt: BlockFormat, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(fmt.shape, generator=g).to(fmt.dtype)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


@pytest.mark.parametrize(
    "bits,rotate,sink", [(None, False, 0), (4, False, 0), (4, False, 5), (3, True, 0), (8, False, 31)]
)
def test_record_round_trip(bits, rotate, sink):
    codec = BlockCodec(SMALL)
    kv = block(SMALL, 0)
    rec = codec.encode(kv, bits, rotate, sink)
    assert rec.numel() == codec.record_bytes(bits, rotate, sink)
    assert codec.verify(rec)[:3] == (bits, rotate, sink if bits else 0)
    out = codec.decode(rec)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    if bits is None:
        assert torch.equal(out, kv)
        return
    assert torch.equal(out[:, :, :, :sink], kv[:, :, :, :sink])  # sinks stay exact
    err = (out.float() - kv.float()).abs()[:, :, :, sink:]
    rng = kv.float().abs().amax()
    assert err.max() <= 0.75 * 2 * rng / (2**bits - 1) * (4 if rotate else 1)


def test_all_valid_path_matches_kbit_codec_bytes():
    codec = BlockCodec(SMALL)
    kv = block(SMALL, 1)
    valid = torch.ones(SMALL.layers, 1, 1, SMALL.tokens, dtype=torch.bool)
    for bits, rotate in [(4, False), (3, True), (2, False)]:
        fast = codec._encode_all_valid(kv, bits, rotate, SMALL.tokens)
        ref = KBitCodec(bits, 64, rotate).encode(kv[:, :, 0:1], kv[:, :, 1:2], valid)
        assert all(torch.equal(fast[n], ref[n]) for n in ref)


@pytest.mark.parametrize("fmt", [SMALL, SMOL, BlockFormat(2, 2, 64, 128, torch.float16)], ids=["small", "smol", "fp16"])
def test_fused_encode_with_sinks_and_key_groups_matches_kbit_codec_bytes(fmt):
    """The fused path (one fp32 buffer for keys and values, sinks out of the statistics) gives
    ``KBitCodec.encode``'s fields byte for byte, and decodes to ``KBitCodec``'s values."""
    codec = BlockCodec(fmt)
    kv = block(fmt, 4) * torch.linspace(0.1, 4, fmt.head_dim).to(fmt.dtype)
    L, H, _, T, D = fmt.shape
    cases = [(3, True, 0, 64), (3, True, 32, 64), (4, False, 5, T), (2, False, T // 2 + 3, T // 4), (6, True, 1, 32)]
    for bits, rotate, sink, kg in cases:
        kg = min(kg, T)
        n = T // kg
        valid = (torch.arange(T) >= sink).view(n, kg).expand(L, 1, n, kg)
        k, v = (kv[:, :, i].reshape(L, H, n, kg, D) for i in (0, 1))
        ref = KBitCodec(bits, 64, rotate).encode(k, v, valid)
        fast = codec._encode_fields(kv, bits, rotate, kg, sink)
        assert all(torch.equal(fast[name], ref[name]) for name in ref), (bits, rotate, sink, kg)
        rk, rv = KBitCodec(bits, 64, rotate).decode(ref, D, fmt.dtype)
        out = codec.decode(codec.encode(kv, bits, rotate, sink, kg))
        assert torch.equal(out[:, :, 0, sink:], rk.reshape(L, H, T, D)[:, :, sink:]), (bits, rotate, sink, kg)
        assert torch.equal(out[:, :, 1, sink:], rv.reshape(L, H, T, D)[:, :, sink:]), (bits, rotate, sink, kg)


def test_fast_pack_and_decode_match_kvtier_quant():
    from kvtier.quant import pack_bits, pack_words, unpack_words

    for bits in range(1, 9):
        for shape in [(3, 5, 64), (7, 8), (2, 24)]:
            codes = torch.randint(0, 1 << bits, shape, dtype=torch.uint8)
            packed = pack_words(codes, bits)
            assert torch.equal(packed, pack_bits(codes, bits)), (bits, shape)
            assert torch.equal(unpack_words(packed, bits, shape[-1]), codes), (bits, shape)
            for k in (1, 2):  # packed bytes at an offset not aligned to the planes' word size
                flat = torch.zeros(packed.numel() + k, dtype=torch.uint8)
                flat[k:] = packed.reshape(-1)
                assert torch.equal(unpack_words(flat[k:].view(packed.shape), bits, shape[-1]), codes), (bits, shape, k)
    codec = BlockCodec(SMALL)
    kv = block(SMALL, 3)
    L, H, _, T, D = SMALL.shape
    for bits, rotate in [(4, False), (4, True), (3, True), (2, False)]:
        fields = KBitCodec(bits, 64, rotate).encode(
            kv[:, :, 0:1], kv[:, :, 1:2], torch.ones(L, 1, 1, T, dtype=torch.bool)
        )
        k, v = codec._decode_fields(fields, bits, rotate)
        ref = KBitCodec(bits, 64, rotate)
        assert torch.equal(k, ref.decode_keys(fields, D, SMALL.dtype))
        assert torch.equal(v, ref.decode_values(fields, D, SMALL.dtype))


def test_sizes_against_bf16():
    codec = BlockCodec(SMOL)
    ratio = {(b, r): codec.record_bytes(b, r, 0, g) / SMOL.exact_bytes for b, r, g in [(4, False, 128), (3, True, 64)]}
    assert ratio[(4, False)] <= 0.28 and ratio[(3, True)] <= 0.22
    # a 23-block prefix with a 32-token exact sink in its first block
    prefix = (codec.record_bytes(4, False, 32) + 22 * codec.record_bytes(4, False, 0)) / (23 * SMOL.exact_bytes)
    assert prefix <= 0.30


def test_verify_rejects_corruption_truncation_and_other_formats():
    codec = BlockCodec(SMALL)
    rec = codec.encode(block(SMALL, 2), 4, False, 0)
    bad = rec.clone()
    bad[-7] ^= 0x10
    with pytest.raises(RecordCorrupt, match="crc32"):
        codec.verify(bad)
    with pytest.raises(RecordCorrupt, match="bytes"):
        codec.verify(rec[:-1].clone())
    with pytest.raises(RecordCorrupt, match="header"):
        codec.verify(rec[:10].clone())
    other = BlockCodec(BlockFormat(2, 3, 32, 64, torch.float16))
    with pytest.raises(RecordCorrupt, match="format"):
        other.verify(rec)


def test_store_put_lookup_pin_read():
    store = PrefixStore(get_store_policy("default"), SMALL, cpu_bytes=1 << 20)
    try:
        assert store.lookup(key(1)) == "miss"
        assert store.reserve([key(1), key(2)], [5, 0]) == [key(1), key(2)]
        assert store.lookup(key(1)) == "pending"
        assert store.reserve([key(1)], [5]) == []  # already held
        kv1, kv2 = block(SMALL, 1), block(SMALL, 2)
        store.put(key(1), kv1)
        store.put(key(2), kv2)
        assert store.lookup(key(1)) == "hit"
        store.pin([key(1)])
        out = store.read(key(1))
        assert torch.equal(out[:, :, :, :5], kv1[:, :, :, :5])
        store.unpin([key(1)])
        assert store.ram_bytes == store.record_bytes(0, 5) + store.record_bytes(0, 0)
        with pytest.raises(Exception, match="not a hit"):
            store.pin([key(3)])
    finally:
        store.close()


def fill(store: PrefixStore, fmt: BlockFormat, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        for k in store.reserve([key(i)], [0]):
            store.put(k, block(fmt, i))
            store.flush()  # step-down jobs of the reservation
        store.maintain()
        store.flush()


def held(store: PrefixStore) -> int:
    return sum(store.stats()["blocks"].get(n, 0) for n in ("exact", "int4", "int3-rot", "int8"))


def test_capacity_at_fixed_bytes_default_vs_exact():
    budget = 6 * BlockCodec(SMOL).record_bytes(None, False, 0)  # six exact blocks of SmolLM2
    exact = PrefixStore(get_store_policy("exact"), SMOL, budget)
    default = PrefixStore(get_store_policy("default"), SMOL, budget)
    try:
        fill(exact, SMOL, 8)
        fill(default, SMOL, 40)
        assert held(exact) == 6 and exact.ram_bytes <= budget
        assert default.ram_bytes <= budget
        assert held(default) >= 3.5 * held(exact), default.stats()
    finally:
        exact.close()
        default.close()


def test_step_down_order_then_eviction():
    fmt = SMALL
    codec = BlockCodec(fmt)
    b4, b3 = codec.record_bytes(4, False, 0), codec.record_bytes(3, True, 0, 64)
    store = PrefixStore(get_store_policy("default"), fmt, cpu_bytes=10 * b4)
    try:
        fill(store, fmt, 10)
        assert store.stats()["blocks"] == {"int4": 10}
        fill(store, fmt, 1, start=10)  # one over: the oldest step down to 3-bit, just enough; nothing leaves
        need = -(-b4 // (b4 - b3))
        levels = [store._entries[key(i)].level for i in range(11)]
        assert levels == [1] * need + [0] * (11 - need)
        assert store.stats().get("evicted", 0) == 0 and store.ram_bytes <= 10 * b4
        fill(store, fmt, 30, start=11)  # far over: every block 3-bit first, then the oldest leave
        st = store.stats()
        assert st["evicted"] > 0 and store.ram_bytes <= 10 * b4
        assert store.lookup(key(40)) == "hit" and store.lookup(key(0)) == "miss"
        assert held(store) == (10 * b4) // b3
    finally:
        store.close()


def test_pinned_blocks_are_not_evicted():
    codec = BlockCodec(SMALL)
    store = PrefixStore(get_store_policy("exact"), SMALL, cpu_bytes=2 * codec.record_bytes(None, False, 0))
    try:
        fill(store, SMALL, 2)
        store.pin([key(0)])
        fill(store, SMALL, 3, start=2)
        assert store.lookup(key(0)) == "hit"
        store.unpin([key(0)])
        fill(store, SMALL, 2, start=5)
        assert store.lookup(key(0)) == "miss"
    finally:
        store.close()


def test_disk_write_through_restart_and_damaged_files(tmp_path):
    policy = get_store_policy("default")
    store = PrefixStore(policy, SMALL, cpu_bytes=1 << 20, disk_path=tmp_path, namespace="ns")
    kvs = {i: block(SMALL, i) for i in range(4)}
    for i, kv in kvs.items():
        (k,) = store.reserve([key(i)], [0])
        store.put(k, kv)
    expected = {i: store.read(key(i)) for i in kvs}
    store.close()
    files = sorted((tmp_path / "ns").glob("*.kvb"))
    assert len(files) == 4
    # damage: flip a byte, truncate, delete
    data = bytearray(store.path(key(1)).read_bytes())
    data[len(data) // 2] ^= 1
    store.path(key(1)).write_bytes(bytes(data))
    with open(store.path(key(2)), "r+b") as fh:
        fh.truncate(100)
    store.path(key(3)).unlink()
    again = PrefixStore(policy, SMALL, cpu_bytes=1 << 20, disk_path=tmp_path, namespace="ns")
    try:
        assert [again.lookup(key(i)) for i in range(4)] == ["hit", "miss", "miss", "miss"]
        assert again.stats()["corrupt"] == 2
        assert not again.path(key(1)).exists() and not again.path(key(2)).exists()  # removed: stored anew later
        again.pin([key(0)])
        assert torch.equal(again.read(key(0)), expected[0])
        again.unpin([key(0)])
        assert again.ram_bytes == again.record_bytes(0, 0)  # a disk hit is promoted to RAM where it has room
        assert again.lookup(key(0)) == "hit"
        again.maintain()
        assert again._entries[key(0)].record is not None and again.stats()["disk_hits"] == 1
    finally:
        again.close()


def test_disk_blocks_leave_ram_instead_of_eviction(tmp_path):
    codec = BlockCodec(SMALL)
    store = PrefixStore(
        get_store_policy("chat"), SMALL, cpu_bytes=2 * codec.record_bytes(4, False, 0), disk_path=tmp_path
    )
    try:
        fill(store, SMALL, 6)
        st = store.stats()
        assert st.get("evicted", 0) == 0 and st["to_disk"] == 4 and st["blocks"] == {"int4": 2, "disk": 4}
        assert all(store.lookup(key(i)) == "hit" for i in range(6))
    finally:
        store.close()


def test_policy_validation_one_line_errors():
    with pytest.raises(ValueError, match=r"StorePolicy.bits=5 is not allowed"):
        StorePolicy(bits=5)
    with pytest.raises(ValueError, match=r"cold_bits=4 is not allowed with bits=4"):
        StorePolicy(bits=4, cold_bits=4)
    with pytest.raises(ValueError, match=r"sink_tokens=-1"):
        StorePolicy(sink_tokens=-1)
    with pytest.raises(ValueError, match="unknown kvtier vLLM store policy 'fast'"):
        kv_transfer_config("fast")
    with pytest.raises(ValueError, match="cpu_bytes=0 is not allowed"):
        kv_transfer_config("default", cpu_bytes=0)
    for name in POLICIES:
        assert isinstance(get_store_policy(name), StorePolicy)


def test_kv_transfer_config_round_trips_through_json():
    cfg = kv_transfer_config("default", cpu_bytes=1 << 30, disk_path="/tmp/x")
    assert cfg.kv_connector == "OffloadingConnector"
    extra = cfg.kv_connector_extra_config
    assert extra["spec_module_path"] == "kvtier.vllm.store.spec"
    assert StoreConfig.from_extra(extra) == StoreConfig("default", 1 << 30, "/tmp/x")
    text = kv_transfer_config(StorePolicy(bits=6, cold_bits=None), cpu_bytes=1 << 30, as_json=True)
    back = StoreConfig.from_extra(json.loads(text)["kv_connector_extra_config"])
    assert back.store_policy == StorePolicy(bits=6, cold_bits=None)


def test_import_kvtier_vllm_pulls_no_transformers_adapter():
    import subprocess
    import sys

    code = (
        "import sys, kvtier; assert 'vllm' not in sys.modules and 'kvtier.vllm' not in sys.modules; "
        "import kvtier.vllm, kvtier.vllm.store.spec; "
        "assert not [m for m in sys.modules if m.startswith('kvtier.hf')], 'kvtier.hf imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_manager_reports_the_stores_counters_as_vllm_metrics(tmp_path):
    from kvtier.vllm.store.slots import SlotArea
    from kvtier.vllm.store.spec import STORE_COUNTERS, KVTierManager, KVTierOffloadingSpec

    defined = KVTierOffloadingSpec.build_metric_definitions({})
    assert {name for name, _ in STORE_COUNTERS.values()} <= set(defined) and "vllm:kvtier_store_ram_bytes" in defined
    store = PrefixStore(get_store_policy("default"), SMALL, cpu_bytes=1 << 20)
    area = SlotArea.create(SMALL, 4 * SMALL.exact_bytes, {}, directory=tmp_path)
    try:
        manager = KVTierManager(store, area, SMALL.tokens)
        for k in store.reserve([key(1), key(2)], [0, 0]):
            store.put(k, block(SMALL, 1))
        store.lookup(key(1))
        store.lookup(key(3))
        first = manager.get_stats().reduce()
        assert first["vllm:kvtier_store_blocks_stored"] == 2 and first["vllm:kvtier_store_lookup_hits"] == 1
        assert first["vllm:kvtier_store_lookup_misses"] == 1 and first["vllm:kvtier_store_encode_seconds"] > 0
        assert first["vllm:kvtier_store_ram_bytes"] == store.ram_bytes > 0
        assert set(first) <= set(defined)
        store.lookup(key(2))
        second = manager.get_stats().reduce()  # what happened since the last call only
        assert second == {"vllm:kvtier_store_lookup_hits": 1, "vllm:kvtier_store_ram_bytes": store.ram_bytes}
    finally:
        store.close()


@pytest.mark.parametrize(
    "heads,head_dim,dtype",
    [(3, 64, torch.bfloat16), (2, 128, torch.bfloat16), (1, 256, torch.bfloat16), (2, 128, torch.float32)],
)
def test_page_layout_finds_where_vllms_cpu_kernels_keep_each_element(heads, head_dim, dtype):
    """The store's records are [H, 2, T, D]; vLLM's CPU pages are in its kernels' order (keys
    transposed or in AMX tiles). Keys and values written by vLLM's own op into a block come back in
    canonical order through ``page_layout``, and a block written back through it reads the same
    in vLLM's order (before the fix the page bytes were read as [H, 2, T, D] as they lay)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvtier.vllm.store.spec import page_layout

    tokens = 128
    g = torch.Generator().manual_seed(heads * head_dim)
    k = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    v = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    cache = torch.zeros(3, heads, tokens, 2 * head_dim, dtype=dtype)
    kc, vc = cache.view(3, heads, 2 * tokens, head_dim).chunk(2, dim=2)
    isa = _get_attn_isa(dtype, tokens, head_dim, "auto")
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(2 * tokens, 3 * tokens), isa)
    perm = page_layout(heads, tokens, head_dim, dtype)
    page = cache[2].flatten()
    kv = page if perm is None else page[perm]
    expected = torch.stack([k.transpose(0, 1), v.transpose(0, 1)], dim=1)  # [H, 2, T, D]
    assert torch.equal(kv.view(heads, 2, tokens, head_dim), expected)
    back = torch.zeros_like(page)
    if perm is None:
        back.copy_(expected.flatten())
    else:
        back.index_copy_(0, perm, expected.flatten())
    assert torch.equal(back, page)


class _Ctx:
    """A request context whose keys are not a sequence's first block (no sinks)."""

    def get_offload_key_position(self, key: bytes) -> None:
        return None


def test_manager_moves_blocks_through_slots_and_never_overcommits_them(tmp_path):
    """The scheduler side alone: stores take at most half the slots and forget what they cannot
    take; hits beyond the free slots are misses; two requests loading one block share its slot;
    a reset keeps the slots of discarded jobs out of use for a few steps."""
    from kvtier.vllm.store.slots import QUARANTINE_STEPS, SlotArea
    from kvtier.vllm.store.spec import KVTierManager

    store = PrefixStore(get_store_policy("exact"), SMALL, cpu_bytes=1 << 30)
    area = SlotArea.create(SMALL, 4 * SMALL.exact_bytes, {}, directory=tmp_path)
    manager, ctx = KVTierManager(store, area, SMALL.tokens), _Ctx()
    try:
        out = manager.prepare_store([key(i) for i in range(3)], ctx)
        assert out.keys_to_store == [key(0), key(1)] and len(set(out.store_spec.slots)) == 2
        assert store.lookup(key(2)) == "miss" and store.lookup(key(0)) == "pending"
        for i, slot in enumerate(out.store_spec.slots):  # what the workers copy
            area.slot(slot).copy_(block(SMALL, i))
        manager.complete_store(out.keys_to_store, ctx)
        store.flush()
        assert manager.pool.free == 4
        manager.on_schedule_end(None)
        assert [manager.lookup(key(i), ctx).name for i in (0, 1, 0)] == ["HIT", "HIT", "HIT"]
        spec = manager.prepare_load([key(0), key(1)], ctx)
        again = manager.prepare_load([key(0)], ctx)  # a second request on the same prefix
        assert again.slots == spec.slots[:1] and manager.pool.free == 2
        assert torch.equal(area.slot(spec.slots[1]), block(SMALL, 1))
        manager.on_schedule_end(None)
        manager.complete_load([key(0), key(1)], ctx)
        assert manager.pool.free == 3  # key 0 is still loading for the other request
        manager.complete_load([key(0)], ctx)
        assert manager.pool.free == 4
        for k in range(4, 8):  # fills RAM with more blocks to hit
            manager.complete_store(manager.prepare_store([key(k)], ctx).keys_to_store, ctx)
            store.flush()
        manager.on_schedule_end(None)
        found = [manager.lookup(key(k), ctx).name for k in (0, 1, 4, 5, 6)]
        assert found == ["HIT"] * 4 + ["MISS"] and store.counters["slots_short"] == 1  # 4 slots
        manager.on_schedule_end(None)
        pending = manager.prepare_store([key(9)], ctx)
        loading = manager.prepare_load([key(0)], ctx)
        assert manager.pool.free == 2
        manager.reset_cache()  # vLLM discards both jobs: their completions never come
        for _ in range(QUARANTINE_STEPS - 1):
            manager.on_schedule_end(None)
            assert manager.pool.free == 2
        manager.on_schedule_end(None)
        assert manager.pool.free == 4 and pending.keys_to_store and loading.slots
    finally:
        store.close()
