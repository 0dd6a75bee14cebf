"""``dps.data.from_dask`` when trainers die, restart or join: nothing hangs, nothing is read twice."""

import os
import signal
import time

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from distributed import get_worker
from distributed.core import Status

import daskps as dps
from daskps.distribute.cluster import cluster_workers
from tests.helpers.cluster import kill_worker, wait_for_worker, worker_address
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


def _frame(rows, partitions):
    return dd.from_pandas(pd.DataFrame({"id": np.arange(rows)}), npartitions=partitions)


def _read_slowly(iterator, pause):
    batch = next(iterator, None)
    time.sleep(pause if batch is not None else max(pause, 0.05))  # one that is done is slow: others get work
    return get_worker().name, None if batch is None else batch["id"]


def _wait_done(coordinator, n):
    wait_until(lambda: coordinator.summary()['done'] >= n, 60,
               failure=lambda: coordinator.summary(), interval=0.02, collect=False)


def _kill_for_good(cluster, client, name):
    """SIGKILL trainer ``name`` with its Nanny told not to start another: it does not come back."""
    # The Nanny lives in this process (LocalCluster). One that is closing gracefully closes once its worker
    # process exits, instead of starting another (Dask's Nanny has no switch for that any more).
    cluster.workers[name].status = Status.closing_gracefully
    addr = worker_address(client, name)
    os.kill(client.run(os.getpid, workers=[addr])[addr], signal.SIGKILL)
    wait_until(lambda: name not in {w['name'] for w in cluster_workers(client).values()}, 30,
               failure=lambda: f"{name} is still in the cluster", interval=0.05, collect=False)
    wait_until(lambda: cluster.workers[name].status == Status.closed, 30,
               failure=lambda: f"{name}'s Nanny is {cluster.workers[name].status}", interval=0.05, collect=False)


def _partition_of(ids, rows_per_partition):
    return set((np.asarray(ids) // rows_per_partition).tolist())


def _read_until_all_end(coordinator, it, names, pause=0.0, rounds=60, per_round=8):
    """Read until every trainer in ``names`` said it is done: [(trainer, ids), ...]."""
    out, ended = [], set()
    for _ in range(rounds):
        for name, ids in coordinator.fetch([coordinator.schedule(_read_slowly, args=(it, pause))
                                            for _ in range(per_round)]):
            if ids is None:
                ended.add(name)
            else:
                out.append((name, ids))
        if ended >= set(names):
            return out
    raise AssertionError(f"only {ended} reached the end")


def test_a_trainer_killed_for_good_leaves_its_unread_partitions_to_the_others(fresh_cluster):
    cluster, client = fresh_cluster
    coordinator = dps.ClusterCoordinator(dps.ParameterServerStrategy(client))
    rows, parts = 16_000, 16  # one batch is one partition: a partition is read whole or not at all
    ds = coordinator.create_per_worker_dataset(dps.data.from_dask(_frame(rows, parts), batch_size=1000))
    it = iter(ds)
    first = coordinator.fetch([coordinator.schedule(_read_slowly, args=(it, 0.2)) for _ in range(4)])
    _kill_for_good(cluster, client, "worker-1")
    rest = _read_until_all_end(coordinator, it, {"worker-0"})
    assert {n for n, _ in rest} == {"worker-0"}, "worker-1 came back"
    ids = np.concatenate([ids for _, ids in first + rest if ids is not None])
    assert len(np.unique(ids)) == len(ids), "a row was read twice"
    missing = np.setdiff1d(np.arange(rows), ids)
    # At most the partition worker-1 was reading as it died (its function never reported) is lost.
    assert len(_partition_of(missing, 1000)) <= 1, f"{len(missing)} rows never read"
    read_by_0 = _partition_of(np.concatenate([i for n, i in first + rest if n == "worker-0" and i is not None]), 1000)
    assert len(read_by_0) >= parts - 1 - sum(1 for n, i in first if n == "worker-1" and i is not None)
    assert len(read_by_0) > parts // 2  # it read worker-1's share too


def test_a_restarted_trainer_goes_on_from_where_it_was(fresh_cluster):
    cluster, client = fresh_cluster
    coordinator = dps.ClusterCoordinator(dps.ParameterServerStrategy(client))
    rows = 16_000
    it = iter(coordinator.create_per_worker_dataset(dps.data.from_dask(_frame(rows, 16), batch_size=1000)))
    first = coordinator.fetch([coordinator.schedule(_read_slowly, args=(it, 0.2)) for _ in range(6)])
    old = kill_worker(client, "worker-1")
    assert wait_for_worker(client, "worker-1", old) != old  # a new process took the name
    rest = _read_until_all_end(coordinator, it, {"worker-0", "worker-1"})
    ids = np.concatenate([ids for _, ids in first + rest if ids is not None])
    assert len(np.unique(ids)) == len(ids), "the restarted trainer read its share again"
    assert len(_partition_of(np.setdiff1d(np.arange(rows), ids), 1000)) <= 1


def test_a_trainer_that_joins_takes_partitions_of_the_next_epochs(fresh_cluster):
    cluster, client = fresh_cluster
    coordinator = dps.ClusterCoordinator(dps.ParameterServerStrategy(client))
    it = iter(coordinator.create_per_worker_dataset(dps.data.from_dask(_frame(8000, 8), batch_size=500, epochs=None)))
    before = coordinator.fetch([coordinator.schedule(_read_slowly, args=(it, 0.01)) for _ in range(20)])
    assert {name for name, _ in before} <= {"worker-0", "worker-1"}
    cluster.scale(len(cluster.worker_spec) + 1)
    client.wait_for_workers(5, timeout=60)
    seen: dict[str, int] = {}
    for _ in range(40):
        for name, ids in coordinator.fetch([coordinator.schedule(_read_slowly, args=(it, 0.02))
                                            for _ in range(12)]):
            assert ids is not None  # repeating forever: nobody runs out
            seen[name] = seen.get(name, 0) + 1
        if seen.get("worker-2", 0) >= 3:
            break
    assert seen.get("worker-2", 0) >= 3, f"the new trainer read nothing: {seen}"


def test_exactly_once_survives_a_trainer_sigkilled_mid_pass(fresh_cluster):
    cluster, client = fresh_cluster
    coordinator = dps.ClusterCoordinator(dps.ParameterServerStrategy(client))
    rows = 100_000
    it = iter(coordinator.create_per_worker_dataset(
        dps.data.from_dask(_frame(rows, 10), batch_size=1000, shuffle=True, exactly_once=True)))
    remotes = [coordinator.schedule(_read_slowly, args=(it, 0.05)) for _ in range(110)]
    _wait_done(coordinator, 30)
    old = kill_worker(client, "worker-1")
    assert wait_for_worker(client, "worker-1", old) != old
    out = coordinator.fetch(remotes)
    ids = np.concatenate([ids for _, ids in out if ids is not None])
    assert np.array_equal(np.sort(ids), np.arange(rows))  # each id exactly once
    assert sum(ids is None for _, ids in out) == 10

