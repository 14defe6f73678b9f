"""The prefix store as vLLM is deployed: under its default multiprocessing (the worker in a process
of its own, the store in the engine core) and with tensor parallelism 2 (two worker processes, each
copying its KV heads of every block through the shared transfer slots). Hits after
``reset_prefix_cache`` and after a restart from disk, ``exact`` greedy tokens identical to vLLM's
own prefix hit, kvtier's series in the metrics vLLM's frontend sees; a read-only, pre-filled block
volume (a real tmpfs remounted read-only) serves its blocks while new prefixes are computed and kept
in RAM, the engine never stalling; a tensor-parallel layout the store cannot split is refused when
the engine is built."""

import os
import shutil
import subprocess

import pytest

# "vllm.v1", not "vllm": without vLLM, tests/vllm itself would import as a namespace package "vllm"
pytest.importorskip("vllm.v1")

from pathlib import Path  # noqa: E402

from vllm_helpers import BLOCK, PREFIX, run_child  # noqa: E402

from kvtier.vllm.store.slots import slot_dir  # noqa: E402

MP = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # vLLM's default, which the suite turns off elsewhere
STEPS = [["gen", 0], ["gen", 0], ["reset"], ["gen", 0]]  # compute + store, vLLM's own hit, the store's hit
VOCAB = 4096


def _tiny_model(path: Path, kv_heads: int) -> str:
    """A random 2-layer :func:`kvtier.testing.tiny_llama` (4 query heads of 64, ``kv_heads`` KV
    heads; decisive greedy tokens) saved in bf16 for vLLM."""
    import torch

    from kvtier.testing import tiny_llama

    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64)
    tiny_llama(0, torch.bfloat16, vocab_size=VOCAB, num_key_value_heads=kv_heads, **shape).save_pretrained(path)
    return str(path)


def _leftovers() -> list[Path]:
    return sorted(slot_dir().glob("kvtier-*.slots"))


def _hits_after_reset_and_restart(job: dict) -> None:
    before = _leftovers()
    out = run_child("mp_child.py", {**job, "steps": STEPS}, env=MP)
    (_, first_cached), (own, own_cached), (hit, hit_cached) = out["outputs"]
    assert first_cached == 0 and own_cached >= 2048
    assert hit_cached >= 2048  # from kvtier's store only
    assert hit == own
    metrics = out["metrics"]
    assert metrics["vllm:kvtier_store_blocks_stored"] >= PREFIX // BLOCK, metrics
    assert metrics["vllm:kvtier_store_blocks_loaded"] >= 2048 // BLOCK, metrics
    restart = run_child("mp_child.py", {**job, "steps": [["gen", 0]]}, env=MP)
    ((again, cached),) = restart["outputs"]
    assert cached >= 2048 and again == own  # a new server hits from disk
    assert _leftovers() == before  # no transfer area outlives its engine


def test_store_under_vllms_default_multiprocessing(model_path, book_ids, tmp_path):
    prompt = book_ids[: PREFIX + 40]
    _hits_after_reset_and_restart({"model": model_path, "disk": str(tmp_path), "prompts": [prompt]})


def test_store_with_tensor_parallel_2(book_ids, tmp_path):
    model = _tiny_model(tmp_path / "model", kv_heads=2)
    prompt = [i % VOCAB for i in book_ids[: PREFIX + 40]]
    job = {"model": model, "disk": str(tmp_path / "blocks"), "prompts": [prompt], "tp": 2}
    _hits_after_reset_and_restart({**job, "kwargs": {"skip_tokenizer_init": True}})


def test_tensor_parallel_over_too_few_kv_heads_is_refused_at_build(tmp_path):
    model = _tiny_model(tmp_path / "model", kv_heads=1)  # vLLM replicates the one KV head on both ranks
    job = {"model": model, "disk": str(tmp_path / "blocks"), "prompts": [], "steps": [], "tp": 2}
    out = run_child("mp_child.py", {**job, "kwargs": {"skip_tokenizer_init": True}}, env=MP, fails=True)["output"]
    assert "KV heads (1) split evenly" in out, out[-3000:]


def test_read_only_prefilled_volume_serves_hits_and_never_stalls(model_path, book_ids, tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a read-only tmpfs needs root")
    volume = tmp_path / "volume"
    volume.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(volume)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("this process may not mount a tmpfs")
    try:
        old, new = book_ids[: PREFIX + 40], book_ids[30_000 : 30_000 + PREFIX + 40]
        job = {"model": model_path, "disk": str(volume), "prompts": [old, new, [1, 2, 3]]}
        run_child("mp_child.py", {**job, "steps": [["gen", 0], ["gen", 2]]}, env=MP)  # fills the volume
        subprocess.run(["mount", "-o", "remount,ro", str(volume)], check=True, capture_output=True)
        # run_child's timeout bounds the run: before the fix of issue 36 the first new prefix hung the engine
        out = run_child("mp_child.py", {**job, "steps": [["gen", 0], ["gen", 1], ["reset"], ["gen", 1]]}, env=MP)
        (_, old_cached), (_, new_cached), (_, new_again_cached) = out["outputs"]
        assert old_cached >= 2048  # the volume's blocks are served
        assert new_cached == 0 and new_again_cached >= 2048  # computed, then hit from RAM
        assert out["metrics"].get("vllm:kvtier_store_disk_bytes_written", 0) == 0
    finally:
        subprocess.run(["umount", str(volume)], capture_output=True)
