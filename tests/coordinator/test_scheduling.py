"""README promises about scheduling that no other test checked, each on a real cluster.

"How the coordinator behaves": what ``schedule`` pickles and when, the order functions run and per-worker
iterators advance within a batch, ``daskps.max-batch``.  "Per-worker data": the 8 most recent iterators a
worker keeps.  "When a parameter server is lost": a server whose worker is gone for good is re-created on
the least-loaded ps worker.  (An exception that cannot be rebuilt arriving as a ``RuntimeError`` with its text,
and ``client.restart()`` giving ``CancelledError``: tests/coordinator/test_every_value_settles.py.)

Batches are observed from inside: a scheduled function runs in its batch's Dask task, so
``get_worker().get_current_task()`` is the batch's key.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import time
import warnings

import dask.config
import pytest
from distributed import get_worker

import daskps as dps
from daskps.distribute.cluster import cluster_workers
from daskps.errors import RollbackWarning
from tests.helpers.cluster import kill_worker, set_trainer_slots, two_ps_training, worker_address
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.cluster  # every test here starts a cluster or a process


# -- what schedule pickles, and when ----------------------------------------------------------------------
class CountsPickles:
    """A value that counts how often this process pickled it."""

    pickled = 0

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        CountsPickles.pickled += 1
        return CountsPickles, (self.value,)


def _value_of(thing):
    return thing.value


def test_schedule_pickles_the_arguments_at_each_call(coordinator):
    """README: schedule pickles the function's arguments at schedule time."""
    CountsPickles.pickled = 0
    args = [CountsPickles([1]), CountsPickles([2])]
    with coordinator.hold():  # holds the pump off: nothing is dispatched before the lists change below
        remotes = [coordinator.schedule(_value_of, args=(a,)) for a in args]
        assert CountsPickles.pickled == 2  # once per call, before schedule returned
        for a in args:
            a.value.append("changed after schedule")
    assert [r.fetch() for r in remotes] == [[1], [2]]  # each call its own arguments, as they were at the call


def test_schedule_pickles_a_function_once_and_reads_what_it_captures_then(coordinator):
    """README: the function itself is pickled the first time that function object is scheduled; what it
    captures is read then (so pass values that change as arguments)."""
    CountsPickles.pickled = 0
    captured = CountsPickles("first")

    def read_captured():
        return captured.value

    assert coordinator.schedule(read_captured).fetch() == "first"
    captured.value = "second"
    remotes = [coordinator.schedule(read_captured) for _ in range(5)]
    assert coordinator.fetch(remotes) == ["first"] * 5
    assert CountsPickles.pickled == 1  # six calls, pickled once

    def read_captured_again():  # another function object: pickled at its own first schedule
        return captured.value

    assert coordinator.schedule(read_captured_again).fetch() == "second"
    assert CountsPickles.pickled == 2


# -- order within a batch --------------------------------------------------------------------------------
def _where(i, iterator):
    worker = get_worker()
    return worker.get_current_task(), worker.name, time.monotonic_ns(), next(iterator), i


def test_functions_run_in_schedule_order_within_a_batch_and_iterators_advance_in_it(coordinator):
    """README: functions run in schedule order within a batch; per-worker iterators advance in schedule order
    on their worker."""
    it = iter(coordinator.create_per_worker_dataset(lambda: iter(range(10_000))))
    with coordinator.hold():  # one pump sees them all: batches of 10 to 20 (the queue split over the trainers)
        remotes = [coordinator.schedule(_where, args=(i, it)) for i in range(40)]
    ran = coordinator.fetch(remotes)
    later = coordinator.fetch([coordinator.schedule(_where, args=(i, it)) for i in range(40, 240)])
    batches = collections.defaultdict(list)
    for batch, _, started, _, i in ran:
        batches[batch].append((i, started))
    sizes = sorted(len(b) for b in batches.values())
    assert sum(sizes) == 40 and sizes[0] >= 5, sizes  # batches of several functions: an order to check
    for batch, runs in batches.items():
        order = [i for i, _ in sorted(runs, key=lambda r: r[1])]  # by when each started, on its trainer
        assert order == sorted(order), f"batch {batch} ran its functions in the order {order}"
    per_worker = collections.defaultdict(list)
    for _, name, _, element, i in ran + later:
        per_worker[name].append((i, element))
    assert len(per_worker) == 2, per_worker.keys()
    for name, elements in per_worker.items():
        in_schedule_order = [e for _, e in sorted(elements)]
        assert in_schedule_order == list(range(len(elements))), (name, in_schedule_order[:30])


# -- daskps.max-batch ------------------------------------------------------------------------------------
def _batch():
    return get_worker().get_current_task()


def test_what_is_scheduled_inside_hold_goes_out_together_as_the_block_ends(client, coordinator):
    """`with coordinator.hold():` sends nothing; the four functions scheduled in it are batched together as it
    ends: the first goes out with the second (without the block, it would have gone alone)."""
    with coordinator.hold():
        first = coordinator.schedule(_batch)
        # A round trip through the client's event loop: a pump woken by that schedule call would run first
        # (callbacks run in order) and send `first` in a batch of its own.
        client.run_on_scheduler(len, [])
        rest = [coordinator.schedule(_batch) for _ in range(3)]
        assert first.status == "pending" and coordinator.summary()["in_flight"] == 4
    batches = coordinator.fetch([first, *rest])
    assert batches[0] == batches[1], batches


def _batch_sizes(coordinator, n):
    with coordinator.hold():  # one pump sees all n: with no durations known, the queue is split over trainers
        remotes = [coordinator.schedule(_batch) for _ in range(n)]
    return sorted(collections.Counter(coordinator.fetch(remotes)).values(), reverse=True)


def test_max_batch_caps_the_functions_in_one_dask_task(strategy, coordinator):
    """README: at most daskps.max-batch functions (256, Dask config) go into one batch."""
    assert dask.config.get("daskps.max-batch") == 256
    sizes = _batch_sizes(coordinator, 600)  # an even split would be 300 a trainer
    assert sizes[0] == 256 and sum(sizes) == 600, sizes
    with dask.config.set({"daskps.max-batch": 3}):
        sizes = _batch_sizes(coordinator, 20)  # an even split would be 10 a trainer
    assert sizes[0] == 3 and sum(sizes) == 20 and len(sizes) >= 7, sizes


# -- the iterators a worker keeps ------------------------------------------------------------------------
def _nine_iterators(iterators):
    """On one trainer: one element from each of nine new iterators, then again from the 9th back to the 2nd,
    then from the 1st."""
    first = [next(it) for it in iterators]
    again = [next(it) for it in reversed(iterators[1:])]
    return first, again, next(iterators[0])


def test_a_worker_keeps_the_8_most_recent_iterators_of_a_dataset(coordinator):
    """README: each worker keeps the 8 most recent iterators of a dataset (an older one starts over)."""
    dataset = coordinator.create_per_worker_dataset(lambda: range(100))  # re-iterable: each iterator from 0
    iterators = [iter(dataset) for _ in range(9)]
    first, again, oldest = coordinator.schedule(_nine_iterators, args=(iterators,)).fetch()
    assert first == [0] * 9
    assert again == [1] * 8  # the 2nd to the 9th were kept: each goes on
    assert oldest == 0  # the 1st was dropped when the 9th was made: a new one starts at the beginning


# -- recovery on the least-loaded ps worker --------------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_ps_gone_for_good_is_recreated_on_the_least_loaded_ps_worker(tmp_path):
    """README: a lost server starts on its own worker once restarted, or else on another ps worker, the
    least loaded.  Here ps-0 is gone for good; ps-1 holds a server of the strategy and ``zz-spare`` (a ps
    worker that joined later, last by name) holds none: the new server goes to zz-spare."""
    with dps.LocalPSCluster(num_ps=2, num_workers=1) as cluster, cluster.get_client() as client:
        strategy, a, b, manager, coordinator, _ = two_ps_training(client, tmp_path)  # a on ps-0, b on ps-1
        a.assign(1.0)
        manager.save()
        spare = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address, "--host", "127.0.0.1",
             "--nthreads", "1", "--resources", "ps=1", "--name", "zz-spare", "--no-nanny", "--no-dashboard",
             "--dashboard-address", "127.0.0.1:0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(lambda: 'zz-spare' in {w['name'] for w in cluster_workers(client).values()}, 60,
                       failure="the spare ps worker never joined", interval=0.1, collect=False)
            spare_address, ps1 = worker_address(client, "zz-spare"), worker_address(client, "ps-1")
            assert [s.address for s in strategy.servers] == [worker_address(client, "ps-0"), ps1]
            with dask.config.set({"daskps.recovery-same-worker-wait": "1s"}), warnings.catch_warnings():
                warnings.simplefilter("ignore", RollbackWarning)
                cluster.workers["ps-0"].close_gracefully(reason="test: gone for good")  # its Nanny stays down
                kill_worker(client, "ps-0")
                wait_until(lambda: coordinator.recoveries, 90,
                           failure="ps-0 was lost but no recovery happened", interval=0.1, collect=False)
                coordinator.join()
            assert [s.address for s in strategy.servers] == [spare_address, ps1]
            assert float(a.numpy()) == 1.0 and "task:0" in a.device  # restored there from the checkpoint
        finally:
            spare.terminate()
            spare.wait(timeout=30)


def _note_order(i):
    worker = get_worker()
    seen = worker.__dict__.setdefault("daskps_test_order", [])
    seen.append(i)
    return worker.name


def _take_order(dask_worker):
    return dask_worker.__dict__.pop("daskps_test_order", [])


def test_batches_waiting_on_one_trainer_run_in_the_order_they_were_made(client, strategy, coordinator):
    """With one trainer and a batch per function, several batches wait on it at once: they run as
    scheduled (Dask ranks tasks submitted close together by key, where batch 10 sorts before batch 9)."""
    set_trainer_slots(client, "worker-1", 0)
    try:
        client.run(_take_order)
        with dask.config.set({"daskps.max-batch": 1}):
            values = [coordinator.schedule(_note_order, args=(i,)) for i in range(60)]
            coordinator.join()
        assert {v.fetch() for v in values} == {"worker-0"}
        ran = [i for seen in client.run(_take_order).values() for i in seen]
        assert ran == list(range(60))
    finally:
        set_trainer_slots(client, "worker-1", 1)
