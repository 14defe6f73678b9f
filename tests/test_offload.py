"""Cold-tier offload: the block store (RAM and disk), checksums and clean-up, beam-safe block tables,
sketch-based selection with exact attention over the fetched blocks, prefetch accounting, generation,
and the resident / offloaded memory split against the planner."""

from __future__ import annotations

import errno
import gc
import os
import warnings

import pytest
import torch

import kvtier
from builders import mask_for, off_policy, offload_layer
from conftest import tiny_llama
from kvtier import OffloadError, OffloadPolicy, TieredCache, TierPolicy
from kvtier.attention.plan import plan_for
from kvtier.attention.reference import reference_attention
from kvtier.attention.tiered import tiered_attention
from kvtier.diagnostics import reachable_tensor_bytes
from kvtier.hf.layer import TieredLayer
from kvtier.offload.records import RecordLayout
from kvtier.offload.sketch import KeySketch, block_lse, block_lse_torch, expand, unpack_valid
from kvtier.offload.store import BlockStore, RecordError, readahead, slab_sizes, store_capacity
from kvtier.quant import pack_bits, rotation
from kvtier.sizing import ModelShape, estimate


def exact_reference(keys, values, valid, query, scaling):
    """Plain causal attention over all tokens in fp64: ``[B, q, Hq, D]``."""
    B, Hq, q, D = query.shape
    H = keys.shape[1]
    N = keys.shape[2]
    k = keys.double().repeat_interleave(Hq // H, 1)
    v = values.double().repeat_interleave(Hq // H, 1)
    s = (query.double() * scaling) @ k.transpose(-1, -2)
    causal = torch.arange(N)[None, :] <= (N - q + torch.arange(q))[:, None]
    allowed = causal[None, None] & valid[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1).nan_to_num(0.0) @ v).transpose(1, 2)


# --- store ------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpu", "disk"])
def test_store_round_trip_and_ids(backend, tmp_path):
    store = BlockStore(40, backend, str(tmp_path), name="t")
    g = torch.Generator().manual_seed(0)
    ids = store.allocate(50)  # crosses slabs (16, 16, 16, 16)
    assert ids.tolist() == list(range(50)) and store.capacity == store_capacity(50, 40) == 64
    data = torch.randint(0, 256, (50, 40), dtype=torch.uint8, generator=g)
    store.write(ids, data)
    order = torch.randperm(50, generator=g)
    assert torch.equal(store.read(ids[order]), data[order])
    store.drop_page_cache()  # disk: pages written back and dropped; the data reads back from the files
    assert torch.equal(store.read(ids[order]), data[order])
    store.free(torch.tensor([3, 17, 5]))
    assert store.live == 47
    assert store.allocate(2).tolist() == [3, 5]  # lowest free ids first
    with pytest.raises(RecordError, match=r"\[17\]"):
        store.read(torch.tensor([17]))  # freed: missing
    assert store.nbytes == 64 * 40
    if backend == "disk":
        assert len(store.files()) == 4 and all(os.path.getsize(f) == 16 * 40 for f in store.files())
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_store_file_ranges_and_readahead(tmp_path):
    """The byte ranges of records (sorted, adjacent records merged, per slab file) that the step's
    readahead queues; the records read back the same after it."""
    store = BlockStore(40, "disk", str(tmp_path), name="t")
    ids = store.allocate(40)  # slabs of 16, 16, 16
    data = torch.randint(0, 256, (40, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    store.write(ids, data)
    want = torch.tensor([20, 3, 4, 5, 15, 16, 17, 39, 4])
    got = store.file_ranges(want)
    f = store.files()
    assert got == [
        (f[0], 3 * 40, 3 * 40),
        (f[0], 15 * 40, 40),
        (f[1], 0, 2 * 40),
        (f[1], 4 * 40, 40),
        (f[2], 7 * 40, 40),
    ]
    store.drop_page_cache()
    readahead(got)
    readahead([(str(tmp_path / "gone.kv"), 0, 40)])  # advice only: a missing file is skipped
    assert torch.equal(store.read(want), data[want])
    assert BlockStore(40, "cpu").file_ranges(want) == []
    store.close()


def test_disk_step_reads_ahead_the_predicted_records(tmp_path):
    """A disk layer that attended once has predicted records; the next step's readahead covers them."""
    pol = off_policy(backend="disk", path=str(tmp_path), prefetch=True, mass=None, max_blocks=2, min_blocks=1)
    layer, _, _, valid = offload_layer(pol, q=1)
    query = torch.randn(3, 4, 1, 12, generator=torch.Generator().manual_seed(5))
    first = tiered_attention(layer, query, mask_for(valid, 1), 0.3)
    ranges = layer.cold.predicted_ranges()
    assert ranges and all(p in layer.cold.store.files() for p, _, _ in ranges)
    covered = sum(length for _, _, length in ranges) // layer.cold.store.record_bytes
    assert covered == int(layer.cold.predicted_blocks().sum())  # one record per predicted (row, head, block)
    layer.cold.store.drop_page_cache()
    again = tiered_attention(layer, query, mask_for(valid, 1), 0.3)
    assert torch.equal(first, again)


def test_slab_growth_rule():
    assert slab_sizes(1, 100) == [16]
    sizes = slab_sizes(1000, 100)
    assert sum(sizes) >= 1000 and sum(sizes[:-1]) < 1000
    assert sum(sizes) <= 1.13 * 1000 + 16  # at most ~1/8 spare
    assert max(slab_sizes(10**5, 1 << 20)) == 8  # slab capped at 8 MiB


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_record_layout_round_trip(bits):
    layout = RecordLayout(7, 12, torch.float16, bits, 4)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 3, 4, 7, 12, generator=g), torch.randn(2, 3, 4, 7, 12, generator=g)
    valid = torch.ones(2, 1, 4, 7, dtype=torch.bool)
    data = layout.encode(k, v, valid)
    assert data.shape == (24, layout.record_bytes)
    kd, vd = layout.decode(data)
    ref_k, ref_v = k.reshape(24, 7, 12), v.reshape(24, 7, 12)
    if bits is None:
        assert torch.equal(kd, ref_k.half()) and torch.equal(vd, ref_v.half())
    else:
        tol = 0.1 if bits == 8 else 1.0
        assert (kd.float() - ref_k).abs().max() < tol and (vd.float() - ref_v).abs().max() < tol


def test_corrupted_block_names_layer_block_and_record(tmp_path):
    layer, *_ = offload_layer(off_policy(backend="disk", path=str(tmp_path)))
    tier = layer.cold
    rid = int(tier.table[1, 0, 2])
    path = tier.store.files()[0]
    with open(path, "r+b") as f:  # flip one byte of record rid
        f.seek(rid * tier.store.record_bytes + 5)
        byte = f.read(1)
        f.seek(rid * tier.store.record_bytes + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(OffloadError, match=rf"layer 0: cold block 2 \(row 1, KV head 0\), record {rid}.*crc32"):
        tier.dense(torch.float32)
    with pytest.raises(OffloadError, match=rf"cold block 2 .* record {rid}"):
        tiered_attention(layer, torch.randn(3, 4, 1, 12), None, 0.3)


def test_missing_block_is_named(tmp_path):
    layer, *_ = offload_layer(off_policy())
    tier = layer.cold
    rid = int(tier.table[0, 1, 1])
    tier.store.free(torch.tensor([rid]))  # the table still points at it
    with pytest.raises(OffloadError, match=rf"layer 0: cold block 1 \(row 0, KV head 1\), record {rid}.*missing"):
        tier.dense(torch.float32)


def test_missing_directory_raises_at_construction(tmp_path, model):
    missing = tmp_path / "nope"
    pol = off_policy(backend="disk", path=str(missing))
    with pytest.raises(OffloadError, match=str(missing)):
        TieredCache(model.config, pol)
    with pytest.raises(OffloadError, match="does not exist"):
        TieredLayer(pol)


def test_read_only_directory_raises_at_construction(tmp_path, model):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: chmod does not make the directory read-only")
        with pytest.raises(OffloadError, match=rf"{ro}.*not writable"):
            TieredCache(model.config, off_policy(backend="disk", path=str(ro)))
    finally:
        ro.chmod(0o755)


def test_full_disk_names_directory(tmp_path, monkeypatch):
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    store = BlockStore(64, "disk", str(tmp_path))
    with pytest.raises(OffloadError, match=rf"no space left .* in '{tmp_path}'"):
        store.allocate(1)
    assert list(tmp_path.iterdir()) == []


def _disk_files(root):
    return [p for p in root.rglob("*") if p.is_file()]


def test_no_files_after_close_or_gc(tmp_path, model):
    pol = off_policy(hot=16, block=8, sinks=4, backend="disk", path=str(tmp_path))
    ids = torch.randint(3, 97, (2, 60))
    with kvtier.enable(model), torch.no_grad():
        with TieredCache(model.config, pol) as cache:
            model(ids, cache=cache)
            model(ids[:, :1], cache=cache)
            assert _disk_files(tmp_path)
            report = cache.memory_report()
            assert report.offloaded_bytes == sum(p.stat().st_size for p in _disk_files(tmp_path))
        assert list(tmp_path.iterdir()) == []  # closed on leaving the with block
        cache = TieredCache(model.config, pol)
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
    assert _disk_files(tmp_path)
    del cache
    gc.collect()
    assert list(tmp_path.iterdir()) == []


# --- tables and beams --------------------------------------------------------------------------
def test_reorder_permutes_block_tables_without_moving_data():
    layer, *_ = offload_layer(off_policy(), pads=(0, 0, 0))
    tier = layer.cold
    old_table = tier.table.clone()
    k_all, v_all, _ = tier.dense(torch.float32)
    ptrs = [s.data_ptr() for s in tier.store._slabs]
    live = tier.store.live
    idx = torch.tensor([2, 0, 0])
    layer.reorder_cache(idx)
    assert torch.equal(tier.table, old_table[idx])
    assert [s.data_ptr() for s in tier.store._slabs] == ptrs  # no data moved
    k_new, v_new, _ = tier.dense(torch.float32)
    assert torch.equal(k_new, k_all[idx]) and torch.equal(v_new, v_all[idx])
    # row 1's records are referenced by nobody now: freed; rows 1 and 2 share row 0's records
    assert tier.store.live == live - old_table[1].numel() == int(tier.table.unique().numel())
    new = layer.cold.store.allocate(1)
    assert int(new) in old_table[1].flatten().tolist()  # reused
    # appends after a reorder get fresh records, never overwrite a shared one
    layer.update(torch.randn(3, 2, 7, 12), torch.randn(3, 2, 7, 12), kwargs={})
    layer.settle(None)
    assert torch.equal(tier.dense(torch.float32)[0][:, :, : k_new.shape[2]], k_new)


# --- selection and attention -------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpu", "disk"])
@pytest.mark.parametrize("gqa,q", [(1, 1), (3, 1), (2, 5)])
def test_unlimited_budget_equals_exact_attention(backend, gqa, q, tmp_path):
    """Every block fetched: the result is exact attention over all tokens (fp32 storage)."""
    extra = {"path": str(tmp_path)} if backend == "disk" else {}
    pol = off_policy(mass=None, min_blocks=0, backend=backend, **extra)
    layer, keys, values, valid = offload_layer(pol, q=q, seed=gqa)
    query = torch.randn(3, 2 * gqa, q, 12, generator=torch.Generator().manual_seed(3))
    out = tiered_attention(layer, query, mask_for(valid, q), 0.3)
    ref = exact_reference(keys, values, valid, query, 0.3)
    real = valid[:, -q:]  # [B, q]: rows of real (non-pad) queries
    assert (out.double() - ref)[real].abs().max() < 1e-5
    assert layer.cold.stats.needed > 0 and layer.cold.stats.misses == layer.cold.stats.needed  # nothing predicted yet


@pytest.mark.parametrize("store_bits", [None, 8])
def test_staged_blocks_are_attended_in_place(store_bits):
    """A step whose selection the prediction covers reads nothing synchronously: the staged
    blocks are attended where the worker put them (no second copy), with the same result."""
    pol = off_policy(mass=None, min_blocks=0, store_bits=store_bits, dtype="float32")
    layer, _, _, valid = offload_layer(pol, q=1)
    tier = layer.cold
    query = torch.randn(3, 4, 1, 12, generator=torch.Generator().manual_seed(5))
    first = tiered_attention(layer, query, mask_for(valid, 1), 0.3)  # nothing predicted yet: all misses
    assert tier.stats.misses == tier.stats.needed > 0 and tier.stats.hits == 0
    seen = {}
    gather = tier.sources

    def spy(union):
        sources = gather(union)
        seen["sources"], seen["staged"] = sources, tier.staging.staged
        return sources

    tier.sources = spy
    second = tiered_attention(layer, query, mask_for(valid, 1), 0.3)  # the prefetcher staged the prediction
    needed = tier.stats.needed // 2  # both calls need the same blocks
    assert tier.stats.hits == needed and tier.stats.misses == needed  # the second call: all hits
    ((blocks, k, v),) = seen["sources"]
    assert k is seen["staged"][1] and v is seen["staged"][2]  # attended where the worker put them
    assert (second - first).abs().max() < 1e-5


def test_unlimited_budget_with_warm_tier_and_8bit_store_matches_reference():
    pol = off_policy(warm=14, mass=None, min_blocks=0, store_bits=8)
    layer, _, _, valid = offload_layer(pol, q=2)
    assert layer.warm.nblocks and layer.cold.nblocks
    query = torch.randn(3, 4, 2, 12)
    fast = tiered_attention(layer, query, mask_for(valid, 2), 0.3)
    ref = reference_attention(layer, query, mask_for(valid, 2), 0.3)  # decodes every stored block
    assert (fast - ref).abs().max() < 1e-4


@pytest.mark.parametrize("budget", [dict(mass=0.6, min_blocks=1), dict(mass=None, max_blocks=2, min_blocks=0)])
@pytest.mark.parametrize("force", [None, "torch"])  # the C++ path (where it builds) and the torch path
def test_limited_budget_drops_exactly_the_unselected_blocks(budget, force):
    pol = off_policy(**budget)  # prefetch on: every selection is observed
    layer, keys, values, valid = offload_layer(pol, q=3)
    chosen = {}
    observe = layer.cold.memory.observe

    def spy(keep, scores):
        chosen["keep"] = keep
        return observe(keep, scores)

    layer.cold.memory.observe = spy
    B, H, gqa, q, D = 3, 2, 2, 3, 12
    query = torch.randn(B, H * gqa, q, D, generator=torch.Generator().manual_seed(4))
    out = tiered_attention(layer, query, mask_for(valid, q), 0.3, force=force)
    keep = chosen["keep"]  # [B, H, R, n]
    n = layer.cold.nblocks
    assert keep.any() and not keep.all()
    # reference: exact attention where each row sees sinks, hot and only its kept cold blocks
    T = pol.block_tokens
    cold_len = n * T
    valid_cold = unpack_valid(layer.cold.fields["valid_bits"], T)
    allowed_cold = keep.repeat_interleave(T, -1) & valid_cold.reshape(B, 1, 1, -1)
    s_k, s_v = layer.sinks.k.double(), layer.sinks.v.double()
    c_k, c_v, _ = layer.cold.dense(torch.float64)
    h_k, h_v = (t.double() for t in layer.hot.view())
    k = torch.cat([s_k, c_k, h_k], 2)
    v = torch.cat([s_v, c_v, h_v], 2)
    rows = query.double().reshape(B, H, gqa * q, D) * 0.3
    hot_pos = layer.hot_start + torch.arange(layer.hot.length)
    q_pos = (layer.seen - q + torch.arange(q)).repeat(gqa)
    allowed_hot = (hot_pos[None, :] <= q_pos[:, None])[None, None] & valid[:, None, None, layer.hot_start :]
    allowed = torch.cat(
        [
            layer.sinks.valid()[:, None, None, :].expand(B, H, gqa * q, -1),
            allowed_cold,
            allowed_hot.expand(B, H, -1, -1),
        ],
        -1,
    )
    assert allowed.shape[-1] == k.shape[2] and cold_len == c_k.shape[2]
    s = (rows @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    ref = (torch.softmax(s, -1).nan_to_num(0.0) @ v).reshape(B, H * gqa, q, D).transpose(1, 2)
    real = valid[:, -q:]
    assert (out.double() - ref)[real].abs().max() < 1e-5
    if budget.get("max_blocks"):
        assert int(keep.sum(-1).max()) <= budget["max_blocks"]


def test_select_offloaded_rule():
    from kvtier.attention.offloaded import select_offloaded

    # resident mass 0.5, blocks 0.3, 0.15, 0.04, 0.01 (of the total); one empty block
    lse = torch.log(torch.tensor([0.04, 0.3, 0.01, 0.15, 0.0]))[None, None, None]
    res = torch.log(torch.tensor([0.5]))[None, None]
    keep = select_offloaded(lse, res, OffloadPolicy(mass=0.9, min_blocks=0))
    assert keep.flatten().tolist() == [False, True, False, True, False]  # 0.5 + 0.3 + 0.15 >= 0.9
    keep = select_offloaded(lse, res, OffloadPolicy(mass=0.99, min_blocks=0, max_blocks=2))
    assert keep.flatten().tolist() == [False, True, False, True, False]
    keep = select_offloaded(lse, res, OffloadPolicy(mass=0.5, min_blocks=3))
    assert keep.flatten().tolist() == [True, True, False, True, False]
    forced = torch.tensor([False, False, True, False, True])
    keep = select_offloaded(lse, res, OffloadPolicy(mass=0.4, min_blocks=0), forced)
    assert keep.flatten().tolist() == [False, False, True, False, False]  # empty never kept


def test_estimated_skipped_share():
    from kvtier.attention.offloaded import budget_binds, estimated_skipped

    # resident mass 0.5, blocks 0.3, 0.15, 0.04, 0.01 (of the total); one empty block
    lse = torch.log(torch.tensor([0.04, 0.3, 0.01, 0.15, 0.0]))[None, None, None]
    res = torch.log(torch.tensor([0.5]))[None, None]
    keep = torch.tensor([False, True, False, True, False])[None, None, None]
    assert float(estimated_skipped(lse, keep, res)) == pytest.approx(0.05, rel=1e-5)
    assert float(estimated_skipped(lse, torch.isfinite(lse), res)) == 0.0
    assert budget_binds(OffloadPolicy(max_blocks=4), 5) and not budget_binds(OffloadPolicy(max_blocks=5), 5)
    assert not budget_binds(OffloadPolicy(max_blocks=None), 10**6)


@pytest.mark.parametrize("force", [None, "torch"])  # the C++ path (where it builds) and the torch path
def test_read_budget_reports_its_estimated_skip_and_warns(force):
    B, H, gqa, q, D = 3, 2, 2, 3, 12
    query = torch.randn(B, H * gqa, q, D, generator=torch.Generator().manual_seed(4))
    layer, _, _, valid = offload_layer(off_policy(mass=None, max_blocks=1, min_blocks=0), q=q)
    assert layer.cold.nblocks > 1
    with pytest.warns(kvtier.BudgetWarning, match="max_blocks=1"):
        tiered_attention(layer, query, mask_for(valid, q), 0.05, force=force)  # small scale: diffuse
    st = layer.cold.stats
    assert st.est_skipped_rows == B * H * gqa * q
    assert 0.05 < st.est_skipped_mass / st.est_skipped_rows <= st.est_skipped_max <= 1.0
    # no cap, or a cap the layer's blocks fit under: nothing estimated, no warning
    for changes in (dict(max_blocks=None), dict(max_blocks=layer.cold.nblocks)):
        layer, _, _, valid = offload_layer(off_policy(mass=0.9, min_blocks=0, **changes), q=q)
        with warnings.catch_warnings():
            warnings.simplefilter("error", kvtier.BudgetWarning)
            tiered_attention(layer, query, mask_for(valid, q), 0.05, force=force)
        assert layer.cold.stats.est_skipped_rows == 0


@pytest.mark.parametrize("name", ["offload-cpu", "offload-disk"])
def test_offload_presets_read_budget_never_binds_up_to_8k(name):
    pol = kvtier.get_policy(name)
    cold_blocks_at_8k = -(-(8192 - pol.sink_tokens - pol.hot_tokens) // pol.block_tokens)
    assert pol.offload.max_blocks is not None and cold_blocks_at_8k <= pol.offload.max_blocks
    assert pol.offload.reuse_every(cold_blocks_at_8k) == 1  # a fresh selection every step up to 8k


def test_auto_reuse_amortizes_selection_beyond_the_read_budget():
    auto = OffloadPolicy(max_blocks=128, reuse_steps=None)
    assert [auto.reuse_every(n) for n in (0, 1, 128, 129, 256, 257, 512)] == [1, 1, 1, 2, 2, 3, 4]
    assert OffloadPolicy(max_blocks=None, reuse_steps=None).reuse_every(10**5) == 1
    assert OffloadPolicy(max_blocks=128, reuse_steps=3).reuse_every(10**5) == 3


@pytest.mark.parametrize("D,T,R", [(12, 7, 1), (16, 8, 5), (64, 64, 3)])
def test_sketch_kernel_equals_torch(D, T, R):
    from kvtier.kernels import sketch_cpu

    if not sketch_cpu.available():
        pytest.skip("sketch kernel could not be built here")
    g = torch.Generator().manual_seed(D)
    sk = KeySketch(rotate=True)
    k = torch.randn(2, 3, 9, T, D, generator=g) * torch.linspace(0.2, 3, D)
    valid = torch.rand(2, 1, 9, T, generator=g) > 0.3
    valid[0, 0, 4] = False  # an empty block
    coded = sk.encode(k, valid)
    f = expand(coded, T)
    assert torch.equal(f["valid"], valid)
    rows = torch.randn(2, 3, R, D, generator=g)
    a, b = block_lse_torch(rows, f, sk), block_lse(rows, f, sk, kernel=True)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.isinf(a[0, :, :, 4]).all()
    assert (a - b).nan_to_num(0.0, 0.0, 0.0).abs().max() < 1e-4
    assert sum(t.numel() * t.element_size() for t in coded.values()) == sk.nbytes(2, 3, 9, T, D)


@pytest.mark.parametrize("D,T", [(12, 7), (64, 64)])
def test_coded_sketch_estimates_match_float_fields(D, T):
    """The uint8/int8-coded mean, scale and per-token factor give the estimates the same sketch
    with float fields gives (the codes' rounding is small next to the 1-bit sketch's own error)."""
    g = torch.Generator().manual_seed(T)
    sk = KeySketch(rotate=True)
    k = (torch.randn(1, 2, 5, T, D, generator=g) * torch.linspace(0.2, 3, D) + torch.randn(D, generator=g)) * 4
    valid = torch.ones(1, 1, 5, T, dtype=torch.bool)
    valid[0, 0, 0, : T // 2] = False
    f = expand(sk.encode(k, valid), T)
    # float reference: the same construction without codes
    kf = k @ rotation(D, k.device)
    tv = valid.unsqueeze(-1).float()
    mean = (kf * tv).sum(3, keepdim=True) / tv.sum(3, keepdim=True)
    dev = kf - mean
    scale = (dev.abs() * tv).sum(3, keepdim=True) / tv.sum(3, keepdim=True)
    alpha = (dev.abs() * scale).sum(-1) / (scale * scale).sum(-1)
    ref = dict(f, k_mean=mean, k_scale=scale, k_alpha=alpha * valid.squeeze(1), k_signs=pack_bits((dev >= 0).byte(), 1))
    rows = torch.randn(1, 2, 3, D, generator=g) / D**0.5
    a, b = block_lse_torch(rows, f, sk), block_lse_torch(rows, ref, sk)
    assert (a - b).abs().max() < 0.02 * b.abs().max()
    assert (f["k_alpha"] <= f["k_amax"][..., None]).all() and (f["k_alpha"][~valid.expand(1, 2, 5, T)] == 0).all()


def test_sketch_ranks_an_outlier_block_first():
    """A block holding a key aligned with the query must get the highest estimate."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 6, 16, 32, generator=g)
    q = torch.randn(1, 1, 1, 32, generator=g)
    k[0, 0, 3, 5] = 4 * q[0, 0, 0] / q.norm()
    sk = KeySketch()
    f = expand(sk.encode(k, torch.ones(1, 1, 6, 16, dtype=torch.bool)), 16)
    assert int(block_lse(q, f, sk).argmax()) == 3


# --- in the model: prefetch, generation, reports ------------------------------------------------
SMALL = dict(hot=16, block=8, sinks=4)


def _stream(model, cache, ids, chunk=16, decode=12):
    outs = []
    with kvtier.enable(model), torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            outs.append(model(ids[:, s : s + chunk], cache=cache).logits)
        tok = outs[-1][:, -1:].argmax(-1)
        for _ in range(decode):
            logits = model(tok, cache=cache).logits
            outs.append(logits)
            tok = logits[:, -1:].argmax(-1)
    return torch.cat(outs, 1)


def test_prefetch_on_and_off_identical_and_stats_add_up(model):
    ids = torch.randint(3, 97, (2, 96), generator=torch.Generator().manual_seed(0))
    runs = {}
    for on in (True, False):
        cache = TieredCache(model.config, off_policy(**SMALL, mass=0.9, min_blocks=1, prefetch=on))
        runs[on] = (_stream(model, cache, ids), cache.offload_stats())
        rb = cache.layers[0].cold.layout.record_bytes
    # the same attention up to fp32 summation order: a staged source lists a superset of the
    # selected blocks (masked per row), a synchronous one exactly the misses
    a, b = runs[True][0], runs[False][0]
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    on, off = runs[True][1], runs[False][1]
    for st in (on, off):
        assert st.hits + st.misses + st.in_place == st.needed > 0
        assert st.blocks_moved == st.prefetched + st.misses
        assert st.bytes_moved == st.blocks_moved * rb
        assert st.calls == 4 * (96 // 16 + 12 - 2)  # every layer call from the third on (cold exists)
    assert off.hits == off.prefetched == 0 and off.needed == on.needed and off.in_place > 0 == on.in_place
    assert on.hit_rate > 0.8 and on.prefetched - on.unused == on.hits
    d = on.to_dict()
    assert {"hit_rate", "blocks_moved", "bytes_moved", "stall_s"} <= d.keys()


@pytest.mark.parametrize("mode", ["greedy", "beam", "padded"])
def test_generate_with_offload(model, mode, tmp_path):
    kw: dict = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    if mode == "padded":
        ids = torch.randint(3, 97, (3, 70), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        for b, n in enumerate([70, 40, 55]):
            ids[b, : 70 - n] = 0
            mask[b, : 70 - n] = 0
        kw.update(input_ids=ids, attention_mask=mask)
    else:
        kw["input_ids"] = torch.randint(3, 97, (1, 70), generator=torch.Generator().manual_seed(1))
    if mode == "beam":
        kw.update(num_beams=3, num_return_sequences=2)
    unlimited = off_policy(**SMALL, mass=None, min_blocks=0, backend="disk", path=str(tmp_path))
    with kvtier.enable(model):
        exact = model.generate(cache=TieredCache(model.config, "exact"), **kw)
        cache = TieredCache(model.config, unlimited)
        out = model.generate(cache=cache, **kw)
        limited = model.generate(cache=TieredCache(model.config, off_policy(**SMALL, mass=0.9)), **kw)
    assert out.shape == exact.shape == limited.shape
    assert torch.equal(out, exact)  # every block fetched exactly: the same tokens as the exact cache
    tier = cache.layers[1].cold
    assert tier.nblocks > 0 and cache.offload_stats().needed > 0
    if mode == "beam":  # beams share the records of their common prefix
        assert tier.store.live == int(tier.table.unique().numel()) < tier.table.numel()
    cache.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("backend", ["cpu", "disk"])
def test_memory_report_splits_resident_and_offloaded(model, backend, tmp_path):
    extra = {"path": str(tmp_path)} if backend == "disk" else {}
    cache = TieredCache(model.config, off_policy(**SMALL, backend=backend, **extra))
    with kvtier.enable(model), torch.no_grad():
        model(torch.randint(3, 97, (2, 150)), cache=cache)
        model(torch.randint(3, 97, (2, 1)), cache=cache)
    r = cache.memory_report()
    stores = [layer.cold.store for layer in cache.layers]
    assert r.offloaded_bytes == r.per_tier["store"] == sum(s.nbytes for s in stores) > 0
    assert r.total_bytes == r.resident_bytes + r.offloaded_bytes
    disk = sum(p.stat().st_size for p in _disk_files(tmp_path)) if backend == "disk" else 0
    assert r.total_bytes == reachable_tensor_bytes(cache) + disk
    assert r.resident_bytes == sum(b for t, b in r.per_tier.items() if t != "store")
    assert r.resident_bytes < r.offloaded_bytes  # the exact blocks left; sketches stayed
    assert "staging" not in r.per_tier  # nothing is staged between steps
    cache.close()


@pytest.mark.parametrize("seq,batch", [(150, 1), (1000, 2)])
@pytest.mark.parametrize("store_bits,backend", [(None, "disk"), (4, "cpu")])
def test_plan_matches_report(seq, batch, store_bits, backend, tmp_path):
    model = tiny_llama(num_hidden_layers=2)
    extra = {"path": str(tmp_path)} if backend == "disk" else {}
    pol = off_policy(hot=64, block=64, sinks=32, dtype="half", store_bits=store_bits, backend=backend, **extra)
    cache = TieredCache(model.config, pol)
    ids = torch.randint(3, 97, (batch, seq))
    with kvtier.enable(model), torch.no_grad():
        for s in range(0, seq, 700):
            model(ids[:, s : s + 700], cache=cache)
    report = cache.memory_report()
    planned = estimate(ModelShape("tiny", ["full_attention"] * 2, 2, 16), seq, pol, batch, torch.float32)
    assert planned.offloaded_bytes == report.offloaded_bytes
    assert abs(planned.resident_bytes - report.resident_bytes) <= 0.02 * report.resident_bytes
    assert abs(planned.total_bytes - report.total_bytes) <= 0.02 * report.total_bytes
    cache.close()


# --- policy ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("backend", "s3"),
        ("store_bits", 2),
        ("mass", 1.5),
        ("max_blocks", 0),
        ("min_blocks", -1),
        ("margin", 1.5),
        ("prefetch", "yes"),
        ("path", 3),
    ],
)
def test_offload_policy_validation(field, value):
    with pytest.raises(ValueError) as err:
        OffloadPolicy(**{field: value})
    assert str(err.value).startswith(f"{field}={value!r} is not allowed: expected")


@pytest.mark.parametrize(
    "backend,prefetch,expected",
    [("cpu", None, False), ("disk", None, True), ("cpu", True, True), ("disk", False, False)],
)
def test_prefetch_auto_is_on_only_where_a_fetch_is_a_transfer(tmp_path, backend, prefetch, expected):
    path = str(tmp_path) if backend == "disk" else None
    layer, *_ = offload_layer(off_policy(backend=backend, path=path, prefetch=prefetch))
    assert layer.cold.prefetch_enabled is expected
    layer.cold.close()


def test_tier_policy_offload_consistency():
    with pytest.raises(ValueError, match="offload=.*None unless cold='offload'"):
        TierPolicy(cold="sign", offload=OffloadPolicy())
    with pytest.raises(ValueError, match="path='/x' is not allowed: expected None unless backend='disk'"):
        OffloadPolicy(path="/x")
    from kvtier.policy import SparsePolicy

    with pytest.raises(ValueError, match="sparse="):
        TierPolicy(cold="offload", sparse=SparsePolicy())
    assert TierPolicy(cold="offload").offload == OffloadPolicy()
    assert kvtier.get_policy("offload-disk").offload.backend == "disk"


@pytest.mark.parametrize("backend", ["cpu", "disk"])
@pytest.mark.parametrize("q", [5, 20])  # 20 x GQA 2 = 40 rows: the flash op's path
def test_long_call_attends_every_cold_block_exactly(backend, q, tmp_path):
    """A call longer than ``OffloadPolicy.max_query_tokens`` (prefill) reads every cold block and
    equals exact attention, under a budget that drops blocks for the same call when selection
    applies (``max_query_tokens=None``)."""
    extra = {"path": str(tmp_path)} if backend == "disk" else {}
    outs = {}
    for limit in (4, None):
        pol = off_policy(mass=0.6, min_blocks=1, max_query_tokens=limit, backend=backend, **extra)
        layer, keys, values, valid = offload_layer(pol, q=q, seed=1)
        query = torch.randn(3, 4, q, 12, generator=torch.Generator().manual_seed(3))
        mask = mask_for(valid, q)
        assert plan_for(layer, query, mask).selection == ("dense" if limit else "sketch")
        outs[limit] = tiered_attention(layer, query, mask, 0.3)
        if limit:
            cold_valid = unpack_valid(layer.cold.fields["valid_bits"], layer.cold.block_tokens).any(-1)  # [B,1,n]
            assert layer.cold.stats.needed == 2 * int(cold_valid.sum())  # every block with a valid token, per head
        layer.cold.close()
    ref = exact_reference(keys, values, valid, query, 0.3)
    real = valid[:, -q:]
    assert (outs[4].double() - ref)[real].abs().max() < 1e-5
    assert (outs[None].double() - ref)[real].abs().max() > 1e-3  # selection drops mass: the test has teeth
