"""Shared fixtures: a tiny random Llama built in code (no files, no network)."""

from __future__ import annotations

import os

# Triton kernels run on CPU tensors through Triton's interpreter (tests/test_triton.py). Triton reads
# the flag when it is first imported, and importing transformers below already imports it (through
# torch._dynamo), so it is set here, before anything else.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def tiny_llama_config(**overrides) -> LlamaConfig:
    cfg = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype).eval()
    # Random init gives near-uniform logits; sharpen them so greedy decoding is decisive.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="session")
def model() -> LlamaForCausalLM:
    return tiny_llama()
