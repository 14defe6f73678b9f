"""Memory doctor: run a serving-style loop of generate calls and say whether memory leaks.

This module owns :func:`diagnose` (the API), its report (:class:`DoctorReport`, one
:class:`CallRow` per call), the leak rule (:class:`LeakRule`, :func:`leak_trend`), the checks of
what a closed cache leaves behind (threads, file descriptors, offload files, ``*.kv`` memory
maps), the autograd check of cache tensors (:func:`autograd_tensors`), the memory plot
(:func:`plot_memory`) and the ``kvtier doctor`` command (:func:`add_parser`, :func:`cmd_doctor`,
wired into :mod:`kvtier.cli`, which also takes its ``--threads`` bound, :func:`threads_arg`).

It may import torch, numpy, tqdm, transformers' cache classes and kvtier's cache, attention,
policy and diagnostics modules; matplotlib (``--plot``), :mod:`kvtier.models` and
:mod:`kvtier.eval.texts` (the command's model and prompt) are imported lazily. Nothing else in
kvtier imports it except the CLI.

Process memory is read from ``/proc/self/statm`` (Linux), else ``psutil`` when it is installed,
else ``resource``'s peak RSS; no dependency is added for it. Descriptors and maps are read from
``/proc/self`` and are empty lists where ``/proc`` is absent.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .policy import TierPolicy, get_policy

#: A step of the loop: ``loop(model, input_ids, cache)`` runs one request with ``cache`` and
#: returns the output ids (``[B, T]``; the next input in ``reuse`` mode) or None.
Loop = Callable[[Any, torch.Tensor, Any], "torch.Tensor | None"]

NO_LEAK = "no leak"
LEAK = "leak"


# --- process probes ----------------------------------------------------------------------------
def rss_bytes() -> int:
    """Resident set size of this process now, in bytes.

    ``/proc/self/statm`` on Linux, else ``psutil`` if installed, else the *peak* RSS from
    ``resource`` (it still rises with a leak, but never falls).
    """
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def open_fds() -> dict[int, str]:
    """``{fd: target}`` of this process's open file descriptors (``{}`` without ``/proc``)."""
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except (OSError, ValueError):  # the descriptor listdir itself used is closed by now
            continue
    return out


def kv_maps() -> list[str]:
    """Lines of ``/proc/self/maps`` that map a kvtier store file (``*.kv``, deleted or not)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    return [ln for ln in lines if ln.removesuffix(" (deleted)").endswith(".kv")]


def _threads() -> dict[int, str]:
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None and t.is_alive()}


def _fd_count() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir held
    except OSError:
        return -1


# --- cache probes ------------------------------------------------------------------------------
def cache_tensors(cache: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` for every tensor a cache's layers hold next to the compute.

    kvtier layers: every tier of :meth:`~kvtier.TieredLayer.tier_tensors` (sinks, hot, warm, cold,
    staging); transformers' layers: ``keys`` and ``values``. Labels read ``"layer 3 hot[0]"``.
    """
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if hasattr(layer, "tier_tensors"):
            groups = layer.tier_tensors()
        else:
            groups = {name: [getattr(layer, name, None)] for name in ("keys", "values")}
        for tier, tensors in groups.items():
            for j, t in enumerate(tensors):
                if isinstance(t, torch.Tensor):
                    yield f"layer {i} {tier}[{j}]", t


def autograd_tensors(cache: Any) -> list[str]:
    """Cache tensors that carry autograd state (``requires_grad`` or a ``grad_fn``).

    A cache tensor with a ``grad_fn`` keeps the graph that built it alive (the activations of the
    forward pass that produced it), so this must be empty; kvtier's tiers and quantizers must
    never attach one, even when the model runs with gradients enabled.

    Returns
    -------
    list of str : ``"layer 0 hot[0]: grad_fn=CatBackward0"``-style descriptions, empty when clean.
    """
    out = []
    for label, t in cache_tensors(cache):
        if t.grad_fn is not None:
            out.append(f"{label}: grad_fn={type(t.grad_fn).__name__}")
        elif t.requires_grad:
            out.append(f"{label}: requires_grad")
    return out


def _cache_bytes(cache: Any) -> tuple[int, int]:
    """``(total, resident)`` bytes of a cache (see :func:`kvtier.diagnostics.memory_report`)."""
    from .diagnostics import memory_report

    rep = memory_report(cache)
    return rep.total_bytes, rep.resident_bytes


def _offload_dirs(cache: Any) -> list[str]:
    offloader = getattr(cache, "offloader", None)
    return list(getattr(offloader, "directories", []) or [])


def _close(cache: Any) -> None:
    close = getattr(cache, "close", None)
    if callable(close):
        close()


# --- the leak rule -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LeakRule:
    """When a memory series counts as leaking (see :func:`leak_trend`).

    A series leaks when, over the calls after the warm-up, **all three** hold:

    1. its robust (Theil-Sen) slope exceeds ``bytes_per_call``;
    2. the slope over the *last half* of those calls exceeds it too;
    3. the fitted growth over the window exceeds ``drift_pct`` percent of the process RSS.

    Why: a Theil-Sen slope (the median of all pairwise slopes) ignores isolated spikes, so
    allocator noise (a page or an arena grown for one call, a sawtooth while the cyclic garbage
    collector frees dead caches in batches) does not move it much, while memory kept by every call
    moves every pairwise slope. A one-time step (a lazily built table, an arena grown once) can
    still tilt the whole-window slope, but it leaves the last half flat: rule 2 demands that the
    growth still goes on at the end. Rule 3 ignores growth too small to matter in a run of this
    length (a few pages of interpreter caches). The defaults flag 1 MiB kept per call within
    tens of calls (its slope is 16x ``bytes_per_call`` and a 50-call window grows several percent
    of a ~400 MiB torch process), and pass steady loops, whose slope after the warm-up is 0 to a
    few KiB per call (measured: benchmarks/soak.py).

    Attributes
    ----------
    bytes_per_call : slope above which a series grows (bytes per call).
    drift_pct : fitted growth over the window, in percent of RSS at the window's start.
    """

    bytes_per_call: float = 64 * 1024
    drift_pct: float = 1.0

    def __post_init__(self) -> None:
        if not self.bytes_per_call >= 0:
            raise ValueError(f"bytes_per_call={self.bytes_per_call!r} is not allowed: expected >= 0")
        if not self.drift_pct >= 0:
            raise ValueError(f"drift_pct={self.drift_pct!r} is not allowed: expected >= 0")


def theil_sen_slope(y: np.ndarray) -> float:
    """Median of the pairwise slopes ``(y[j] - y[i]) / (j - i)``, ``i < j`` (0.0 below two points).

    Series longer than 1,024 points are thinned evenly first (the median barely moves; the pair
    count stays below 524k).
    """
    y = np.asarray(y, dtype=np.float64)
    x = np.arange(len(y), dtype=np.float64)
    if len(y) > 1024:
        keep = np.linspace(0, len(y) - 1, 1024).round().astype(int)
        x, y = x[keep], y[keep]
    if len(y) < 2:
        return 0.0
    i, j = np.triu_indices(len(y), k=1)
    return float(np.median((y[j] - y[i]) / (x[j] - x[i])))


@dataclass
class Trend:
    """The leak rule applied to one series (see :class:`LeakRule`).

    Attributes
    ----------
    slope : Theil-Sen slope over the window (bytes per call).
    tail_slope : the same over the window's last half.
    drift_pct : ``slope * (calls - 1)`` in percent of ``reference`` bytes.
    verdict : ``"leak"`` or ``"no leak"``.
    """

    slope: float
    tail_slope: float
    drift_pct: float
    verdict: str


def leak_trend(series: np.ndarray, reference: float, rule: LeakRule = LeakRule()) -> Trend:  # noqa: B008
    """Apply ``rule`` to ``series`` (bytes per call, warm-up already cut; ``reference``: the bytes
    the drift is a percentage of, e.g. RSS at the window's start)."""
    series = np.asarray(series, dtype=np.float64)
    slope = theil_sen_slope(series)
    tail = theil_sen_slope(series[len(series) // 2 :])
    drift = 100.0 * slope * max(len(series) - 1, 0) / reference if reference > 0 else 0.0
    leak = min(slope, tail) > rule.bytes_per_call and drift > rule.drift_pct
    return Trend(slope=slope, tail_slope=tail, drift_pct=drift, verdict=LEAK if leak else NO_LEAK)


# --- the report --------------------------------------------------------------------------------
@dataclass
class CallRow:
    """Memory after one call, measured once its cache was released (closed, dropped).

    Attributes
    ----------
    call : call index (0-based).
    seconds : wall time of the call.
    rss_bytes : process RSS.
    cache_bytes : this call's cache (``memory_report().total_bytes`` right after the call).
    caches_alive : caches of this run not yet freed (a dropped cache waits for the cyclic
        garbage collector while a reference cycle holds it).
    alive_cache_bytes : bytes those caches still hold (they explain part of the RSS).
    unexplained_bytes : ``rss_bytes - baseline_rss - alive_cache_bytes``: growth not explained by
        a live cache.
    threads : live Python threads.
    fds : open file descriptors (-1 without ``/proc``).
    cuda_allocated, cuda_reserved : ``torch.cuda.memory_allocated/reserved`` on CUDA, else None.
    """

    call: int
    seconds: float
    rss_bytes: int
    cache_bytes: int
    caches_alive: int
    alive_cache_bytes: int
    unexplained_bytes: int
    threads: int
    fds: int
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None


@dataclass
class DoctorReport:
    """What :func:`diagnose` found. ``verdict`` is ``"leak"`` when the unexplained RSS (or, on
    CUDA, the unexplained allocated device memory) trends up after the warm-up (see
    :class:`LeakRule`), else ``"no leak"``; :attr:`clean` also requires nothing left behind and no
    autograd graph in a cache.

    Attributes
    ----------
    preset : the policy name (or the cache factory's name).
    calls, warmup, new_tokens, prompt_tokens, reuse, collect : the run.
    baseline_rss : RSS before the first call.
    rows : one :class:`CallRow` per call.
    verdict : ``"leak"`` or ``"no leak"``.
    rss : the leak rule on ``unexplained_bytes`` after the warm-up.
    cuda : the leak rule on CUDA allocated bytes less live resident cache bytes (None on CPU).
    rss_drift_pct : raw RSS drift after the warm-up: median of the last tenth of the calls vs the
        first tenth, in percent.
    autograd : cache tensors that carried autograd state (:func:`autograd_tensors`), first 20.
    threads_left, fds_left, maps_left : threads, descriptors (their targets) and ``*.kv`` maps
        present after the run that were not there before it.
    files_left : offload directories of the run that still exist, and the files in them.
    offload_dirs : the offload directories the run's caches used.
    cuda_summary : ``torch.cuda.memory_summary()`` at the end, on CUDA.
    rule : the leak rule used.
    """

    preset: str
    calls: int
    warmup: int
    new_tokens: int
    prompt_tokens: int
    reuse: bool
    collect: bool
    baseline_rss: int
    rows: list[CallRow]
    verdict: str
    rss: Trend
    cuda: Trend | None
    rss_drift_pct: float
    autograd: list[str] = field(default_factory=list)
    threads_left: list[str] = field(default_factory=list)
    fds_left: list[str] = field(default_factory=list)
    files_left: list[str] = field(default_factory=list)
    maps_left: list[str] = field(default_factory=list)
    offload_dirs: list[str] = field(default_factory=list)
    cuda_summary: str | None = None
    rule: LeakRule = field(default_factory=LeakRule)

    @property
    def leftovers(self) -> bool:
        """Whether the run left threads, descriptors, offload files or maps behind."""
        return bool(self.threads_left or self.fds_left or self.files_left or self.maps_left)

    @property
    def clean(self) -> bool:
        """No leak, nothing left behind, no autograd graph in a cache."""
        return self.verdict == NO_LEAK and not self.leftovers and not self.autograd

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["clean"] = self.clean
        return d

    def __str__(self) -> str:
        mib = 2**20
        window = self.rows[self.warmup :]
        lines = [
            f"kvtier doctor: {self.preset}, {self.calls} calls ({self.warmup} warm-up), prompt {self.prompt_tokens}"
            f" + {self.new_tokens} new tokens, {'one cache reused' if self.reuse else 'a fresh cache per call'}"
            + (", gc.collect() after each" if self.collect else ""),
            f"  baseline RSS {self.baseline_rss / mib:.1f} MiB; after warm-up {window[0].rss_bytes / mib:.1f} MiB,"
            f" at the end {window[-1].rss_bytes / mib:.1f} MiB (drift {self.rss_drift_pct:+.2f}%)",
            f"  cache {self.rows[-1].cache_bytes / mib:.3f} MiB per call; caches alive at most"
            f" {max(r.caches_alive for r in self.rows)}; unexplained at the end"
            f" {self.rows[-1].unexplained_bytes / mib:.1f} MiB, of which"
            f" {(self.rows[-1].unexplained_bytes - window[0].unexplained_bytes) / mib:+.1f} MiB after the warm-up"
            " (the warm-up pages in weights, loads kernels)",
            f"  RSS trend after warm-up: {self.rss.slope / 1024:+.1f} KiB/call"
            f" (last half {self.rss.tail_slope / 1024:+.1f}),"
            f" fitted drift {self.rss.drift_pct:+.2f}% -> {self.rss.verdict}",
        ]
        if self.cuda is not None:
            lines.append(
                f"  CUDA allocated trend: {self.cuda.slope / 1024:+.1f} KiB/call (last half"
                f" {self.cuda.tail_slope / 1024:+.1f}), drift {self.cuda.drift_pct:+.2f}% -> {self.cuda.verdict}"
            )
        lines.append(f"  autograd graphs in cache tensors: {'; '.join(self.autograd) if self.autograd else 'none'}")
        for what, items in (
            ("threads", self.threads_left),
            ("file descriptors", self.fds_left),
            ("offload files", self.files_left),
            ("*.kv memory maps", self.maps_left),
        ):
            lines.append(f"  {what} left after close(): {', '.join(items) if items else 'none'}")
        lines.append(f"verdict: {self.verdict}" + ("" if self.clean else " (not clean: see above)"))
        return "\n".join(lines)


# --- the run -----------------------------------------------------------------------------------
def generate_step(new_tokens: int) -> Loop:
    """The default loop step: greedy ``model.generate`` of exactly ``new_tokens`` tokens."""

    def step(model: Any, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )

    return step


def prompt_ids(tokenizer: Any, tokens: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """``([1, tokens] ids, source)``: the start of the first book of
    :func:`kvtier.eval.texts.load_texts`, repeated if short, or random token ids when no text is found."""
    from .eval.texts import load_texts

    try:
        name, text = next(iter(load_texts(limit=1).items()))
    except (FileNotFoundError, StopIteration):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, len(tokenizer), (1, tokens), generator=g), "random token ids"
    ids: list[int] = []
    chars = 8 * tokens
    while len(ids) < tokens:
        ids = tokenizer(text[:chars], add_special_tokens=False).input_ids
        if chars >= len(text):
            if not ids:
                raise ValueError(f"text {name!r} gives no tokens")
            ids = (ids * (tokens // len(ids) + 1))[:tokens]
        chars *= 2
    return torch.tensor([ids[:tokens]]), f"book {name!r}"


def _factory(preset: str | TierPolicy | Callable[[Any], Any], model: Any) -> tuple[Callable[[], Any], str]:
    if callable(preset) and not isinstance(preset, TierPolicy):
        return (lambda: preset(model)), getattr(preset, "__name__", type(preset).__name__)
    from .hf import TieredCache

    policy = get_policy(preset)
    return (lambda: TieredCache(model.config, policy)), policy.name or "custom"


def _on_cuda(model: Any) -> bool:
    p = next(iter(model.parameters()), None)
    return p is not None and p.is_cuda


def _drift_pct(rss: np.ndarray) -> float:
    k = max(1, len(rss) // 10)
    first, last = float(np.median(rss[:k])), float(np.median(rss[-k:]))
    return 100.0 * (last - first) / first if first else 0.0


def diagnose(
    model: Any,
    tokenizer_or_input_ids: Any,
    preset: str | TierPolicy | Callable[[Any], Any] = "default",
    calls: int = 100,
    new_tokens: int = 8,
    prompt_tokens: int = 512,
    warmup: int | None = None,
    loop: Loop | None = None,
    reuse: bool = False,
    rule: LeakRule | None = None,
    progress: bool = False,
    collect: bool = False,
) -> DoctorReport:
    """Run ``calls`` requests the way a serving loop would and report memory per call.

    Each call builds a fresh cache (``with TieredCache(...)``: closed at the end of the call) and
    runs ``loop`` on it under ``kvtier.enable(model)``; with ``reuse`` one cache serves every call,
    each continuing the previous output (the cache grows by ``new_tokens`` a call). After each call
    the cache's tensors are checked for autograd state, the cache is released and RSS (and CUDA
    memory) is read. Unless ``collect``, nothing calls the garbage collector: a cache held by a
    reference cycle stays alive until Python's cyclic collector runs, as in a user's loop, and its
    bytes are counted as explained (:attr:`CallRow.alive_cache_bytes`).

    Parameters
    ----------
    model : a transformers causal LM (eval mode).
    tokenizer_or_input_ids : a tokenizer (the prompt is ``prompt_tokens`` tokens of the first
        book of :func:`kvtier.eval.texts.load_texts`, random ids when there is none) or the prompt
        ids ``[B, T]`` (``[T]`` is taken as one row).
    preset : a preset name, a :class:`~kvtier.TierPolicy`, or ``factory(model) -> cache`` for any
        transformers cache (``kvtier.enable`` is entered only for a :class:`~kvtier.TieredCache`).
    calls : requests to run.
    new_tokens : tokens generated per request (exactly; end-of-sequence is suppressed).
    prompt_tokens : prompt length when a tokenizer is given.
    warmup : calls left out of the trend (default ``max(5, calls // 5)``); at least 8 calls must remain.
    loop : ``loop(model, input_ids, cache) -> output ids | None`` replaces the generate call
        (tests inject a leaking or autograd-building step here).
    reuse : one cache grown across the calls instead of a fresh one per call.
    rule : the leak rule (default :class:`LeakRule`).
    progress : show a tqdm bar over the calls (stderr).
    collect : call ``gc.collect()`` after each call, before measuring (not timed): dropped caches
        are then freed at once, which tells garbage waiting for the collector from a leak.

    Returns
    -------
    DoctorReport

    Raises
    ------
    ValueError : too few calls after the warm-up, or ``reuse`` past the model's positions.
    """
    from tqdm.auto import tqdm

    rule = rule or LeakRule()
    warmup = max(5, calls // 5) if warmup is None else warmup
    if warmup < 0 or calls - warmup < 8:
        raise ValueError(f"calls={calls}, warmup={warmup}: need at least 8 calls after the warm-up")
    ids = _prompt(model, tokenizer_or_input_ids, prompt_tokens)
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if reuse and limit is not None and ids.shape[1] + calls * new_tokens > limit:
        raise ValueError(
            f"reuse: {ids.shape[1]} prompt + {calls} x {new_tokens} new tokens exceed the model's {limit} positions"
        )
    make, name = _factory(preset, model)
    # the bar first: tqdm starts its process-wide monitor thread with the first bar
    bar = tqdm(range(calls), desc=f"doctor {name}", unit="call", disable=not progress, file=sys.stderr)
    run = _CallLoop(model, ids, make, loop or generate_step(new_tokens), reuse, collect)
    with contextlib.ExitStack() as stack:
        stack.callback(run.close_last)
        for i in bar:
            run.call(i, stack)
    return run.report(
        preset=name,
        calls=calls,
        warmup=warmup,
        new_tokens=new_tokens,
        prompt_tokens=int(ids.shape[1]),
        reuse=reuse,
        collect=collect,
        rule=rule,
    )


def _prompt(model: Any, tokenizer_or_input_ids: Any, prompt_tokens: int) -> torch.Tensor:
    """The prompt ids ``[B, T]`` on the model's device."""
    if isinstance(tokenizer_or_input_ids, torch.Tensor):
        ids = tokenizer_or_input_ids
        ids = ids[None] if ids.dim() == 1 else ids
    else:
        ids, _ = prompt_ids(tokenizer_or_input_ids, prompt_tokens)
    return ids.to(next(iter(model.parameters())).device)


class _CallLoop:
    """:func:`diagnose`'s serving loop: what the process held before, one measured row per call,
    what it holds after (threads, descriptors, mappings, folders)."""

    def __init__(self, model: Any, ids: torch.Tensor, make: Callable[[], Any], step: Loop, reuse: bool, collect: bool):
        self.model, self.make, self.step, self.reuse, self.collect = model, make, step, reuse, collect
        self.inputs = ids
        self.cuda = _on_cuda(model)
        self.device = ids.device
        self.threads0, self.fds0, self.maps0 = _threads(), open_fds(), set(kv_maps())
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.cuda0 = torch.cuda.memory_allocated(self.device)
        self.baseline = rss_bytes()
        self.alive: list[weakref.ref] = []
        self.dirs: list[str] = []
        self.autograd: list[str] = []
        self.rows: list[CallRow] = []
        self.resident: list[int] = []
        self.enabled = False
        self.cache = None

    def close_last(self) -> None:
        """Close the reused cache, or the current one when a step raised."""
        if self.cache is not None:
            _close(self.cache)

    def call(self, i: int, stack: contextlib.ExitStack) -> None:
        """Run call ``i`` (a fresh cache unless reused) and append its row."""
        from .hf import TieredCache, enable

        t0 = time.perf_counter()
        if self.cache is None:
            self.cache = self.make()
            self.alive.append(weakref.ref(self.cache))
            self.dirs.extend(d for d in _offload_dirs(self.cache) if d not in self.dirs)
            if isinstance(self.cache, TieredCache) and not self.enabled:
                stack.enter_context(enable(self.model))
                self.enabled = True
        out = self.step(self.model, self.inputs, self.cache)
        seconds = time.perf_counter() - t0
        if self.reuse and isinstance(out, torch.Tensor):
            self.inputs = out
        found = autograd_tensors(self.cache)
        self.autograd.extend(f"call {i} {f}" for f in found[: max(0, 20 - len(self.autograd))])
        this_bytes = _cache_bytes(self.cache)[0]
        if not self.reuse:
            t1 = time.perf_counter()
            _close(self.cache)
            self.cache = None
            seconds += time.perf_counter() - t1
        self.rows.append(self._measure(i, seconds, this_bytes))

    def _measure(self, i: int, seconds: float, this_bytes: int) -> CallRow:
        """Memory after a call: RSS, the caches still alive and what they explain."""
        if self.collect:
            gc.collect()
        live = [c for c in (r() for r in self.alive) if c is not None]
        self.alive = [weakref.ref(c) for c in live]
        held = [_cache_bytes(c) for c in live]
        del live
        rss = rss_bytes()
        row = CallRow(
            call=i,
            seconds=seconds,
            rss_bytes=rss,
            cache_bytes=this_bytes,
            caches_alive=len(held),
            alive_cache_bytes=sum(h[0] for h in held),
            unexplained_bytes=rss - self.baseline - sum(h[0] for h in held),
            threads=len(_threads()),
            fds=_fd_count(),
        )
        if self.cuda:
            torch.cuda.synchronize(self.device)
            row.cuda_allocated = torch.cuda.memory_allocated(self.device)
            row.cuda_reserved = torch.cuda.memory_reserved(self.device)
            self.resident.append(sum(h[1] for h in held))  # resident tiers live on the device
        return row

    def _files_left(self) -> list[str]:
        out = []
        for d in self.dirs:
            if os.path.exists(d):
                entries = sorted(os.listdir(d)) if os.path.isdir(d) else []
                out.append(d + (f" ({', '.join(entries)})" if entries else " (empty)"))
        return out

    def report(self, *, warmup: int, rule: LeakRule, **fields: Any) -> DoctorReport:
        """Trends over the calls after the warm-up, the verdict and what was left behind."""
        threads1, fds1, maps1 = _threads(), open_fds(), kv_maps()
        files_left = self._files_left()
        window = self.rows[warmup:]
        unexplained = np.array([r.unexplained_bytes for r in window], dtype=np.float64)
        rss = np.array([r.rss_bytes for r in window], dtype=np.float64)
        rss_trend = leak_trend(unexplained, float(np.median(rss[:5])), rule)
        cuda_trend = None
        summary = None
        if self.cuda:
            dev = [(r.cuda_allocated or 0) - self.cuda0 - b for r, b in zip(window, self.resident[warmup:])]
            cuda_trend = leak_trend(np.array(dev, dtype=np.float64), float(max(self.cuda0, 1)), rule)
            summary = torch.cuda.memory_summary(self.device)
        verdict = LEAK if LEAK in (rss_trend.verdict, getattr(cuda_trend, "verdict", None)) else NO_LEAK
        return DoctorReport(
            **fields,
            warmup=warmup,
            baseline_rss=self.baseline,
            rows=self.rows,
            verdict=verdict,
            rss=rss_trend,
            cuda=cuda_trend,
            rss_drift_pct=_drift_pct(rss),
            autograd=self.autograd,
            threads_left=[f"{n} ({ident})" for ident, n in threads1.items() if ident not in self.threads0],
            fds_left=sorted({f"{fd} -> {t}" for fd, t in fds1.items() if self.fds0.get(fd) != t}),
            files_left=files_left,
            maps_left=[m for m in maps1 if m not in self.maps0],
            offload_dirs=self.dirs,
            cuda_summary=summary,
            rule=rule,
        )


# --- plot --------------------------------------------------------------------------------------
def plot_memory(report: DoctorReport, path: str | Path) -> Path:
    """PNG of memory over the calls: RSS, live cache bytes and unexplained bytes (MiB; CUDA
    allocated too on CUDA), the warm-up shaded, the verdict in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    x = [r.call for r in report.rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(x, [r.rss_bytes / mib for r in report.rows], label="process RSS")
    ax.plot(x, [r.alive_cache_bytes / mib for r in report.rows], label="live cache bytes")
    ax.plot(x, [r.unexplained_bytes / mib for r in report.rows], label="unexplained (RSS - baseline - cache)")
    if report.cuda is not None:
        ax.plot(x, [(r.cuda_allocated or 0) / mib for r in report.rows], label="CUDA allocated")
    if report.warmup:
        ax.axvspan(0, report.warmup - 0.5, color="0.9", label="warm-up")
    ax.set_xlabel("call")
    ax.set_ylabel("MiB")
    ax.set_title(f"kvtier doctor: {report.preset}: {report.verdict} ({report.rss.slope / 1024:+.1f} KiB/call)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


# --- the command -------------------------------------------------------------------------------
def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


#: ``--threads`` of every command: torch takes ``set_num_threads(1024)``, but 100000 crashes it
#: (a segfault), so the count is bounded by a fixed cap, the same on every machine.
MAX_THREADS = 1024


def threads_arg(text: str) -> int:
    """``--threads``: an int in ``[1, MAX_THREADS]`` (an argparse ``type``; ``kvtier.cli`` uses it too)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected a thread count in [1, {MAX_THREADS}], got {text!r}")
    return value


def _check_device(name: str) -> None:
    """``--device``: ``cpu`` or an available ``cuda[:N]``, checked before the model loads."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r} is not allowed: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ValueError(
            f"--device {name!r}: CUDA is not available ({why}, torch {torch.__version__}); use --device cpu"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name!r}: there are {torch.cuda.device_count()} CUDA devices")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``doctor`` to the ``kvtier`` subcommands (``subparsers``: ``add_subparsers()``'s result)."""
    p = subparsers.add_parser(
        "doctor",
        help="run N generate calls and check memory: leak verdict, leftover threads/files/maps, autograd",
        description="Exit status: 0 clean, 1 a leak or something left behind, 2 an error.",
    )
    p.add_argument("--model", default="smollm2-135m", help="built-in name or a local model folder (offline)")
    p.add_argument(
        "--preset",
        default="default",
        help="a preset or a preset variant, as kvtier eval and plan name them: adaptive@2.5:codes=vq, "
        "default:vq3/3, default:dense, ... (checked before the model loads)",
    )
    p.add_argument("--calls", type=_positive, default=100)
    p.add_argument("--new-tokens", type=_positive, default=8)
    p.add_argument("--prompt-tokens", type=_positive, default=512)
    p.add_argument("--warmup", type=int, default=None, help="calls left out of the trend (default max(5, calls/5))")
    p.add_argument("--reuse", action="store_true", help="one cache grown across the calls")
    p.add_argument("--gc", action="store_true", help="gc.collect() after each call (frees dropped caches at once)")
    p.add_argument("--offload-dir", help="directory for the offload-disk files (default: the temp directory)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=threads_arg, default=max(1, min(2, torch.get_num_threads())))
    p.add_argument("--plot", metavar="FILE", help="PNG of memory over the calls")
    p.add_argument("--json", action="store_true", help="end with one JSON line (the report)")
    p.set_defaults(fn=cmd_doctor)
    return p


def cmd_doctor(args: argparse.Namespace) -> int:
    """``kvtier doctor``: 0 when clean, 1 on a leak or leftovers, 2 on an error (one line on stderr)."""
    from .models import load_model

    try:
        policy = get_policy(args.preset)
        if args.offload_dir is not None:
            if policy.offload is None or policy.offload.backend != "disk":
                raise ValueError(f"--offload-dir needs a disk offload preset, not {args.preset!r}")
            policy = policy.replace(offload=replace(policy.offload, path=args.offload_dir))
        _check_device(args.device)
        torch.set_num_threads(args.threads)
        print(f"loading {args.model} (offline) ...", file=sys.stderr, flush=True)
        model, tok = load_model(args.model, device=args.device)
        ids, source = prompt_ids(tok, args.prompt_tokens)
        print(f"prompt: {ids.shape[1]} tokens of {source}", file=sys.stderr, flush=True)
        report = diagnose(
            model,
            ids,
            policy,
            calls=args.calls,
            new_tokens=args.new_tokens,
            warmup=args.warmup,
            reuse=args.reuse,
            progress=True,
            collect=args.gc,
        )
    except (ValueError, OSError, RuntimeError) as err:  # OffloadError and kvtier's errors are RuntimeErrors
        if getattr(args, "traceback", False):  # ``kvtier --traceback doctor ...``
            raise
        print(f"kvtier doctor: {' '.join(str(err).split()) or type(err).__name__}", file=sys.stderr)
        return 2
    print(report)
    if report.cuda_summary:
        print(report.cuda_summary)
    if args.plot:
        print(f"wrote {plot_memory(report, args.plot)}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0 if report.clean else 1
