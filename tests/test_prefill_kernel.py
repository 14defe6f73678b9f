"""kvtier's bf16 prefill kernel (``kvtier.kernels.prefill_cpu``) against its plain-torch reference:
chunk and context lengths off the 16-query / 64-key tiles, odd key counts, a chunk over earlier
keys, GQA and plain heads, head dims 64 and 128, query rows strided inside a wider tensor, output
rows of other requests untouched; and a clear error for inputs it does not take."""

import pytest
import torch

from kvtier.kernels import prefill_cpu

pytestmark = pytest.mark.skipif(not prefill_cpu.available(), reason="no AVX-512 BF16 build of the prefill kernel")


def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 reference and the kernel's own error bound: probabilities rounded to bf16 (unit
    roundoff 2^-8) move the output by at most 2^-8 * sum_j p_j |v_j|, and the output's rounding
    to bf16 by 2^-8 |out|; fp32 sums and the exp polynomial add ~1e-6 of the same."""
    n, Hq, D = q.shape
    L, H, _ = k.shape
    G = Hq // H
    ref = prefill_cpu.attend_reference(q, k, v, scale)
    qf = q.float().transpose(0, 1)
    kf = k.float().transpose(0, 1).repeat_interleave(G, 0)
    vf = v.float().abs().transpose(0, 1).repeat_interleave(G, 0)
    s = (qf @ kf.transpose(1, 2) * scale).masked_fill(
        torch.arange(L).view(1, L) >= (L - n + torch.arange(n) + 1).view(n, 1), float("-inf")
    )
    pv = (s.softmax(-1) @ vf).transpose(0, 1)  # sum_j p_j |v_j|
    return ref, 2**-8 * (pv + ref.abs()) * (1 + 1e-4) + 1e-6


@pytest.mark.parametrize(
    ("n", "L", "Hq", "H", "D"),
    [
        (1, 1, 9, 3, 64),  # one token
        (1, 203, 9, 3, 64),  # one query over an odd context
        (17, 17, 9, 3, 64),  # one token past a query tile
        (37, 301, 9, 3, 64),  # a chunk over earlier keys, nothing on a tile boundary
        (130, 130, 4, 4, 64),  # no GQA
        (64, 129, 8, 1, 64),  # one KV head for eight
        (33, 95, 4, 2, 128),  # head dim 128
        (200, 200, 2, 1, 128),
    ],
)
def test_prefill_kernel_matches_reference(n: int, L: int, Hq: int, H: int, D: int) -> None:
    torch.manual_seed(n * 1000 + L)
    scale = D**-0.5
    # query rows strided inside a wider [tokens, Hq + 2H, D] tensor, as vLLM's fused qkv projection gives them
    qkv = (torch.randn(L, Hq + 2 * H, D) * 2).bfloat16()
    q = qkv[L - n :, :Hq]
    k, v = qkv[:, Hq : Hq + H], qkv[:, Hq + H :]
    out = torch.full((n + 3, Hq, D), float("nan"), dtype=torch.bfloat16)
    prefill_cpu.attend(q, k, v, out[2 : n + 2], scale)
    ref, tol = bound(q, k, v, scale)
    err = (out[2 : n + 2].float() - ref).abs()
    assert (err <= tol).all(), (err.max().item(), (err / tol).max().item())
    assert out[:2].isnan().all() and out[n + 2 :].isnan().all()  # other rows untouched
    if L > 1:
        assert err.max() > 0  # the bf16 path does differ from the fp32 reference: the comparison is live


def test_prefill_kernel_handles_large_scores() -> None:
    """Scores of ~±500 (no overflow in exp, masked keys never leak in)."""
    torch.manual_seed(1)
    q = (torch.randn(50, 4, 64) * 8).bfloat16()
    k = (torch.randn(90, 2, 64) * 8).bfloat16()
    v = torch.randn(90, 2, 64).bfloat16()
    out = torch.empty(50, 4, 64, dtype=torch.bfloat16)
    prefill_cpu.attend(q, k, v, out, 0.125)
    ref, tol = bound(q, k, v, 0.125)
    assert torch.isfinite(out.float()).all()
    assert ((out.float() - ref).abs() <= tol).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v, o: (q.float(), k, v, o), "bfloat16"),
        (lambda q, k, v, o: (q[..., :48], k[..., :48], v[..., :48], o[..., :48]), "head_dim"),
        (lambda q, k, v, o: (q[:, :5], k, v, o[:, :5]), "multiple"),
        (lambda q, k, v, o: (q, k[:3], v[:3], o), "fewer keys"),
        (lambda q, k, v, o: (q, k, v[:7], o), "token counts"),
        (lambda q, k, v, o: (torch.cat([q, q], -1)[..., ::2], k, v, o), "contiguous last dim"),
    ],
)
def test_prefill_kernel_rejects_bad_inputs(change, message: str) -> None:  # noqa: ANN001
    q, k, v = torch.zeros(6, 6, 64).bfloat16(), torch.zeros(8, 3, 64).bfloat16(), torch.zeros(8, 3, 64).bfloat16()
    o = torch.zeros(6, 6, 64).bfloat16()
    with pytest.raises(RuntimeError, match=message):
        prefill_cpu.attend(*change(q, k, v, o), 0.125)


@pytest.mark.parametrize(
    ("n", "Le", "pages", "Hq", "H", "D", "policy"),
    [
        (37, 40, 2, 9, 3, 64, {}),  # default pages, a chunk after 3 exact side rows, off the tiles
        (128, 128, 3, 9, 3, 64, {"value_bits": 3}),  # compact's 3-bit values
        (5, 70, 1, 9, 3, 64, {"block_size": 64, "key_group": 64}),  # 64-token pages
        (200, 200, 2, 8, 1, 64, {"key_group": 64, "value_bits": 3}),  # two key groups a page, one KV head
        (33, 33, 1, 4, 2, 128, {"value_group": 128}),  # head dim 128
    ],
)
def test_paged_prefill_matches_reference(n: int, Le: int, pages: int, Hq: int, H: int, D: int, policy: dict) -> None:
    """``attend_paged`` over packed pages + exact rows = the fp32 reference over the pages' decoded
    fp32 keys and values: within the kernel's bound, with packed values' p * s rounded to bf16."""
    from kvtier.codecs.pages import PageFormat
    from kvtier.vllm.pages.policy import PagePolicy

    torch.manual_seed(n + 7 * Le)
    fmt = PageFormat(PagePolicy(**policy), H, D, torch.bfloat16)
    T = fmt.tokens
    kp = (torch.randn(pages + 2, H, T, D) * torch.linspace(0.2, 3, D) + torch.linspace(-2, 2, D)).bfloat16()
    vp = (torch.randn(pages + 2, H, T, D) * 1.5 + 0.5).bfloat16()
    store = fmt.encode(kp, vp)  # pages 0 .. pages + 1, read out of order below
    pids = torch.tensor([pages + 1, *range(pages)][:pages], dtype=torch.long)
    kd, vd = fmt.decode(store[pids])  # fp32 [pages, H, T, D]
    kd, vd = kd.transpose(1, 2).reshape(-1, H, D), vd.transpose(1, 2).reshape(-1, H, D)
    qkv = (torch.randn(Le, Hq + 2 * H, D) * 2).bfloat16()
    q, k, v = qkv[Le - n :, :Hq], qkv[:, Hq : Hq + H], qkv[:, Hq + H :]
    out = torch.full((n + 2, Hq, D), float("nan"), dtype=torch.bfloat16)
    prefill_cpu.attend_paged(q, k, v, out[1 : n + 1], D**-0.5, store, pids, fmt.layout())
    kall, vall = torch.cat((kd, k.float())), torch.cat((vd, v.float()))
    ref = prefill_cpu.attend_reference(q, kall, vall, D**-0.5)
    # weights a_j of the rounded probabilities: |s_j (c_j - h)| = |v_j + s_j (z_j - h)| for packed values
    # (centred codes, h = 2^(bits-1)), |v_j| for exact ones
    f = fmt.views(store[pids])
    h = 2 ** (fmt.policy.vbits - 1)
    sz = (f["vscale"].float() * (f["vzero"].float() - h)).transpose(1, 2).reshape(-1, H, 1)
    a = torch.cat(((vd + sz).abs(), v.float().abs()))
    L, G = kall.shape[0], Hq // H
    s = (q.float().transpose(0, 1) @ kall.transpose(0, 1).repeat_interleave(G, 0).transpose(1, 2)) * D**-0.5
    s = s.masked_fill(torch.arange(L).view(1, L) >= (L - n + torch.arange(n) + 1).view(n, 1), float("-inf"))
    pa = (s.softmax(-1) @ a.transpose(0, 1).repeat_interleave(G, 0)).transpose(0, 1)
    tol = 2**-8 * (pa + ref.abs()) * (1 + 1e-3) + 1e-5
    err = (out[1 : n + 1].float() - ref).abs()
    assert (err <= tol).all(), (err.max().item(), (err / tol).max().item())
    assert out[0].isnan().all() and out[n + 1].isnan().all()
    assert prefill_cpu.paged_supported(fmt.layout())


def test_paged_prefill_refuses_pages_it_cannot_read() -> None:
    from kvtier.codecs.pages import PageFormat
    from kvtier.vllm.pages.policy import PagePolicy

    fmt = PageFormat(PagePolicy(block_size=32), 1, 64, torch.bfloat16)  # 32-token pages
    assert not prefill_cpu.paged_supported(fmt.layout())
    x = torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiples of 64"):
        prefill_cpu.attend_paged(x, x, x, x.clone(), 0.125, torch.zeros(1, fmt.page_bytes, dtype=torch.uint8),
                                 torch.zeros(1, dtype=torch.long), fmt.layout())  # fmt: skip


@pytest.mark.parametrize("bad", [-1, 2])
def test_paged_prefill_refuses_page_ids_out_of_range(bad: int) -> None:
    """A page id outside the pool is refused before anything is read."""
    from kvtier.codecs.pages import PageFormat
    from kvtier.vllm.pages.policy import PagePolicy

    fmt = PageFormat(PagePolicy(), 1, 64, torch.bfloat16)
    x = torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    pages = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="out of range"):
        prefill_cpu.attend_paged(x, x, x, x.clone(), 0.125, pages, torch.tensor([0, bad]), fmt.layout())
