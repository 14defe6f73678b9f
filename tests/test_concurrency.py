"""One cache, several threads: a second concurrent call on a cache is refused at once and the open
call runs on untouched; separate caches in separate threads, and one cache used by one thread after
another, keep working. Real threads with the tiny Llama; the races are made deterministic by
pausing the first thread inside its forward call (a pre-hook on a decoder layer and two events).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

import kvtier
from conftest import kvtier_attention_by_hand, tiny_llama, tiny_llama_config
from kvtier.errors import KVTierError
from kvtier.testing import feed, random_ids

#: Safety net only (a broken lock must fail the test, not hang CI): no test waits this long.
WAIT_S = 120


class _Thread(threading.Thread):
    """Runs ``fn`` and keeps its result or exception."""

    def __init__(self, name: str, fn: Callable[[], torch.Tensor]):
        super().__init__(name=name, daemon=True)
        self.fn = fn
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as err:  # reported by the test
            self.error = err

    def finish(self) -> None:
        self.join(WAIT_S)
        assert not self.is_alive()


@contextmanager
def _pause(model, thread_name: str, layer: int = 2) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Pause the first forward call of thread ``thread_name`` before decoder ``layer`` (its call on
    the cache is then open: the layers before it are done): ``reached`` is set there, and the
    thread waits for ``go``."""
    reached, go = threading.Event(), threading.Event()

    def hook(module, args):  # noqa: ANN001, ANN202
        if threading.current_thread().name == thread_name and not reached.is_set():
            reached.set()
            assert go.wait(WAIT_S)

    handle = model.model.layers[layer].register_forward_pre_hook(hook)
    try:
        yield reached, go
    finally:
        go.set()
        handle.remove()


def _lengths(cache) -> list[int]:
    return [layer.seen for layer in cache.tiered_layers]


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=1)


@pytest.mark.parametrize("preset", ["default", "offload-cpu"])
def test_second_thread_is_refused_while_a_call_is_open(llama, preset):
    """Thread A's call is open (paused before layer 2); a call, a reorder, a reset, a close and a copy
    from another thread are refused at once naming concurrent use; A finishes with the logits of a
    single-threaded run, every layer has the same length, and the cache goes on like the reference."""
    ref, cache = kvtier.TieredCache(llama.config, preset), kvtier.TieredCache(llama.config, preset)
    with kvtier.enable(llama):
        for c in (ref, cache):
            feed(llama, c, random_ids(400, seed=1))
        expected = feed(llama, ref, random_ids(64, seed=2))
        with _pause(llama, "A") as (reached, go):
            a = _Thread("A", lambda: feed(llama, cache, random_ids(64, seed=2)))
            a.start()
            assert reached.wait(WAIT_S)
            refused = {
                "call": lambda: feed(llama, cache, random_ids(8, seed=3)),
                "reorder": lambda: cache.reorder_cache(torch.tensor([0])),
                "select": lambda: cache.batch_select_indices(torch.tensor([0])),
                "reset": cache.reset,
                "close": cache.close,
                "copy": lambda: copy.deepcopy(cache),
            }
            for what, use in refused.items():
                with pytest.raises(KVTierError, match="concurrent use") as info:
                    use()
                assert "\n" not in str(info.value) and "'A'" in str(info.value), what
            go.set()
            a.finish()
        assert a.error is None, a.error
        torch.testing.assert_close(a.result, expected, rtol=0, atol=0)
        assert _lengths(cache) == _lengths(ref) == [464] * 4
        torch.testing.assert_close(
            feed(llama, cache, random_ids(8, 4)), feed(llama, ref, random_ids(8, 4)), rtol=0, atol=0
        )
    cache.close()
    ref.close()


def test_separate_caches_in_two_threads_match_single_threaded_runs(llama):
    """Thread A pauses in the middle of its call on cache X while the main thread runs whole calls
    on cache Y with the same model: both give the logits of single-threaded runs."""
    refs = [kvtier.TieredCache(llama.config, "default") for _ in range(2)]
    x, y = (kvtier.TieredCache(llama.config, "default") for _ in range(2))
    with kvtier.enable(llama):
        want_x = [feed(llama, refs[0], random_ids(300, seed=5)), feed(llama, refs[0], random_ids(1, seed=6))]
        want_y = [feed(llama, refs[1], random_ids(200, seed=7)), feed(llama, refs[1], random_ids(3, seed=8))]
        with _pause(llama, "A") as (reached, go):
            a = _Thread("A", lambda: feed(llama, x, random_ids(300, seed=5)))
            a.start()
            assert reached.wait(WAIT_S)
            got_y = [feed(llama, y, random_ids(200, seed=7)), feed(llama, y, random_ids(3, seed=8))]
            go.set()
            a.finish()
        assert a.error is None, a.error
        b = _Thread("B", lambda: feed(llama, x, random_ids(1, seed=6)))
        b.start()
        b.finish()
        assert b.error is None, b.error
    for got, want in zip([a.result, b.result, *got_y], [*want_x, *want_y]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_kvtier_mask_built_in_another_thread_does_not_count(llama):
    """A cache built from its own config (so only the mask check can tell) used by a model that does
    not run kvtier attention, while another thread ran kvtier's mask: refused, not silently wrong."""
    plain = tiny_llama(seed=1)  # runs sdpa
    cache = kvtier.TieredCache(tiny_llama_config(), "default")

    def other_thread() -> torch.Tensor:
        with kvtier.enable(llama):
            return feed(llama, kvtier.TieredCache(llama.config, "default"), random_ids(40, seed=9))

    b = _Thread("B", other_thread)
    b.start()
    b.finish()
    assert b.error is None, b.error
    with pytest.raises(KVTierError, match="kvtier.enable"):
        feed(plain, cache, random_ids(40, seed=9))
    assert cache.get_seq_length() == 0


def test_one_cache_used_by_one_thread_after_another_keeps_working(llama):
    ref, cache = kvtier.TieredCache(llama.config, "default"), kvtier.TieredCache(llama.config, "default")
    parts = [random_ids(300, seed=10), random_ids(5, seed=11), random_ids(1, seed=12)]
    with kvtier.enable(llama):
        want = [feed(llama, ref, p) for p in parts]
        got = []
        for name, part in zip("AB", parts):
            t = _Thread(name, lambda part=part: feed(llama, cache, part))
            t.start()
            t.finish()
            assert t.error is None, t.error
            got.append(t.result)
        got.append(feed(llama, cache, parts[2]))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_call_left_open_by_an_ended_thread_is_undone_at_the_next_use(llama):
    """Thread A's call fails between two layers (outside kvtier, in a model run without
    ``kvtier.enable``'s wrapper, which would undo it at once) and A ends: the next call from another
    thread puts the cache back and asks to call again; the call after that is right."""
    ref, cache = kvtier.TieredCache(llama.config, "default"), kvtier.TieredCache(llama.config, "default")

    def boom(module, args, out):  # noqa: ANN001, ANN202
        if threading.current_thread().name == "A":
            raise RuntimeError("outside kvtier")

    with kvtier_attention_by_hand(llama):
        for c in (ref, cache):
            feed(llama, c, random_ids(300, seed=13))
        handle = llama.model.layers[2].mlp.register_forward_hook(boom)
        try:
            a = _Thread("A", lambda: feed(llama, cache, random_ids(16, seed=14)))
            a.start()
            a.finish()
        finally:
            handle.remove()
        assert isinstance(a.error, RuntimeError)
        with pytest.raises(KVTierError, match="call again"):
            feed(llama, cache, random_ids(16, seed=14))
        assert _lengths(cache) == [300] * 4
        torch.testing.assert_close(
            feed(llama, cache, random_ids(16, 14)), feed(llama, ref, random_ids(16, 14)), rtol=0, atol=0
        )
