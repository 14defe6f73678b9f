"""The default (4-bit, stepping down to 3-bit) store inside a real vLLM engine: teacher-forced NLL
against exact KV, bytes on disk against bf16, and overfilling a small RAM budget."""

import pytest

# "vllm.v1", not "vllm": without vLLM, tests/vllm itself would import as a namespace package "vllm"
pytest.importorskip("vllm.v1")

from pathlib import Path  # noqa: E402

from vllm_helpers import BLOCK, PREFIX, block_files, close_llm, generate, make_llm, teacher_nll  # noqa: E402

from kvtier.vllm import kv_transfer_config  # noqa: E402
from kvtier.vllm.store.spec import engine_store  # noqa: E402

#: RAM budget: the first three prefixes at 4-bit fit (~58 MB), the later ones overfill it
CPU_BYTES = 64 << 20


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvtier-default")


@pytest.fixture(scope="module")
def engine(model_path, disk):
    cfg = kv_transfer_config("default", cpu_bytes=CPU_BYTES, disk_path=disk)
    llm = make_llm(model_path, cfg, disable_log_stats=False)  # kvtier's series in vLLM's metrics
    yield llm, engine_store(cfg.engine_id)
    close_llm(llm)


def test_nll_within_005_of_exact_and_bytes_on_disk(engine, book_ids, disk):
    """Mean over three windows of the book: 64 tokens are few, one window alone is noisy (±0.05)."""
    llm, store = engine
    # scored: the book's 64 tokens after each prefix (and one more)
    windows = [book_ids[s : s + PREFIX + 65] for s in (1000, 9000, 17000)]
    for ids in windows:
        generate(llm, [ids[:PREFIX]], 2)
    exact = [teacher_nll(llm, ids) for ids in windows]  # vLLM's own prefix cache: exact bf16 KV
    assert [c for _, c in exact] == [PREFIX] * 3
    llm.reset_prefix_cache()
    lossy = [teacher_nll(llm, ids) for ids in windows]  # the prefixes from kvtier's 4-bit store
    assert [c for _, c in lossy] == [PREFIX] * 3, store.stats()
    delta = sum(a - b for (a, _), (b, _) in zip(lossy, exact)) / 3
    assert delta <= 0.05, (lossy, exact)
    store.flush()
    files = block_files(disk)
    assert len(files) == 3 * PREFIX // BLOCK
    bf16 = 3 * PREFIX * store.fmt.exact_bytes // BLOCK
    assert sum(f.stat().st_size for f in files) <= 0.30 * bf16


def test_overfilling_ram_steps_down_and_recent_prefixes_still_hit(engine, book_ids):
    llm, store = engine
    prefixes = [book_ids[20_000 + i * 2000 : 20_000 + i * 2000 + 12 * BLOCK] for i in range(6)]
    for p in prefixes:
        generate(llm, [p + [13]], 2)
    generate(llm, [[1, 2, 3]], 2)  # one more step: the last stores are submitted
    store.flush()
    store.maintain()
    st = store.stats()
    assert st["step_downs"] > 0 and st["to_disk"] > 0, st
    assert store.ram_bytes <= CPU_BYTES
    llm.reset_prefix_cache()
    outs = generate(llm, [prefixes[-1] + [17], book_ids[1000 : 1000 + PREFIX] + [17]], 2)
    assert [cached for _, cached in outs] == [12 * BLOCK, PREFIX]  # RAM (recent) and disk (oldest) both hit


def test_kvtier_series_in_vllms_metrics(engine):
    """The store's counters reach vLLM's Prometheus registry (what the server's /metrics serves)."""
    llm, store = engine
    st = store.stats()
    metrics = {m.name: m for m in llm.get_metrics() if m.name.startswith("vllm:kvtier_")}
    assert {"vllm:kvtier_store_blocks_stored", "vllm:kvtier_store_lookup_hits", "vllm:kvtier_store_ram_bytes"} <= set(
        metrics
    ), metrics
    assert metrics["vllm:kvtier_store_blocks_stored"].value == st["stored"] > 0
    assert metrics["vllm:kvtier_store_lookup_hits"].value > 0
    assert metrics["vllm:kvtier_store_step_downs"].value == st["step_downs"] > 0
