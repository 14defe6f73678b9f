"""kvtier's packed vLLM pages without vLLM: page codec, side buffer bookkeeping, and the torch
attention of a whole step against a float64 reference over the same (decoded) keys and values.

A fake engine hands out block ids and schedules steps the way vLLM's scheduler does (chunked
prefill, decode, several requests per step, prefix-cache hits of full blocks, the recomputed last
token of a fully cached prompt); the reference keeps every request's exact K/V and reads the
blocks that were full before a step through ``decode(encode(block))``.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F

from kvtier.codecs.pages import PageFormat
from kvtier.kernels import vllm_paged_cpu
from kvtier.vllm.pages import paged
from kvtier.vllm.pages.attention import PagedAttention, TritonPages
from kvtier.vllm.pages.paged import SideBuffer, SideSlotLost, plan_step
from kvtier.vllm.pages.policy import PAGE_POLICIES, PagePolicy, get_page_policy

H, HQ, D = 3, 9, 64


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bits": 5},
        {"value_bits": 6},
        {"value_bits": 3, "bits": None},
        {"value_rotation": 1},
        {"value_rotation": True, "bits": None},
        {"block_size": 100},
        {"block_size": 16},
        {"sink_tokens": 128},
        {"sink_tokens": -1},
        {"key_group": 48},
        {"value_group": 24},
        {"side_slots": 0},
        {"bits": True},
        {"sparse_mass": 1.0},
        {"sparse_mass": 0.12345},
        {"sparse_mass": True},
        {"sparse_mass": 0.9, "bits": None},
        {"local_window": -1},
    ],
)
def test_policy_rejects(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="PagePolicy"):
        PagePolicy(**kwargs)


def test_policy_name_round_trip() -> None:
    from kvtier.vllm.pages.policy import parse_policy_name, policy_name

    more = [PagePolicy(sparse_mass=0.9999, local_window=0), PagePolicy(bits=2, value_bits=8, value_rotation=True)]
    for p in [*(v[0] for v in PAGE_POLICIES.values()), *more]:
        assert parse_policy_name(policy_name(p)) == p


def test_presets_and_page_bytes() -> None:
    assert get_page_policy("default") is PAGE_POLICIES["default"][0]
    with pytest.raises(ValueError, match="unknown"):
        get_page_policy("nope")
    fmt = PageFormat(get_page_policy("default"), H, D, torch.bfloat16)
    # codes 2 x 32 B, value scale+zero 4 B, key scale+zero 4 * 64 B over 128 tokens: 70 B per cell
    assert (fmt.cell_bytes, fmt.page_bytes, fmt.exact_page_bytes) == (70, 26880, 98304)
    sinks = PageFormat(PagePolicy(block_size=256, sink_tokens=1), H, D, torch.bfloat16)
    assert sinks.cell_bytes == 70 and sinks.used_bytes == sinks.page_bytes  # the sink fills the spare byte
    # compact: value codes 24 B instead of 32: 62 B per cell, 256 / 62 = 4.13x bf16
    compact = PageFormat(get_page_policy("compact"), H, D, torch.bfloat16)
    assert compact.cell_bytes == 62 and compact.policy.kernel_codes
    assert not PagePolicy(bits=3).kernel_codes and not PagePolicy(value_bits=2).kernel_codes


@pytest.mark.parametrize(
    "policy",
    [
        PagePolicy(),
        PagePolicy(bits=2, key_group=32),
        PagePolicy(block_size=64, sink_tokens=3),
        PagePolicy(value_bits=3),
        PagePolicy(bits=3, value_bits=8, block_size=64, sink_tokens=1),
    ],
)
def test_round_trip_bound(policy: PagePolicy) -> None:
    torch.manual_seed(0)
    fmt = PageFormat(policy, H, D, torch.bfloat16)
    T, s = policy.block_size, policy.sink_tokens
    k = (torch.randn(4, H, T, D) * torch.linspace(0.1, 8, D)).bfloat16()
    k[:, :, 0] *= 50  # a sink-like outlier token
    v = torch.randn(4, H, T, D).bfloat16()
    v[1] = 0.5  # constant groups
    pages = fmt.encode(k, v)
    kd, vd = fmt.decode(pages)
    f = fmt.views(pages)
    kscale = f["kscale"].float().repeat_interleave(fmt.key_group, dim=2)  # [N, H, T, D]
    vscale = f["vscale"].float().repeat_interleave(fmt.value_group, dim=-1)
    kerr, verr = (kd - k.float()).abs(), (vd - v.float()).abs()
    assert (kerr[:, :, s:] <= 0.5 * kscale[:, :, s:] * (1 + 2**-8) + 1e-6).all()
    assert (verr <= 0.5 * vscale * (1 + 2**-8) + 1e-6).all()
    assert torch.isfinite(vd[1]).all() and (vd[1] - 0.5).abs().max() < 1e-2  # constant groups: no NaN
    if s:
        assert torch.equal(kd[:, :, :s], k[:, :, :s].float()) and torch.equal(vd[:, :, :s], v[:, :, :s].float())


def torch_path(fmt: PageFormat) -> PagedAttention:
    """The plain-torch reference (every request)."""
    return PagedAttention(fmt, "torch")


class FakeEngine:
    """Block ids, side buffer, pages and the reference K/V of each request."""

    def __init__(
        self, policy: PagePolicy, slots: int = 8, blocks: int = 64, attend=torch_path, oracle=None,  # noqa: ANN001
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:  # fmt: skip
        # attend(fmt) -> the PagedAttention under test (it packs too: C++ for the C++ backend, else torch);
        # oracle: one whose output the step is compared with instead of the float64 reference
        self.variant, self.dtype = attend, dtype
        self.fmt = PageFormat(policy, H, D, dtype)
        self.att = attend(self.fmt)
        self.oracle = oracle(self.fmt) if oracle is not None else None
        self.T = policy.block_size
        self.side = SideBuffer(slots, self.T, H, D, dtype)
        self.pages = torch.zeros(blocks, self.fmt.page_bytes, dtype=torch.uint8)
        self.next_block = 1
        self.table: dict[str, list[int]] = {}
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.done: dict[str, int] = {}

    def add(self, name: str, length: int, share: tuple[str, int] | None = None) -> None:
        self.k[name] = torch.randn(length, H, D).to(self.dtype)
        self.v[name] = torch.randn(length, H, D).to(self.dtype)
        self.table[name], self.done[name] = [], 0
        if share:  # a prefix-cache hit: the other request's first full blocks, same tokens
            other, nblocks = share
            n = nblocks * self.T
            self.k[name][:n], self.v[name][:n] = self.k[other][:n], self.v[other][:n]
            self.table[name] = self.table[other][:nblocks]
            self.done[name] = n

    def step(self, sched: dict[str, int], rewind: dict[str, int] | None = None) -> None:
        """Run one step: ``sched`` maps request -> new tokens; ``rewind`` sets a request's computed tokens back."""
        for name, n in (rewind or {}).items():
            self.done[name] = n
        names = list(sched)
        qsl, lens = [0], []
        for name in names:
            c, q = self.done[name], sched[name]
            while len(self.table[name]) * self.T < c + q:
                self.table[name].append(self.next_block)
                self.next_block += 1
            qsl.append(qsl[-1] + q)
            lens.append(c + q)
        width = max(len(self.table[n]) for n in names)
        bt = torch.tensor([self.table[n] + [0] * (width - len(self.table[n])) for n in names])
        q_all = torch.randn(qsl[-1], HQ, D).to(self.dtype)
        k_new = torch.cat([self.k[n][self.done[n] : self.done[n] + sched[n]] for n in names])
        v_new = torch.cat([self.v[n][self.done[n] : self.done[n] + sched[n]] for n in names])
        packed_before = set(self.side.packed)
        step = plan_step(self.side, qsl, lens, bt, qsl[-1])
        plan = self.att.plan(step)
        side = self.side.layer("layer0")
        if self.oracle is not None:
            oracle = self.oracle.run(self.oracle.plan(step), self.pages, side, q_all, k_new, v_new, D**-0.5).double()
        bf16_out = getattr(self.variant, "bf16_out", False)
        out = None
        if bf16_out:  # written into a bf16 output, as into vLLM's
            out = torch.full((qsl[-1], HQ, D), float("nan"), dtype=torch.bfloat16)
        threads = torch.get_num_threads()
        torch.set_num_threads(getattr(self.variant, "threads", threads))
        try:
            out = self.att.run(plan, self.pages, side, q_all, k_new, v_new, D**-0.5, out=out)
        finally:
            torch.set_num_threads(threads)
        for i, name in enumerate(names):
            c, q = self.done[name], sched[name]
            if self.oracle is not None:
                ref = oracle[qsl[i] : qsl[i + 1]]
            else:
                ref = self.reference(name, q_all[qsl[i] : qsl[i + 1]], c, q, packed_before)
            err = (out[qsl[i] : qsl[i + 1]].double() - ref).abs()
            tol = 2e-5 + (ref.abs() * 2**-8 if bf16_out else 0)  # bf16 output: its rounding on top
            assert (err <= tol).all(), (name, c, q, err.max().item())
        self.att.update(plan, self.pages, side, k_new, v_new)
        for name in names:
            self.done[name] += sched[name]
            full = self.done[name] // self.T
            for j in range(full):  # every full block is packed, with the request's own tokens
                kd, vd = self.fmt.decode(self.pages[self.table[name][j] : self.table[name][j] + 1])
                ke, ve = self.quantized(name, j)
                assert torch.equal(kd[0], ke) and torch.equal(vd[0], ve)

    def quantized(self, name: str, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        sl = slice(j * self.T, (j + 1) * self.T)
        k, v = self.fmt.decode(
            self.fmt.encode(self.k[name][sl].transpose(0, 1)[None], self.v[name][sl].transpose(0, 1)[None])
        )
        return k[0], v[0]

    def reference(self, name: str, q: torch.Tensor, c: int, n: int, packed: set[int]) -> torch.Tensor:
        """float64 attention of ``q [n, HQ, D]`` (positions ``c..c+n-1``): blocks full before the step decoded."""
        L, full = c + n, c // self.T
        k, v = self.k[name][:L].double().transpose(0, 1).clone(), self.v[name][:L].double().transpose(0, 1).clone()
        for j in range(full):
            kq, vq = self.quantized(name, j)
            k[:, j * self.T : (j + 1) * self.T], v[:, j * self.T : (j + 1) * self.T] = kq.double(), vq.double()
        if c % self.T and full < len(self.table[name]) and self.table[name][full] in packed:
            kq, vq = self.quantized(name, full)  # a cached full block read in part
            k[:, full * self.T : c], v[:, full * self.T : c] = (
                kq[:, : c % self.T].double(),
                vq[:, : c % self.T].double(),
            )
        mask = torch.ones(n, L, dtype=torch.bool).tril(L - n)
        o = F.scaled_dot_product_attention(
            q.double().transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=D**-0.5, enable_gqa=True
        )
        return o[0].transpose(0, 1)


def fused(fmt: PageFormat) -> PagedAttention:
    """The C++ kernel for decode rows and short chunks over packed blocks, the torch reference for the rest."""
    return PagedAttention(fmt, "cpp")


def fused_only(fmt: PageFormat) -> PagedAttention:
    """The C++ kernel for every request, prefill chunks too (its causal exact-row path)."""
    return PagedAttention(fmt, "cpp", kernel_max_query=1 << 30)


def fused_bf16(fmt: PageFormat) -> PagedAttention:
    """The C++ path writing a bf16 output in place (as the backend writes vLLM's)."""
    return PagedAttention(fmt, "cpp")


fused_bf16.bf16_out = True


def fused_split(fmt: PageFormat) -> PagedAttention:
    """The C++ path with 8 threads: fewer (request, head) tasks than 2 x threads, so the kernel splits
    each request's packed blocks across tasks and merges their softmax states."""
    return PagedAttention(fmt, "cpp")


fused_split.threads = 8


def triton_dense(fmt: PageFormat) -> PagedAttention:
    """The Triton kernel (interpreted on the CPU), splits picked as on a device; packing in torch."""
    return PagedAttention(fmt, "triton")


def triton_split(fmt: PageFormat) -> PagedAttention:
    """The Triton kernel (interpreted on the CPU) with 3 splits per (request, head, row tile): pages,
    the block read in part and the exact unit land in different splits and are merged."""
    return PagedAttention(fmt, TritonPages(num_splits=3))


def triton_bf16(fmt: PageFormat) -> PagedAttention:
    """The Triton kernel writing a bf16 output in place."""
    return PagedAttention(fmt, "triton")


triton_bf16.bf16_out = True


def _triton_available() -> bool:
    try:
        from kvtier.kernels import triton_pages  # noqa: F401
    except ImportError:
        return False
    return True


_NO_KERNEL = pytest.mark.skipif(not vllm_paged_cpu.available(), reason="no C++ build")
_NO_TRITON = pytest.mark.skipif(not _triton_available(), reason="no Triton")
ATTEND = [
    torch_path,
    pytest.param(fused, marks=_NO_KERNEL),
    pytest.param(fused_only, marks=_NO_KERNEL),
    pytest.param(fused_bf16, marks=_NO_KERNEL),
    pytest.param(fused_split, marks=_NO_KERNEL),
    pytest.param(triton_dense, marks=_NO_TRITON),
]
#: the Triton variants the interpreter runs on the small cases only (it runs every program in Python)
ATTEND_SMALL = [pytest.param(triton_split, marks=_NO_TRITON), pytest.param(triton_bf16, marks=_NO_TRITON)]


@pytest.mark.parametrize("attend", ATTEND)
@pytest.mark.parametrize(
    "policy",
    [
        PagePolicy(block_size=32),
        PagePolicy(block_size=64, sink_tokens=2, key_group=32),
        PagePolicy(block_size=32, value_bits=3, value_group=16),
    ],
)
def test_steps_against_reference(policy: PagePolicy, attend) -> None:  # noqa: ANN001
    if attend is triton_dense and policy.sink_tokens:
        pytest.skip("interpreted Triton: sinks and key groups run in test_triton_kernel_reads_every_page_code_width")
    torch.manual_seed(1)
    eng = FakeEngine(policy, attend=attend)
    T = policy.block_size
    eng.add("a", 5 * T + 7)
    eng.add("b", 3 * T + 1)
    eng.step({"a": T + 5, "b": 3})  # chunked prefill off block boundaries, two requests
    eng.step({"a": 1, "b": T - 3})  # decode; b fills its first block exactly
    eng.step({"a": 2 * T, "b": 1})  # a crosses two boundaries in one chunk
    eng.add("c", 4 * T, share=("a", 2))  # prefix-cache hit of a's two full blocks
    eng.step({"a": 1, "b": 1, "c": T - 1})
    for _ in range(3):
        eng.step({"a": 1, "b": 1, "c": 1})
    eng.step({"b": T - 5})
    assert eng.side.slot_of and all(b not in eng.side.packed for b in eng.side.slot_of)


@pytest.mark.parametrize(
    "attend",
    [torch_path, pytest.param(fused, marks=_NO_KERNEL), pytest.param(fused_only, marks=_NO_KERNEL)],
)
@pytest.mark.parametrize("policy", [get_page_policy("default"), get_page_policy("compact")])
def test_steps_at_the_qwen_shape(policy: PagePolicy, attend, monkeypatch) -> None:  # noqa: ANN001
    """Qwen2.5-Coder-1.5B's attention shape (2 KV heads of dim 128, 12 query heads: 6:1 GQA) through
    the shipped page policies: chunked prefill off block boundaries, decode, a prefix-cache hit."""
    import sys

    here = sys.modules[__name__]
    for name, value in (("H", 2), ("HQ", 12), ("D", 128)):
        monkeypatch.setattr(here, name, value)
    torch.manual_seed(3)
    eng = FakeEngine(policy, attend=attend)
    T = policy.block_size
    eng.add("a", 2 * T + 12)
    eng.add("b", T + 3)
    eng.step({"a": T + 5, "b": 3})
    eng.step({"a": T + 3, "b": T - 3})
    eng.add("c", 2 * T + 2, share=("a", 1))
    eng.step({"a": 1, "b": 1, "c": T - 1})
    eng.step({"a": 1, "b": 1, "c": 1})


@pytest.mark.parametrize("attend", ATTEND + ATTEND_SMALL)
def test_recomputed_last_token_of_cached_block(attend) -> None:  # noqa: ANN001
    """A prompt that is all cached blocks: vLLM recomputes its last token into a packed block."""
    torch.manual_seed(2)
    eng = FakeEngine(PagePolicy(block_size=32), attend=attend)
    eng.add("a", 64 + 8)
    eng.step({"a": 64})
    eng.add("b", 64 + 8, share=("a", 2))
    eng.step({"b": 1}, rewind={"b": 63})
    eng.step({"b": 1})


def test_side_slots_exhausted_raises() -> None:
    eng = FakeEngine(PagePolicy(block_size=32), slots=1)
    eng.add("a", 40)
    eng.add("b", 40)
    with pytest.raises(SideSlotLost, match="side slots"):
        eng.step({"a": 3, "b": 3})


def test_lost_slot_raises() -> None:
    side = SideBuffer(8, 32, H, D, torch.bfloat16)
    with pytest.raises(SideSlotLost, match="not kept"):
        plan_step(side, [0, 1], [6], torch.tensor([[4]]), 1)  # block 4 was never written


def test_a_loaded_block_read_in_part_comes_from_its_page_not_from_a_stale_side_slot() -> None:
    """The serving soak's crash (``SideSlotLost: block 371 is partly filled (127 of 128 tokens) but its
    exact tokens were not kept``): vLLM recomputes the last token of a prompt the prefix store held
    whole, so the step reads the first T - 1 rows of a block the store just loaded. A block id the
    side buffer never saw packed raised (and killed the engine); one with a slot left from its last,
    partial use read that slot's rows: another sequence's tokens, silently. The store's worker now
    says which pages it wrote (``page_events.pages_loaded``) and the read comes from the page."""
    from kvtier.vllm.page_events import listen, pages_loaded

    T = 32
    side = SideBuffer(8, T, H, D, torch.bfloat16)
    listen("engine-a", side)
    plan_step(side, [0, 10], [10], torch.tensor([[5]]), 10)  # block 5: a request's partial last block
    stale = side.slot_of[5]
    # a prompt of two blocks the store held whole (6, then 5 or 7), its last token recomputed
    req = plan_step(copy.deepcopy(side), [0, 1], [2 * T], torch.tensor([[6, 5]]), 1).requests[0]
    assert (req.side_slot, req.side_rows) == (stale, T - 1)  # the load unknown: the stale rows
    pages_loaded("engine-b", [6, 5, 7])  # another engine's blocks: not this buffer's
    assert side.slot_of.get(5) == stale
    with pytest.raises(SideSlotLost, match="block 7 is partly filled"):
        plan_step(copy.deepcopy(side), [0, 1], [2 * T], torch.tensor([[6, 7]]), 1)
    pages_loaded("engine-a", [6, 5, 7])
    assert 5 not in side.slot_of and stale in side.free
    for last in (5, 7):
        req = plan_step(copy.deepcopy(side), [0, 1], [2 * T], torch.tensor([[6, last]]), 1).requests[0]
        assert (req.packed, req.head_block, req.head_rows, req.side_slot) == ([6], last, T - 1, -1)


def test_engine_kwargs() -> None:
    from kvtier.vllm import engine_kwargs
    from kvtier.vllm.pages.policy import parse_policy_name

    kw = engine_kwargs("default")
    assert kw["block_size"] == 128 and kw["max_num_seqs"] == 64
    assert parse_policy_name(kw["additional_config"]["kvtier_attention"]) == get_page_policy("default")
    assert "max_num_seqs" not in engine_kwargs("exact")
    with pytest.raises(ValueError, match="side buffer holds 64"):
        engine_kwargs("default", max_num_seqs=65)


@_NO_KERNEL
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "policy",
    [
        PagePolicy(block_size=32),
        PagePolicy(block_size=64, sink_tokens=3, key_group=32),
        PagePolicy(sink_tokens=1),
        PagePolicy(block_size=32, value_bits=3, sink_tokens=2, value_group=32),
    ],
)
def test_fused_update_packs_encode_bytes(policy: PagePolicy, dtype: torch.dtype) -> None:
    """The C++ packer writes PageFormat.encode's bytes (padding included) and the side rows of the torch path,
    from side rows + new tokens, for blocks started earlier and blocks filled within the step."""
    torch.manual_seed(3)
    fmt = PageFormat(policy, H, D, dtype)
    T = policy.block_size
    k = (torch.randn(3 * T, H, D) * torch.linspace(0.01, 8, D)).to(dtype)
    v = torch.randn(3 * T, H, D).to(dtype)
    k[5] *= 60  # an outlier token
    v[T : T + 9] = 0.25  # constant value groups
    k[2 * T :, 1] = -1.5  # a constant key head
    side = torch.randn(4, T, 2, H, D).to(dtype)
    side[2, :7, 0], side[2, :7, 1] = k[2 * T : 2 * T + 7], v[2 * T : 2 * T + 7]  # block 3 started earlier
    side_ref = side.clone()
    key, value = torch.cat((k[: 2 * T], k[2 * T + 7 :], k[:5])), torch.cat((v[: 2 * T], v[2 * T + 7 :], v[:5]))
    plan = paged.StepPlan(key.shape[0], [], [5, 1, 3], [(-1, 0, 0), (-1, 0, T), (2, 7, 2 * T)])
    plan.write_rows = torch.arange(T + 10, T + 15)  # slot 1, offsets 10..14
    plan.write_tokens = torch.arange(3 * T - 7, 3 * T - 2)
    pages = torch.randint(0, 256, (8, fmt.page_bytes), dtype=torch.uint8)
    ref = pages.clone()
    ref_att, att = PagedAttention(fmt, "torch"), PagedAttention(fmt, "cpp")
    ref_att.update(ref_att.plan(plan), ref, side_ref, key, value)
    att.update(att.plan(plan), pages, side, key, value)
    assert torch.equal(pages[[5, 1, 3]], ref[[5, 1, 3]])
    assert torch.equal(side, side_ref)


@_NO_KERNEL
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "policy",
    [
        PagePolicy(block_size=32),
        PagePolicy(block_size=64, sink_tokens=3, key_group=32),
        PagePolicy(block_size=32, value_bits=3, value_group=16),
    ],
)
def test_decode_rows_is_page_decode(policy: PagePolicy, dtype: torch.dtype) -> None:
    """The C++ page decoder gives PageFormat.decode's values in the model dtype, token-major."""
    torch.manual_seed(4)
    fmt = PageFormat(policy, H, D, dtype)
    T = policy.block_size
    k = (torch.randn(5, H, T, D) * torch.linspace(0.01, 8, D)).to(dtype)
    v = torch.randn(5, H, T, D).to(dtype)
    pages = fmt.encode(k, v)
    for out_dtype in (dtype, torch.float32):  # the model dtype, and fp32 (prefill chunks over packed blocks)
        kd, vd = PagedAttention(fmt, "cpp").decode_rows(pages, [3, 0, 4], out_dtype)
        kr, vr = fmt.decode(pages[[3, 0, 4]], out_dtype)
        assert kd.dtype == out_dtype and torch.equal(kd, kr.transpose(1, 2).reshape(-1, H, D))
        assert torch.equal(vd, vr.transpose(1, 2).reshape(-1, H, D))


SPARSE = [
    PagePolicy(block_size=32, sparse_mass=0.9, local_window=20),
    PagePolicy(block_size=64, sink_tokens=2, key_group=32, sparse_mass=0.98, local_window=0),
    PagePolicy(block_size=32, value_bits=3, sparse_mass=0.95, local_window=8),
]


def _sparse_steps(eng: FakeEngine) -> None:
    """Prefill chunks (dense), decode steps of 1-4 new tokens over packed blocks (sparse), a
    prefix-cache hit and a cached block read in part (its last token recomputed)."""
    T = eng.T
    eng.add("a", 6 * T + 7)
    eng.add("b", 4 * T + 3)
    eng.step({"a": 3 * T + 5, "b": 2 * T + 1})
    eng.step({"a": 1, "b": 4})
    eng.step({"a": 3, "b": 2})
    eng.step({"a": T - 2, "b": 1})
    eng.add("c", 3 * T + 8, share=("a", 3))
    eng.step({"c": 1, "a": 4}, rewind={"c": 3 * T - 1})  # c: a cached block read in part
    for _ in range(3):
        eng.step({"a": 1, "b": 3, "c": 2})


@_NO_KERNEL
@pytest.mark.parametrize("attend", [fused, fused_bf16, fused_split])
@pytest.mark.parametrize("policy", SPARSE)
def test_sparse_decode_kernel_matches_torch_path(policy: PagePolicy, attend) -> None:  # noqa: ANN001
    """Sparse decode (PagePolicy.sparse_mass) in the fused kernel = the torch path's select_packed."""
    torch.manual_seed(5)
    _sparse_steps(FakeEngine(policy, attend=attend, oracle=torch_path))


@pytest.mark.parametrize("policy", SPARSE)
def test_sparse_decode_close_to_dense(policy: PagePolicy) -> None:
    """The torch path with sparse decode against the float64 dense reference: the dropped tokens
    carry at most 1 - level of a row's packed softmax mass, so each output moves by at most
    2 (1 - level) / level of the largest value (renormalized), and it does move (tokens dropped)."""
    torch.manual_seed(6)
    eng = FakeEngine(policy)
    T, level = policy.block_size, policy.sparse_mass
    eng.add("a", 12 * T)
    eng.step({"a": 10 * T + 3})
    worst = 0.0
    for n in (1, 2, 4):
        q_rows = torch.randn(n, HQ, D).bfloat16()
        c = eng.done["a"]
        k_new, v_new = eng.k["a"][c : c + n], eng.v["a"][c : c + n]
        plan = eng.att.plan(plan_step(eng.side, [0, n], [c + n], torch.tensor([eng.table["a"]]), n))
        assert plan.index["reqs"][0][1]  # decode rows: sparse
        side = eng.side.layer("layer0")
        out = eng.att.run(plan, eng.pages, side, q_rows, k_new, v_new, D**-0.5).double()
        ref = eng.reference("a", q_rows, c, n, set(eng.side.packed))
        bound = 2 * (1 - level) / level * eng.v["a"][: c + n].double().abs().amax()
        err = (out - ref).abs().max().item()
        assert err <= bound + 2e-5, (n, err, bound.item())
        worst = max(worst, err)
        eng.att.update(plan, eng.pages, side, k_new, v_new)
        eng.done["a"] += n
    assert worst > 1e-4  # tokens were dropped: the comparison is live


def test_select_packed_drops_at_most_the_budget() -> None:
    torch.manual_seed(7)
    s = torch.randn(3, 5, 700) * 3
    s[:, :, 0] += 12  # a sink-like token
    forced = torch.zeros(700, dtype=torch.bool)
    forced[-40:] = True
    for level in (0.5, 0.9, 0.98, 0.9999):
        keep = paged.select_packed(s, level, forced)
        w = torch.softmax(s.double(), -1)
        dropped = (w * ~keep.unsqueeze(1)).sum(-1)
        assert (dropped <= 1 - level + 1e-9).all() and keep[:, -40:].all() and keep[:, 0].all()
    assert not paged.select_packed(s, 0.9, forced).all()  # something is dropped at 0.9
    assert paged.select_packed(s, 0.9, forced).sum() <= paged.select_packed(s, 0.98, forced).sum()


@_NO_KERNEL
def test_sparse_decode_counts() -> None:
    """The kernel counts the tokens it scored and valued under sparse decode (fewer valued)."""
    torch.manual_seed(8)
    policy = PagePolicy(block_size=32, sparse_mass=0.9)
    eng = FakeEngine(policy, attend=fused)
    eng.add("a", 10 * 32)
    eng.step({"a": 8 * 32})
    c = eng.done["a"]
    plan = eng.att.plan(plan_step(eng.side, [0, 1], [c + 1], torch.tensor([eng.table["a"] + [eng.next_block]]), 1))
    counts = torch.zeros(2, dtype=torch.long)
    k1, v1 = eng.k["a"][c : c + 1], eng.v["a"][c : c + 1]
    q1 = torch.randn(1, HQ, D).bfloat16()
    eng.att.run(plan, eng.pages, eng.side.layer("layer0"), q1, k1, v1, 0.125, counts=counts)
    assert counts[1] == 8 * 32 * H and 0 < counts[0] < counts[1]


def test_fused_paths_refuse_codes_the_kernel_cannot_read() -> None:
    """3-bit keys or 2-bit values go through the torch path (the engine's choice); the C++ backend
    refuses them when it is named."""
    for policy in (PagePolicy(block_size=32, bits=3), PagePolicy(block_size=32, value_bits=2)):
        fmt = PageFormat(policy, H, D, torch.bfloat16)
        assert PagedAttention(fmt).kernel.name == "torch"
        with pytest.raises(ValueError, match="4-bit keys with 4- or 3-bit values"):
            PagedAttention(fmt, "cpp")


@_NO_TRITON
@pytest.mark.parametrize(
    "policy, dtype, attend",
    [
        (PagePolicy(block_size=32, bits=2, value_bits=8, sink_tokens=3), torch.float32, triton_split),
        (PagePolicy(block_size=64, bits=8, value_bits=2, key_group=16, value_group=32), torch.float16, triton_dense),
        (PagePolicy(block_size=32, bits=3, value_bits=4, sink_tokens=1, value_group=8), torch.bfloat16, triton_bf16),
    ],
)
def test_triton_kernel_reads_every_page_code_width(policy: PagePolicy, dtype: torch.dtype, attend) -> None:  # noqa: ANN001
    """The Triton kernel reads pages of any code width (the C++ kernels: 4-bit keys only), exact sinks in
    fp32 / fp16 / bf16, key groups smaller than a block, narrow value groups: against the float64 reference."""
    torch.manual_seed(7)
    eng = FakeEngine(policy, attend=attend, dtype=dtype)
    T = policy.block_size
    eng.add("a", 3 * T + 5)
    eng.add("b", 2 * T + 9)
    eng.step({"a": T + 3, "b": T - 1})
    eng.step({"a": 1, "b": T + 2})
    eng.add("c", 3 * T, share=("a", 1))
    eng.step({"a": 2, "b": 1, "c": 5})
    eng.step({"c": 1}, rewind={"c": T - 1})  # a cached block read in part


@_NO_TRITON
def test_triton_path_refusals() -> None:
    """Sparse decode has no Triton path (refused, not silently dense); a layout that does not match the
    pages, or index tensors on another device or dtype, are refused with one line."""
    from kvtier.kernels import triton_pages

    eng = FakeEngine(PagePolicy(block_size=32, sparse_mass=0.9))
    eng.add("a", 40)
    step = plan_step(eng.side, [0, 40], [40], torch.tensor([[1, 2]]), 40)
    q, k, v = torch.randn(40, HQ, D), torch.randn(40, H, D), torch.randn(40, H, D)
    side = eng.side.layer("layer0")
    with pytest.raises(ValueError, match="sparse_mass has no Triton path"):
        PagedAttention(eng.fmt, "triton")
    fmt = PageFormat(PagePolicy(block_size=32), H, D, torch.bfloat16)
    pages = torch.zeros(4, fmt.page_bytes, dtype=torch.uint8)
    idx = PagedAttention(fmt, "triton").plan(step, q.device).index
    args = (q, k, v, side, pages, idx["reqs"], idx["pstart"], idx["pids"], torch.empty_like(q), 0.1)
    kw = {"max_query": 40, "max_units": 3}
    with pytest.raises(ValueError, match="layout has"):
        triton_pages.attend(*args, fmt.layout()[:-1], 4, **kw)
    with pytest.raises(ValueError, match="pages"):
        triton_pages.attend(*args[:4], pages[:, 1:], *args[5:], fmt.layout(), 4, **kw)
    with pytest.raises(ValueError, match="int64"):
        triton_pages.attend(*args[:5], idx["reqs"].int(), *args[6:], fmt.layout(), 4, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        triton_pages.attend(q.transpose(0, 1).contiguous().transpose(0, 1), *args[1:], fmt.layout(), 4, **kw)


@_NO_KERNEL
def test_fused_kernels_refuse_indices_out_of_range() -> None:
    """Every index the C++ kernels follow is checked: a request's rows past q / key, a page id or
    side slot outside the buffers, a block whose new tokens run past key - one line naming it,
    never a read or write out of bounds (nothing is written before the checks)."""
    dtype = torch.bfloat16
    fmt = PageFormat(PagePolicy(block_size=32), H, D, dtype)
    T = 32
    pages = fmt.encode(torch.randn(4, H, T, D).to(dtype), torch.randn(4, H, T, D).to(dtype))
    side = torch.randn(2, T, 2, H, D).to(dtype)
    q, key, value = torch.randn(5, HQ, D).to(dtype), torch.randn(5, H, D).to(dtype), torch.randn(5, H, D).to(dtype)
    out = torch.zeros(5, HQ, D)

    def attend(reqs, pids, pstart=None, k=key):
        reqs = torch.tensor(reqs, dtype=torch.long)
        pstart = torch.tensor(pstart or [0, len(pids)], dtype=torch.long)
        vllm_paged_cpu.attend(q, k, value, side, pages, reqs, pstart, torch.tensor(pids, dtype=torch.long), out,
                              0.1, fmt.layout())  # fmt: skip

    attend([[0, 5, 1, 7, -1, 0]], [3, 0])  # in range: runs
    before = out.clone()
    bad = [
        (dict(reqs=[[0, 5, 1, 7, -1, 0]], pids=[3, 4]), "pids[1] = 4 is outside the 4 pages"),
        (dict(reqs=[[0, 5, 1, 7, -1, 0]], pids=[3, -1]), "pids[1] = -1"),
        (dict(reqs=[[0, 6, 1, 7, -1, 0]], pids=[3]), "new tokens [0, 6) outside the 5 rows"),
        (dict(reqs=[[0, 5, 1, 7, -1, 0]], pids=[3], k=key[:4]), "outside the 4 rows"),
        (dict(reqs=[[0, 5, 2, 7, -1, 0]], pids=[3]), "side slot 2 with 7 rows is outside 2 slots"),
        (dict(reqs=[[0, 5, 1, 33, -1, 0]], pids=[3]), "with 33 rows"),
        (dict(reqs=[[0, 5, 1, 7, 9, 4]], pids=[3]), "head block 9 with 4 rows is outside 4 pages"),
        (dict(reqs=[[0, 5, 1, 7, -1, 0]], pids=[3], pstart=[0, 2]), "pstart: pages [0, 2) outside the 1 pids"),
        (dict(reqs=[[0, 2, 0, 0, -1, 0], [2, 5, 1, 7, -1, 0]], pids=[3], pstart=[0, 1]), "pstart: 3 entries"),
    ]
    for kwargs, shown in bad:
        with pytest.raises(RuntimeError, match=re.escape(shown)) as err:
            attend(**kwargs)
        assert "\n" not in str(err.value).strip()
    assert torch.equal(out, before)
    enc = torch.tensor([[1, 0, 4, 3]], dtype=torch.long)  # page 1: 4 side rows of slot 0, then key[3:31]
    writes = torch.zeros(0, 2, dtype=torch.long)
    for enc_bad, writes_bad, shown in [
        ([[4, 0, 4, 0]], None, "enc[0]: page 4 is outside the 4 pages"),
        ([[1, 2, 4, 0]], None, "side slot 2 with 4 rows"),
        (None, None, "new tokens from 3 run past the 5 rows"),
        ([[1, 0, 32, 0]], [[64, 0]], "writes[0]: side row 64"),
        ([[1, 0, 32, 0]], [[3, 5]], "token 5"),
    ]:
        e = enc if enc_bad is None else torch.tensor(enc_bad, dtype=torch.long)
        w = writes if writes_bad is None else torch.tensor(writes_bad, dtype=torch.long)
        with pytest.raises(RuntimeError, match=re.escape(shown)):
            vllm_paged_cpu.update(pages, side, key, value, e, w, fmt.layout())
    with pytest.raises(RuntimeError, match=re.escape("pids[2] = 7 is outside the 4 pages")):
        kd = torch.empty(3 * T, H, D, dtype=dtype)
        vllm_paged_cpu.decode(pages, torch.tensor([0, 1, 7]), kd, kd.clone(), dtype, fmt.layout())


def test_plan_decides_every_request_once() -> None:
    """PagedAttention.plan routes each request of a step once: the C++ kernel takes decode rows and
    short chunks over packed blocks (up to its thresholds), the torch reference the rest (no prefill
    kernels given); sparse decode only for rows of at most SPARSE_MAX_QUERY new tokens; the torch and
    Triton backends take every request. run and update read only the plan."""
    from kvtier.vllm.pages.attention import KERNEL_MAX_CHUNK, KERNEL_MAX_QUERY
    from kvtier.vllm.pages.policy import SPARSE_MAX_QUERY

    T = 32
    fmt = PageFormat(PagePolicy(block_size=T, sparse_mass=0.9), H, D, torch.bfloat16)
    side = SideBuffer(8, T, H, D, torch.bfloat16)
    side.packed.update(range(1, 9))
    # new tokens / packed blocks: decode, a short chunk over packed blocks, a long one, a chunk over nothing
    news = [1, SPARSE_MAX_QUERY + 1, KERNEL_MAX_CHUNK, KERNEL_MAX_CHUNK + 1, KERNEL_MAX_QUERY + 1]
    packed = [2, 2, 2, 2, 0]
    qsl = [0]
    for n in news:
        qsl.append(qsl[-1] + n)
    table = torch.tensor([[1 + 2 * i, 2 + 2 * i, 20 + 3 * i, 21 + 3 * i, 22 + 3 * i] for i in range(5)])
    table[4] = torch.tensor([30, 31, 32, 33, 34])
    step = plan_step(side, qsl, [p * T + n for p, n in zip(packed, news)], table, qsl[-1])
    cpp = PagedAttention(fmt, "cpp") if vllm_paged_cpu.available() else None
    if cpp is not None:
        plan = cpp.plan(step)
        assert [r.qe - r.qs for r in plan.kernel] == news[:3]
        assert [(r.qe - r.qs, sparse) for r, sparse in plan.rest["reqs"]] == [(news[3], False), (news[4], False)]
        assert plan.index["reqs"][:, 1].sub(plan.index["reqs"][:, 0]).tolist() == news[:3]
        assert plan.index["max_query"] == SPARSE_MAX_QUERY and plan.prefill == []
    ref = PagedAttention(fmt, "torch").plan(step)
    assert [sparse for _, sparse in ref.index["reqs"]] == [True, False, False, False, False]
    assert ref.rest is None and [r.qe - r.qs for r in ref.kernel] == news
    with pytest.raises(ValueError, match="backend='cuda' is not allowed"):
        PagedAttention(fmt, "cuda")
    with pytest.raises(ValueError, match="backend must be 'cpp'"):
        PagedAttention(fmt, "torch", prefill=object())
