"""The Triton decode kernels against the torch reference, on the CPU through Triton's interpreter.

Tiers are built the way the cache builds them (a ``TieredLayer`` fed with ``update`` + ``settle``)
over awkward sizes: blocks and head dims off the power-of-two grid, batch > 1 with left padding (a
batch row whose whole cold tier is padding attends nothing there), GQA ratios 1/4/8, bit widths
2/3/4/6/8, sign codes with and without rotation, several sequence splits, and the CSR block-sparse
variant with per-row masks. Tolerance follows the flash-attention rule: the kernel's error against
an fp64 reference is at most twice the error of the fp32 torch path (plus a tiny absolute floor).
Sizes are tiny because the interpreter runs every program in Python.

Beyond numerics: the kernels also compile for sm_90 with Triton's bundled ptxas (no GPU needed),
``benchmarks/gpu_check.py --dry-run`` runs end to end, and kvtier never imports Triton at import time.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined: run them on the CPU

import ast  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from builders import POLICIES as SHARED_POLICIES  # noqa: E402
from builders import build_layer  # noqa: E402
from kvtier.attention.mask import KVMask  # noqa: E402
from kvtier.attention.partials import (  # noqa: E402
    Partial,
    exact_partial,
    from_rows,
    merge,
    packed_partial,
    to_rows,
)
from kvtier.attention.reference import reference_attention  # noqa: E402
from kvtier.attention.tiered import _hot_allowed, tiered_attention  # noqa: E402
from kvtier.codecs import KBitCodec, SignCodec  # noqa: E402
from kvtier.hf.layer import TieredLayer  # noqa: E402
from kvtier.kernels import dispatch  # noqa: E402
from kvtier.kernels import triton_decode as td  # noqa: E402
from kvtier.quant import rotation, unpack_bits  # noqa: E402

# Triton decorates its own library when first imported: the flag must be set before that (conftest.py).
assert type(td._packed_split_kernel).__name__ == "InterpretedFunction", "TRITON_INTERPRET was set too late"

ROOT = Path(__file__).resolve().parents[1]
FLOOR = 1e-5

# name -> (policy, head_dim); tiers: warm k-bit, cold sign / k-bit / evicted. The attention tests'
# policies (builders.POLICIES) with other windows and sinks.
POLICIES = {
    "int4+sign": (SHARED_POLICIES["int4+sign"].replace(hot_tokens=5, sink_tokens=2, cold_rotation=False), 16),
    "int2+int3": (SHARED_POLICIES["int2+int3"].replace(sink_tokens=0), 12),
    "int6+rot": (SHARED_POLICIES["int6+rot"].replace(hot_tokens=4, warm_tokens=8, sink_tokens=1), 12),
    "int8+evict": (SHARED_POLICIES["int8+evict"].replace(sink_tokens=0), 16),
}
PADS = [0, 22]  # row 1: the first 22 tokens are padding
CHUNKS = [30, 6, 1, 1]  # prefill, a short chunk, two decode steps


def tiers(layer: TieredLayer):
    return [t for t in (layer.cold, layer.warm) if t is not None and t.nblocks]


def tier_reference64(rows, fields, codec, dim, keep=None):
    """fp64 attention over a tier decoded from its stored codes and fp16 parameters.

    ``keep``: bool ``[B, H, R, n]`` blocks each row reads (None = all)."""
    B, H, n, T, _ = (fields["k_codes"] if isinstance(codec, KBitCodec) else fields["k_signs"]).shape
    NG = fields["v_scale"].shape[-1]
    f = {k: v.double() for k, v in fields.items() if k not in ("valid", "k_codes", "v_codes", "k_signs", "v_signs")}
    if isinstance(codec, KBitCodec):
        kq = unpack_bits(fields["k_codes"], codec.bits, dim).double()
        vq = unpack_bits(fields["v_codes"], codec.bits, dim).double().reshape(B, H, n, T, NG, -1)
        k = (kq - f["k_zero"]) * f["k_scale"]
        v = (vq - f["v_zero"][..., None]) * f["v_scale"][..., None]
    else:
        ks = unpack_bits(fields["k_signs"], 1, dim).double()
        vs = unpack_bits(fields["v_signs"], 1, dim).double().reshape(B, H, n, T, NG, -1)
        k = f["k_mean"] + f["k_scale"] * (2 * ks - 1)
        v = f["v_mean"][..., None] + f["v_scale"][..., None] * (2 * vs - 1)
    k, v = k.reshape(B, H, n * T, dim), v.reshape(B, H, n * T, dim)
    if codec.rotate:
        r = rotation(dim).double()
        k, v = k @ r.T, v @ r.T
    allowed = fields["valid"].reshape(B, 1, 1, n * T)
    if keep is not None:
        allowed = allowed & keep.repeat_interleave(T, dim=-1)
    scores = (rows.double() @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return torch.exp(scores - finite[..., None]) @ v, lse


def torch_partial(rows, fields, codec, dim, keep=None):
    p = packed_partial(rows, fields, codec, dim, keep)
    return p.out, p.lse


def assert_close(got, fp32, ref64):
    """``got``/``fp32``/``ref64``: ``(out [B,H,R,D], lse [B,H,R])``; the flash-attention tolerance rule."""
    out, lse = got
    out64, lse64 = ref64
    empty = torch.isinf(lse64)
    assert torch.isfinite(out).all()
    assert torch.equal(torch.isinf(lse), empty), "rows that attend nothing must give lse = -inf, and only those"
    assert (out[empty] == 0).all()

    def err(o, lse_):
        d_lse = (lse_.double() - lse64)[~empty]
        return max((o.double() - out64).abs().max().item(), d_lse.abs().max().item() if d_lse.numel() else 0.0)

    e_kernel, e_torch = err(out, lse), err(*fp32)
    assert e_kernel <= 2 * e_torch + FLOOR, (e_kernel, e_torch)


# --- packed tiers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("gqa,splits", [(1, 1), (4, None), (8, 3)])
@pytest.mark.parametrize("name", list(POLICIES))
def test_packed_tier_matches_reference(name, gqa, splits):
    """Every tier of the layer (warm k-bit; cold sign / rotated sign / k-bit), decode rows."""
    policy, D = POLICIES[name]
    B, H = 2, 2
    layer, _ = build_layer(policy, B, H, D, CHUNKS, PADS, seed=gqa)
    rows = to_rows(torch.randn(B, H * gqa, 1, D, generator=torch.Generator().manual_seed(gqa)), H, 0.3)
    assert tiers(layer)
    for t in tiers(layer):
        got = dispatch.gpu_partial(rows, t.fields, t.codec, D, num_splits=splits)
        assert_close(got, torch_partial(rows, t.fields, t.codec, D), tier_reference64(rows, t.fields, t.codec, D))


def test_padding_row_attends_nothing_in_cold():
    """Row 1's cold blocks hold only padding: its partial is empty (zeros, -inf), not NaN."""
    policy, D = POLICIES["int4+sign"]
    layer, _ = build_layer(policy, 2, 1, D, CHUNKS, PADS)
    cold = layer.cold.fields
    assert not cold["valid"][1].any() and cold["valid"][0].any()
    out, lse = dispatch.gpu_partial(to_rows(torch.randn(2, 2, 1, D), 1, 0.3), cold, layer.cold.codec, D)
    assert torch.isinf(lse[1]).all() and (out[1] == 0).all()
    assert torch.isfinite(lse[0]).all()


@pytest.mark.parametrize("bits", [1, 5, 7])
def test_ab_contract_any_width(bits):
    """The CPU kernel's contract (``x = a * code + b`` in fp32) for widths the policies do not use."""
    B, H, n, T, D, G, R = 2, 1, 3, 6, 20, 5, 3
    g = torch.Generator().manual_seed(bits)
    codec = SignCodec(G) if bits == 1 else KBitCodec(bits, G)
    valid = torch.rand(B, 1, n, T, generator=g) > 0.25
    fields = codec.encode(torch.randn(B, H, n, T, D, generator=g), torch.randn(B, H, n, T, D, generator=g), valid)
    fields["valid"] = valid
    ka, kb, va, vb, kc, vc = codec.affine(fields)
    rows = torch.randn(B, H, R, D, generator=g)
    got = td.packed_attention(rows, kc, ka, kb, vc, va, vb, valid.squeeze(1), bits, D, num_splits=2)
    assert_close(got, torch_partial(rows, fields, codec, D), tier_reference64(rows, fields, codec, D))


# --- block-sparse (CSR) -----------------------------------------------------------------------------


def test_padded_to_csr_exact():
    blocks = torch.tensor([[[3, -1, 0], [-1, -1, -1]], [[1, 2, -1], [5, -1, 4]]])
    indptr, indices = td.padded_to_csr(blocks)
    assert indptr.tolist() == [0, 2, 2, 4, 6]
    assert indices.tolist() == [3, 0, 1, 2, 5, 4]
    row_mask = torch.zeros(2, 2, 2, 3, dtype=torch.bool)
    row_mask[0, 0, 1, 2] = row_mask[1, 1, 0, 0] = row_mask[1, 1, 1, 2] = True
    assert td.csr_row_mask(blocks, row_mask).tolist() == [
        [False, False], [False, True], [False, False], [False, False], [True, False], [False, True],
    ]  # fmt: skip


@pytest.mark.parametrize("tier", ["warm", "cold"])
@pytest.mark.parametrize("gqa", [1, 4])
def test_sparse_csr_matches_reference(tier, gqa):
    """Only the listed blocks are read, and within them only what each row's mask keeps; a head
    with no block at all, and rows whose mask keeps nothing, attend nothing."""
    policy, D = POLICIES["int4+sign"]
    B, H = 2, 2
    layer, _ = build_layer(policy, B, H, D, chunks=[45, 1], pads=[0, 8], seed=5)
    t = getattr(layer, tier)
    n = t.nblocks
    g = torch.Generator().manual_seed(gqa)
    R = gqa
    rows = to_rows(torch.randn(B, H * gqa, 1, D, generator=g), H, 0.3)
    k = min(3, n)
    blocks = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(B * H)]).reshape(B, H, k)
    blocks[0, 1, :] = -1  # head without blocks
    blocks[1, 0, 0] = -1  # a hole in the padded list
    row_mask = torch.rand(B, H, R, k, generator=g) > 0.3
    row_mask[1, 1, 0] = False  # a row that keeps nothing
    keep = torch.zeros(B, H, R, n, dtype=torch.bool)
    keep.scatter_(-1, blocks.clamp(min=0)[:, :, None].expand(B, H, R, k), row_mask & (blocks >= 0)[:, :, None])
    ref64 = tier_reference64(rows, t.fields, t.codec, D, keep)
    fp32 = torch_partial(rows, t.fields, t.codec, D, keep)
    assert_close(dispatch.gpu_partial(rows, t.fields, t.codec, D, blocks, row_mask, num_splits=2), fp32, ref64)
    # the CSR plan itself, computed once and reused (no row mask: every listed block for every row)
    indptr, indices = td.padded_to_csr(blocks)
    listed = (blocks >= 0)[:, :, None].expand(B, H, R, k)
    whole = torch.zeros_like(keep).scatter_(-1, blocks.clamp(min=0)[:, :, None].expand(B, H, R, k), listed)
    got = dispatch.gpu_csr_partial(rows, t.fields, t.codec, D, indptr.to(torch.int32), indices)
    assert_close(
        got, torch_partial(rows, t.fields, t.codec, D, whole), tier_reference64(rows, t.fields, t.codec, D, whole)
    )


# --- exact tokens -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gqa,N", [(1, 100), (4, 37), (8, 5)])
def test_exact_matches_reference(dtype, gqa, N):
    """Hot-window layout: a strided view of a larger buffer, a per-row causal + padding mask."""
    B, H, D = 2, 2, 24
    g = torch.Generator().manual_seed(N)
    buf_k = torch.randn(B, H, N + 9, D, generator=g).to(dtype)
    buf_v = torch.randn(B, H, N + 9, D, generator=g).to(dtype)
    k, v = buf_k[:, :, :N], buf_v[:, :, :N]
    q = 2
    R = gqa * q
    causal = torch.arange(N)[None, :] <= (N - q + torch.arange(q))[:, None]  # [q, N]
    allowed = causal.repeat(gqa, 1)[None, None] & (torch.arange(N) >= torch.tensor([0, N - 1])[:, None])[:, None, None]
    allowed[1, :, :gqa] = False  # row 1's first query sees nothing (its only real key is in the future)
    allowed = allowed.expand(B, 1, R, N)
    rows = torch.randn(B, H, R, D, generator=g) * 0.4
    scores = (rows.double() @ k.double().transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    lse64 = torch.logsumexp(scores, -1)
    out64 = torch.exp(scores - torch.where(torch.isfinite(lse64), lse64, 0)[..., None]).nan_to_num(0) @ v.double()
    ref = exact_partial(rows, k, v, allowed)
    got = dispatch.gpu_exact(rows, k, v, allowed, num_splits=3)
    assert_close(got, (ref.out, ref.lse), (out64, lse64))
    if dtype == torch.float32:  # no mask at all
        ref = exact_partial(rows, k, v, None)
        scores = rows.double() @ k.double().transpose(-1, -2)
        lse64 = torch.logsumexp(scores, -1)
        assert_close(
            dispatch.gpu_exact(rows, k, v), (ref.out, ref.lse), (torch.softmax(scores, -1) @ v.double(), lse64)
        )


# --- a whole decode step ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,gqa", [("int4+sign", 4), ("int6+rot", 1)])
def test_decode_step_merges_like_torch(name, gqa):
    """Sinks + cold + warm + hot through the kernels, merged with ``merge``: the kvtier decode step."""
    policy, D = POLICIES[name]
    B, H = 2, 2
    layer, valid = build_layer(policy, B, H, D, CHUNKS, PADS, seed=11)
    query = torch.randn(B, H * gqa, 1, D, generator=torch.Generator().manual_seed(3))
    mask = KVMask(B, 1, valid.shape[1], valid.shape[1] - 1, 0, valid, True)
    rows = to_rows(query, H, 0.3)
    parts = []
    if layer.sinks.k is not None:
        parts.append(dispatch.gpu_exact(rows, layer.sinks.k, layer.sinks.v, layer.sinks.valid()[:, None, None, :]))
    parts += [dispatch.gpu_partial(rows, t.fields, t.codec, D) for t in tiers(layer)]
    hk, hv = layer.hot.view()
    q_pos = layer.seen - 1 + torch.arange(1)
    parts.append(dispatch.gpu_exact(rows, hk, hv, _hot_allowed(layer, q_pos, valid, gqa)))
    got = from_rows(merge([Partial(o, lse) for o, lse in parts]), H * gqa, 1)
    ref64 = reference_attention(layer, query.double(), mask, 0.3)
    fast32 = tiered_attention(layer, query, mask, 0.3)
    e_kernel, e_torch = ((x.double() - ref64).abs().max().item() for x in (got, fast32))
    assert e_kernel <= 2 * e_torch + FLOOR, (e_kernel, e_torch)


# --- vq tiers (vector codes read in place) ------------------------------------------------------------


@pytest.mark.parametrize("kb,vb,D", [(3, 3, 12), (2, 1, 16), (4, 2, 24), (1, 4, 8)])
@pytest.mark.parametrize("R,splits", [(1, 1), (6, 2), (3, None)])
def test_vq_tier_matches_reference(kb, vb, D, R, splits):
    """The vq kernel (codebook coordinates gathered per token, values' means through the rotated
    all-ones vector) against the fp64 oracle of the stored codes, within the flash-attention rule
    of the torch tables (``vq_partial``): lengths off the block grid, left padding, a batch row whose
    tier is all padding, GQA rows, sequence splits, 6-bit indices in two planes (3 bits, 2-D)."""
    from builders import vq_reference64
    from kvtier.attention.partials import vq_partial
    from kvtier.codecs import VqCodec

    g = torch.Generator().manual_seed(D + R)
    k = torch.randn(3, 2, 3, 5, D, generator=g) * 2 + 4.0
    v = torch.randn(3, 2, 3, 5, D, generator=g)
    valid = torch.ones(3, 1, 3, 5, dtype=torch.bool)
    valid[:, :, -1, 3:] = False
    valid[1] = False  # nothing valid in this batch row
    valid[2, :, 0, :2] = False  # left padding
    codec = VqCodec(kb, vb, D)
    f = codec.encode(k, v, valid)
    f["valid"] = valid
    rows = torch.randn(3, 2, R, D, generator=g) * 0.3
    got = dispatch.gpu_partial(rows, f, codec, D, num_splits=splits)
    fp32 = vq_partial(rows, f, codec, D, None)
    assert_close(got, (fp32.out, fp32.lse), vq_reference64(rows, f, codec, D))


def test_vq_layer_through_the_triton_plan():
    """A tiered layer with a vq cold tier (sinks, vq cold, 2-bit warm, hot; batch 2 left-padded, GQA
    3): the plan sends the vq tier to the Triton backend, and the step matches the fp64 reference."""
    from builders import POLICIES as SHARED
    from builders import mask_for
    from kvtier.attention import plan as plan_mod
    from kvtier.attention.backends.triton import TritonBackend

    policy = SHARED["int2+int3"].replace(
        cold_codes="vq", cold_bits=3, cold_value_bits=2, cold_rotation=True, value_group_size=4
    )
    layer, valid = build_layer(policy, 2, 2, 16, [43, 11, 1], [0, 17], seed=5)
    assert layer.cold.nblocks >= 3
    query = torch.randn(2, 6, 1, 16, generator=torch.Generator().manual_seed(1))
    mask = mask_for(valid, 1)
    plan = plan_mod.plan_for(layer, query, mask, "triton")
    assert all(isinstance(c.backend(layer.cold.codec), TritonBackend) for c in plan.chunks)
    got = tiered_attention(layer, query, mask, 0.3, force="triton")
    ref64 = reference_attention(layer, query.double(), mask, 0.3)
    fast32 = tiered_attention(layer, query, mask, 0.3, force="torch")
    e_kernel, e_torch = ((x.double() - ref64).abs().max().item() for x in (got, fast32))
    assert e_kernel <= 2 * e_torch + FLOOR, (e_kernel, e_torch)


# --- packaging ----------------------------------------------------------------------------------------


def _module_level_imports(tree):
    """Import statements executed when a module is imported (not those inside functions or classes)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def test_cpu_use_never_imports_triton():
    """Only the Triton kernel modules (``triton_decode``, ``triton_pages``) import Triton, and no other
    module imports them or ``dispatch`` at import time: CPU-only use of kvtier never loads Triton
    (``partials`` imports ``dispatch`` inside its CUDA branch, ``kvtier.vllm.pages.attention`` ``triton_pages``
    inside ``TritonPages.attend``)."""
    for path in (ROOT / "src" / "kvtier").rglob("*.py"):
        if path.name in ("triton_decode.py", "triton_pages.py"):
            continue
        for node in _module_level_imports(ast.parse(path.read_text())):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert not any("triton" in n or n.endswith("dispatch") for n in names), (path, ast.unparse(node))


def test_gpu_kernels_compile_for_sm90():
    """``gpu_check.py --compile-only``: every kernel compiles for sm_90 with Triton's bundled ptxas, no GPU."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--compile-only", "90"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=env,
    )  # fmt: skip
    if "No module named 'triton.backends.nvidia'" in res.stdout + res.stderr:
        pytest.skip("this Triton build has no NVIDIA backend")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["correct"] is True and len(result["kernels"]) >= 9


def test_gpu_check_dry_run():
    """``benchmarks/gpu_check.py --dry-run`` runs every code path on the CPU and ends with one JSON line."""
    import json

    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["dry_run"] is True and result["correct"] is True
