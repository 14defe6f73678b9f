"""Faults in whole forward calls of tiny random models: the cache must be all-or-nothing.

A fuzzer, not a test (``tests/test_fuzz_model.py`` runs a few seeded cases). The promise it checks
(``kvtier.hf.cache``): a forward call through a model under ``kvtier.enable`` is kept when the
model's forward returns; an exception anywhere in the forward (inside kvtier, in any layer, after
the last layer in the final norm, ``lm_head`` or a hook) leaves every layer of the cache, the
sliding-window layers of hybrid models included, as it was before the call: at once for an
ordinary exception, and for ``KeyboardInterrupt`` at once or at the next use, which then raises a
:class:`~kvtier.KVTierError` saying the call was undone ("call again").

Per case (``--seed``, then ``seed + 1``, ...) it draws:

* a model: a tiny random Llama (head dim 16, 64, 128 or 256, 2-4 layers), a Qwen2 with q/k/v
  biases (head dim 128, 2-3 layers) or a hybrid Gemma 3 (the 3 sliding + 1 full layout of
  ``kvtier.testing.tiny_gemma3``, or drawn ``layer_types``, ``sliding_window`` and layer count),
  in fp32 or bf16;
* a policy: a preset (offloading ones included) or a variant (``default:vq3/3``,
  ``adaptive@2.5``, ``adaptive@3:codes=vq``, ``default:dense``, ...), often shrunk (hot window, warm
  window, blocks, sinks, an adaptive warm-up) so that tokens move between tiers within a few
  hundred tokens; an attention path; sometimes ``max_bytes`` with ``on_full`` error / evict / degrade;
* calls: prefill chunks of drawn sizes (batch 1-3, left padding in the first chunk), decode
  steps, ``crop(-n)``, ``reorder_cache``, ``batch_select_indices``, ``reset``, ``copy.deepcopy``
  and a pickle round trip (the cache goes on as the copy);
* faults on some forward calls: an exception (``Exception`` or ``KeyboardInterrupt``) raised by a
  forward hook on a drawn module (a decoder layer, a norm, an attention module, an MLP, the final
  norm, ``lm_head``, the base model), a byte cap too small for the call (``CacheFullError``),
  values beyond the storage range (``v_proj`` of a tiered layer scaled by 1e5: ``StorageRangeError``,
  now or when the block moves), or for offloading policies a failing store write or a full disk
  (``os.posix_fallocate`` failing with ENOSPC, as ``tests/test_offload_faults.py`` does).

A reference cache (same policy, cap and path) replays only the calls that returned normally.
After every step both caches must agree: per-layer ``get_seq_length``, ``memory_report()``'s
per-layer entries (bytes by tier, token slots, widths; offloading layers' ``cold`` bytes excepted:
the read path keeps a memo of record addresses), the adaptive allocation, the logits of every call
both ran, and bit for bit the logits of a probe call run on a deep copy of each (an offloading cache
refuses copies: the next real call's logits are compared instead). A step may instead be refused
with a kvtier error (its state unchanged). Anything else is a failure: another exception, a
mismatch, an ordinary exception undone only at the next use, a cache left unusable. A failure
prints the seed, its class (model, step, fault, where the fault fired, what went wrong) and the
calls up to it; ``--cases 1 --seed S --verbose`` replays one case step by step.

    python scripts/fuzz_model.py --cases 200 --seed 0
    python scripts/fuzz_model.py --cases 1000 --seed 0 --log fuzz_model.jsonl   # resumable

Progress goes to stdout every ``--every`` cases; the last line is one JSON object (counts, seed
range, seconds, failure classes with their seeds). With ``--log`` every case appends one JSON line,
and a rerun skips the seeds the log already holds. Imports kvtier only (``kvtier.testing`` builds
the models).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import errno
import json
import os
import pickle
import random
import re
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

import kvtier
from kvtier import KVTierError
from kvtier.errors import StorageRangeError
from kvtier.testing import tiny_gemma3, tiny_llama, tiny_qwen2

VARIANTS = (
    "default:vq3/3",
    "default:vq2/2",
    "default:vq4/2",
    "adaptive@2.5",
    "adaptive@3:codes=vq",
    "adaptive@2:keep=0.5",
    "adaptive@3:codes=affine+vq",
    "default:dense",
    "chat:dense",
)
ATTENTION = ("fast", "fast", "per-tier", "reference", "torch")
OPS = ("prefill", "decode", "crop", "reorder", "select", "reset", "deepcopy", "pickle")
OP_WEIGHTS = (3, 3, 1, 1, 0.5, 0.3, 1, 0.7)
#: module suffixes inside a decoder layer whose forward hook fires after the layer's attention
AFTER_ATTENTION = ("", ".self_attn", ".mlp", ".post_attention_layernorm")


class InjectedFault(RuntimeError):
    """The ordinary exception a fault raises."""


class InjectedInterrupt(KeyboardInterrupt):
    """The Ctrl-C a fault raises (a subclass: a real Ctrl-C still stops the fuzzer)."""


class Case(NamedTuple):
    """One drawn case: how to build the model, the cache's arguments, the steps (dicts with ``op``,
    ``n`` tokens for forward calls, ``k`` for crops and an optional ``fault``), the batch."""

    seed: int
    kind: str  # "llama", "qwen2", "gemma3"
    dtype: torch.dtype
    overrides: dict
    policy: Any  # a preset or variant name, or a TierPolicy (shrunk)
    policy_desc: str
    attention: str
    max_bytes: int | None
    on_full: str
    batch: int
    steps: list

    def layer_types(self) -> list[str]:
        return layer_types(self.kind, self.overrides)

    def describe(self, upto: int | None = None) -> str:
        steps = self.steps if upto is None else self.steps[: upto + 1]
        cap = f" max_bytes={self.max_bytes} on_full={self.on_full}" if self.max_bytes else ""
        return (
            f"seed={self.seed} model={self.kind}({str(self.dtype).removeprefix('torch.')}, {self.overrides}) "
            f"policy={self.policy_desc} attention={self.attention}{cap} B={self.batch}\n"
            f"  steps: {' | '.join(step_text(s) for s in steps)}"
        )


def layer_types(kind: str, overrides: dict) -> list[str]:
    """The model's layer kinds (``kvtier.testing``'s defaults unless ``overrides`` set them)."""
    if kind != "gemma3":
        return ["full_attention"] * overrides.get("num_hidden_layers", 2 if kind == "qwen2" else 4)
    return list(overrides.get("layer_types", ["sliding_attention"] * 3 + ["full_attention"]))


def step_text(step: dict) -> str:
    op = step["op"]
    text = f"{op} {step['n']}" if op == "prefill" else f"crop {step['k']}" if op == "crop" else op
    fault = step.get("fault")
    if fault:
        where = f" {fault['module']}" if "module" in fault else ""
        text += f" + {fault['kind']}{where}"
    return text


# --- drawing ------------------------------------------------------------------------------------
def draw_model(rng: random.Random) -> tuple[str, torch.dtype, dict]:
    kind = rng.choice(["llama", "llama", "qwen2", "gemma3", "gemma3"])
    dtype = torch.bfloat16 if rng.random() < 0.3 else torch.float32
    if kind == "llama":
        return kind, dtype, dict(head_dim=rng.choice([16, 64, 128, 256]), num_hidden_layers=rng.choice([2, 3, 4]))
    if kind == "qwen2":
        return kind, dtype, dict(num_hidden_layers=rng.choice([2, 3]))
    if rng.random() < 0.5:  # kvtier.testing's layout: 3 sliding (window 64) + 1 full
        return kind, dtype, {}
    n = rng.choice([2, 3, 4, 5])
    types = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(n)]
    if "full_attention" not in types and rng.random() < 0.9:
        types[rng.randrange(n)] = "full_attention"
    if "sliding_attention" not in types and rng.random() < 0.9:
        types[rng.randrange(n)] = "sliding_attention"
    return kind, dtype, dict(num_hidden_layers=n, layer_types=types, sliding_window=rng.choice([4, 8, 16, 64]))


def build_model(case: Case) -> torch.nn.Module:
    make = {"llama": tiny_llama, "qwen2": tiny_qwen2, "gemma3": tiny_gemma3}[case.kind]
    return make(seed=case.seed % 997, dtype=case.dtype, **case.overrides)


def shrink(policy: kvtier.TierPolicy, rng: random.Random) -> tuple[kvtier.TierPolicy, str]:
    """``policy`` with windows small enough that tokens move within a few hundred tokens."""
    block = 1 if policy.block_tokens == 1 else rng.choice([4, 8, 16])
    fields: dict = dict(block_tokens=block, hot_tokens=rng.choice([4, 8, 16, 24]))
    if policy.warm_tokens:
        fields["warm_tokens"] = block * rng.choice([0, 1, 2, 4])
    if policy.sink_tokens:
        fields["sink_tokens"] = rng.choice([0, 2, 4])
    if policy.sparse is not None:
        fields["sparse"] = dataclasses.replace(policy.sparse, local_window=rng.choice([2, 4, 8]))
    if policy.adaptive is not None:
        fields["adaptive"] = dataclasses.replace(
            policy.adaptive, warmup_tokens=rng.choice([8, 24, 48]), fit_tokens=rng.choice([64, 128])
        )
    if policy.offload is not None:
        fields["offload"] = dataclasses.replace(policy.offload, min_blocks=rng.choice([0, 2]))
    sizes = ("block_tokens", "hot_tokens", "warm_tokens", "sink_tokens")
    text = ",".join(f"{k}={v}" for k, v in fields.items() if k in sizes)
    return policy.replace(**fields), text


def draw_policy(rng: random.Random) -> tuple[Any, str]:
    name = rng.choice(list(kvtier.PRESETS) + list(VARIANTS))
    policy = kvtier.get_policy(name)
    if policy.hot_tokens is None or rng.random() < 0.3:
        return name, name
    try:
        small, text = shrink(policy, rng)
    except ValueError:
        return name, name
    return small, f"{name} shrunk({text})"


def draw_steps(rng: random.Random, offloading: bool, disk: bool, kinds: list[str], capped_evict: bool) -> list:
    full = [i for i, k in enumerate(kinds) if k == "full_attention"]
    modules = ["model.norm", "lm_head", "model"]
    for j in range(len(kinds)):
        modules += [f"model.layers.{j}{s}" for s in ("", ".input_layernorm", ".self_attn", ".mlp")]
    steps: list[dict] = []
    total = 0
    for i in range(rng.randint(4, 16)):
        op = rng.choices(OPS, weights=OP_WEIGHTS)[0] if i else "prefill"
        step: dict = {"op": op}
        if op == "prefill":
            step["n"] = min(rng.choice([1, 3, 7, 16, 33, 64, 100, 150]), max(1, 600 - total))
            total += step["n"]
        elif op == "crop":
            step["k"] = rng.choice([1, 2, 3, 8])
        if op in ("prefill", "decode") and rng.random() < 0.4:
            faults = ["exception"] * 4 + ["interrupt"] * 2 + ["range"]
            if not capped_evict:
                faults.append("cap")
            if offloading:
                faults += ["store-write"] * 2 + (["enospc"] if disk else [])
            kind = rng.choice(faults)
            fault: dict = {"kind": kind}
            if kind in ("exception", "interrupt"):
                fault["module"] = rng.choice(modules)
            elif kind == "range":
                if not full:
                    continue
                fault["module"] = f"model.layers.{rng.choice(full)}.self_attn.v_proj"
            step["fault"] = fault
        steps.append(step)
    return steps


def draw_case(seed: int) -> Case:
    """The case of ``seed`` (the same on every machine: Python's ``random`` only)."""
    rng = random.Random(seed)
    kind, dtype, overrides = draw_model(rng)
    while True:
        policy, desc = draw_policy(rng)
        p = kvtier.get_policy(policy)
        try:  # a shrunk draw the head dim refuses (value groups, vq sub-vectors): draw again
            kvtier.TieredCache(build_config(kind, overrides), p).close()
            break
        except ValueError:
            continue
    offloading = p.cold == "offload"
    attention = rng.choice(ATTENTION)
    max_bytes, on_full = None, "error"
    if rng.random() < 0.25:
        on_full = "error" if offloading else rng.choice(["error", "evict", "degrade"])
        cfg = build_config(kind, overrides)
        elt = 2 if dtype == torch.bfloat16 else 4
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elt
        max_bytes = max(1, int(per_token * rng.choice([16, 64, 200, 400]) * rng.uniform(0.1, 1.0)))
    batch = rng.choice([1, 1, 2, 3])
    kinds = layer_types(kind, overrides)
    disk = offloading and p.offload.backend == "disk"
    steps = draw_steps(rng, offloading, disk, kinds, max_bytes is not None and on_full != "error")
    return Case(seed, kind, dtype, overrides, policy, desc, attention, max_bytes, on_full, batch, steps)


def build_config(kind: str, overrides: dict):  # noqa: ANN201
    from kvtier.testing import tiny_gemma3_config, tiny_llama_config, tiny_qwen2_config

    make = {"llama": tiny_llama_config, "qwen2": tiny_qwen2_config, "gemma3": tiny_gemma3_config}[kind]
    return make(**overrides)


# --- running -------------------------------------------------------------------------------------
class Failure(Exception):
    """A broken promise (raised inside :func:`run_case`, caught there)."""

    def __init__(self, problem: str, detail: str):
        super().__init__(f"{problem}: {detail}")
        self.problem, self.detail = problem, detail


@contextlib.contextmanager
def armed(model: torch.nn.Module, fault: dict | None, cache: Any, reference: bool = False) -> Iterator[None]:
    """The fault of a call, installed for the call (``reference``: only what changes the call's
    inputs, the range fault's scaled values, which the reference replays)."""
    undo: list = []
    kind = None if fault is None else fault["kind"]
    try:
        if kind == "range":
            module = dict(model.named_modules())[fault["module"]]
            undo.append(module.register_forward_hook(lambda m, a, out: out * 1e5).remove)
        elif reference or kind is None:
            pass
        elif kind in ("exception", "interrupt"):
            module = dict(model.named_modules())[fault["module"]]
            exc = InjectedFault if kind == "exception" else InjectedInterrupt

            def hook(m, args, out):  # noqa: ANN001, ANN202
                raise exc(f"injected after {fault['module']}")

            undo.append(module.register_forward_hook(hook).remove)
        elif kind == "cap":  # every byte more than the cache holds now is too many
            saved = cache.max_bytes, cache.on_full
            cache.max_bytes, cache.on_full = max(1, cache.memory_report().total_bytes), "error"
            undo.append(lambda: (setattr(cache, "max_bytes", saved[0]), setattr(cache, "on_full", saved[1])))
        elif kind == "store-write":
            from kvtier.offload.store import BlockStore

            real = BlockStore.write

            def write(self, ids, data):  # noqa: ANN001, ANN202
                raise InjectedFault("injected store write")

            BlockStore.write = write
            undo.append(lambda: setattr(BlockStore, "write", real))
        elif kind == "enospc":
            real_fallocate = os.posix_fallocate

            def fallocate(fd, offset, size):  # noqa: ANN001, ANN202
                raise OSError(errno.ENOSPC, "No space left on device")

            os.posix_fallocate = fallocate
            undo.append(lambda: setattr(os, "posix_fallocate", real_fallocate))
        yield
    finally:
        for fn in reversed(undo):
            fn()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and torch.equal(a.masked_fill(na, 0), b.masked_fill(nb, 0))


def shown(probe: tuple[str, Any]) -> str:
    return f"raised {probe[1]}" if probe[0] == "raised" else probe[0]


def fingerprint(cache: Any) -> dict:
    """Per-layer lengths, memory report entries (without offloading layers' cold bytes) and the
    adaptive allocation."""
    report = cache.memory_report()
    layers = []
    for i, entry in enumerate(report.per_layer):
        entry = copy.deepcopy(entry)
        if getattr(cache.layers[i], "offloaded", False):
            entry["bytes"].pop("cold", None)
        layers.append((cache.get_seq_length(i), entry))
    return {"layers": layers, "allocation": repr(cache.allocation())}


def diff_text(a: dict, b: dict) -> str:
    for i, (x, y) in enumerate(zip(a["layers"], b["layers"])):
        if x != y:
            return f"layer {i}: got {x}, reference {y}"
    return f"allocation: got {a['allocation']}, reference {b['allocation']}"


class Run:
    """One case in progress: the model, the cache under test and the reference, the mask."""

    def __init__(self, case: Case, verbose: bool = False):
        self.case, self.verbose = case, verbose
        self.model = build_model(case)
        self.kinds = case.layer_types()
        self.tiered = [i for i, k in enumerate(self.kinds) if k == "full_attention"]
        self.policy = kvtier.get_policy(case.policy)
        self.offloading = self.policy.cold == "offload"
        self.cache = self.new_cache()
        self.ref = self.new_cache()
        self.batch = case.batch
        self.mask = torch.ones(self.batch, 0, dtype=torch.long)
        self.refusals: list[str] = []
        self.faults: list[str] = []  # per armed call: the fault's kind and whether the call raised
        self.last_error: BaseException | None = None  # what the latest failed step raised
        self.failed_at = -1  # and its index

    def new_cache(self):  # noqa: ANN201
        c = self.case
        return kvtier.TieredCache(
            self.model.config, c.policy, attention=c.attention, max_bytes=c.max_bytes, on_full=c.on_full
        )

    def log(self, text: str) -> None:
        if self.verbose:
            print("   ", text, flush=True)

    # -- the calls --
    def inputs(self, i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.case.seed * 1000 + i)
        ids = torch.randint(3, 97, (self.batch, n), generator=g)
        new = torch.ones(self.batch, n, dtype=torch.long)
        if self.mask.shape[1] == 0 and n >= 3:  # the first chunk: left padding of rows 1.., 2 real tokens kept
            for b in range(1, self.batch):
                pad = int(torch.randint(0, n - 1, (1,), generator=g))
                new[b, :pad] = 0
        return ids, torch.cat([self.mask, new], dim=1)

    def forward(self, cache: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits

    def between(self, cache: Any, step: dict, rows: torch.Tensor | None) -> Any:
        """A change between calls on ``cache``; returns the cache to go on with."""
        op = step["op"]
        if op == "crop":
            cache.crop(-step["k"])
        elif op == "reorder":
            cache.reorder_cache(rows)
        elif op == "select":
            cache.batch_select_indices(rows)
        elif op == "reset":
            cache.reset()
        elif op == "deepcopy":
            return copy.deepcopy(cache)
        elif op == "pickle":
            return pickle.loads(pickle.dumps(cache))
        return cache

    def probe(self, cache: Any, i: int) -> tuple[str, Any]:
        """The logits of one more call on a deep copy of ``cache`` (or its exception), or None
        when the cache refuses copies (offloading)."""
        try:
            twin = copy.deepcopy(cache)
        except kvtier.OffloadError:
            return "refused", None
        ids, mask = self.inputs(-1 - i, 1)
        try:
            return "logits", self.forward(twin, ids, mask)
        except Exception as err:  # noqa: BLE001 - compared with the reference's
            return "raised", f"{type(err).__name__}: {err}"

    def check(self, i: int, what: str) -> None:
        got, want = fingerprint(self.cache), fingerprint(self.ref)
        if got != want:
            raise Failure(f"state differs {what}", diff_text(got, want))
        a, b = self.probe(self.cache, i), self.probe(self.ref, i)
        if a[0] != b[0] or (a[0] == "logits" and not same(a[1], b[1])) or (a[0] == "raised" and a[1] != b[1]):
            if a[0] == b[0] == "logits" and a[1].shape == b[1].shape:
                detail = f"max |diff| {float((a[1].float() - b[1].float()).abs().max()):.3g}"
            else:
                detail = f"got {shown(a)}, reference {shown(b)}"
            raise Failure(f"probe logits differ {what}", detail)

    def step(self, i: int, step: dict) -> None:
        op, fault = step["op"], step.get("fault")
        rows = None
        if op in ("reorder", "select"):
            g = torch.Generator().manual_seed(self.case.seed * 1000 + i)
            rows = torch.randperm(self.batch, generator=g)
            if op == "select":  # a subset of the rows (one at least), in any order
                rows = rows[: int(torch.randint(1, max(2, self.batch), (1,), generator=g))]
        ids = mask = None
        if op in ("prefill", "decode"):
            ids, mask = self.inputs(i, step.get("n", 1))
        err: BaseException | None = None
        out = None
        try:
            if ids is not None:
                with armed(self.model, fault, self.cache):
                    out = self.forward(self.cache, ids, mask)
            else:
                self.cache = self.between(self.cache, step, rows)
        except (Exception, InjectedInterrupt) as e:  # noqa: BLE001 - judged below
            err = e
        if fault is not None:
            self.faults.append(f"{fault['kind']}: {'raised' if err is not None else 'the call returned'}")
        if err is None:
            self.log(f"{i}: {step_text(step)}: ok")
            try:  # the reference replays the call
                if ids is not None:
                    with armed(self.model, fault, self.ref, reference=True):
                        ref_out = self.forward(self.ref, ids, mask)
                    if not same(out, ref_out):
                        raise Failure("logits differ from the reference", f"after {step_text(step)}")
                    self.mask = mask
                else:
                    if op not in ("deepcopy", "pickle"):  # the reference stays the original
                        self.ref = self.between(self.ref, step, rows)
                    self.apply_rows(op, rows, step)
            except Failure:
                raise
            except Exception as e:  # noqa: BLE001
                raise Failure("the reference refused a call the cache took", f"{type(e).__name__}: {e}") from e
        else:
            self.last_error, self.failed_at = err, i
            pending = self.judge(i, step, err)
            if pending is not None:  # the cache's state first: a wrong exception that changed it is worse
                self.check(i, f"after a failed {op}")
                raise Failure(pending.problem + " (the cache unchanged)", pending.detail)
        self.check(i, f"after {'a failed ' if err is not None else ''}{op}")

    def apply_rows(self, op: str, rows: torch.Tensor | None, step: dict) -> None:
        if op in ("reorder", "select"):
            self.mask = self.mask[rows]
            self.batch = self.mask.shape[0]
        elif op == "crop":
            self.mask = self.mask[:, : max(0, self.mask.shape[1] - step["k"])]
        elif op == "reset":
            self.mask = self.mask[:, :0]

    def judge(self, i: int, step: dict, err: BaseException) -> Failure | None:
        """A step raised ``err``: allowed are the injected exception and kvtier's refusals; then
        the cache must be as before (an interrupt may be undone at the next use: ``check_usable``).
        Returns the failure an unexpected exception is, for the caller to raise once the cache's
        state was compared."""
        op = step["op"]
        name = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        self.log(f"{i}: {step_text(step)}: raised {name}")
        injected = isinstance(err, (InjectedFault, InjectedInterrupt))
        if isinstance(err, KVTierError):
            if "unusable" in str(err):
                raise Failure("the cache became unusable", name)
            expected = (
                (kvtier.CacheFullError, StorageRangeError, kvtier.OffloadError)  # also from earlier accepted values
                if op in ("prefill", "decode")
                else KVTierError
                if op == "crop"
                else kvtier.OffloadError
                if op in ("deepcopy", "pickle") and self.offloading
                else ()
            )
            if not isinstance(err, expected):
                return Failure(f"refused {op} without a fault", name)
            words = re.sub(r"[0-9][0-9,.]*", "N", name.split(": ", 1)[1])[:70]  # numbers out: counted by kind
            self.refusals.append(f"{type(err).__name__} at {op}: {words}")
        elif not injected:
            return Failure(f"unexpected {type(err).__name__}", name)
        try:
            self.cache.check_usable()
        except KVTierError as use_err:
            text = str(use_err).splitlines()[0]
            if "call again" not in text:
                raise Failure("the next use raised", text) from use_err
            self.log(f"   next use: {text}")
            if not isinstance(err, InjectedInterrupt):
                raise Failure(f"undone only at the next use after {type(err).__name__}", text) from use_err
        return None


def site(run: Run, fault: dict) -> str:
    """Where a hook fault fires: before any cache layer changed, between layers, or after the
    last tiered layer; ``+sliding`` when sliding-window layers had changed."""
    name = fault.get("module", "")
    if fault["kind"] not in ("exception", "interrupt"):
        return "in kvtier"
    if not name.startswith("model.layers."):
        j, after = len(run.kinds), True
    else:
        parts = name.split(".")
        j = int(parts[2])
        after = "." + ".".join(parts[3:]) in AFTER_ATTENTION if len(parts) > 3 else True
    done = [t for t in range(len(run.kinds)) if t < j or (t == j and after)]
    tiered = [t for t in done if t in run.tiered]
    sliding = [t for t in done if t not in run.tiered]
    if not done:
        where = "before any layer"
    else:
        where = "after the last tiered layer" if len(tiered) == len(run.tiered) else "between layers"
    return where + (" +sliding" if sliding else "")


class Result(NamedTuple):
    seed: int
    ok: bool
    cls: str  # "" when ok
    text: str
    steps: int
    refusals: list
    faults: list


def run_case(case: Case, verbose: bool = False) -> Result:
    """Run ``case``; a failure's class names the model kind, the step, the fault and where it fired."""
    run = None
    done = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = Run(case, verbose)
            with kvtier.enable(run.model):
                for i, step in enumerate(case.steps):
                    done = i
                    run.step(i, step)
        return Result(case.seed, True, "", case.describe(), len(case.steps), run.refusals, run.faults)
    except Failure as f:
        step = case.steps[done]
        fault = step.get("fault")
        hybrid = "sliding_attention" in case.layer_types()
        model = f"{case.kind}{' hybrid' if hybrid else ''}"
        if fault and run is not None:
            where = f"{fault['kind']} ({site(run, fault)})"
        elif run is not None and run.last_error is not None and done == run.failed_at:
            where = f"no fault, {type(run.last_error).__name__}"  # a refusal (a drawn cap) or a transformers error
        else:
            where = "no fault"
        cls = f"{model} | {step['op']} | {where} | {f.problem}"
        text = f"{cls}: {f.detail}\n  {case.describe(done)}"
        return Result(case.seed, False, cls, text, done + 1, run.refusals if run else [], run.faults if run else [])
    except Exception as err:  # noqa: BLE001 - in the fuzzer's own setup: a finding too
        cls = f"{case.kind} | setup | raised {type(err).__name__}"
        return Result(case.seed, False, cls, f"{cls}: {err}\n  {case.describe(done)}", done + 1, [], [])
    finally:
        if run is not None:
            for c in (run.cache, run.ref):
                with contextlib.suppress(Exception):
                    c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed (cases take seed, seed+1, ...)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--every", type=int, default=10, help="a progress line every N cases")
    ap.add_argument("--log", type=Path, help="append one JSON line per case; seeds already in it are skipped")
    ap.add_argument("--verbose", action="store_true", help="print every step's outcome")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    logged: dict[int, dict] = {}
    if args.log is not None and args.log.exists():
        for line in args.log.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                logged[rec["seed"]] = rec
    seeds = range(args.seed, args.seed + args.cases)
    classes: dict[str, list[int]] = {}
    refused: dict[str, int] = {}
    armed_calls: dict[str, int] = {}
    passed = failed = skipped = 0
    t0 = time.time()
    for n, seed in enumerate(seeds, 1):
        if seed in logged:
            rec, skipped = logged[seed], skipped + 1
        else:
            case = draw_case(seed)
            if args.verbose:
                print(case.describe(), flush=True)
            t1 = time.time()
            res = run_case(case, args.verbose)
            rec = {"seed": seed, "ok": res.ok, "cls": res.cls, "steps": res.steps, "refusals": res.refusals}
            rec["faults"] = res.faults
            rec["seconds"] = round(time.time() - t1, 2)
            if not res.ok:
                print(f"FAIL {res.text}", flush=True)
            if args.log is not None:
                with args.log.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
        if rec["ok"]:
            passed += 1
        else:
            failed += 1
            classes.setdefault(rec["cls"], []).append(seed)
        for r in rec["refusals"]:
            refused[r] = refused.get(r, 0) + 1
        for f in rec.get("faults", []):
            armed_calls[f] = armed_calls.get(f, 0) + 1
        if n % args.every == 0 or n == len(seeds):
            print(
                f"[{n}/{len(seeds)}] seeds {args.seed}..{seed}: {passed} passed, {failed} failed"
                f"{f', {skipped} from the log' if skipped else ''} ({time.time() - t0:.0f} s)",
                flush=True,
            )
    seconds = time.time() - t0
    print(f"{passed} passed, {failed} failed ({seconds:.0f} s)")
    for cls, which in sorted(classes.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(which):4d}  {cls}  (seeds {', '.join(map(str, which[:5]))}{', ...' if len(which) > 5 else ''})")
    summary = {
        "cases": args.cases,
        "seeds": [args.seed, args.seed + args.cases - 1],
        "next_seed": args.seed + args.cases,
        "passed": passed,
        "failed": failed,
        "seconds": round(seconds, 1),
        "faults": dict(sorted(armed_calls.items())),
        "refusals": dict(sorted(refused.items(), key=lambda kv: -kv[1])),
        "classes": {cls: which for cls, which in sorted(classes.items())},
    }
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
