"""Tiny random models built in code (no files, no network), for the tests and the benchmarks that
need a model but not a real one (``tests/conftest.py``, ``benchmarks/soak.py``): a Llama (head dim
16), a Qwen2 with the real Qwen2.5-Coder-1.5B's attention shape (head dim 128, 6:1 GQA, q/k/v
biases, rope theta 1e6) and a hybrid Gemma 3 (sliding-window layers beside a full-attention one).

May import: torch and transformers.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

#: Vocabulary and special tokens of every tiny model (token ids 3..96 are plain text).
_TOKENS: dict[str, object] = dict(vocab_size=97, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _decisive(model):  # noqa: ANN001, ANN202
    """Scale ``lm_head`` so greedy decoding is decisive (random init gives near-uniform logits);
    pad id 0 for ``generate``."""
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.pad_token_id = 0
    return model


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    """4 layers, hidden 64, 4 query / 2 KV heads of dim 16, vocabulary 97; ``overrides`` replace fields."""
    cfg: dict[str, object] = dict(
        _TOKENS,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object) -> LlamaForCausalLM:
    """A random :func:`tiny_llama_config` model in eval mode, seeded; its ``lm_head`` is scaled so
    greedy decoding is decisive (random init gives near-uniform logits)."""
    torch.manual_seed(seed)
    return _decisive(LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype).eval())


def tiny_qwen2_config(**overrides: object) -> Qwen2Config:
    """Qwen2.5-Coder-1.5B's attention shape on a tiny body: 2 layers, hidden 96, 12 query / 2 KV
    heads of dim 128 (6:1 GQA), q/k/v biases (Qwen2's), rope theta 1e6, vocabulary 97."""
    cfg: dict[str, object] = dict(
        _TOKENS,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    cfg.update(overrides)
    return Qwen2Config(**cfg)


def tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object) -> Qwen2ForCausalLM:
    """A random :func:`tiny_qwen2_config` model in eval mode, seeded; biases random (Qwen2's are
    large in trained models: keys get a per-channel offset) and ``lm_head`` scaled as in :func:`tiny_llama`."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**overrides)).to(dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return _decisive(model)


def tiny_gemma3_config(**overrides: object) -> Gemma3TextConfig:
    """A hybrid Gemma 3 text model: 4 layers, 3 sliding (window 64) then 1 full attention, hidden 64,
    2 query / 1 KV head of dim 32, vocabulary 97; ``overrides`` replace fields."""
    cfg: dict[str, object] = dict(
        _TOKENS,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=64,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
    )
    cfg.update(overrides)
    return Gemma3TextConfig(**cfg)


def tiny_gemma3(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object) -> Gemma3ForCausalLM:
    """A random :func:`tiny_gemma3_config` model in eval mode, seeded, ``lm_head`` scaled as in :func:`tiny_llama`."""
    torch.manual_seed(seed)
    return _decisive(Gemma3ForCausalLM(tiny_gemma3_config(**overrides)).to(dtype).eval())


def random_ids(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """``[batch, n]`` random token ids of the tiny models' vocabulary (3..96: no pad, bos or eos), seeded."""
    return torch.randint(3, 97, (batch, n), generator=torch.Generator().manual_seed(seed))


def feed(model, cache, ids: torch.Tensor, chunk: int = 256) -> torch.Tensor:  # noqa: ANN001
    """Run ``ids`` through ``model`` in chunks of ``chunk`` tokens with ``cache``; logits of the last chunk."""
    out = None
    for s in range(0, ids.shape[1], chunk):
        with torch.no_grad():
            out = model(ids[:, s : s + chunk], cache=cache, use_cache=True).logits
    return out


def feed_chunks(model, cache, ids: torch.Tensor, mask: torch.Tensor, chunks) -> torch.Tensor:  # noqa: ANN001
    """Run ``ids [B, N]`` through ``model`` with ``cache`` in calls of ``chunks`` tokens (uneven
    sizes summing to at most ``N``), ``mask [B, N]`` the attention mask (left padding included);
    logits of every position fed, ``[B, sum(chunks), vocab]``."""
    out, pos = [], 0
    with torch.no_grad():
        for c in chunks:
            pos += c
            out.append(model(ids[:, pos - c : pos], attention_mask=mask[:, :pos], cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


class ByteTokenizer:
    """A tokenizer of UTF-8 bytes (ids 0-255; id 0 pads, id 4 ends a turn) with a plain chat
    template: enough for code that counts tokens and renders chat prompts (``kvtier.eval.tasks``)
    without a real model's tokenizer. Pair it with a model of ``vocab_size=256``."""

    chat_template = "<user>{content}</user><assistant>"
    name_or_path = "bytes"
    pad_token_id = 0
    eos_token_id = 4

    def __call__(self, text: str, add_special_tokens: bool = False, return_tensors: str | None = None):  # noqa: ANN204
        from types import SimpleNamespace

        ids = list(text.encode("utf-8"))
        return SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True
    ) -> str:
        text = "".join(self.chat_template.format(content=m["content"]) for m in messages)
        return text if add_generation_prompt else text.removesuffix("<assistant>")

    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in (self.pad_token_id, self.eos_token_id)]
        return bytes(ids).decode("utf-8", errors="replace")
