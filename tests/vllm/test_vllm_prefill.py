"""Prefill chunks over packed pages through vLLM's own CPU attention or kvtier's bf16 kernel reading
the pages in place (``kvtier.vllm.pages.prefill``) against kvtier's plain-torch reference
(``PagedAttention(fmt, "torch")``), step by step without an engine: chunks with packed earlier
blocks, side rows, a cached block read in part, beside decode requests of the fused kernel; block
sizes and chunk lengths off block boundaries."""

import pytest

pytest.importorskip("vllm.v1")

import torch  # noqa: E402

from kvtier.codecs.pages import PageFormat  # noqa: E402
from kvtier.kernels import prefill_cpu, vllm_paged_cpu  # noqa: E402
from kvtier.kernels.build import cpu_has_avx512  # noqa: E402
from kvtier.vllm.pages.attention import PagedAttention  # noqa: E402
from kvtier.vllm.pages.paged import SideBuffer, plan_step  # noqa: E402
from kvtier.vllm.pages.policy import PagePolicy  # noqa: E402

H, HQ, D = 3, 9, 64

AVX512 = cpu_has_avx512()

pytestmark = pytest.mark.skipif(not vllm_paged_cpu.available(), reason="no C++ build")


@pytest.mark.parametrize(
    "policy",
    [
        PagePolicy(block_size=32),
        PagePolicy(block_size=64, sink_tokens=2, key_group=32),
        PagePolicy(block_size=64),  # pages kvtier's bf16 kernel reads in place
        PagePolicy(block_size=64, value_bits=3),
    ],
)
def test_prefill_through_vllm_matches_torch_reference(policy: PagePolicy) -> None:
    torch.manual_seed(0)
    T = policy.block_size
    fmt = PageFormat(policy, H, D, torch.bfloat16)
    side = SideBuffer(8, T, H, D, torch.bfloat16)
    pages = torch.zeros(64, fmt.page_bytes, dtype=torch.uint8)
    att = PagedAttention.for_engine(fmt, HQ)  # what the metadata builder makes
    assert att.kernel.name == "cpp" and att.prefill is not None
    assert att.prefill_paged == (prefill_cpu.available() and T % 64 == 0 and not policy.sink_tokens)
    reference = PagedAttention(fmt, "torch")
    kernel_only = PagedAttention(fmt, "cpp")  # the same C++ rows, the chunks through the torch reference
    tables = {"a": list(range(1, 8)), "b": list(range(8, 14)), "c": [1, 2, 14, 15, 16]}
    done = {"a": 0, "b": 0, "c": 0}
    steps = [
        {"a": T + 5, "b": 40},  # chunks off block boundaries
        {"a": 2 * T + 9, "b": 1},  # a: packed blocks + side rows before its chunk; b decodes (fused kernel)
        {"a": 1, "b": T + 3},
        {"c": 1},  # c shares a's first two blocks: recomputes token 2T-1 (a cached block read in part)...
        {"c": T + 20, "a": 1},  # ... then a chunk after it
    ]
    rewinds = {3: {"c": 2 * T - 1}}
    seqs = {n: (torch.randn(6 * T, H, D).bfloat16(), torch.randn(6 * T, H, D).bfloat16()) for n in tables}
    seqs["c"][0][: 2 * T], seqs["c"][1][: 2 * T] = seqs["a"][0][: 2 * T], seqs["a"][1][: 2 * T]
    worst = 0.0
    for i, sched in enumerate(steps):
        done.update(rewinds.get(i, {}))
        names = list(sched)
        qsl, lens = [0], []
        for n in names:
            qsl.append(qsl[-1] + sched[n])
            lens.append(done[n] + sched[n])
        width = max(len(tables[n]) for n in names)
        bt = torch.tensor([tables[n] + [0] * (width - len(tables[n])) for n in names])
        k = torch.cat([seqs[n][0][done[n] : done[n] + sched[n]] for n in names])
        v = torch.cat([seqs[n][1][done[n] : done[n] + sched[n]] for n in names])
        q = torch.randn(qsl[-1], HQ, D).bfloat16()
        step = plan_step(side, qsl, lens, bt, qsl[-1])
        layer = side.layer("l0")
        ref = reference.run(reference.plan(step), pages, layer, q, k, v, D**-0.5)
        plan = att.plan(step)
        left = kernel_only.plan(step).rest
        assert [p.req for p in plan.prefill] == ([r for r, _ in left["reqs"]] if left else [])
        assert plan.kernel == kernel_only.plan(step).kernel and plan.rest is None
        assert len(plan.prefill) <= sum(s > 16 for s in sched.values())
        for p in plan.prefill:  # the path is decided in plan: vLLM's tensors only for vLLM's kernel
            exact = not (p.req.packed or p.req.head_rows)
            in_place = bool(p.req.packed) and not p.req.head_rows and att.prefill_paged
            assert p.kvtier_kernel == ((exact and att.prefill_bf16) or in_place)
            assert (p.pids is not None) == in_place
            assert (p.scheduler_metadata is None) == p.kvtier_kernel
        out = torch.full((qsl[-1], HQ, D), float("nan"), dtype=torch.bfloat16)
        att.run(plan, pages, layer, q, k, v, D**-0.5, out=out)
        err = (out.float() - ref).abs()
        # the bf16 output's rounding on top of fp32 error (chunks over packed blocks run in fp32);
        # chunks with no packed block round their probabilities to bf16, in kvtier's bf16 kernel
        # (kvtier.kernels.prefill_cpu, measured 0.0116 at 4.56) or, without AVX-512, in vLLM's
        # portable CPU attention (measured 0.0155): up to ~2^-8 of the row's largest value
        tol = 2e-5 + 2**-8 * ref.abs()
        if not AVX512 or prefill_cpu.available():
            tol = tol + 2**-7 * ref.abs().amax(-1, keepdim=True)
        assert (err <= tol).all(), (i, err.max().item(), ref.abs().amax().item())
        worst = max(worst, err.max().item())
        att.update(plan, pages, layer, k, v)
        for n in names:
            done[n] += sched[n]
    assert worst > 0  # the bf16 paths do differ from the fp32 reference: the comparison is live
