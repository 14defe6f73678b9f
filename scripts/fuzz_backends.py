"""Random tiered states through every CPU attention backend, each against the reference path.

A fuzzer, not a test (the suite's shapes are chosen; these are drawn; ``tests/test_fuzz_backends.py``
runs a few seeded cases): per case a tiny random Llama (head dim 16-128, 1-2 KV heads, GQA 1-3,
2 layers, fp32 or bf16), a random valid ``TierPolicy`` (tier sizes off each other's grid, warm and
cold widths, fp8, signs, eviction, rotation, vq cold codes, sinks, sparse selection at level 1.0,
an offloaded cold tier fetched whole, an adaptive budget with its eviction rung), a batch of 1-3
rows with random left padding fed in random chunks, then decode steps, through
``attention="reference"``. At every layer call, on the state the reference attends over, each
backend (``torch``, ``cpu``, ``fused``) must give the reference's output within ``--tol`` of its
largest magnitude (fp32; bf16 models, 30 % of the cases: one bf16 step, 2^-7). A failure prints
the case (seed, model, policy, chunks) and the largest difference; the script exits 1 if any
failed. Imports kvtier only (``kvtier.testing`` builds the models).

``--states``: the same draws through two caches as the plan picks the path; after every call each
layer holds ``seen`` token slots and (without offloading) reports the bytes reachable from it; at a
drawn call a drawn layer's settle fails after moving its tokens, and the cache must be as before
the call, the retried call bit for bit what the cache that never failed gives; after another drawn
call a deep copy and a pickled copy go on beside and must give the same logits (offloading: both
refused).

    python scripts/fuzz_backends.py --cases 3000 --threads 2
    python scripts/fuzz_backends.py --states --cases 1000 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import pickle
import random
import sys
import time
import warnings
from typing import NamedTuple

import torch

import kvtier
from kvtier import AdaptivePolicy, OffloadPolicy, SparsePolicy, TierPolicy
from kvtier.attention import interface
from kvtier.attention import plan as plan_mod
from kvtier.attention.reference import reference_attention
from kvtier.attention.tiered import tiered_attention
from kvtier.testing import feed_chunks, tiny_llama

BACKENDS = ("torch", "cpu", "fused")


def draw_policy(rng: random.Random, dim: int) -> TierPolicy | None:
    """A random policy for head dim ``dim`` (None: the draw does not validate)."""
    block = rng.choice([4, 5, 7, 8, 16])
    groups = [g for g in (4, 8, 16, 32, 64) if dim % g == 0]
    fields: dict = dict(
        hot_tokens=rng.choice([0, 3, 9, 16]),
        warm_tokens=block * rng.choice([0, 1, 2, 3]),
        block_tokens=block,
        sink_tokens=rng.choice([0, 1, 3, 4]),
        value_group_size=rng.choice(groups),
        warm_bits=rng.choice([2, 3, 4, 8, "fp8"]),
        cold=rng.choice(["quant", "quant", "sign", "evict", "offload"]),
        layer_overrides={},
        name="fuzz",
    )
    if fields["cold"] == "quant":
        vq = rng.random() < 0.35
        fields["cold_bits"] = rng.choice([2, 3, 4]) if vq else rng.choice([2, 3, 4, 8, "fp8"])
        fields["cold_rotation"] = vq or rng.random() < 0.5
        if vq:
            fields.update(cold_codes="vq", cold_meta="fp16", cold_value_bits=rng.choice([None, 2, 3, 4]))
        elif rng.random() < 0.3:
            fields["cold_value_bits"] = rng.choice([2, 3, 4])
    elif fields["cold"] == "sign":
        fields["cold_rotation"] = rng.random() < 0.5
    elif fields["cold"] == "offload":  # every block fetched (mass=None): exact over what the store holds
        fields["offload"] = OffloadPolicy(
            backend=rng.choice(["cpu", "disk"]),
            store_bits=rng.choice([None, None, 8]),
            mass=None,
            min_blocks=0,
            prefetch=rng.choice([False, True]),
            max_query_tokens=rng.choice([None, 1, 16]),
        )
    if rng.random() < 0.3 and fields.get("cold_codes") != "vq" and fields["cold"] != "offload":
        fields["sparse"] = SparsePolicy(local_window=rng.choice([2, 4, 8]), select="tokens", method="mass", level=1.0)
    if rng.random() < 0.15:  # an adaptive budget (eviction by the reference run's own queries)
        fields.pop("offload", None)
        fields.update(
            cold="quant",
            hot_tokens=max(fields["hot_tokens"], 1),
            adaptive=AdaptivePolicy(
                bits=rng.choice([3.0, 4.0, 5.0]),
                warmup_tokens=rng.choice([8, 24]),
                fit_tokens=64,
                keep=rng.choice([1.0, 1.0, 0.5, 0.75]),
                codes=rng.choice(["affine", "vq", "affine+vq"]),
            ),
        )
        for key in ("cold_bits", "cold_codes", "cold_meta", "cold_value_bits", "sparse"):
            fields.pop(key, None)
    try:
        return TierPolicy(**fields)
    except ValueError:
        return None


def draw_model(rng: random.Random):
    dim = rng.choice([16, 32, 64, 128])
    kv = rng.choice([1, 2])
    gqa = rng.choice([1, 2, 3])
    dtype = torch.bfloat16 if rng.random() < 0.3 else torch.float32
    model = tiny_llama(
        seed=rng.randrange(1 << 16),
        dtype=dtype,
        head_dim=dim,
        num_key_value_heads=kv,
        num_attention_heads=kv * gqa,
        num_hidden_layers=2,
        hidden_size=32 * kv * gqa,
        intermediate_size=64,
    )
    return model, dim, dict(head_dim=dim, kv_heads=kv, gqa=gqa, dtype=str(dtype).removeprefix("torch."))


class Case(NamedTuple):
    """One drawn case: the model, the policy, ids and mask ``[B, N]``, the calls' token counts."""

    model: torch.nn.Module
    policy: TierPolicy
    ids: torch.Tensor
    mask: torch.Tensor
    chunks: list[int]
    dtype: str
    desc: str


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    model, dim, shape = draw_model(rng)
    policy = None
    while policy is None:
        policy = draw_policy(rng, dim)
    B = rng.choice([1, 2, 3])
    prompt = rng.randrange(5, 300)
    decode = rng.randrange(1, 6)
    n = prompt + decode
    ids = torch.randint(3, 97, (B, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for b in range(1, B):
        mask[b, : rng.randrange(0, prompt - 1)] = 0  # left padding, at least 2 real prompt tokens
    chunks, left = [], prompt
    while left:
        c = min(left, rng.choice([1, 2, 7, 16, 33, 64, 100]))
        chunks.append(c)
        left -= c
    chunks += [1] * decode
    desc = f"seed={seed} model={shape} B={B} chunks={chunks} policy={policy}"
    return Case(model, policy, ids, mask, chunks, shape["dtype"], desc)


def one_case(seed: int, tol: float) -> tuple[bool, str]:
    """Feed a drawn case through ``attention="reference"``; at every layer call, before the layer
    settles, attend with each backend over the same state and compare with the reference. (Two
    whole runs would not do: a 1e-7 difference in one layer's output can move a later layer's
    4-bit code by one step, which is no backend's fault.)"""
    case = draw_case(seed)
    model, policy, ids, mask, chunks, desc = case.model, case.policy, case.ids, case.mask, case.chunks, case.desc
    if case.dtype == "bfloat16":  # outputs rounded to bf16: two fp32 orders may land one bf16 step apart
        tol = max(tol, 2.0**-7)
    backends = []
    for backend in BACKENDS:
        try:
            plan_mod.check_force(backend, torch.device("cpu"))
            backends.append(backend)
        except ValueError:
            pass
    found: list[str] = []
    calls = [0]

    def spy(layer, query, kv_mask, scaling, plan=None, force=None):
        calls[0] += 1
        budget, layer.budget = layer.budget, None  # the extra calls must not feed an adaptive measurement
        try:
            ref = reference_attention(layer, query, kv_mask, scaling)
            scale = max(1.0, float(ref.abs().max()))
            for backend in backends:
                try:
                    got = tiered_attention(layer, query, kv_mask, scaling, force=backend)
                except Exception as err:  # noqa: BLE001 - a backend that raises where the reference ran
                    found.append(f"{backend} raised {type(err).__name__}: {err} (layer {layer.layer_idx}, seen {layer.seen})")
                    continue
                diff = float((got - ref).abs().max())
                if not diff <= tol * scale:
                    found.append(f"{backend} differs by {diff:.3g} (layer {layer.layer_idx}, seen {layer.seen}, {layer.token_counts()})")
        finally:
            layer.budget = budget
        return tiered_attention(layer, query, kv_mask, scaling, plan, force=force)

    interface.tiered_attention = spy
    try:
        with kvtier.enable(model), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            feed_chunks(model, kvtier.TieredCache(model.config, policy, attention="reference"), ids, mask, chunks)
    finally:
        interface.tiered_attention = tiered_attention
    if found:
        return False, f"{found[0]} (+{len(found) - 1} more)\n  {desc}"
    return True, f"{calls[0]} layer calls: {desc}"


class InjectedFault(RuntimeError):
    """The fault :func:`state_case` injects into a layer's settle."""


def _fingerprint(cache) -> tuple:
    """What a failed call must leave unchanged: the length, each layer's token counts and the sums
    of every tensor it holds (an offloaded tier: its table and live records), the bytes reported
    (without offloading: an offloaded tier keeps a memo of record addresses that attention may
    have made for the same table), and an adaptive budget's measurements."""
    layers = []
    for layer in cache.layers:
        if not hasattr(layer, "token_counts"):
            continue
        tiers = dict(layer.tier_tensors())
        if layer.is_initialized:  # the hot buffer's used part (its spare capacity holds anything)
            tiers["hot"] = list(layer.hot.view())
        cold = layer.cold
        if getattr(cold, "store", None) is not None:  # offloaded: the live records, not the memos
            # (record addresses) or the checksums of free slots, which a failed call may touch
            live = []
            if cold.table is not None:  # the table, and the records it names (read: crc-checked on disk)
                ids = cold.table.flatten()
                live = [cold.table, cold.store.read(ids[ids >= 0])]
            tiers["cold"] = list(cold.fields.values()) + live
        sums = tuple((name, tuple(float(t.double().sum()) for t in ts)) for name, ts in sorted(tiers.items()))
        layers.append((layer.seen, tuple(sorted(layer.token_counts().items())), sums))
    offloading = any(getattr(getattr(layer, "cold", None), "store", None) is not None for layer in cache.layers)
    reported = None if offloading else cache.memory_report().total_bytes  # offloaded: its address memo may differ
    return cache.get_seq_length(), tuple(layers), reported, repr(cache.allocation())


def _copies(cache, policy: TierPolicy, problems: list[str], i: int) -> list:
    """``[(name, copy)]``: a ``copy.deepcopy`` and a pickled round trip of ``cache`` between calls;
    an offloading cache must refuse both (its records are this process's) and stay usable."""
    from kvtier.offload.store import OffloadError

    makers = {"deep copy": copy.deepcopy, "pickled copy": lambda c: pickle.loads(pickle.dumps(c))}
    out = []
    for name, make in makers.items():
        try:
            twin = make(cache)
        except OffloadError:
            if policy.cold != "offload":
                problems.append(f"call {i}: the {name} was refused without offloading")
            continue
        if policy.cold == "offload":
            problems.append(f"call {i}: an offloading cache made a {name}")
        out.append((name, twin))
    return out


def state_case(seed: int) -> tuple[bool, str]:
    """A drawn case through two caches (attention as the plan picks). After every call: each layer
    holds ``seen`` token slots (evicted + cold + warm + hot) and, without an offloaded tier, the
    bytes reported are the bytes reachable. At one drawn call a drawn layer's settle fails after
    moving its tokens (an injected fault): the call must raise, leave the cache as it was, and the
    same call retried must give bit for bit the logits of the cache that never failed, to the end."""
    from kvtier.cache.state import LayerState
    from kvtier.diagnostics import reachable_tensor_bytes

    case = draw_case(seed)
    model, policy, ids, mask, chunks, desc = case.model, case.policy, case.ids, case.mask, case.chunks, case.desc
    rng = random.Random(-seed - 1)
    fail_call, fail_layer = rng.randrange(len(chunks)), rng.randrange(model.config.num_hidden_layers)
    copy_call = rng.randrange(len(chunks))  # after it: a deep copy and a pickled copy go on beside
    twins: list = []
    armed = [False]
    real_move = LayerState._move

    def move(self, token_valid):
        real_move(self, token_valid)
        if armed[0] and self.layer_idx == fail_layer:
            raise InjectedFault("injected")

    problems: list[str] = []
    LayerState._move = move
    try:
        with kvtier.enable(model), warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            clean = kvtier.TieredCache(model.config, policy)
            faulty = kvtier.TieredCache(model.config, policy)
            s = 0
            for i, c in enumerate(chunks):
                args = dict(input_ids=ids[:, s : s + c], attention_mask=mask[:, : s + c])
                want = model(**args, cache=clean).logits
                if i == fail_call:
                    before = _fingerprint(faulty)
                    armed[0] = True
                    try:
                        model(**args, cache=faulty)
                        problems.append(f"call {i}: the injected fault did not raise")
                    except InjectedFault:
                        pass
                    finally:
                        armed[0] = False
                    if _fingerprint(faulty) != before:
                        problems.append(f"call {i}: a failed call (layer {fail_layer}) changed the cache")
                got = model(**args, cache=faulty).logits
                if not torch.equal(got, want):
                    diff = float((got.float() - want.float()).abs().max())
                    problems.append(f"call {i}: logits differ from the cache that never failed by {diff:.3g}")
                for name, twin in twins:
                    if not torch.equal(model(**args, cache=twin).logits, want):
                        problems.append(f"call {i}: the {name} gives other logits than the original")
                if i == copy_call:
                    twins = _copies(clean, policy, problems, i)
                s += c
                for layer in clean.layers:
                    counts = layer.token_counts()
                    held = counts["evicted"] + counts["cold"] + counts["warm"] + counts["hot"]
                    if held != layer.seen:
                        problems.append(f"call {i}: layer {layer.layer_idx} holds {counts}, seen {layer.seen}")
                if policy.cold != "offload":
                    reported, reachable = clean.memory_report().total_bytes, reachable_tensor_bytes(clean)
                    if reported != reachable:
                        problems.append(f"call {i}: {reported} bytes reported, {reachable} reachable")
                if problems:
                    break
    except Exception as err:  # noqa: BLE001 - anything else raised is a finding
        problems.append(f"raised {type(err).__name__}: {err}")
    finally:
        LayerState._move = real_move
    if problems:
        return False, f"{problems[0]} (+{len(problems) - 1} more; fault at call {fail_call}, layer {fail_layer})\n  {desc}"
    return True, desc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed (cases take seed, seed+1, ...)")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest output difference, relative to max |output|")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--states", action="store_true", help="check the cache's invariants and an injected fault instead of backends"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    failures, t0 = 0, time.time()
    for i in range(args.cases):
        ok, what = state_case(args.seed + i) if args.states else one_case(args.seed + i, args.tol)
        if not ok:
            failures += 1
            print("FAIL", what, flush=True)
    print(f"{args.cases - failures} passed, {failures} failed ({time.time() - t0:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
