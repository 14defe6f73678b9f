"""Fixtures of the vLLM adapter tests (nothing of vLLM is imported here, so the main suite, which
has no vLLM, still collects this folder and skips its modules; helpers are in ``vllm_helpers.py``).

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so a test can read the store's
counters; the restart test starts a real second process (``restart_child.py``), and
``test_vllm_mp.py`` runs vLLM's default multiprocessing and tensor parallelism in children
(``mp_child.py``).
"""

from __future__ import annotations

import os

import pytest

ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="session")
def model_path() -> str:
    from kvtier.models import model_dir

    return str(model_dir())


@pytest.fixture(scope="session")
def book_ids(model_path: str) -> list[int]:
    """Token ids of the book shipped with kvtier (Dracula, chapters I-XII)."""
    from transformers import AutoTokenizer

    from kvtier.eval.texts import shipped_book

    (text,) = shipped_book().values()
    return AutoTokenizer.from_pretrained(model_path)(text[:200_000])["input_ids"]
