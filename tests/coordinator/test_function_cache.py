"""Scheduled functions stay warm on trainers: unpickled once per process, captured state kept."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import daskps as dps
from daskps._core.pickling import FunctionCache
from tests.helpers.pickles import Expensive, _unpickles
from tests.helpers.waiting import wait_until


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


# -- function cache --------------------------------------------------------------
def _make_step(value, log):
    def step():
        log.append(value)
        return value, len(log)
    return step


def test_identical_code_with_other_captured_values_is_not_confused(coordinator):
    steps = [_make_step(v, []) for v in range(5)]
    got = coordinator.fetch([coordinator.schedule(s) for s in steps * 4])
    assert [v for v, _ in got] == list(range(5)) * 4


def test_more_functions_than_the_cache_holds_all_run_right(coordinator):
    steps = [_make_step(f"f{v}", []) for v in range(80)]  # > 64
    got = coordinator.fetch([coordinator.schedule(s) for s in steps + steps[::-1]])
    assert [v for v, _ in got] == [f"f{v}" for v in range(80)] + [f"f{v}" for v in reversed(range(80))]


class _FailsOnWorker:
    def __reduce__(self):
        return (_boom, ())


def _boom():
    raise RuntimeError("cannot rebuild this on a trainer")


def _cached_functions() -> list[int]:
    """The keys of this process's function cache (run on each worker with ``client.run``), hashed."""
    from daskps.trainer import batches

    return sorted(hash(key) for key in batches.function_cache().keys())


def test_a_function_that_fails_to_unpickle_on_the_trainer_reports_and_is_not_kept(client, coordinator):
    bad = _FailsOnWorker()

    def step():
        return bad

    before = client.run(_cached_functions)
    coordinator.schedule(step)
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        coordinator.join()
    assert client.run(_cached_functions) == before  # no trainer's cache gained (or lost) an entry for it
    coordinator.schedule(step)  # fails again (not a cached broken function), then the coordinator works on
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        coordinator.join()
    assert coordinator.fetch(coordinator.schedule(_make_step(7, []))) == (7, 1)


def test_a_function_rescheduled_after_its_variable_was_dropped_and_recreated(strategy, coordinator):
    """The function keeps what it captured at its first schedule (documented): it updates the
    variable it was pickled with, which stays alive for it; a new function sees the new one."""
    with strategy.scope():
        box = {"v": dps.Variable(0.0, name="dropped")}
    old = box["v"]

    def step():
        box["v"].assign_add(1.0)

    coordinator.fetch(coordinator.schedule(step))
    with strategy.scope():
        box["v"] = dps.Variable(100.0, name="dropped")
    coordinator.schedule(step)
    coordinator.join()
    assert float(old.numpy()) == 2.0 and float(box["v"].numpy()) == 100.0

    def step2():
        box["v"].assign_add(1.0)

    coordinator.schedule(step2)
    coordinator.join()
    assert float(box["v"].numpy()) == 101.0


def test_captured_state_mutated_by_a_step_stays_on_each_trainer(coordinator):
    log: list[int] = []
    step = _make_step(1, log)
    got = coordinator.fetch([coordinator.schedule(step) for _ in range(40)])
    assert log == []  # the coordinator's copy is untouched
    assert max(n for _, n in got) > 1  # warm: the list grew on some trainer
