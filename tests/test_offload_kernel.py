"""The C++ offload path (kvtier.kernels.offload_cpu) against its torch references: two-level block
selection (coarse bound, sketch scores for the blocks walked, mass rule), exact attention over
records read where they lie (RAM store) or from gathered buffers (disk, prefetch), the whole
layer against the torch path, selection reuse and the skipped-mass diagnostic."""

from __future__ import annotations

import pytest
import torch

from builders import mask_for, off_policy, offload_layer
from kvtier import OffloadPolicy
from kvtier.attention.offloaded import attend_blocks_torch, coarse_bounds, select_two_level_torch
from kvtier.attention.tiered import tiered_attention
from kvtier.kernels import offload_cpu
from kvtier.offload.records import RecordLayout
from kvtier.offload.sketch import KeySketch, block_lse_torch, expand, query_rows
from kvtier.offload.store import BlockStore

pytestmark = pytest.mark.skipif(not offload_cpu.available(), reason="offload kernel could not be built here")


def sketched(B, H, n, T, D, seed, empty=True):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, n, T, D, generator=g) * torch.linspace(0.2, 3, D) + torch.randn(D, generator=g)
    k[:, :, n // 2, T // 3] *= 6  # an outlier key
    v = torch.randn(B, H, n, T, D, generator=g)
    valid = torch.rand(B, 1, n, T, generator=g) > 0.2
    valid[-1, :, 0, : T // 2] = False  # left padding of the last row
    if empty:
        valid[0, 0, 1] = False  # an empty block
    f = KeySketch(rotate=True).encode(k, valid)  # coded, as the tier stores it and the kernels read it
    return f, k, v, valid, g


@pytest.mark.parametrize("D,T,R", [(12, 7, 1), (16, 8, 5), (64, 64, 3)])
@pytest.mark.parametrize(
    "pol",
    [
        OffloadPolicy(mass=0.9, min_blocks=1, coarse_tol=0.0),
        OffloadPolicy(mass=0.99, min_blocks=0, coarse_tol=1e-2),
        OffloadPolicy(mass=None, max_blocks=3, min_blocks=0, coarse_tol=0.3),
        OffloadPolicy(mass=0.5, min_blocks=2, max_blocks=4, coarse_tol=1e-4, local_window=9),
    ],
)
def test_select_kernel_equals_torch(D, T, R, pol):
    B, H, n = 2, 3, 11
    f, _, _, _, g = sketched(B, H, n, T, D, seed=D + R)
    fx = expand(f, T)  # the float view the torch reference reads
    rows = torch.randn(B, H, R, D, generator=g)
    qrot = query_rows(rows, KeySketch(rotate=True))
    lse_res = torch.randn(B, H, R, generator=g) + 2
    forced_from = torch.tensor([n - 1 - (r % 3) for r in range(R)]) if pol.local_window else torch.full((R,), n)
    keep_t, lse_t, scored_t = select_two_level_torch(qrot, fx, lse_res, forced_from, pol)
    keep_k, lse_k, scored_k = offload_cpu.offload_select(
        qrot, f, lse_res, forced_from, pol.mass, pol.min_blocks, pol.max_blocks, pol.coarse_tol
    )
    assert torch.equal(scored_t, scored_k)
    assert torch.equal(torch.isinf(lse_t), torch.isinf(lse_k))
    assert (lse_t - lse_k).nan_to_num(0.0, 0.0, 0.0).abs().max() < 1e-4
    assert torch.equal(keep_t, keep_k)
    assert not keep_k[0, :, :, 1].any()  # the empty block
    # the coarse bound is an upper bound of every block's sketch estimate
    full = block_lse_torch(qrot, fx, KeySketch(rotate=False))
    ub = coarse_bounds(qrot, fx)
    assert (full <= ub + 1e-4).all()
    if pol.coarse_tol == 0:
        assert torch.equal(scored_k, torch.full_like(scored_k, n - 1) + torch.tensor([0, 0, 0, 1, 1, 1]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D,T,R", [(12, 7, 1), (64, 64, 3), (16, 8, 6)])
def test_attend_in_place_equals_torch(dtype, D, T, R):
    """Records read where they lie in a RAM store (the block table maps blocks to scattered ids)."""
    B, H, n = 2, 3, 9
    f, k, v, valid, g = sketched(B, H, n, T, D, seed=R)
    layout = RecordLayout(T, D, dtype)
    store = BlockStore(layout.record_bytes, "cpu")
    store.put(torch.zeros(5, layout.record_bytes, dtype=torch.uint8))  # ids 0..4 taken
    ids = store.put(layout.encode(k, v, valid))
    table = ids.view(B, H, n).flip(-1).contiguous()  # scattered: block j at the id of block n-1-j
    kd, vd = layout.decode(store.read(table.flatten()))
    kd, vd = kd.reshape(B, H, n, T, D), vd.reshape(B, H, n, T, D)
    rows = torch.randn(B, H, R, D, generator=g) * 0.3
    keep = torch.rand(B, H, R, n, generator=g) > 0.4
    out_prev = torch.randn(B, H, R, D, generator=g)
    lse_prev = torch.randn(B, H, R, generator=g)
    lse_prev[0, 0, 0] = float("-inf")  # nothing attended before
    keep[0, 0, 0] = False  # and nothing kept: the row stays empty
    kptr = store.addresses(table)
    vptr = kptr + T * D * layout.dtype.itemsize
    bits = f["valid_bits"]
    out_k, lse_k, counts = offload_cpu.offload_attend(rows, keep, kptr, vptr, bits, T, dtype, out_prev, lse_prev)
    out_t, lse_t = attend_blocks_torch(rows, keep, kd, vd, valid, out_prev, lse_prev)
    assert torch.isinf(lse_k[0, 0, 0]) and (out_k[0, 0, 0] == 0).all()
    fin = torch.isfinite(lse_t)
    assert torch.equal(fin, torch.isfinite(lse_k))
    assert (lse_k - lse_t)[fin].abs().max() < 1e-4 and (out_k - out_t)[fin].abs().max() < 1e-4
    assert int(counts[:, 0].sum()) == int(keep.any(2).sum())


@pytest.mark.parametrize("backend", ["cpu", "disk"])
@pytest.mark.parametrize("gqa,q", [(1, 1), (3, 1), (2, 3)])
@pytest.mark.parametrize("budget", [dict(mass=None, min_blocks=0), dict(mass=None, max_blocks=2, min_blocks=1)])
def test_layer_kernel_path_equals_torch_path(backend, gqa, q, budget, tmp_path):
    """The whole layer (sinks, hot, cold in place or gathered) against the torch path, prefetch
    auto (off in RAM: in place; on for disk: staged + gathered), left padding, GQA."""
    extra = {"path": str(tmp_path)} if backend == "disk" else {}
    pol = off_policy(backend=backend, prefetch=None, **budget, **extra)
    layer, _, _, valid = offload_layer(pol, q=q, seed=gqa)
    query = torch.randn(3, 2 * gqa, q, 12, generator=torch.Generator().manual_seed(3))
    fast = tiered_attention(layer, query, mask_for(valid, q), 0.3)
    st = layer.cold.stats
    assert st.blocks_total > 0 and st.needed > 0
    assert (st.in_place == st.needed) == (backend == "cpu")
    slow = tiered_attention(layer, query, mask_for(valid, q), 0.3, force="torch")
    real = valid[:, -q:]
    assert (fast - slow)[real].abs().max() < 1e-5


def test_reuse_selection_and_skipped_mass():
    pol = off_policy(prefetch=False, mass=0.6, min_blocks=1, reuse_steps=3)
    layer, _, _, valid = offload_layer(pol, q=1)
    tier = layer.cold
    tier.measure_skipped = True
    query = torch.randn(3, 4, 1, 12, generator=torch.Generator().manual_seed(7))
    outs = [tiered_attention(layer, query, mask_for(valid, 1), 0.3) for _ in range(4)]
    st = tier.stats
    assert st.reused == 2  # calls 2 and 3 reuse call 1's selection; call 4 selects afresh
    assert st.reuse_needed > 0 and st.reuse_hits == st.reuse_needed  # same query: same selection
    assert all((o - outs[0]).abs().max() < 1e-6 for o in outs)
    assert st.skipped_rows == 4 * 3 * 2 * 2 and 0 < st.skipped_max < 1
    assert 0 < st.skipped_mass / st.skipped_rows <= st.skipped_max


def test_skipped_mass_is_zero_when_every_block_is_attended():
    pol = off_policy(prefetch=False, mass=None, min_blocks=0)
    layer, _, _, valid = offload_layer(pol, q=1)
    layer.cold.measure_skipped = True
    tiered_attention(layer, torch.randn(3, 4, 1, 12), mask_for(valid, 1), 0.3)
    assert layer.cold.stats.skipped_rows > 0 and layer.cold.stats.skipped_max < 1e-6


@pytest.mark.filterwarnings("ignore::kvtier.BudgetWarning")
def test_auto_reuse_serves_ceil_n_over_budget_steps():
    probe, *_ = offload_layer(off_policy(prefetch=False), q=1)
    n = probe.cold.nblocks
    pol = off_policy(prefetch=False, mass=0.6, min_blocks=1, max_blocks=-(-n // 3), reuse_steps=None)
    assert pol.offload.reuse_every(n) == 3
    layer, _, _, valid = offload_layer(pol, q=1)
    query = torch.randn(3, 4, 1, 12, generator=torch.Generator().manual_seed(7))
    for _ in range(4):
        tiered_attention(layer, query, mask_for(valid, 1), 0.3)
    assert layer.cold.stats.reused == 2  # calls 2 and 3 reuse call 1's selection
