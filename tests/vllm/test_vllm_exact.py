"""The exact store inside a real vLLM engine (SmolLM2-135M, bf16, CPU): hits after
``reset_prefix_cache``, tokens and NLL identical to vLLM's own prefix cache, concurrent hits, and a
restart in a new process with damaged block files."""

import pytest

# "vllm.v1", not "vllm": without vLLM, tests/vllm itself would import as a namespace package "vllm"
pytest.importorskip("vllm.v1")

from pathlib import Path  # noqa: E402

from vllm_helpers import BLOCK, PREFIX, block_files, close_llm, generate, make_llm, run_child, teacher_nll  # noqa: E402,E501

from kvtier.vllm import kv_transfer_config  # noqa: E402
from kvtier.vllm.store.spec import engine_store  # noqa: E402


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvtier-exact")


@pytest.fixture(scope="module")
def engine(model_path, disk):
    cfg = kv_transfer_config("exact", cpu_bytes=1 << 30, disk_path=disk)
    llm = make_llm(model_path, cfg)
    yield llm, engine_store(cfg.engine_id)
    close_llm(llm)


@pytest.fixture(scope="module")
def results() -> dict:
    return {}


def test_hit_after_reset_is_token_identical_to_vllms_own_prefix_cache(engine, book_ids, results):
    llm, store = engine
    prompt = book_ids[:PREFIX] + book_ids[PREFIX : PREFIX + 40]
    (first,) = generate(llm, [prompt], 16)  # computes and offloads the prompt's blocks
    (own,) = generate(llm, [prompt], 16)  # vLLM's own prefix cache
    assert own[1] >= 2048
    llm.reset_prefix_cache()
    (hit,) = generate(llm, [prompt], 16)  # from kvtier's store only
    assert hit[1] >= 2048, store.stats()
    assert hit[0] == own[0]
    assert store.stats()["loaded"] >= 2048 // BLOCK
    results["a"] = (prompt, hit[0])


def test_teacher_forced_nll_matches_vllms_own_prefix_cache(engine, book_ids):
    llm, store = engine
    ids = book_ids[PREFIX : 2 * PREFIX + 65]  # a new prefix; scored: its last 64 tokens
    generate(llm, [ids[:PREFIX]], 1)  # store the prefix's blocks
    own, own_cached = teacher_nll(llm, ids)
    llm.reset_prefix_cache()
    hit, hit_cached = teacher_nll(llm, ids)
    assert own_cached == hit_cached == PREFIX
    assert abs(hit - own) <= 1e-3, (hit, own)


def test_eight_concurrent_requests_sharing_a_prefix_all_hit(engine, book_ids):
    llm, store = engine
    prefix = book_ids[2 * PREFIX : 3 * PREFIX]
    generate(llm, [prefix + [11]], 1)
    llm.reset_prefix_cache()
    loaded = store.stats()["loaded"]
    outs = generate(llm, [prefix + book_ids[i * 50 : i * 50 + 30] for i in range(8)], 4)
    assert all(cached >= 2048 for _, cached in outs), [c for _, c in outs]
    assert store.stats()["loaded"] - loaded >= PREFIX // BLOCK


def test_restart_hits_from_disk_and_damaged_files_are_misses(engine, book_ids, disk, model_path, results):
    llm, store = engine
    store.flush()
    # prefix b: its block files get damaged; the parent computes the right tokens first
    prompt_b = book_ids[3 * PREFIX : 4 * PREFIX] + book_ids[:20]
    before = set(block_files(disk))
    generate(llm, [prompt_b], 2)  # stores are submitted at the start of the engine's next step
    store.flush()
    new = sorted(set(block_files(disk)) - before, key=lambda p: p.stat().st_mtime_ns)
    assert len(new) == PREFIX // BLOCK
    corrupt, truncated = new[5], new[9]  # blocks 5 and 9 of prefix b
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 3] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    with open(truncated, "r+b") as fh:
        fh.truncate(truncated.stat().st_size // 2)
    # what vLLM computes with blocks 0-4 cached and the rest recomputed (bf16 results depend on that split)
    assert llm.reset_prefix_cache()
    (ref_b,) = generate(llm, [prompt_b], 16, max_load_tokens=5 * BLOCK)
    assert ref_b[1] == 5 * BLOCK, store.stats()
    prompt_a, tokens_a = results["a"]
    job = {"model": model_path, "disk": str(disk), "prompts": [prompt_a, prompt_b]}
    out = run_child("restart_child.py", job)
    (hit_a, cached_a), (hit_b, cached_b) = out["outputs"]
    assert cached_a >= 2048 and hit_a == tokens_a  # a new process hits without recomputing
    # blocks 0-4 hit, block 5 fails its crc32: a miss from there on
    assert cached_b == 5 * BLOCK, (out["stats"], store.stats())
    assert hit_b == ref_b[0]
    assert out["stats"]["corrupt"] == 1
    # both damaged files were replaced by the recomputed blocks the child stored
    assert corrupt.read_bytes() != bytes(data)
    assert corrupt.stat().st_size == truncated.stat().st_size == new[0].stat().st_size
