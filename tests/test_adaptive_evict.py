"""The eviction rung of the adaptive policy (``AdaptivePolicy.keep < 1``): the attention mass and
the choice against plain loops, the budget held while streaming with tokens dropped, the fast path
against the reference with left padding and GQA, and the accounting of dropped tokens. Tiny random
Llama, no files."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import kvtier
from builders import adaptive_policy, token_ids
from conftest import tiny_llama
from kvtier import AdaptivePolicy
from kvtier.cache.adaptive import attention_mass, select_by_attention
from kvtier.sizing import ModelShape, estimate


# --- the scoring and the choice against plain loops ----------------------------------------------
def test_attention_mass_matches_a_per_row_softmax():
    g = torch.Generator().manual_seed(0)
    B, H, R, N, M, D = 2, 3, 5, 12, 7, 8
    rows, k = torch.randn(B, H, R, D, generator=g), torch.randn(B, H, N, D, generator=g)
    ck = torch.randn(B, H, M, D, generator=g)
    valid, cvalid = torch.rand(B, N, generator=g) > 0.2, torch.rand(B, M, generator=g) > 0.3
    weight = (torch.rand(B, R, generator=g) > 0.3).float()
    got = attention_mass(rows, k, valid, weight, [(ck, cvalid)])
    want = torch.zeros(B, H, N)
    for b in range(B):
        for h in range(H):
            keys = torch.cat([k[b, h][valid[b]], ck[b, h][cvalid[b]]])
            n = int(valid[b].sum())
            for r in range(R):
                p = torch.softmax(keys @ rows[b, h, r], 0)[:n]
                want[b, h, valid[b]] += weight[b, r] * p
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("pool", [1, 3])
def test_select_by_attention_matches_a_loop(pool):
    g = torch.Generator().manual_seed(1)
    B, H, N, D, keep = 3, 2, 16, 4, 6
    k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[1, :12] = False  # left padding: 4 real tokens, fewer than keep
    valid[2, 3] = False  # a captured sink
    mass = torch.rand(B, H, N, generator=g) * valid[:, None]
    kk, kv, kvalid = select_by_attention(k, v, valid, mass, keep, pool=pool)
    assert kk.shape == (B, H, keep, D) and kvalid.shape == (B, keep)
    for b in range(B):
        real = int(valid[b].sum())
        assert kvalid[b].tolist() == [True] * min(keep, real) + [False] * (keep - min(keep, real))
        for h in range(H):
            s = mass[b, h]
            if pool > 1:  # average over the neighbours that exist
                s = torch.stack([s[max(0, i - pool // 2) : i + pool // 2 + 1].mean() for i in range(N)])
            s = s.masked_fill(~valid[b], float("-inf"))
            order = sorted(range(N), key=lambda i: -float(s[i]))[: min(keep, real)]
            want = sorted(order)
            assert torch.equal(kk[b, h, : len(want)], k[b, h, want])
            assert torch.equal(kv[b, h, : len(want)], v[b, h, want])


def test_select_without_queries_keeps_the_newest():
    k = torch.arange(8.0).reshape(1, 1, 8, 1)
    kk, _, kvalid = select_by_attention(k, k, torch.ones(1, 8, dtype=torch.bool), None, 3, pool=1)
    assert kk.flatten().tolist() == [5.0, 6.0, 7.0] and bool(kvalid.all())


@pytest.mark.parametrize("keep,match", [(0.0, "keep"), (0.3, "keep"), (1.5, "keep"), (True, "keep")])
def test_keep_validation(keep, match):
    with pytest.raises(ValueError, match=match):
        AdaptivePolicy(keep=keep)
    assert AdaptivePolicy(keep=0.75).keep_blocks == (3, 4)
    assert AdaptivePolicy().keep_blocks == (1, 1)


# --- streaming -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=3)


def _stream_within_budget(llama, bits: float, keep: float) -> kvtier.TieredCache:
    """640 tokens in calls of 16; the bytes held after every call from ``fit_tokens`` (256) on are
    at most ``bits`` per element."""
    cache = kvtier.TieredCache(llama.config, adaptive_policy(bits, keep=keep))
    ids = token_ids(640)
    with kvtier.enable(llama), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", kvtier.BudgetWarning)  # a budget that holds does not warn
        for s in range(0, ids.shape[1], 16):
            llama(ids[:, s : s + 16], cache=cache, use_cache=True)
            rep = cache.memory_report()
            if s + 16 >= 256:
                assert rep.total_bytes <= bits / 16 * rep.dense_fp16_bytes, (keep, s + 16, rep.ratio * 16)
    return cache


@pytest.mark.parametrize("bits,keep,floor", [(2.5, 0.5, 3.44), (3.0, 1.0, 4.25)])
def test_a_budget_out_of_reach_warns_once_with_what_it_holds(llama, bits, keep, floor):
    # tiny model: sinks + hot ring + the filling block are 36 of fit_tokens=256 tokens, exact
    cache = kvtier.TieredCache(llama.config, adaptive_policy(bits, keep=keep))
    ids = token_ids(640)
    held = {}
    with kvtier.enable(llama), torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(0, ids.shape[1], 16):
            llama(ids[:, s : s + 16], cache=cache, use_cache=True)
            held[s + 16] = cache.memory_report().ratio * 16
    budget = [w for w in caught if issubclass(w.category, kvtier.BudgetWarning)]
    assert len(budget) == 1
    assert f"bits={bits:g} cannot be held at fit_tokens=256" in str(budget[0].message)
    assert f"{floor:.2f} bits per element" in str(budget[0].message)
    assert held[256] == pytest.approx(floor, abs=0.005)  # the floor is what the cache holds there
    assert held[640] <= bits  # and longer contexts come within the budget


@pytest.mark.parametrize("keep", [0.5, 0.25])
def test_budget_holds_with_eviction_and_buys_wider_codes(llama, keep):
    caches = {kp: _stream_within_budget(llama, 5.0, kp) for kp in (1.0, keep)}
    rep = caches[keep].memory_report()
    t = rep.tokens
    assert t["evicted"] > 0 and caches[1.0].memory_report().tokens["evicted"] == 0
    layer = caches[keep].layers[1]
    held = layer.token_counts()
    # every token is somewhere: sinks' slots stay in the block tiers (invalid), dropped ones are counted
    assert held["evicted"] + held["cold"] + held["warm"] + held["hot"] == 640
    # g blocks in, j blocks out: the dropped share of what left the warm window is 1 - keep
    assert held["evicted"] == round((held["evicted"] + held["cold"]) * (1 - keep))

    # the freed bytes buy wider cold codes
    def width(c):
        return sum(a["key_bits"] + a["value_bits"] for a in c.allocation()["layers"].values())

    assert width(caches[keep]) > width(caches[1.0])


def _run(llama, policy, ids, mask, attention, step=37):
    cache = kvtier.TieredCache(llama.config, policy, attention=attention)
    n = ids.shape[1]
    with kvtier.enable(llama), torch.no_grad():
        for s in range(0, n - 4, step):
            e = min(s + step, n - 4)
            llama(ids[:, s:e], cache=cache, use_cache=True, attention_mask=mask[:, :e])
        out = llama(ids[:, n - 4 :], cache=cache, use_cache=True, attention_mask=mask).logits
    return cache, out


def test_eviction_fast_path_matches_reference_with_left_padding_and_gqa(llama):
    assert llama.config.num_attention_heads > llama.config.num_key_value_heads  # GQA
    ids = token_ids(600, seed=5, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0  # left padding
    logits = {}
    for attention in ("fast", "reference"):
        cache, logits[attention] = _run(llama, adaptive_policy(5.0, keep=0.5), ids, mask, attention)
        assert cache.memory_report().tokens["evicted"] > 0
        for layer in cache.layers:
            # pads never enter cold ahead of real tokens; each row's real tokens come first
            cold_valid = layer.cold.fields["valid"]  # [B, 1, n, T]
            blocks = cold_valid[:, 0]  # keep 1/2: each cold block is one group's kept tokens
            assert not bool((blocks[..., 1:] & ~blocks[..., :-1]).any())
            assert bool(blocks[1].sum() < blocks[0].sum())  # row 1's pads were not kept
    assert torch.allclose(logits["fast"], logits["reference"], atol=2e-3, rtol=1e-3)


def test_rows_of_a_padded_batch_evict_alone(llama):
    # a row next to a left-padded one keeps exactly the tokens it keeps alone (one candidate width,
    # so the shared allocation cannot differ): no row's queries or pads vote for another row, and
    # the padded row keeps no pads
    ids = token_ids(560, seed=6)
    other = torch.cat([torch.zeros(1, 32, dtype=ids.dtype), token_ids(528, seed=7)], 1)
    batch = torch.cat([other, ids])
    mask = torch.ones_like(batch)
    mask[0, :32] = 0
    policy = adaptive_policy(5.0, keep=0.5)
    policy = policy.replace(adaptive=dataclasses.replace(policy.adaptive, widths=(3,)))
    alone_cache, alone = _run(llama, policy, ids, torch.ones_like(ids), "reference", step=16)
    both_cache, both = _run(llama, policy, batch, mask, "reference", step=16)
    assert torch.allclose(both[1], alone[0], atol=1e-4)
    for a, b in zip(alone_cache.layers, both_cache.layers):
        assert a.evicted == b.evicted > 0
        for name, t in a.cold.fields.items():
            assert torch.equal(b.cold.fields[name][1], t[0]), name
        real = both_cache.layers[0].cold.fields["valid"][0].sum() + both_cache.layers[0].warm.fields["valid"][0].sum()
        assert int(real) <= 528 - 4  # the padded row's block tiers hold no pad (its 4 sinks are apart)


def test_plan_prices_the_eviction_rung():
    model = tiny_llama(num_hidden_layers=3)
    # binding from fit_tokens on (at 5 bits the planner's steady state has no cold)
    policy = adaptive_policy(3.5, keep=0.5)
    cache = kvtier.TieredCache(model.config, policy)
    ids = token_ids(1500, seed=9)
    with kvtier.enable(model), torch.no_grad():
        for s in range(0, 1500, 100):
            model(ids[:, s : s + 100], cache=cache)
    report = cache.memory_report()
    planned = estimate(ModelShape("tiny", ["full_attention"] * 3, 2, 16), 1500, policy, 1, torch.float32)
    slack = report.tokens["cold"] // 3 * 2 * 16 // 8  # the greedy rule spends to within one width step
    assert abs(planned.total_bytes - report.total_bytes) <= 0.02 * report.total_bytes + slack
    assert abs(planned.tokens["evicted"] - report.tokens["evicted"]) <= 3 * 2 * 16


def test_cache_spec_sets_adaptive_fields():
    from kvtier.eval.caches import cache_spec

    spec = cache_spec("adaptive@2.5:keep=0.25:fit_tokens=1024")
    assert spec.policy.adaptive == AdaptivePolicy(bits=2.5, keep=0.25, fit_tokens=1024)
    assert cache_spec("adaptive@3").policy.adaptive.keep == 0.5  # the preset's rung
    assert cache_spec("adaptive@2.5:sinks=8").policy.sink_tokens == 8
    assert cache_spec("adaptive@2.5").policy.sink_tokens == 32
    with pytest.raises(ValueError, match="adaptive@"):
        cache_spec("adaptive@2.5:nope=1")


# --- a one-call prefill ends the warm-up inside the call -----------------------------------------
@pytest.mark.parametrize("keep,bits", [(0.5, 4.0), (1.0, 4.5)])  # budgets the tiny model can hold
def test_one_call_prefill_ends_within_the_budget(llama, keep, bits):
    # every layer but the last settles while the budget still measures (the last one's block ends
    # the warm-up): the call must still end within ``bits``, as a streamed prompt does
    cache = kvtier.TieredCache(llama.config, adaptive_policy(bits, keep=keep))
    ids = token_ids(640, seed=11)
    with kvtier.enable(llama), torch.no_grad():
        llama(ids, cache=cache, use_cache=True)
    rep = cache.memory_report()
    assert cache.allocation()["allocated"]
    assert rep.total_bytes <= bits / 16 * rep.dense_fp16_bytes, rep.ratio * 16
    counts = [layer.token_counts() for layer in cache.layers]
    assert len({(c["warm"], c["cold"], c["evicted"]) for c in counts}) == 1  # every layer alike
    assert (counts[0]["evicted"] > 0) == (keep < 1)
    with kvtier.enable(llama), torch.no_grad():  # and it decodes on from there
        llama(ids[:, -1:], cache=cache, use_cache=True)


@pytest.mark.parametrize("chunk", [640, 96])  # the prompt in one call; streamed, a call ends the warm-up
def test_the_call_that_ends_the_warm_up_scores_by_one_window_in_every_layer(llama, monkeypatch, chunk):
    # the layers that settle while the budget measures evict afterwards (rebalance) by the call's
    # last REBALANCE_OBS_TOKENS query tokens; the layer whose block ends the warm-up evicts in its
    # own settle and must score by that same window, not by every row of the call
    from kvtier.cache.state import REBALANCE_OBS_TOKENS, LayerState

    seen = []
    real = LayerState._evict_by_attention

    def spy(self, k, v, valid):
        seen.append((self.layer_idx, self.seen, None if self._obs is None else self._obs[1]))
        return real(self, k, v, valid)

    monkeypatch.setattr(LayerState, "_evict_by_attention", spy)
    cache = kvtier.TieredCache(llama.config, adaptive_policy(4.0, keep=0.5))
    ids = token_ids(640, seed=13)
    with kvtier.enable(llama), torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            llama(ids[:, s : s + chunk], cache=cache, use_cache=True)
    first = min(n for _, n, _ in seen)  # the call that ended the warm-up
    ending = {layer: q for layer, n, q in seen if n == first}
    assert set(ending) == set(range(llama.config.num_hidden_layers)), seen
    assert set(ending.values()) == {min(chunk, REBALANCE_OBS_TOKENS)}, ending
    later = {q for _, n, q in seen if n > first}  # streamed calls after it: every row of the call votes
    assert later <= {chunk}, later


def test_a_failed_rebalance_leaves_the_cache_unchanged(llama, monkeypatch):
    from kvtier.cache.state import LayerState

    cache = kvtier.TieredCache(llama.config, adaptive_policy(5.0, keep=0.5))
    ids = token_ids(640, seed=12)
    calls = []

    def fail(self):
        calls.append(self.layer_idx)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return real(self)

    real = LayerState.rebalance
    monkeypatch.setattr(LayerState, "rebalance", fail)
    with kvtier.enable(llama), torch.no_grad(), pytest.raises(RuntimeError, match="disk on fire"):
        llama(ids, cache=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and cache.memory_report().total_bytes == 0
    monkeypatch.setattr(LayerState, "rebalance", real)
    with kvtier.enable(llama), torch.no_grad():  # usable again: the same call now succeeds
        llama(ids, cache=cache, use_cache=True)
    rep = cache.memory_report()
    assert rep.total_bytes <= 5.0 / 16 * rep.dense_fp16_bytes


@pytest.mark.parametrize("keep,bits", [(0.5, 3.5), (0.5, 4.0), (0.25, 3.5)])
def test_budget_holds_from_fit_tokens_with_blocks_waiting_for_a_group(llama, keep, bits):
    # up to g - 1 blocks wait in the warm tier for a whole eviction group: the cold widths are
    # chosen with their warm bytes reserved (these budgets ran over at fit_tokens without that)
    _stream_within_budget(llama, bits, keep)


# --- the warm-up and faults ----------------------------------------------------------------------
def test_a_warm_cap_waits_for_the_allocation(llama):
    # warm_tokens on an adaptive policy caps the warm tier once allocated; during the warm-up every
    # block stays warm, else a one-call prefill would allocate at the first layer's step-down,
    # before the other layers joined (they got the narrowest widths, silently)
    ids = token_ids(400, seed=14)
    caches = {}
    for cap in (None, 32):
        cache = kvtier.TieredCache(llama.config, adaptive_policy(4.5, keep=1.0).replace(warm_tokens=cap))
        with kvtier.enable(llama), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", kvtier.BudgetWarning)
            llama(ids, cache=cache, use_cache=True)
        caches[cap] = cache
    widths = {
        cap: {i: (r["key_bits"], r["value_bits"]) for i, r in c.allocation()["layers"].items()}
        for cap, c in caches.items()
    }
    assert len(widths[32]) == llama.config.num_hidden_layers
    assert None not in {w for kv in widths[32].values() for w in kv}
    assert widths[32] == widths[None]  # the same measurements, so the same allocation
    assert all(layer.token_counts()["warm"] <= 32 for layer in caches[32].layers)  # and the cap holds


@pytest.mark.parametrize("fail_layer", [0, 3])
def test_a_failed_call_puts_the_budget_back(llama, monkeypatch, fail_layer):
    # a call that fails during the warm-up (here: the call that would end it) leaves the budget's
    # measurements and allocation as they were; the same call again gives what a cache that never
    # failed gives, bit for bit
    from kvtier.cache.state import LayerState

    real = LayerState._move
    armed = [False]

    def move(self, token_valid):
        real(self, token_valid)
        if armed[0] and self.layer_idx == fail_layer:
            raise RuntimeError("disk on fire")

    monkeypatch.setattr(LayerState, "_move", move)
    policy = adaptive_policy(4.0, keep=0.5)
    ids = token_ids(160, seed=15)
    clean, faulty = kvtier.TieredCache(llama.config, policy), kvtier.TieredCache(llama.config, policy)
    with kvtier.enable(llama), torch.no_grad():
        for s in range(0, 160, 32):
            want = llama(ids[:, s : s + 32], cache=clean, use_cache=True).logits
            if s == 32:  # the warm-up (64 tokens) ends in this call
                before = repr(faulty.allocation()), [e.tokens for e in faulty.budgets[policy].errors.values()]
                armed[0] = True
                with pytest.raises(RuntimeError, match="disk on fire"):
                    llama(ids[:, s : s + 32], cache=faulty, use_cache=True)
                armed[0] = False
                after = repr(faulty.allocation()), [e.tokens for e in faulty.budgets[policy].errors.values()]
                assert after == before and not faulty.allocation()["allocated"]
            got = llama(ids[:, s : s + 32], cache=faulty, use_cache=True).logits
            assert torch.equal(got, want), s
    assert faulty.allocation() == clean.allocation() and clean.allocation()["allocated"]


def test_plan_prices_a_warm_cap_from_the_warm_up_on(llama):
    # kvtier plan's token slots per tier equal the run's on a capped stream, inside the warm-up
    # (every block warm) and after it (the cap and the budget)
    base = adaptive_policy(4.5, keep=1.0)
    policy = base.replace(warm_tokens=32, adaptive=dataclasses.replace(base.adaptive, warmup_tokens=128))
    shape = ModelShape("tiny", ["full_attention"] * llama.config.num_hidden_layers, 2, 16)
    cache = kvtier.TieredCache(llama.config, policy)
    ids = token_ids(320, seed=1)
    with kvtier.enable(llama), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", kvtier.BudgetWarning)
        for s in range(0, 320, 16):
            llama(ids[:, s : s + 16], cache=cache, use_cache=True)
            if (s + 16) % 32 == 0:
                planned = estimate(shape, s + 16, policy, 1, torch.float32)
                assert planned.tokens == cache.memory_report().tokens, s + 16
