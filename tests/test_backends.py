"""Every attention backend, forced through ``force=`` (no private names patched), against the reference.

Backends: ``torch``, ``cpu`` (per-tier C++ kernel at any row count), ``fused`` (one C++ call per
layer where it applies), ``triton`` (Triton's CPU interpreter, as in tests/test_triton.py). Shapes
are awkward: lengths off the block grid, batch 2 with left padding, GQA 3, head dims 12/16, decode
and short prefill chunks. Dense attention is compared with the fp64 reference oracle (the
flash-attention rule: ``err <= 2 * err(fp32 reference) + 1e-5``); sparse selection with the torch
backend under the same selection (same output within fp32 order, same work counted); whole models
(tiny Llama, a sparse and an offloading policy) through ``TieredCache(..., attention=NAME)`` against
``attention="reference"``. Then the plan itself: memoized once per forward call and layout, one-line
errors for a backend that cannot run, fallbacks logged once.
"""

from __future__ import annotations

import logging

import pytest
import torch

from builders import POLICIES as SHARED_POLICIES
from builders import build_layer, mask_for
from kvtier import TierPolicy
from kvtier.attention import plan as plan_mod
from kvtier.attention.reference import reference_attention
from kvtier.attention.tiered import tiered_attention
from kvtier.policy import OffloadPolicy, SparsePolicy
from kvtier.testing import feed_chunks

BACKENDS = ["torch", "cpu", "fused", "triton"]


def _usable(force: str) -> None:
    try:
        plan_mod.check_force(force, torch.device("cpu"))
    except ValueError as err:
        pytest.skip(str(err))


@pytest.fixture(params=BACKENDS)
def backend(request):
    _usable(request.param)
    return request.param


POLICIES = {
    "int4+sign": SHARED_POLICIES["int4+sign"],
    "int2+int3+rot": SHARED_POLICIES["int2+int3"].replace(cold_rotation=True),
}


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("D", [12, 16])
@pytest.mark.parametrize("q", [1, 5])
def test_dense_backend_matches_reference(backend, name, D, q):
    """Each backend over sinks + cold + warm + hot, batch 2 left-padded (one row's cold tier all
    padding), GQA 3, lengths off the block grid: within the oracle bound of the fp64 reference."""
    policy = POLICIES[name]
    if D % policy.value_group_size:
        policy = policy.replace(value_group_size=D)
    B, H, gqa = 2, 2, 3
    layer, valid = build_layer(policy, B, H, D, [37, 11, 3, q], [0, 30], seed=D + q)
    query = torch.randn(B, H * gqa, q, D, generator=torch.Generator().manual_seed(q))
    mask = mask_for(valid, q)
    plan = plan_mod.plan_for(layer, query, mask, backend)
    assert plan.force == backend and plan.path == "tiered"
    names = {c.packed.name for c in plan.chunks}
    assert names == {"cpu" if backend == "fused" else backend}
    if backend == "fused":
        assert all(c.fused for c in plan.chunks)
    fast = tiered_attention(layer, query, mask, 0.3, force=backend)
    ref32 = reference_attention(layer, query, mask, 0.3)
    ref64 = reference_attention(layer, query.double(), mask, 0.3)
    err = (fast.double() - ref64).abs().max().item()
    err_ref = (ref32.double() - ref64).abs().max().item()
    assert torch.isfinite(fast).all()
    assert err <= 2 * err_ref + 1e-5, (backend, err, err_ref)


def test_reference_is_forced_too():
    layer, valid = build_layer(POLICIES["int4+sign"], 2, 2, 16, [40, 1], [0, 9])
    query = torch.randn(2, 4, 1, 16)
    mask = mask_for(valid, 1)
    assert plan_mod.plan_for(layer, query, mask, "reference").path == "reference"
    out = tiered_attention(layer, query, mask, 0.3, force="reference")
    assert torch.equal(out, reference_attention(layer, query, mask, 0.3))


SPARSE = {
    "blocks-topk": SparsePolicy(local_window=6, select="blocks", method="topk", level=0.5),
    "blocks-mass": SparsePolicy(local_window=0, select="blocks", method="mass", level=0.9),
    "tokens-mass": SparsePolicy(local_window=5, select="tokens", method="mass", level=0.9),
    "tokens-quantile": SparsePolicy(local_window=0, select="tokens", method="quantile", level=0.4),
}


@pytest.mark.parametrize("sp", list(SPARSE))
@pytest.mark.parametrize("q", [1, 3])
def test_sparse_backend_matches_torch(backend, sp, q):
    """Under a sparse policy every backend attends what the torch backend attends (same selection,
    same output within fp32 order) and counts the same work; Triton has no token selection, so its
    token-sparse calls attend densely (the plan says so) and match the reference instead."""
    policy = POLICIES["int4+sign"].replace(sparse=SPARSE[sp], value_group_size=8)
    B, H, D, gqa = 2, 2, 16, 3
    query = torch.randn(B, H * gqa, q, D, generator=torch.Generator().manual_seed(7)) * 2
    out, stats = {}, {}
    for name in ("torch", backend):
        layer, valid = build_layer(policy, B, H, D, [70, 21, q], [0, 11])
        mask = mask_for(valid, q)
        plan = plan_mod.plan_for(layer, query, mask, name)
        out[name] = tiered_attention(layer, query, mask, 0.3, plan)
        stats[name] = layer.sparse_stats.to_dict()
    if backend == "triton" and SPARSE[sp].select == "tokens":
        assert plan.selection == "dense" and plan.dense_call
        ref = reference_attention(layer, query, mask, 0.3)
        assert (out["triton"] - ref).abs().max() < 1e-4
        assert stats["triton"]["dense_calls"] == 1
        return
    assert plan.selection == SPARSE[sp].select
    assert (out["torch"] - out[backend]).abs().max() < 1e-4
    assert stats["torch"] == stats[backend]
    assert stats[backend]["valued"] < stats[backend]["pairs"]


@pytest.mark.parametrize("q", [1, 6])
def test_long_calls_attend_densely_under_sparse_policy(backend, q):
    """``max_query_tokens``: a longer call attends densely through every backend, counted apart."""
    sp = SparsePolicy(local_window=2, select="tokens", method="mass", level=0.5, max_query_tokens=4)
    layer, valid = build_layer(POLICIES["int4+sign"].replace(sparse=sp), 2, 2, 16, [60, 13, q], [0, 5])
    query = torch.randn(2, 6, q, 16, generator=torch.Generator().manual_seed(2))
    plan = plan_mod.plan_for(layer, query, mask_for(valid, q), backend)
    assert (plan.selection == "dense") == (q > 4 or backend == "triton")
    tiered_attention(layer, query, mask_for(valid, q), 0.3, plan)
    assert layer.sparse_stats.dense_calls == (1 if plan.selection == "dense" else 0)


# --- whole models through TieredCache(attention=...) ------------------------------------------------


MODEL_POLICIES = {
    "tokens": TierPolicy(
        hot_tokens=9,
        warm_tokens=21,
        block_tokens=7,
        sink_tokens=3,
        value_group_size=8,
        sparse=SparsePolicy(local_window=4, select="tokens", method="mass", level=1.0),
        layer_overrides={},
    ),
    "offload": TierPolicy(
        hot_tokens=9,
        warm_tokens=7,
        block_tokens=7,
        sink_tokens=3,
        value_group_size=4,
        cold="offload",
        offload=OffloadPolicy(mass=None, min_blocks=0, prefetch=False),
        layer_overrides={},
    ),
}


@pytest.mark.parametrize("name", list(MODEL_POLICIES))
def test_model_backends_match_reference(model, backend, name):
    """A tiny Llama (GQA 2), batch 2 left-padded, a prompt in uneven chunks then decode steps:
    ``TieredCache(..., attention=backend)`` gives the logits of ``attention="reference"`` (selection
    at level 1.0 keeps every token; the offload budget is unlimited, so both are exact)."""
    import kvtier

    ids = torch.randint(3, 97, (2, 52), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    chunks = [29, 17, 3, 1, 1, 1]
    logits = {}
    with kvtier.enable(model):
        for attention in ("reference", backend):
            with kvtier.TieredCache(model.config, MODEL_POLICIES[name], attention=attention) as cache:
                logits[attention] = feed_chunks(model, cache, ids, mask, chunks)
    real = mask.bool()
    assert (logits[backend] - logits["reference"])[real].abs().max() < 1e-3


# --- the plan -------------------------------------------------------------------------------------------


def test_plan_is_built_once_per_call_and_layout():
    """Layers of one forward call with the same layout share one plan object (memoized in the
    call's mask); another call (a new mask) builds a new one."""
    pol = POLICIES["int4+sign"]
    a, valid = build_layer(pol, 2, 2, 16, [40, 1], [0, 9])
    b, _ = build_layer(pol, 2, 2, 16, [40, 1], [0, 9], seed=1)
    query = torch.randn(2, 4, 1, 16)
    mask = mask_for(valid, 1)
    p = plan_mod.plan_for(a, query, mask)
    assert plan_mod.plan_for(b, query, mask) is p
    assert plan_mod.plan_for(a, query, mask_for(valid, 1)) is not p
    assert plan_mod.plan_for(a, torch.randn(2, 4, 1, 16, dtype=torch.float64), mask) is p  # dtype: not layout
    assert plan_mod.plan_for(a, query.bfloat16(), mask) is not p  # ... unless the flash op would read it
    layers_attention = plan_mod.plan_for(a, query, mask, "torch")
    assert layers_attention is not p and layers_attention.force == "torch"


def test_forced_backend_that_cannot_run_raises_one_line(monkeypatch):
    with pytest.raises(ValueError, match="runs on CPU tensors") as err:
        plan_mod.check_force("cpu", torch.device("cuda"))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="not allowed"):
        plan_mod.check_force("flash", torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors without the interpreter
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        plan_mod.check_force("triton", torch.device("cpu"))
    layer, valid = build_layer(POLICIES["int4+sign"], 1, 2, 16, [30, 1], [0])
    with pytest.raises(ValueError, match="'triton'"):
        tiered_attention(layer, torch.randn(1, 2, 1, 16), mask_for(valid, 1), 0.3, force="triton")


def test_fallback_is_logged_once(caplog):
    """The fused call has no block selection: forced, it falls back to the per-tier kernel, logged once."""
    _usable("fused")
    plan_mod._logged.clear()  # a fresh process's log state
    policy = POLICIES["int4+sign"].replace(sparse=SPARSE["blocks-topk"], value_group_size=8)
    layer, valid = build_layer(policy, 2, 2, 16, [50, 1], [0, 9])
    query = torch.randn(2, 6, 1, 16)
    with caplog.at_level(logging.INFO, logger="kvtier.attention"):
        for _ in range(3):
            p = plan_mod.plan_for(layer, query, mask_for(valid, 1), "fused")
    assert not p.chunks[0].fused and p.chunks[0].packed.name == "cpu"
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "fused" in caplog.records[0].getMessage()


def test_automatic_plan_on_cpu():
    """What the automatic plan picks on the CPU: the fused call for decode, chunked GEMMs for long
    chunks (split by the score budget), the per-tier kernel for block selection."""
    _usable("fused")
    layer, valid = build_layer(POLICIES["int4+sign"], 2, 2, 16, [50, 9], [0, 9])
    decode = plan_mod.plan_for(layer, torch.randn(2, 6, 1, 16))
    assert decode.chunks[0].fused and decode.chunks[0].rows == 3
    prefill = plan_mod.plan_for(layer, torch.randn(2, 6, 11, 16))
    assert not prefill.chunks[0].fused and prefill.chunks[0].packed.name == "torch"
    assert prefill.chunks[0].rows == 33 > plan_mod.CPU_KERNEL_MAX_ROWS
    chunk4 = plan_mod.plan_for(layer, torch.randn(2, 6, 8, 16))  # 4 query tokens of a 6:1 GQA model
    assert chunk4.chunks[0].fused and chunk4.chunks[0].rows == 24 > plan_mod.KERNEL_MAX_ROWS
    per_tier, _ = build_layer(POLICIES["int4+sign"], 2, 2, 16, [50, 9], [0, 9], attention="per-tier")
    assert not plan_mod.plan_for(per_tier, torch.randn(2, 6, 1, 16)).chunks[0].fused


def test_cli_attention_option_forces_the_tiered_caches(model):
    """``kvtier eval|bench --attention NAME``: every kvtier cache on the automatic plan runs NAME;
    baselines and explicit ``:reference`` / ``:per-tier`` caches keep theirs; an unknown name is an
    argparse error and a backend that cannot run is refused before the run."""
    from kvtier.cli import _forced, build_parser
    from kvtier.eval.caches import cache_spec

    args = build_parser().parse_args(["bench", "--caches", "default", "--attention", "cpu"])
    assert args.attention == "cpu"
    assert build_parser().parse_args(["eval", "ppl"]).attention == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--attention", "flash"])
    specs = [cache_spec(n) for n in ("dynamic", "default", "default:reference", "chat")]
    _usable("torch")
    got = {s.name: s.attention for s in _forced(specs, "torch", model)}
    assert got == {"dynamic": "fast", "default": "torch", "default:reference": "reference", "chat": "torch"}
    assert _forced(specs, "auto", model) is specs

    class OnMeta:  # a model whose weights are on a device no backend but torch runs on
        def parameters(self):
            return iter([torch.empty(0, device="meta")])

    with pytest.raises(ValueError, match="'triton' needs CUDA tensors"):
        _forced(specs, "triton", OnMeta())


# --- long dense calls: every segment through torch's CPU flash op (prefill) ----------------------
def _flash_or_skip():
    if plan_mod.flash_lse_op() is None:
        pytest.skip("torch's CPU flash op with lse is unavailable here")


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("B,pads", [(1, [0]), (2, [0, 30])])
def test_long_call_flash_pass_matches_reference(name, B, pads):
    """A prefill-sized chunk (rows > ``CPU_KERNEL_MAX_ROWS``, dense): sinks, hot and every packed
    tier go through the flash op in one pass (no score matrix, tiers decoded once) - within the
    oracle bound of the fp64 reference, left padding included."""
    _flash_or_skip()
    policy = POLICIES[name].replace(value_group_size=4)
    H, gqa, D, q = 2, 3, 16, 23  # 69 rows per KV head
    layer, valid = build_layer(policy, B, H, D, [37, 11, 3, q], pads, seed=q)
    query = torch.randn(B, H * gqa, q, D, generator=torch.Generator().manual_seed(5))
    mask = mask_for(valid, q)
    plan = plan_mod.plan_for(layer, query, mask)
    assert len(plan.chunks) == 1 and plan.chunks[0].rows == gqa * q
    c = plan.chunks[0]
    assert c.exact.flash is not None and c.exact.chunked and c.packed is c.exact
    fast = tiered_attention(layer, query, mask, 0.3, plan)
    ref32 = reference_attention(layer, query, mask, 0.3)
    ref64 = reference_attention(layer, query.double(), mask, 0.3)
    real = valid[:, -q:]  # rows of real (non-pad) queries
    err = (fast.double() - ref64)[real].abs().max().item()
    err_ref = (ref32.double() - ref64)[real].abs().max().item()
    assert torch.isfinite(fast).all()
    assert err <= 2 * err_ref + 1e-5, (err, err_ref)


def test_long_call_flash_pass_reads_the_model_dtype():
    """A bf16 query's flash pass reads bf16 (what the model's own SDPA reads): the plan says so and
    the output is within bf16's rounding of the fp64 reference; an fp32 query stays fp32."""
    _flash_or_skip()
    policy = POLICIES["int4+sign"].replace(value_group_size=4)
    B, H, gqa, D, q = 2, 2, 3, 16, 23
    layer, valid = build_layer(policy, B, H, D, [37, 11, 3, q], [0, 30], seed=1)
    query = torch.randn(B, H * gqa, q, D, generator=torch.Generator().manual_seed(6))
    mask = mask_for(valid, q)
    assert plan_mod.plan_for(layer, query, mask).chunks[0].exact.flash_dtype == torch.float32
    plan = plan_mod.plan_for(layer, query.bfloat16(), mask)
    assert plan.chunks[0].exact.flash_dtype == torch.bfloat16
    out = tiered_attention(layer, query.bfloat16(), mask, 0.3, plan)
    assert out.dtype == torch.bfloat16
    ref = reference_attention(layer, query.bfloat16().double(), mask, 0.3)
    real = valid[:, -q:]
    scale = ref[real].abs().max().item()
    assert (out.double() - ref)[real].abs().max().item() <= 2**-6 * scale  # a few bf16 ulps of inputs and output


def test_long_call_passes_are_bounded_by_the_mask_budget(monkeypatch):
    """Without a score matrix a dense call runs in passes of ``FLASH_PASS_BUDGET`` rows x tokens
    (the exact tokens' boolean mask), not ``SCORE_BUDGET``; a token-sparse short call keeps the
    score budget (its selection builds scores)."""
    _flash_or_skip()
    monkeypatch.setattr(plan_mod, "SCORE_BUDGET", 600)
    monkeypatch.setattr(plan_mod, "FLASH_PASS_BUDGET", 6000)
    layer, valid = build_layer(POLICIES["int4+sign"], 1, 2, 16, [60, 40], [0])
    query = torch.randn(1, 6, 40, 16)
    plan = plan_mod.plan_for(layer, query, mask_for(valid, 40))
    step = 6000 // (100 * 3)  # tokens x G
    assert [c.stop - c.start for c in plan.chunks] == [step, 40 - step]
    out = tiered_attention(layer, query, mask_for(valid, 40), 0.3, plan)
    ref = reference_attention(layer, query, mask_for(valid, 40), 0.3)
    assert (out - ref).abs().max() < 1e-4
    sparse = POLICIES["int4+sign"].replace(sparse=SPARSE["tokens-mass"])
    layer, valid = build_layer(sparse, 1, 2, 16, [60, 4], [0])
    plan = plan_mod.plan_for(layer, torch.randn(1, 6, 4, 16), mask_for(valid, 4), "torch")
    assert plan.selection == "tokens" and len(plan.chunks) == 2  # 600 // (64 x 3) = 3 tokens a pass
