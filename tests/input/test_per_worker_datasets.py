"""Per-worker datasets on a real cluster."""

import gc
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from distributed import get_worker

import daskps as dps
from daskps.distribute.cluster import cluster_workers
from daskps.errors import NotScheduledError, OutOfRangeError
from tests.helpers.cluster import datasets_built, kill_worker, set_trainer_slots, wait_for_worker
from tests.helpers.waiting import wait_until


def _next(iterator):
    return next(iterator)


def _where_and_next(iterator):
    return get_worker().name, next(iterator)


def test_dataset_fn_without_arguments(coordinator):
    it = iter(coordinator.create_per_worker_dataset(lambda: range(100)))
    values = coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,)) for _ in range(10)])
    per_worker = {}
    for name, v in values:
        per_worker.setdefault(name, []).append(v)
    # each trainer called dataset_fn() and reads its own range from the start, in order
    assert per_worker and all(vs == list(range(len(vs))) for vs in per_worker.values()), per_worker


def test_dataset_fn_gets_its_input_context(coordinator):
    def dataset_fn(ctx):
        return [(ctx.input_pipeline_id, ctx.num_input_pipelines, get_worker().name)] * 50

    it = iter(coordinator.create_per_worker_dataset(dataset_fn))
    out = coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,)) for _ in range(20)])
    for ran_on, (pipeline_id, num, built_on) in out:
        assert ran_on == built_on  # read where it was built
        assert num == 2
        assert pipeline_id == int(built_on.split("-")[1])


def test_dataset_is_built_on_workers_never_here(coordinator):
    def dataset_fn():
        get_worker()  # raises on the coordinator
        return [1, 2, 3]

    it = iter(coordinator.create_per_worker_dataset(dataset_fn))
    assert coordinator.schedule(_next, args=(it,)).fetch() == 1


def _read_on_both(coordinator, it) -> dict[str, list[int]]:
    """Read ``it`` until both trainers have read from it: ``{trainer: values read there, in order}``."""
    seen: dict[str, list[int]] = {}

    def both():
        for name, value in coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,)) for _ in range(8)]):
            seen.setdefault(name, []).append(value)
        return len(seen) >= 2

    wait_until(both, 60, failure=lambda: f"one trainer ran every function: {seen}", interval=0, collect=False)
    return seen


def test_iter_gives_fresh_iterators(coordinator):
    ds = coordinator.create_per_worker_dataset(lambda: iter(range(1000)))
    first = _read_on_both(coordinator, iter(ds))  # both trainers are past 0 on the first iterator
    second = _read_on_both(coordinator, iter(ds))
    # a fresh pass starts again at 0 on each trainer, and goes on in order, whatever the first read
    for values in (*first.values(), *second.values()):
        assert values == list(range(len(values))), (first, second)


def test_iterator_handle_is_small(coordinator):
    import pickle

    big = np.zeros(2_000_000)
    it = iter(coordinator.create_per_worker_dataset(lambda: iter([big.sum()] * 4)))
    assert len(pickle.dumps(it)) < 300
    assert coordinator.schedule(_next, args=(it,)).fetch() == 0.0


def test_exhausted_iterator_raises_out_of_range(coordinator):
    it = iter(coordinator.create_per_worker_dataset(lambda: [1]))
    for _ in range(6):
        coordinator.schedule(_next, args=(it,))
    with pytest.raises(OutOfRangeError) as err:
        coordinator.join()
    assert re.fullmatch(r"per-worker iterator \d+ is exhausted on worker 'worker-[01]'; create a new one with "
                        r"iter\(dataset\)", str(err.value)), err.value
    coordinator.join()


def _ends(why):
    if why is None:
        return next(iter([]))  # a plain iterator's end: StopIteration with no text
    raise StopIteration(why)


def test_a_stop_iteration_in_a_function_arrives_as_out_of_range_with_its_text(coordinator):
    for why, text in ((None, "an iterator is exhausted"), ("the shard file ended", "the shard file ended")):
        coordinator.schedule(_ends, args=(why,))
        with pytest.raises(OutOfRangeError) as err:
            coordinator.join()
        assert str(err.value) == f"{text}; create a new one with iter(dataset), or catch the end with next(iterator, None)"


def test_next_on_the_coordinator_is_refused(coordinator):
    it = iter(coordinator.create_per_worker_dataset(lambda: [1]))
    with pytest.raises(NotScheduledError) as err:
        next(it)
    assert str(err.value) == "next() on a per-worker iterator works only inside a function run by ClusterCoordinator.schedule"


def test_bad_dataset_fns(coordinator):
    with pytest.raises(TypeError) as err:
        coordinator.create_per_worker_dataset([1, 2, 3])
    assert str(err.value) == ("dataset_fn must be a callable returning an iterable, got list "
                              "(wrap a dataset as `lambda: dataset`)")
    it = iter(coordinator.create_per_worker_dataset(lambda: 5))
    coordinator.schedule(_next, args=(it,))
    with pytest.raises(TypeError) as err:
        coordinator.join()
    assert str(err.value) == "dataset_fn must return an iterable, got int"


def test_a_dataset_fn_whose_signature_python_cannot_read_is_called_without_arguments(coordinator):
    it = iter(coordinator.create_per_worker_dataset(frozenset))  # inspect.signature(frozenset): ValueError
    with pytest.raises(OutOfRangeError, match=r"^per-worker iterator 1 is exhausted on worker"):
        coordinator.fetch(coordinator.schedule(_next, args=(it,)))  # frozenset(): empty


def test_datasets_are_spread_over_the_parameter_servers(coordinator):
    """Each dataset's pickled function is kept on one server, picked by its id: not all on the first."""
    datasets = [coordinator.create_per_worker_dataset(lambda: iter(range(3))) for _ in range(16)]
    ps = set(coordinator.strategy.cluster_resolver.cluster_spec()["ps"])
    assert len(ps) == 2
    assert {d.blob.server.address for d in datasets} == ps


class _ReadsUnderALock:
    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self):
        return iter(range(3))


def test_a_dataset_fn_that_cannot_be_pickled_is_refused_naming_what(coordinator):
    with pytest.raises(TypeError) as err:
        coordinator.create_per_worker_dataset(_ReadsUnderALock())
    assert str(err.value) == ("cannot pickle attribute 'lock' of dataset_fn (a _thread.lock): "
                              "TypeError: cannot pickle '_thread.lock' object")


def _slow_next(iterator):
    time.sleep(0.02)
    return next(iterator)


@pytest.mark.timeout(60)
def test_a_trainer_forgets_a_dropped_dataset_while_it_builds_another(coordinator, client):
    """A dataset dropped (forgotten on every worker, on the worker's event loop) while a trainer is building
    another one: the forgetting does not wait for the build, which itself may need that loop. (It did wait:
    the trainer hung for good, seen in CI as a full suite stuck in this file.)"""
    import uuid

    from distributed import Event

    from daskps.trainer.datasets import forget_on_worker

    tag = uuid.uuid4().hex

    def slow_source():
        Event(f"building-{tag}").set()
        assert Event(f"go-{tag}").wait(30), "the test never let the build go on"
        return iter(range(5))

    it = iter(coordinator.create_per_worker_dataset(slow_source))
    first = coordinator.schedule(next, args=(it,))
    assert Event(f"building-{tag}", client=client).wait(10), "the dataset was never built"
    other = coordinator.create_per_worker_dataset(lambda: iter(range(3)))
    # what dropping `other` has every worker do; it returns while the build above still waits
    client.run(forget_on_worker, other.dataset_id)
    Event(f"go-{tag}", client=client).set()
    assert first.fetch() == 0


def test_a_dataset_that_only_scheduled_functions_hold_lives_until_they_have_run(coordinator):
    """Arguments are pickled when a function is scheduled; the dataset behind an iterator passed so is
    kept by the coordinator until those functions have run, though the caller dropped both."""
    it = iter(coordinator.create_per_worker_dataset(lambda: iter(range(1000))))
    pending = [coordinator.schedule(_slow_next, args=(it,)) for _ in range(60)]
    del it
    gc.collect()
    values = coordinator.fetch(pending)
    # Each trainer's iterator from the start: k functions on one trainer, the rest on the other.
    assert any(sorted(values) == sorted([*range(k), *range(60 - k)]) for k in range(61)), values


def test_per_worker_values_give_each_worker_its_own(coordinator):
    values = dps.PerWorkerValues(["for worker-0", "for worker-1"])
    out = coordinator.fetch([coordinator.schedule(lambda v: (get_worker().name, v), args=(values,)) for _ in range(10)])
    for name, v in out:
        assert v == f"for {name}"


def test_restarted_worker_builds_its_own(fresh_cluster):
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)

    def dataset_fn(ctx):
        return iter([(ctx.input_pipeline_id, os.getpid())] * 1000)

    it = iter(coordinator.create_per_worker_dataset(dataset_fn))
    before = coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,)) for _ in range(10)])
    old = kill_worker(client, "worker-1")
    address = wait_for_worker(client, "worker-1", old)
    new_pid = client.run(os.getpid, workers=[address])[address]
    assert new_pid not in {pid for _, (_, pid) in before}  # a new process
    set_trainer_slots(client, "worker-0", 0)  # the functions go to the restarted worker
    after = coordinator.fetch([coordinator.schedule(_where_and_next, args=(it,)) for _ in range(20)])
    set_trainer_slots(client, "worker-0", 1)
    assert {name for name, _ in after} == {"worker-1"}, after
    new = [(index, pid) for _, (index, pid) in after]
    assert all(index == 1 and pid == new_pid for index, pid in new), (new_pid, new)  # built in the new process


def test_worker_that_joins_later_builds_its_own(fresh_cluster, tmp_path):
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    it = iter(coordinator.create_per_worker_dataset(lambda ctx: iter([ctx.input_pipeline_id] * 1000)))
    coordinator.fetch([coordinator.schedule(_next, args=(it,)) for _ in range(4)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
         "--host", "127.0.0.1", "--nthreads", "1", "--resources", "worker=1",
         "--name", "late-worker", "--no-dashboard", "--dashboard-address", "127.0.0.1:0", "--no-nanny"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: 'late-worker' in {w['name'] for w in cluster_workers(client).values()}, 60,
                   failure="late worker never joined", interval=0.1, collect=False)

        def on_late(iterator):
            time.sleep(0.1)  # long enough that all three workers get work
            return get_worker().name, next(iterator)

        late_ids: set = set()
        for _ in range(10):  # Dask places the batches: rounds until the newcomer got one
            seen = coordinator.fetch([coordinator.schedule(on_late, args=(it,)) for _ in range(30)])
            late_ids |= {value for name, value in seen if name == "late-worker"}
            if late_ids:
                break
        assert late_ids == {2}  # built its own, with the next free index
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_closing_a_strategy_forgets_its_datasets_on_every_trainer_before_close_returns(client):
    kept = dps.ClusterCoordinator(dps.ParameterServerStrategy(client))  # another strategy's: not forgotten
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    datasets = {c: c.create_per_worker_dataset(lambda: iter(range(1000))) for c in (kept, coordinator)}
    for c, dataset in datasets.items():
        it = iter(dataset)
        wait_until(lambda c=c, it=it: len({name for name, _ in c.fetch([c.schedule(_where_and_next, args=(it,))
                                                                       for _ in range(8)])}) >= 2,
                   60, failure="one trainer ran every function", interval=0, collect=False)
    ids = {c: d.dataset_id for c, d in datasets.items()}
    trainers = set(cluster_workers(client)) - set(strategy.cluster_resolver.cluster_spec()["ps"])
    built = client.run(datasets_built, workers=list(trainers))
    assert all(set(ids.values()) <= set(names) for names in built.values()), built
    strategy.close()
    built = client.run(datasets_built, workers=list(trainers))  # at once: close() waited for them
    assert all(ids[coordinator] not in names and ids[kept] in names for names in built.values()), built
    kept.strategy.close()
    with pytest.raises(dps.errors.ClosedError) as err:
        coordinator.create_per_worker_dataset(lambda: iter(range(3)))
    assert str(err.value) == ("cannot use create_per_worker_dataset: the ParameterServerStrategy it belongs to "
                              "was closed (strategy.close()), which released its parameter servers and "
                              "everything on them")


def _index_among(worker_names):
    from daskps.trainer.datasets import local_worker_index

    return local_worker_index(worker_names)


@pytest.mark.parametrize("names, expected", [
    (("worker-0", "worker-1"), {"worker-0": 0, "worker-1": 1}),  # known by name: its place
    (("worker-0",), {"worker-0": 0, "worker-1": 1}),  # a newcomer, no place free: after the known ones
    (("gone",), {"worker-0": 0, "worker-1": 2}),  # newcomers in name order: the first takes the free place
    (("worker-1", "gone"), {"worker-0": 1, "worker-1": 0}),  # a newcomer takes the place of one not alive
    (("gone-a", "gone-b", "worker-1"), {"worker-0": 0, "worker-1": 2}),
    ((), {"worker-0": 0, "worker-1": 1}),
])
def test_a_trainers_index_among_names_it_may_not_be_in(client, names, expected):
    """Parameter servers are not trainers: only workers with a trainer's resources are counted as alive."""
    trainers = {info["name"]: addr for addr, info in cluster_workers(client).items()
                if str(info["name"]).startswith("worker-")}
    assert set(trainers) == {"worker-0", "worker-1"}
    got = {name: client.submit(_index_among, names, workers=[addr], pure=False).result(timeout=60)
           for name, addr in trainers.items()}
    assert got == expected


def test_reprs_name_the_dataset_and_get_next_is_next(coordinator):
    dataset = coordinator.create_per_worker_dataset(lambda: iter(range(10)))
    short = dataset.dataset_id[:8]
    assert repr(dataset) == f"PerWorkerDataset(id={short}, iterators=0)"
    first, second = iter(dataset), iter(dataset)
    assert repr(dataset) == f"PerWorkerDataset(id={short}, iterators=2)"
    assert repr(second) == f"PerWorkerIterator(dataset={short}, iterator=2)"
    with pytest.raises(NotScheduledError):
        first.get_next()
    assert coordinator.fetch(coordinator.schedule(lambda it: it.get_next(), args=(first,))) == 0
