"""Scheduled functions stay warm on trainers: unpickled once per process, captured state kept."""

from __future__ import annotations

import gc

import numpy as np

import daskps as dps
from daskps._core.pickling import FunctionCache

from .helpers.pickles import Expensive, _unpickles
from .helpers.waiting import wait_until


def test_a_function_scheduled_500_times_is_unpickled_a_few_times_per_trainer(client, coordinator):
    client.run(_unpickles)  # start from zero
    captured = Expensive()
    calls: list[int] = []  # captured state: it persists between calls on one trainer

    def step(i):
        assert isinstance(captured, Expensive)
        calls.append(i)
        return len(calls)

    results = [coordinator.schedule(step, args=(i,)) for i in range(500)]
    coordinator.join()
    counts = {a: n for a, n in client.run(_unpickles).items() if n}
    assert counts, "the function never ran on a trainer"
    assert all(n <= 3 for n in counts.values()), counts  # without the cache: one per call, 500 in all
    seen = [r.fetch() for r in results]
    # Every unpickling starts an empty list, whose first call returns 1; later calls see it grow.
    assert seen.count(1) == sum(counts.values()), (seen.count(1), counts)
    assert max(seen) >= 500 // (2 * len(counts)), max(seen)

def test_arguments_are_unpickled_for_every_call(client, coordinator):
    client.run(_unpickles)

    def step(thing):
        return isinstance(thing, Expensive)

    results = [coordinator.schedule(step, args=(Expensive(),)) for _ in range(40)]
    coordinator.join()
    assert all(r.fetch() for r in results)
    assert sum(client.run(_unpickles).values()) == 40


def _train_captured(strategy, coordinator) -> str:
    with strategy.scope():
        v = dps.Variable([0.0], name="captured")

    def step():
        v.assign_add([1.0])

    for _ in range(30):
        coordinator.schedule(step)
    coordinator.join()
    assert v.numpy().tolist() == [30.0]
    return v.handle.key


def test_handles_captured_by_a_kept_function_do_not_keep_their_variable(strategy, coordinator):
    before = [s["calls"].get("acquire", 0) for s in strategy.ps_stats()]
    key = _train_captured(strategy, coordinator)  # the function and the variable are dropped on return
    assert [s["calls"].get("acquire", 0) for s in strategy.ps_stats()] == before  # the trainers borrow
    gc.collect()
    wait_until(lambda: not any(key in s["variables"] for s in strategy.ps_stats()), what="freed after the drop")

def test_the_cache_keeps_the_most_recently_used_functions():
    import cloudpickle

    cache = FunctionCache(size=2)
    blobs = [cloudpickle.dumps(lambda i=i: i) for i in range(3)]
    first = cache.load(blobs[0])
    assert cache.load(blobs[0]) is first
    cache.load(blobs[1])
    cache.load(blobs[0])  # used again: now the most recent
    cache.load(blobs[2])  # evicts blobs[1], the least recently used
    assert len(cache) == 2
    assert cache.load(blobs[0]) is first
    assert np.array([f() for f in (cache.load(b) for b in blobs)]).tolist() == [0, 1, 2]
