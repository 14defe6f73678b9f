"""A tiny random Llama built in code (no files, no network), for the tests and the benchmarks
that need a model but not a real one (``tests/conftest.py``, ``benchmarks/soak.py``).

May import: torch and transformers.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    """4 layers, hidden 64, 4 query / 2 KV heads of dim 16, vocabulary 97; ``overrides`` replace fields."""
    cfg: dict[str, object] = dict(
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


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object) -> LlamaForCausalLM:
    """A random :func:`tiny_llama_config` model in eval mode, seeded; its ``lm_head`` is scaled so
    greedy decoding is decisive (random init gives near-uniform logits)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.pad_token_id = 0
    return model
