"""Shared fixtures: a tiny random Llama built in code (no files, no network)."""

from __future__ import annotations

import os

# Triton kernels run on CPU tensors through Triton's interpreter (tests/test_triton.py). Triton reads
# the flag when it is first imported, and importing transformers below already imports it (through
# torch._dynamo), so it is set here, before anything else.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from kvtier.testing import tiny_llama, tiny_llama_config  # noqa: E402

__all__ = ["tiny_llama", "tiny_llama_config"]


@pytest.fixture(scope="session")
def model() -> LlamaForCausalLM:
    return tiny_llama()
