"""The prefix store and kvtier's packed pages in one engine: blocks are stored as the engine's
packed pages (already compressed) and loaded back into pages; against plain vLLM (bf16 pages, no
store) and vLLM's own prefix cache over the same pages."""

from pathlib import Path

import pytest

pytest.importorskip("vllm.v1")

from vllm_helpers import BLOCK, PREFIX, block_files, close_llm, generate, make_llm, run_child, teacher_nll  # noqa: E402,E501

from kvtier.vllm import attention_backend, engine_kwargs, kv_transfer_config  # noqa: E402
from kvtier.vllm.store.spec import engine_store  # noqa: E402

STARTS = (1000, 9000, 17000)


def _capacity(llm) -> int:  # noqa: ANN001
    cfg = llm.llm_engine.vllm_config.cache_config
    return cfg.num_gpu_blocks * cfg.block_size


def _paged(model_path: str, pages: str, store: str, disk: Path):  # noqa: ANN202
    cfg = kv_transfer_config(store, cpu_bytes=256 << 20, disk_path=disk)
    with attention_backend(pages):
        llm = make_llm(model_path, cfg, **engine_kwargs(pages))
    return llm, engine_store(cfg.engine_id)


@pytest.fixture(scope="module")
def plain(model_path, book_ids):
    """Plain vLLM's teacher-forced NLL of each window's last 64 tokens (recomputed), greedy tokens
    after its own prefix hit (a cold prefill of the whole prompt rounds differently), capacity."""
    llm = make_llm(model_path, None)
    try:
        windows = [book_ids[s : s + PREFIX + 65] for s in STARTS]
        nll = [teacher_nll(llm, ids, recompute=True)[0] for ids in windows]
        # the prefix blocks computed from the prompts the store test computes them from: a prompt one
        # token shorter splits its prefill into other GEMM shapes, and bf16 KV rounds differently
        llm.reset_prefix_cache()  # the NLL prompts' blocks: computed in other shapes too
        generate(llm, [w[:PREFIX] + [13] for w in windows], 2)
        greedy = generate(llm, [w[:PREFIX] + [13] for w in windows], 16)  # over vLLM's own prefix hit
        assert [c for _, c in greedy] == [PREFIX] * 3
        yield {"nll": nll, "greedy": [t for t, _ in greedy], "tokens": _capacity(llm)}
    finally:
        close_llm(llm)


def test_default_pages_with_the_default_store(model_path, book_ids, plain, tmp_path):
    """Hits from the store into packed pages: the same NLL as vLLM's own prefix cache over those
    pages (the bytes are stored as they are), within +0.05 nats/token of plain vLLM; the block files
    hold the pages' bytes (0.28 of bf16 at 64-dim heads); capacity >= 3.5x plain vLLM's tokens; a new
    process over the same folder loads them into its pages."""
    llm, store = _paged(model_path, "default", "default", tmp_path)
    windows = [book_ids[s : s + PREFIX + 65] for s in STARTS]
    try:
        tokens = _capacity(llm)
        assert tokens >= 3.5 * plain["tokens"], (tokens, plain["tokens"])
        for ids in windows:
            generate(llm, [ids[:PREFIX]], 2)
        generate(llm, [[1, 2, 3]], 2)  # one more step: the last stores are submitted
        pooled = [teacher_nll(llm, ids) for ids in windows]  # vLLM's prefix cache: the pages themselves
        assert [c for _, c in pooled] == [PREFIX] * 3
        llm.reset_prefix_cache()
        stored = [teacher_nll(llm, ids) for ids in windows]  # the pages from the store
        assert [c for _, c in stored] == [PREFIX] * 3, store.stats()
        assert store.stats()["lookup_hits"] >= 3 * PREFIX // BLOCK
        assert [a for a, _ in stored] == pytest.approx([a for a, _ in pooled], abs=1e-6)
        delta = sum(a for a, _ in stored) / 3 - sum(plain["nll"]) / 3
        ratio = tokens / plain["tokens"]
        print(f"default pages + default store: NLL {delta:+.4f} nats/token vs plain vLLM, {ratio:.2f}x its KV tokens")
        assert delta <= 0.05, (stored, plain["nll"])
        store.flush()
        files = block_files(tmp_path)
        assert len(files) == 3 * PREFIX // BLOCK
        assert sum(f.stat().st_size for f in files) <= 0.30 * 3 * PREFIX * store.fmt.dense_bytes // BLOCK
        llm.reset_prefix_cache()
        # a prompt the store holds whole (block-aligned): vLLM loads every block and recomputes the
        # last token, reading the last loaded page in part (before the fix: SideSlotLost, engine dead)
        whole = [generate(llm, [windows[1][:PREFIX]], 4)[0] for _ in range(2)]
        assert whole[0][1] >= PREFIX - 1 and whole[0][0] == whole[1][0] and len(whole[0][0]) == 4
        llm.reset_prefix_cache()
        ref = generate(llm, [w[:PREFIX] + [13] for w in windows[:1]], 16)[0]
        assert ref[1] == PREFIX
    finally:
        close_llm(llm)
    job = {"model": model_path, "disk": str(tmp_path), "prompts": [windows[0][:PREFIX] + [13]]}
    job |= {"policy": "default", "pages": "default"}
    out = run_child("restart_child.py", job)
    ((tokens_after, cached),) = out["outputs"]
    assert cached == PREFIX and tokens_after == ref[0]


def test_exact_pages_with_the_exact_store_are_plain_vllm(model_path, book_ids, plain, tmp_path):
    """Loaded from the store, the prefixes give the tokens plain vLLM gives over its own prefix hit."""
    llm, store = _paged(model_path, "exact", "exact", tmp_path)
    prompts = [book_ids[s : s + PREFIX] + [13] for s in STARTS]
    try:
        generate(llm, prompts, 2)
        generate(llm, [[1, 2, 3]], 2)  # the engine's next steps copy the last blocks out
        store.flush()  # encoded: a block still pending delays its request a step (another batch, other bf16 GEMMs)
        llm.reset_prefix_cache()
        out = generate(llm, prompts, 16)
        assert [c for _, c in out] == [PREFIX] * 3, store.stats()
        assert [t for t, _ in out] == plain["greedy"]
    finally:
        close_llm(llm)
