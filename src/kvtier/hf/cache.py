"""``TieredCache``: a transformers ``Cache`` whose full-attention layers are :class:`TieredLayer`.

Part of the transformers adapter (:mod:`kvtier.hf`). May import: transformers, ``kvtier.cache``,
``kvtier.codecs``, ``kvtier.policy``, ``kvtier.errors``, ``kvtier.stats``, ``kvtier.diagnostics``,
``kvtier.hf.layer``, and (lazily) ``kvtier.offload``.

Sliding-window and other non-full-attention layers of hybrid models (``config.layer_types``)
use transformers' own layer classes. The cache needs kvtier's attention function, which reads
the tiers directly; ``kvtier.enable(model)`` switches a model to it.

Every call is checked before anything changes: the model must run kvtier's attention for this
call (its config says so, and a kvtier mask was built in the calling thread since the call began:
transformers builds the mask once per forward), the model's layers must be the cache's (count and
kinds, checked when ``kvtier.enable``'s wrapper opens the call), and the states must fit the cache
(KV heads, head dim, batch, device, dtype).

A forward call is all-or-nothing, for every layer of the cache whatever its kind: each tiered
layer keeps a journal of the call's changes (see :mod:`kvtier.cache.state`), and every other layer
(transformers' sliding-window layers of hybrid models) is saved as it was when the call first
reached it (its state is bounded by its window). Under ``kvtier.enable`` the call opens when the
model's forward is entered and is kept when it returns (:meth:`TieredCache.model_call`): an
exception anywhere in the forward (in kvtier, in any layer, in the final norm or ``lm_head``, Ctrl-C)
puts every layer back before it reaches the caller, so calling again is always safe. A model run
without that wrapper (kvtier attention selected by hand) opens the call at its first layer and keeps
it once every layer has run; a call interrupted there between two layers is undone when the cache is
next used, with an error asking to call again. What happens after the forward returned (a logits
processor or stopping criterion of ``generate``) is not part of the call: ``get_seq_length()`` then
says how many tokens the cache holds. If undoing itself fails, the cache refuses every later use,
naming the first fault.

Threads: a cache serves one forward call at a time. While a call is open in one thread, a call
from another thread (and ``reorder_cache``, ``batch_select_indices``, ``reset``, ``close``, a copy
or a pickle) is refused at once with a :class:`~kvtier.KVTierError` naming concurrent use, before
anything changes, and the open call runs on untouched (the check and the start of a call are one
step under a lock). Refusing rather than serializing keeps a second user's tokens from silently
landing in the middle of someone else's conversation: sharing one cache between threads is a bug
in the caller. One call after another from different threads is fine, and so are separate caches
in separate threads (a kvtier mask counts only in the thread that built it). A call left open by
a thread that has ended is undone at the next use, as an interrupted one.

Copies: ``copy.copy`` is refused (it would share the layers); ``copy.deepcopy`` shares the config
it was built from (``kvtier.enable`` switches the model's config, and the copy follows the model
as the original does); ``pickle`` works for caches without offloading (an unpickled cache holds a
copy of the config, so only the mask check tells whether the model runs kvtier attention) and an
offloading cache refuses it.

Byte caps: ``max_bytes=N`` bounds the bytes the cache holds after every call (what
:meth:`memory_report` counts: every tensor of every layer, offloaded blocks included). With
``on_full="error"`` a call that would end above ``N`` raises :class:`~kvtier.CacheFullError` and
leaves the cache as it was; with ``"evict"`` each tiered layer drops its oldest non-sink blocks
(StreamingLLM-style) to stay within an equal share of ``N``, and ``memory_report()`` counts the
evicted tokens; with ``"degrade"`` the oldest tokens go down the ladder first (the oldest cold
blocks are evicted while the cold tier holds more token slots than the warm one, else the oldest
warm block steps down to the cold code), so a recent warm window stays. The exact hot tokens of
the call being processed are held transiently before they settle (a long prompt chunk briefly
holds its exact K/V).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    get_layer_types_and_kwargs,
)

from ..cache.adaptive import Budget
from ..cache.state import ATTENTION_NAME, Journal, forward_epoch
from ..diagnostics import MemoryReport, memory_report, untiered_tensors
from ..errors import CacheFullError, KVTierError
from ..policy import TierPolicy, get_policy
from ..stats import OffloadStats, SparseStats, tensor_bytes
from .attention import attn_implementation
from .layer import TieredLayer

ON_FULL = ("error", "evict", "degrade")


#: Version of the pickled state's layout; a pickle of another version is refused (see ``__setstate__``).
STATE_VERSION = 2

#: transformers' layer classes known to replace their tensors on every change (``torch.cat``,
#: slicing, ``index_select``), never to write them in place: a saved state may share their tensors.
#: Any other kind of layer is saved with its tensors cloned.
_REPLACING_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


class _Saved:
    """A transformers layer (not tiered) as it was when a call first reached it; ``restore`` puts it back."""

    def __init__(self, layer: Any):
        share = type(layer) in _REPLACING_LAYERS
        self.state = {
            k: v.clone() if isinstance(v, torch.Tensor) and not share else v for k, v in layer.__dict__.items()
        }

    def restore(self, layer: Any) -> None:
        layer.__dict__.clear()
        layer.__dict__.update(self.state)


class _Call:
    """One forward call in progress: its thread, the mask id it runs under, and the journals of the
    layers it reached (tiered layers' :class:`Journal`, other layers' :class:`_Saved` state)."""

    def __init__(self, since: int, wrapped: bool):
        self.since = since  # the thread's mask id when the call opened: the call's mask is newer
        self.epoch: int | None = None  # the call's mask id, once its first layer checked it
        self.wrapped = wrapped  # opened by kvtier.enable's wrapper: kept when the model's forward returns
        self.thread = threading.current_thread()
        self.journals: dict[int, tuple[TieredLayer, Journal]] = {}
        self.saved: dict[int, tuple[Any, _Saved]] = {}
        self.done = 0
        self.budgets: list[tuple[Budget, object]] = []  # each budget's state before the call (its snapshot)

    def reached(self, idx: int) -> bool:
        return idx in self.journals or idx in self.saved


class TieredCache(Cache):
    """Tiered hot / warm / cold KV cache.

    Parameters
    ----------
    config : the model's config (``model.config``) or the model itself.
    policy : a preset name (see ``kvtier.PRESETS``), a preset variant's name (``"adaptive@2.5:codes=vq"``,
        ``"default:vq3/3"``; :func:`kvtier.get_policy`) or a :class:`TierPolicy`.
    attention : ``"fast"`` (attention on the packed data; decode on the CPU in one fused call per
        layer), ``"per-tier"`` (the same, one partial per tier merged in torch), ``"reference"``
        (each tier decoded to dense K/V for one SDPA call; the oracle the fast paths are tested against),
        or a backend to force: ``"torch"``, ``"cpu"``, ``"fused"``, ``"triton"`` (see
        :mod:`kvtier.attention.plan`; a forced backend that cannot run raises at the first call).
    max_bytes : cap on the bytes the cache holds after every call (see the module doc), or None.
    on_full : ``"error"`` (raise :class:`~kvtier.CacheFullError`, cache unchanged), ``"evict"``
        (drop the oldest non-sink blocks) or ``"degrade"`` (evict the oldest cold blocks while the cold tier
        holds more token slots than the warm tier, else step the oldest warm block down to the cold
        code) when a call would exceed ``max_bytes``.
    bits : with an adaptive policy (``"adaptive"``, or ``policy.adaptive`` set): the budget in
        stored bits per K/V element, every overhead included (see :class:`~kvtier.AdaptivePolicy`);
        None keeps the policy's.

    Example
    -------
    >>> with kvtier.enable(model):
    ...     out = model.generate(**inputs, cache=kvtier.TieredCache(model.config, "default"))
    """

    def __init__(
        self,
        config: PretrainedConfig | PreTrainedModel,
        policy: str | TierPolicy = "default",
        attention: str = "fast",
        max_bytes: int | None = None,
        on_full: str = "error",
        bits: float | None = None,
    ):
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0):
            raise ValueError(f"max_bytes={max_bytes!r} is not allowed: expected an int > 0 (bytes) or None")
        if on_full not in ON_FULL:
            raise ValueError(f"on_full={on_full!r} is not allowed: expected one of {ON_FULL}")
        if isinstance(config, PreTrainedModel):
            config = config.config
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"config must be a transformers config or model, got {type(config).__name__}")
        self.config = config
        self.policy = get_policy(policy)
        if bits is not None:
            if self.policy.adaptive is None:
                raise ValueError(
                    f"bits={bits!r} is not allowed with policy {self.policy.name!r}: it sets the budget of an adaptive "
                    "policy (policy='adaptive' or a TierPolicy with adaptive=AdaptivePolicy(...))"
                )
            named = self.policy.name.partition(":")[0].partition("@")[2]  # "adaptive@2.5..." names its budget
            if named and float(bits) != self.policy.adaptive.bits:
                raise ValueError(
                    f"bits={bits!r} is not allowed with policy {self.policy.name!r}, which names a budget of "
                    f"{self.policy.adaptive.bits:g} bits: give the budget once (policy='adaptive@{bits:g}', or "
                    "policy='adaptive' with bits=...)"
                )
            self.policy = self.policy.replace(adaptive=dataclasses.replace(self.policy.adaptive, bits=bits))
        text = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
        n = len(layer_types)
        self.policy.check_layers(n)  # keys beyond the model, two keys naming one layer
        policies = {i: self.policy.for_layer(i, n) for i, kind in enumerate(layer_types) if kind == "full_attention"}
        offloading = [p.offload for p in policies.values() if p.cold == "offload" and not p.is_exact]
        if max_bytes is not None and on_full in ("evict", "degrade") and offloading:
            raise ValueError(
                f"on_full={on_full!r} is not allowed with offloading layers (a store keeps its slots once grown); "
                "use on_full='error' or a policy without cold='offload'"
            )
        self.max_bytes = max_bytes
        self.on_full = on_full
        self.offloader = None
        if offloading:  # one worker and one private directory per disk path, shared by the layers
            from ..offload.prefetch import Offloader

            self.offloader = Offloader(offloading)
        self.budgets: dict[TierPolicy, Budget] = {}  # one per adaptive layer policy, shared by its layers
        for p in policies.values():
            if p.adaptive is not None and p not in self.budgets:
                self.budgets[p] = Budget(p, sum(q == p for q in policies.values()))
        layers: list[Any] = []
        for i, (kind, kw) in enumerate(zip(layer_types, layer_kwargs)):
            if kind == "full_attention":
                budget = self.budgets.get(policies[i])
                layers.append(TieredLayer(policies[i], owner=self, attention=attention, layer_idx=i, budget=budget))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
        super().__init__(layers=layers)
        self.layer_types = tuple(layer_types)  # what the model's layers must be (checked per call)
        self.num_tiered = sum(isinstance(layer, TieredLayer) for layer in layers)
        self._state_version = STATE_VERSION
        self._last_thread = threading.current_thread().name  # the thread of the last kept call
        self._epoch = forward_epoch()  # mask id of the last call (or this thread's at construction)
        self._call: _Call | None = None
        self._lock = threading.RLock()  # held to check and change ``_call`` (see the module doc)
        self._config_is_live = True  # False once unpickled: ``config`` is then a copy
        self._fault: str | None = None
        self._bytes: dict[int, int] = {}  # bytes of each tiered layer after its last settled call

    # --- checks and the call journal ------------------------------------------------------------
    def check_usable(self, what: str = "a change between calls") -> None:
        """Between calls (beam reordering, copies): raise if a call of another thread is open
        (``what`` names the refused use), or if an earlier fault left the cache unusable, and undo
        a call that was interrupted outside kvtier."""
        with self._lock:
            self._claim(what)
            self._check_fault()
            call = self._call
            if call is not None:
                self._rollback(call)
                raise self._interrupted(call)

    def _claim(self, what: str) -> None:
        """Raise, changing nothing, if a forward call of another live thread is open (the caller
        holds ``_lock``); a call whose thread has ended is undone as an interrupted one."""
        call = self._call
        if call is None or call.thread is threading.current_thread():
            return
        if not call.thread.is_alive():
            self._rollback(call)
            raise self._interrupted(call)
        raise self._concurrent(call.thread.name, what)

    @staticmethod
    def _concurrent(other: str, what: str) -> KVTierError:
        return KVTierError(
            f"this TieredCache is in use by a forward call in thread {other!r} (concurrent use): "
            f"{what} from thread {threading.current_thread().name!r} is refused; a cache serves one call at a "
            "time: give each thread its own TieredCache, or wait for the call to end"
        )

    @contextmanager
    def _between_calls(self, what: str) -> Iterator[None]:
        """Hold the lock over a change between calls, once :meth:`check_usable` passed."""
        with self._lock:
            self.check_usable(what)
            yield

    def _check_fault(self) -> None:
        if self._fault is not None:
            raise KVTierError(f"this TieredCache is unusable after an earlier fault ({self._fault}); build a new one")

    def _interrupted(self, call: _Call | None) -> KVTierError:
        reached = 0 if call is None else len(call.journals) + len(call.saved)
        fewer = ""
        if 0 < reached < len(self.layers):
            fewer = (
                f"; it reached {reached} of the cache's {len(self.layers)} layers: if the model has {reached} "
                "layers, the cache was built for another model (build it from this model's config)"
            )
        return KVTierError(
            "the previous forward call stopped between two layers (interrupted outside kvtier); the cache was "
            f"put back as it was before that call: call again{fewer}"
        )

    def _model_attention(self, epoch: int, since: int) -> None:
        """Raise unless this call runs kvtier attention: a kvtier mask built in this thread since
        ``since`` (``epoch`` is the thread's latest mask id) and, for a cache built from a live config,
        that config selecting kvtier attention (not checked on an unpickled cache, whose config is a copy)."""
        impl = attn_implementation(self.config) if self._config_is_live else None
        if impl is not None and impl != ATTENTION_NAME:
            if epoch > since:  # the model ran kvtier's mask: the cache's config is not this model's
                raise KVTierError(
                    f"this TieredCache was built from another model's config (its attention is {impl!r}), not "
                    "from the config of the model that runs it: build the cache from this model's config "
                    "(kvtier.TieredCache(model.config, ...))"
                )
            raise KVTierError(
                f"TieredCache reads its compressed tiers in kvtier's attention, but the model uses {impl!r}: "
                "run the model inside `with kvtier.enable(model):` (or call kvtier.enable(model))"
            )
        if epoch <= since:
            if epoch > 0 and self._last_thread != threading.current_thread().name:
                raise KVTierError(
                    f"this TieredCache was used by a forward call of thread {self._last_thread!r} while this "
                    f"call of thread {threading.current_thread().name!r} was starting (concurrent use): this "
                    "call is refused; a cache serves one call at a time: give each thread its own TieredCache"
                )
            raise self._misuse()

    def _misuse(self) -> KVTierError:
        return KVTierError(
            "TieredCache needs kvtier's attention, but this forward call did not build kvtier's mask: the model "
            "is not running kvtier attention. Run it inside `with kvtier.enable(model):` (or call "
            "kvtier.enable(model)) and build the cache from model.config"
        )

    def check_model(self, model: PreTrainedModel) -> None:
        """Raise, changing nothing, unless ``model``'s layers are the ones this cache was built for
        (count and kinds: full attention, sliding window, ...); a config that passed is not read again."""
        if model.config is getattr(self, "_model_config", None):
            return
        text = model.config.get_text_config(decoder=True)
        try:
            types = tuple(get_layer_types_and_kwargs(text)[0])
        except Exception:  # noqa: BLE001 - a config transformers cannot read: the layer checks remain
            return
        if len(types) != len(self.layer_types):
            raise KVTierError(
                f"this TieredCache was built for {len(self.layer_types)} layers; the model has {len(types)}: "
                "build the cache from this model's config (kvtier.TieredCache(model.config, ...))"
            )
        if types != self.layer_types:
            i = next(i for i, (a, b) in enumerate(zip(types, self.layer_types)) if a != b)
            raise KVTierError(
                f"this TieredCache was built for other layer kinds than the model's (layer {i}: "
                f"{self.layer_types[i]!r} in the cache, {types[i]!r} in the model): build the cache from this "
                "model's config"
            )
        self._model_config = model.config

    @contextmanager
    def model_call(self, model: PreTrainedModel) -> Iterator[None]:
        """One forward call of ``model`` with this cache, all or nothing (``kvtier.enable`` wraps the
        model's forward in it): the call opens here, is kept when the body returns, and is undone,
        every layer of it, if the body raises anything (Ctrl-C included). A call already open in this
        thread under this wrapper (the base model inside its ``*ForCausalLM``) is joined."""
        with self._lock:
            self._claim("this call")
            self._check_fault()
            call = self._call
            if call is not None and call.wrapped:  # a nested model's forward: the outer one owns the call
                nested = True
            else:
                nested = False
                if call is not None:  # left open by a call without the wrapper
                    self._rollback(call)
                    raise self._interrupted(call)
                self.check_model(model)
                call = self._call = self._open(wrapped=True)
        if nested:
            yield
            return
        try:
            yield
        except BaseException as err:
            self.abort(err)
            raise
        with self._lock:
            if self._call is call:
                self._finish(call)

    def _open(self, wrapped: bool) -> _Call:
        call = _Call(forward_epoch() if wrapped else self._epoch, wrapped)
        call.budgets = [(b, b.snapshot()) for b in self.budgets.values()]
        return call

    def _join(self, idx: int) -> _Call:
        """The call ``layer idx`` joins (the caller holds ``_lock``): checks, and a call opened here
        when none is (a model run without ``kvtier.enable``'s wrapper)."""
        self._claim("this call")
        self._check_fault()
        epoch, call = forward_epoch(), self._call
        if call is not None and call.reached(idx):
            self._rollback(call)
            if call.wrapped:
                raise KVTierError(
                    f"layer {idx} ran twice in one forward call: a TieredCache holds one call's tokens once per "
                    "layer; the call was undone"
                )
            if epoch == call.epoch:
                raise self._misuse()
            raise self._interrupted(call)
        if call is None:
            call = self._call = self._open(wrapped=False)
        if call.epoch is None:  # the call's first layer: the mask this call built
            try:
                self._model_attention(epoch, call.since)
            except BaseException:
                self._call = None  # nothing changed yet
                raise
            call.epoch = epoch
        return call

    def begin_update(self, layer: TieredLayer) -> None:
        """Called by ``layer.update`` before it changes anything: check the call, start the layer's journal.

        The call was opened by :meth:`model_call` or, without it, by the model's first layer; a
        layer already in the open call means a new forward began before the previous one finished.
        A call of another thread is refused first.
        """
        with self._lock:  # check and start the call in one step: a second thread sees it open
            call = self._join(layer.layer_idx)
            layer.journal = Journal(layer)
            call.journals[layer.layer_idx] = (layer, layer.journal)

    def layer_done(self, layer: TieredLayer) -> None:
        """Called at the end of ``layer.settle``: enforce the byte cap; apply what the call's
        budgets decided once every tiered layer is done; keep a call without the wrapper once
        every layer has run."""
        with self._lock:
            call = self._call
            if call is None or call.thread is not threading.current_thread() or layer.layer_idx not in call.journals:
                return
            if self.max_bytes is not None:
                self._enforce_cap(layer)
                self._bytes[layer.layer_idx] = layer.nbytes()
            call.done += 1
            if call.done == len(call.journals) == self.num_tiered:
                for lay, _ in call.journals.values():  # layers that settled before the call ended a
                    # budget's warm-up apply it now (kvtier.cache.state), in the call
                    if lay.rebalance() and self.max_bytes is not None:
                        self._bytes[lay.layer_idx] = lay.nbytes()
            self._keep_if_complete(call)

    def _keep_if_complete(self, call: _Call) -> None:
        """Without the wrapper, a call is kept once every layer ran (and every tiered layer settled)."""
        if not call.wrapped and len(call.saved) + call.done == len(self.layers) == len(call.saved) + len(call.journals):
            self._finish(call)

    def _finish(self, call: _Call) -> None:
        """Keep ``call`` (the caller holds ``_lock``): every layer it reached must have finished, and
        the cache must be within ``max_bytes`` with every layer's share of this call counted (the
        cap checked at a tiered layer's settle cannot see transformers' layers that run after it)."""
        if call.done != len(call.journals):  # a tiered layer updated but never attended (not kvtier attention)
            self._rollback(call)
            raise KVTierError(
                "a tiered layer stored this call's tokens but kvtier's attention never read them (the model did "
                "not run kvtier attention in every layer); the call was undone: run the model inside "
                "`with kvtier.enable(model):`"
            )
        if self.max_bytes is not None and call.saved:
            try:
                tiered = self.tiered_layers
                if self._other_bytes() + sum(self._held(t) for t in tiered) > self.max_bytes:
                    for layer in tiered:  # evict or degrade to the share left now, or refuse
                        self._enforce_cap(layer)
                        self._bytes[layer.layer_idx] = layer.nbytes()
            except BaseException as err:
                self._rollback(call, err)
                raise
        for lay, journal in call.journals.values():
            journal.commit(lay)
        if call.epoch is not None:
            self._epoch = call.epoch
        self._call, self._last_thread = None, call.thread.name

    def abort(self, err: BaseException) -> None:
        """A step of the current call failed with ``err``: undo every layer's changes."""
        with self._lock:
            call = self._call
            if call is not None and call.thread is threading.current_thread():
                self._rollback(call, err)

    def _rollback(self, call: _Call, err: BaseException | None = None) -> None:
        self._call = None
        if call.epoch is not None:
            self._epoch = call.epoch
        try:
            for layer, journal in reversed(list(call.journals.values())):
                journal.rollback(layer)
                self._bytes.pop(layer.layer_idx, None)
            for layer, saved in call.saved.values():
                saved.restore(layer)
            for budget, snap in call.budgets:  # the warm-up's measurements and allocation, as before the call
                budget.restore(snap)
        except BaseException as undo_err:
            first = err if err is not None else undo_err
            self._fault = f"{type(first).__name__}: {first}"
            raise KVTierError(f"this TieredCache could not undo a failed call and is unusable ({self._fault})") from (
                undo_err
            )

    # --- byte cap -----------------------------------------------------------------------------
    def _other_bytes(self) -> int:
        """Bytes of the layers that are not tiered (sliding-window layers of hybrid models)."""
        tensors = [t for layer in self.layers if not isinstance(layer, TieredLayer) for t in untiered_tensors(layer)]
        return tensor_bytes(tensors)

    def _held(self, layer: TieredLayer) -> int:
        if layer.layer_idx not in self._bytes:
            self._bytes[layer.layer_idx] = layer.nbytes()
        return self._bytes[layer.layer_idx]

    def _enforce_cap(self, layer: TieredLayer) -> None:
        assert self.max_bytes is not None
        own = layer.nbytes()
        other_layers = self._other_bytes()
        if self.on_full in ("evict", "degrade"):
            share = (self.max_bytes - other_layers) // max(1, self.num_tiered)
            while own > share:
                # degrade: the oldest tokens go first down the ladder, keeping a recent warm window:
                # while the cold tier holds more slots than the warm one its oldest blocks are
                # evicted, else the oldest warm block steps down. Demoting the whole warm window
                # before evicting anything cost +3.78 % at 8k where this costs +1.77 % and plain
                # eviction +1.68 % (BENCHMARKS.md, v6)
                c = layer.token_counts() if self.on_full == "degrade" else None
                if c is not None and c["cold"] <= c["warm"] and layer.demote_oldest(1):
                    pass
                elif not layer.evict_oldest(1):
                    if c is None or not layer.demote_oldest(1):
                        break
                own = layer.nbytes()
            if own <= share:
                return
        others = other_layers + sum(self._held(t) for t in self.tiered_layers if t is not layer)
        if own + others > self.max_bytes:
            what = "even after evicting every non-sink block of layer" if self.on_full != "error" else "at layer"
            advice = (
                "raise max_bytes, use on_full='evict', or a smaller policy"
                if self.on_full == "error"  # evict/degrade already dropped all they may: sinks and hot stay
                else "raise max_bytes, or use a smaller policy (fewer sink_tokens or hot_tokens) or shorter calls"
            )
            raise CacheFullError(
                f"this call would make the cache hold {own + others:,} bytes > max_bytes={self.max_bytes:,} "
                f"({what} {layer.layer_idx}: {own:,} bytes); the cache is unchanged: {advice}"
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise KVTierError(
                f"layer_idx={layer_idx!r} is not in this cache: it was built for {len(self.layers)} layers; "
                "build the cache from the config of the model that runs it"
            )
        layer = self.layers[layer_idx]
        if isinstance(layer, TieredLayer):  # tiered layers join the call in begin_update
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        with self._lock:  # transformers' own layer (a sliding window): saved as it is, then updated
            call = self._join(layer_idx)
            call.saved[layer_idx] = (layer, _Saved(layer))
        try:
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException as err:
            self.abort(err)
            raise
        with self._lock:
            if self._call is call:
                self._keep_if_complete(call)
        return out

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        with self._between_calls("reorder_cache"):
            self._reset_empty_others()
            super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        with self._between_calls("batch_select_indices"):
            self._reset_empty_others()
            super().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        with self._between_calls("batch_repeat_interleave"):
            self._reset_empty_others()
            super().batch_repeat_interleave(repeats)

    def _reset_empty_others(self) -> None:
        """transformers' layers holding no token (cropped to nothing) skip a batch change and keep
        an empty tensor of the old batch, which the next call's states cannot join: such a layer is
        reset (its public ``reset``: uninitialized, as before its first call)."""
        for layer in self.layers:
            if not isinstance(layer, TieredLayer) and layer.is_initialized and layer.get_seq_length() == 0:
                layer.reset()

    def reset(self) -> None:
        """Empty every layer; an interrupted call of this thread is dropped with the rest."""
        with self._lock:
            self._claim("reset()")
            self._call = None
            super().reset()
            self._bytes.clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the latest ``-tokens_to_remove`` tokens from every layer (``crop(-n)``: assisted
        and prompt-lookup decoding roll back rejected draft tokens), all or nothing: every tiered
        layer is checked before any layer changes, and a crop past a layer's exact hot window
        raises a :class:`~kvtier.KVTierError` naming how many tokens can go (see
        :meth:`kvtier.cache.state.LayerState.crop`)."""
        with self._between_calls("crop"):
            for layer in self.tiered_layers:
                layer.check_crop(tokens_to_remove)
            others = [
                (i, layer, _Saved(layer)) for i, layer in enumerate(self.layers) if not isinstance(layer, TieredLayer)
            ]
            for i, layer, _ in others:  # transformers' own layers (hybrid models) first: they may refuse
                try:
                    layer.crop(tokens_to_remove)
                except Exception as err:
                    for _, lay, saved in others:
                        saved.restore(lay)
                    raise KVTierError(
                        f"TieredCache cannot crop {-tokens_to_remove} tokens: layer {i} ({type(layer).__name__}) "
                        f"refuses ({err}); the cache is unchanged"
                    ) from err
            for layer in self.tiered_layers:
                layer.crop(tokens_to_remove)
                self._bytes.pop(layer.layer_idx, None)

    @property
    def tiered_layers(self) -> list[TieredLayer]:
        return [layer for layer in self.layers if isinstance(layer, TieredLayer)]

    def sparse_stats(self) -> SparseStats:
        """Attention work of all tiered layers so far (see :class:`kvtier.stats.SparseStats`)."""
        total = SparseStats()
        for layer in self.tiered_layers:
            total.add(layer.sparse_stats)
        return total

    def offload_stats(self) -> OffloadStats:
        """Block traffic of the offloading layers so far: hit rate, blocks and bytes moved, stall time."""
        total = OffloadStats()
        for layer in self.tiered_layers:
            if layer.offloaded:
                total.add(layer.cold.stats)
        return total

    def close(self) -> None:
        """Release offloaded blocks: stop the prefetch worker, delete the store files (idempotent).
        Garbage collection does the same; the cache is empty afterwards. Refused while a call of
        another thread is open; an interrupted call of this thread is undone first."""
        with self._lock:
            self._claim("close()")
            try:
                if self._call is not None:
                    self._rollback(self._call)
            finally:
                if self.offloader is not None:
                    self.offloader.close()
                for layer in self.tiered_layers:
                    if layer.offloaded:
                        layer.reset()

    def __copy__(self) -> TieredCache:
        raise KVTierError(
            "a TieredCache cannot be shallow-copied (copy.copy): the copy would share its layers with the "
            "original; use copy.deepcopy"
        )

    def __deepcopy__(self, memo: dict) -> TieredCache:
        """A deep copy between calls that shares the config (the model's, which ``kvtier.enable``
        switches); an offloading cache refuses it (:class:`~kvtier.offload.store.OffloadError`)."""
        with self._lock:
            self.check_usable("copy.deepcopy")
            new = self.__class__.__new__(self.__class__)
            memo[id(self)] = new
            memo.setdefault(id(self.config), self.config)
            for name, value in self.__dict__.items():
                setattr(new, name, threading.RLock() if name == "_lock" else copy.deepcopy(value, memo))
        return new

    def __getstate__(self) -> dict:
        """For ``pickle``, between calls; an offloading cache's offloader and store refuse it
        (:class:`~kvtier.offload.store.OffloadError`: their records, files and worker are this process's)."""
        with self._lock:
            self.check_usable("pickle")
            state = {name: value for name, value in self.__dict__.items() if name != "_lock"}
        state["_config_is_live"] = False
        return state

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickled as ``_load_cache(STATE_VERSION)`` and the state: the version is checked before any
        of the state (whose classes may have moved in another version) is read."""
        return _load_cache, (STATE_VERSION,), self.__getstate__()

    def __setstate__(self, state: dict) -> None:
        if state.get("_state_version") != STATE_VERSION:  # a pickle written before versions were kept
            raise _incompatible(state.get("_state_version"))
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._epoch = forward_epoch()  # mask ids are this process's: the next call needs a new mask

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def allocation(self) -> dict:
        """The adaptive budget's allocation: per layer the cold key and value widths and the measured
        distortion at each candidate width (empty without an adaptive policy)."""
        out: dict = {}
        for budget in self.budgets.values():
            rep = budget.report()
            out.setdefault("bits", rep["bits"])
            out["allocated"] = out.get("allocated", True) and rep["allocated"]
            out.setdefault("layers", {}).update(rep["layers"])
        return out

    def memory_report(self) -> MemoryReport:
        """Bytes held per tier and layer; see :class:`kvtier.diagnostics.MemoryReport`."""
        return memory_report(self)


def _incompatible(version: object) -> KVTierError:
    return KVTierError(
        f"this pickled TieredCache was written by an incompatible kvtier version (state format {version}; this "
        f"kvtier reads format {STATE_VERSION}): build a new TieredCache and run its prompt again"
    )


def _load_cache(version: object) -> TieredCache:
    """Unpickling's first step (see ``TieredCache.__reduce_ex__``): refuse another state format
    before its classes are looked up. Part of the pickle format: never moved or renamed."""
    if version != STATE_VERSION:
        raise _incompatible(version)
    return TieredCache.__new__(TieredCache)
