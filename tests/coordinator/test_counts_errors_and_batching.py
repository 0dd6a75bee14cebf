"""The coordinator's pieces that need no cluster: counting ``next`` calls per running function, errors
carried from a worker, per-worker values, what a recovery says and how it holds dispatch (mutation testing's
fast killers for ``daskps/coordinator/``)."""

from __future__ import annotations

import pickle
import sys
import threading
import time
import traceback
import types

import pytest

from daskps.client.routing import ROUTES, ServerRef
from daskps.coordinator.book import Book
from daskps.coordinator.recovery import MAX_RERUNS, Recovered, Recovery, RecoveryState
from daskps.errors import PSUnavailableError
from daskps.scheduler.messages import load_error
from daskps.trainer.batches import pickled_error
from daskps.trainer.datasets import PerWorkerValues, call_position, running_function


def test_call_position_counts_each_iterators_next_calls_within_the_running_function():
    a, b = object(), object()
    assert call_position(a) == (None, 0) and call_position(a) == (None, 0)  # outside a function: nothing counted
    with running_function(7):
        assert [call_position(a) for _ in range(3)] == [(7, 0), (7, 1), (7, 2)]
        assert call_position(b) == (7, 0)  # counted per iterator
        assert call_position(a) == (7, 3)
    assert call_position(a) == (None, 0)
    with running_function(8):  # the next function counts from 0 again
        assert call_position(a) == (8, 0) and call_position(b) == (8, 0)


def _fails_deep():
    raise ValueError("bad row 7")


def test_an_error_carries_the_workers_traceback_as_a_note():
    try:
        _fails_deep()
    except ValueError as exc:
        caught = exc
        expected = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    error = load_error(pickled_error(caught))
    assert type(error) is ValueError and str(error) == "bad row 7"
    assert error.__notes__ == [f"raised in a scheduled function on a worker:\n{expected}"]
    assert "in _fails_deep" in expected and expected.endswith("ValueError: bad row 7\n")


class _NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_an_error_that_cannot_be_rebuilt_arrives_as_runtime_error_with_its_text():
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(_NeedsTwo(1, 2)))  # pickles, but does not unpickle
    try:
        raise _NeedsTwo(1, 2)
    except _NeedsTwo as exc:
        caught = exc
        expected = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    error = load_error(pickled_error(caught))
    assert type(error) is RuntimeError and str(error) == "_NeedsTwo: 1 and 2"
    assert error.__notes__ == [f"raised in a scheduled function on a worker:\n{expected}"]  # the worker's own


def test_an_error_whose_class_only_the_worker_has_arrives_as_runtime_error_saying_why():
    """The worker could rebuild it (its module is there); the coordinator cannot (it is not here)."""
    module = types.ModuleType("daskps_test_only_on_workers")
    exec("class WorkerOnlyError(Exception):\n    pass\n", module.__dict__)
    module.WorkerOnlyError.__module__ = module.__name__
    sys.modules[module.__name__] = module
    try:
        try:
            raise module.WorkerOnlyError("shard 3 is gone")
        except Exception as exc:
            payload = pickled_error(exc)  # on the worker: pickles and unpickles
            where = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    finally:
        del sys.modules[module.__name__]
    error = load_error(payload)  # here: no such module
    assert type(error) is RuntimeError and str(error) == "WorkerOnlyError: shard 3 is gone"
    assert error.__notes__ == [
        f"raised in a scheduled function on a worker:\n{where}(it cannot be rebuilt here: ModuleNotFoundError: "
        "No module named 'daskps_test_only_on_workers')\n"]


def test_per_worker_values_refuse_none_and_non_sequences_by_name():
    with pytest.raises(ValueError) as err:
        PerWorkerValues([])
    assert str(err.value) == "values must hold one value per training worker, got none"
    for bad in ("ab", {"a": 1}, {1, 2}, 3):
        with pytest.raises(TypeError) as err:
            PerWorkerValues(bad)
        assert str(err.value) == ("values must be a list or tuple of one value per training worker, "
                                  f"got {type(bad).__name__}")
    values = PerWorkerValues(iter(["a", "b"]))
    assert values.values == ("a", "b") and repr(values) == "PerWorkerValues(2 values)"
    with pytest.raises(ValueError) as err:
        values.on_worker(2)
    assert str(err.value) == ("values of PerWorkerValues hold 2 value(s), one per training worker, but this "
                              "function runs on the trainer with index 2: give one value per training worker")
    with pytest.raises(ValueError):
        values.on_worker(-1)


def _moved(task_id: int, old: str, new: str) -> tuple[ServerRef, ServerRef]:
    return ServerRef(old, f"old-{task_id}", task_id), ServerRef(new, f"new-{task_id}", task_id)


def test_the_rollback_warning_says_what_the_recovery_did_word_for_word():
    """The RollbackWarning's text (docs/user-guide/recovery.md lists what it holds), for each case."""
    one = [_moved(0, "tcp://10.0.0.1:1", "tcp://10.0.0.2:2")]
    text = Recovered(one, "/ck/ckpt-4", ["a", "b"], [], 3, 1.26).describe(2)
    assert text == ("daskps: lost parameter server re-created in 1.3s: ps:0 (was at tcp://10.0.0.1:1) now runs at "
                    "tcp://10.0.0.2:2. Rolled back to checkpoint /ck/ckpt-4: 'a', 'b'; every update made to them "
                    "after it is lost (3 scheduled function(s) that reached the lost server finished since it was "
                    "saved). 2 function(s) that failed or were cancelled by the loss run again.")
    two = [*one, _moved(1, "tcp://10.0.0.3:3", "tcp://10.0.0.2:2")]
    text = Recovered(two, "/ck/ckpt-4", [], ["m"], None).describe(0)
    assert text == ("daskps: lost parameter server re-created in 0.0s: ps:0 (was at tcp://10.0.0.1:1) now runs at "
                    "tcp://10.0.0.2:2; ps:1 (was at tcp://10.0.0.3:3) now runs at tcp://10.0.0.2:2. Rolled back to "
                    "checkpoint /ck/ckpt-4: nothing; every update made to them after it is lost (an unknown number "
                    "of scheduled functions (it was not saved by this coordinator) that reached the lost server "
                    "finished since it was saved). Back to their initial value (in no checkpoint): 'm'. "
                    "0 function(s) that failed or were cancelled by the loss run again.")
    names = [f"v{i}" for i in range(13)]
    text = Recovered(one, None, [], names, 0, 0.04).describe(1)
    assert text == ("daskps: lost parameter server re-created in 0.0s: ps:0 (was at tcp://10.0.0.1:1) now runs at "
                    "tcp://10.0.0.2:2. No checkpoint had been saved yet. Back to their initial value (in no "
                    "checkpoint): " + ", ".join(repr(n) for n in names[:12]) + " and 1 more. "
                    "1 function(s) that failed or were cancelled by the loss run again.")


def _recovery_of(manager=None):
    """A Recovery on a book of its own, for a strategy that is open and a client that runs (plain records:
    what it reads of them is ``closed`` and ``status``; nothing here reaches a cluster)."""
    book = Book()
    return book, Recovery(book, types.SimpleNamespace(closed=False), types.SimpleNamespace(status="running"))


def _lost(key="ps-0-key"):
    error = PSUnavailableError("gone")
    error.server_key = key
    return error


def test_recovery_refuses_to_run_again_without_a_manager_a_loss_or_reruns_left():
    book, recovery = _recovery_of()
    assert recovery.state is RecoveryState.DISPATCHING and recovery.dispatching and not recovery.recovering
    with book.lock:
        closure = book.add((b"", b""), [], 0)
        assert not recovery.run_again(closure, _lost())  # no checkpoint manager: the loss stands
        recovery.manager = object()
        assert not recovery.run_again(closure, ValueError("not a loss"))
        closure.reruns = MAX_RERUNS
        assert not recovery.run_again(closure, _lost())
    assert list(book.queue) == [closure] and closure.reruns == MAX_RERUNS and book.counts.totals["rerun"] == 0


def test_a_recovery_counts_reruns_keeps_servers_lost_meanwhile_and_halts_when_it_fails():
    book, recovery = _recovery_of()
    recovery.manager = object()
    recovered = []
    recovery.on_recovered(lambda: recovered.append(recovery.state))
    with book.lock:
        first, second = book.add((b"", b""), [], 0), book.add((b"", b""), [], 0)
        book.take(2)
        first.batch = second.batch = "batch-1"
        recovery.requeue(first)  # outside a recovery: queued again, not counted as run again by it
    assert recovery.rerun == 0 and [c.id for c in book.queue] == [first.id]
    recovery.state = RecoveryState.RECOVERING  # as _begin sets it (without starting its thread)
    with book.lock:
        assert recovery.run_again(second, _lost("ps-1-key"))  # during a recovery: no second one starts
    assert [c.id for c in book.queue] == [first.id, second.id] and second.reruns == 1 and second.batch is None
    assert recovery.rerun == 1 and recovery.lost_meanwhile == {"ps-1-key"}
    assert book.counts.totals["rerun"] == 2
    with book.lock:
        book.take(1)
        recovery.requeue(first)  # each function queued again while it runs counts: two now
    assert recovery.rerun == 2
    recovery.resume()  # only a halted coordinator resumes
    assert recovery.state is RecoveryState.RECOVERING
    recovery.stopped_batch("batch-1")
    assert recovery.batch_ended("batch-1") and not recovery.batch_ended("batch-1")
    recovery.manager = None  # the server lost meanwhile is not recovered again (no manager now)
    recovery.end(None, None)
    assert recovery.state is RecoveryState.DISPATCHING and recovered == [RecoveryState.DISPATCHING]
    assert recovery.lost_meanwhile == set() and book.error is None
    recovery.state = RecoveryState.RECOVERING
    failure = RuntimeError("no worker came")
    recovery.end(None, failure)
    assert recovery.state is RecoveryState.HALTED and not recovery.dispatching and not recovery.recovering
    assert book.error is failure and book.last_error is failure and recovered == [RecoveryState.DISPATCHING]
    recovery.resume()
    assert recovery.state is RecoveryState.DISPATCHING
    recovery.resume()
    assert recovery.state is RecoveryState.DISPATCHING


def test_a_loss_starts_a_recovery_unless_the_lost_server_has_a_successor_already():
    book, recovery = _recovery_of()
    recovery.manager = object()
    ROUTES.moved["ps-0-moved"] = ServerRef("tcp://127.0.0.1:1", "ps-0-new", 0)  # re-created: a handle had not heard
    try:
        with book.lock:
            first, second = book.add((b"", b""), [], 0), book.add((b"", b""), [], 0)
            book.take(2)
            assert recovery.run_again(first, _lost("ps-0-moved"))
        assert recovery.state is RecoveryState.DISPATCHING  # queued again, no recovery
        before = set(threading.enumerate())
        with book.lock:
            assert recovery.run_again(second, _lost("ps-0-key"))
            assert recovery.state is RecoveryState.RECOVERING  # under the lock: its thread cannot end it yet
            # It runs in a thread of its own that does not hold the interpreter at exit, named for thread dumps.
            (thread,) = set(threading.enumerate()) - before
            assert (thread.name, thread.daemon) == ("daskps-recover", True)
        # That thread's recovery fails on this bare strategy (no servers to look at): join() would raise it.
        deadline = time.monotonic() + 60
        while recovery.recovering and time.monotonic() < deadline:
            time.sleep(0.01)
        assert recovery.state is RecoveryState.HALTED and isinstance(book.error, AttributeError)
        assert [c.id for c in book.queue] == [first.id, second.id]
    finally:
        del ROUTES.moved["ps-0-moved"]


# -- the batching policy (daskps.coordinator.batching), by the rules its docstring states ---------------
def test_until_durations_are_known_the_queue_is_split_evenly_over_every_trainer():
    from daskps.coordinator.batching import BatchPolicy

    assert BatchPolicy().next_size(queued=10, pending=10, trainers=2, in_flight=0) == 5
    assert BatchPolicy().next_size(queued=7, pending=7, trainers=3, in_flight=0) == 3


def test_short_functions_go_in_one_big_batch_long_ones_spread_over_the_trainers():
    from daskps.coordinator.batching import BATCH_SECONDS, BatchPolicy

    short, long = BatchPolicy(), BatchPolicy()
    short.observe([0.001, 0.001])
    long.observe([0.1])
    assert short.next_size(queued=100, pending=100, trainers=2, in_flight=0) == 100  # 0.1 s of work: one batch
    # while that one batch runs, what it could carry goes as a second batch to follow it on its trainer
    assert short.next_size(queued=10, pending=20, trainers=2, in_flight=1) == 10
    assert short.next_size(queued=10, pending=30, trainers=2, in_flight=2) == 0  # two batches for its one trainer
    assert long.next_size(queued=10, pending=10, trainers=2, in_flight=0) == int(BATCH_SECONDS / 0.1)
    # a batch each first; then a second each while a whole one is queued for every trainer; a third never
    assert long.next_size(queued=3, pending=7, trainers=2, in_flight=1) == 2
    assert long.next_size(queued=3, pending=7, trainers=2, in_flight=2) == 0
    assert long.next_size(queued=4, pending=8, trainers=2, in_flight=2) == 2
    assert long.next_size(queued=100, pending=100, trainers=2, in_flight=4) == 0
    # until durations are known, one batch each: the queue split evenly over the trainers
    assert BatchPolicy().next_size(queued=40, pending=80, trainers=2, in_flight=2) == 0
    # a 100 ms step measures a little over 0.1 s: still two to a 0.2 s batch (one each doubled the batches,
    # and with them the scheduler's and the coordinator's work per function)
    step = BatchPolicy()
    step.observe([0.1004])
    assert step.next_size(queued=80, pending=80, trainers=8, in_flight=0) == 2
    step.observe([0.15])  # (the average: 0.1252 s) 1.6 of them make a batch: rounded, 2
    assert step.next_size(queued=80, pending=80, trainers=8, in_flight=0) == 2


def test_the_duration_is_a_moving_average_and_max_batch_caps_a_batch():
    import dask

    from daskps.coordinator.batching import BatchPolicy

    policy = BatchPolicy()
    policy.observe([0.4])
    policy.observe([0.2, 0.0])  # an event's mean (0.1), half-way from 0.4: 0.25
    assert policy.seconds_per_function == pytest.approx(0.25)
    fast = BatchPolicy()
    fast.observe([0.0001])
    with dask.config.set({"daskps.max-batch": 8}):  # 100 queued of 0.01 s of work: capped, so spread
        assert fast.next_size(queued=100, pending=100, trainers=2, in_flight=0) == 8
        assert fast.next_size(queued=100, pending=100, trainers=2, in_flight=1) == 8


# -- the counts and their rate limit (daskps.coordinator.counts) ------------------------------------------
def test_counts_keep_totals_and_per_trainer_counts_and_snapshot_both():
    from daskps.coordinator.counts import Counts

    counts = Counts()
    counts.add("scheduled", n=3)
    counts.add("done", "worker-0")
    counts.add("failed", "worker-1")
    counts.add("rerun", "")  # a function never run: no trainer to count it on
    counts.add("cancelled")
    assert counts.snapshot(in_flight=1) == {
        "scheduled": 3, "done": 1, "failed": 1, "cancelled": 1, "rerun": 1, "in_flight": 1,
        "trainers": {"worker-0": {"done": 1}, "worker-1": {"failed": 1}}}


def test_a_rate_limited_call_runs_at_once_then_at_most_once_an_interval():
    import asyncio

    from daskps.coordinator.counts import RateLimited

    async def main():
        loop = asyncio.get_running_loop()
        ran = []
        limited = RateLimited(loop, lambda: ran.append(loop.time()), interval=0.2)
        start = loop.time()
        for _ in range(5):  # the first runs now; the four within the interval make one run, later
            limited.call()
        assert len(ran) == 1
        for _ in range(100):  # the deferred run, once the interval has passed (not before)
            if len(ran) > 1:
                break
            await asyncio.sleep(0.05)
        assert len(ran) == 2 and ran[1] - start >= 0.2
        limited.call(now=True)
        assert len(ran) == 3

    asyncio.run(main())


def test_past_20_trainers_batches_run_longer_and_reports_gather_longer_so_the_scheduler_load_stays_bounded():
    """Batch tasks a second, over every trainer, stay near 100, and report events near 500, however many
    trainers there are (with up to 20, and 10, the 0.2 s batches and 20 ms reports of a small cluster)."""
    from daskps.coordinator.batching import BatchPolicy, batch_seconds, report_seconds

    assert batch_seconds(2) == batch_seconds(20) == 0.2 and report_seconds(2) == report_seconds(10) == 0.02
    for trainers in (64, 512, 1024):
        assert trainers / batch_seconds(trainers) == pytest.approx(100)  # every trainer busy: tasks a second
        assert trainers / report_seconds(trainers) == pytest.approx(500)  # a report each per interval
    policy = BatchPolicy()
    policy.observe([0.1])  # 100 ms steps, as a real trainer's
    # 1,024 trainers with plenty queued: 10.24 s of work per batch (102 functions), not 0.2 s (2 functions)
    assert policy.next_size(queued=200_000, pending=200_000, trainers=1024, in_flight=0) == 102
    assert policy.next_size(queued=200_000, pending=200_000, trainers=8, in_flight=0) == 2

