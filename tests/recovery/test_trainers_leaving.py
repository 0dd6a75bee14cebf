"""Trainers that leave gracefully lose nothing."""

import time

import numpy as np
import pytest

import daskps as dps
from daskps.distribute.cluster import cluster_workers
from tests.helpers.cluster import worker_address
from tests.helpers.waiting import wait_until


@pytest.mark.timeout(180)
def test_a_retired_trainer_loses_nothing(fresh_cluster):
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    n = 400
    with strategy.scope():
        runs = dps.Variable(np.zeros(n), name="runs")  # runs[i]: how many times function i ran

    def step(i):
        time.sleep(0.01)
        runs.scatter_add(dps.IndexedSlices(np.ones(1), np.array([i])))
        return i

    remotes = [coordinator.schedule(step, args=(i,)) for i in range(n)]
    while coordinator.summary()["done"] < 50:
        time.sleep(0.05)
    reported = [i for i, r in enumerate(remotes) if r.status == "finished"]
    client.retire_workers(workers=[worker_address(client, "worker-1")])
    assert "worker-1" not in {w["name"] for w in cluster_workers(client).values()}
    coordinator.join()
    assert [r.fetch() for r in remotes] == list(range(n))
    got = runs.numpy()
    assert (got >= 1).all()
    assert (got[reported] == 1).all(), "a function that had reported ran again"
    assert got.sum() - n <= 10, f"{got.sum() - n} functions ran twice"  # those not yet reported, not a batch
    # And the one trainer left goes on taking work.
    more = [coordinator.schedule(step, args=(i,)) for i in range(20)]
    assert [r.fetch() for r in more] == list(range(20))


@pytest.mark.timeout(180)
def test_trainers_added_with_cluster_scale_take_work_and_build_their_datasets(fresh_cluster):
    from distributed import get_worker

    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    with strategy.scope():
        count = dps.Variable(0)

    def dataset_fn():
        name = get_worker().name  # built where it is used
        return ((name, i) for i in range(10**6))

    it = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(it):
        time.sleep(0.02)
        count.assign_add(1)
        return get_worker().name, next(it)

    first = [coordinator.schedule(step, args=(it,)) for _ in range(100)]
    while coordinator.summary()["done"] < 10:
        time.sleep(0.05)
    with pytest.raises(ValueError, match="n must be an int >= 2"):
        cluster.scale(1)  # would remove a parameter server
    cluster.scale(len(cluster.worker_spec) + 2)
    client.wait_for_workers(6, timeout=60)
    assert cluster.num_workers == 4 and "num_workers=4" in repr(cluster)
    later = [coordinator.schedule(step, args=(it,)) for _ in range(300)]
    coordinator.join()
    ran_on = [r.fetch() for r in first + later]
    new = {"worker-2", "worker-3"}
    assert new & {where for where, _ in ran_on}, "the new trainers took no work"
    for where, (built_on, _) in ran_on:
        assert where == built_on  # each trainer reads its own dataset
    assert int(count.numpy()) >= 400
    cluster.scale(4)  # back to 2 trainers: the newest go, the parameter servers stay
    wait_until(lambda: len(cluster_workers(client)) <= 4, 60, failure="the trainers did not go", interval=0.1,
               collect=False)
    names = sorted(w["name"] for w in cluster_workers(client).values())
    assert names == ["ps-0", "ps-1", "worker-0", "worker-1"]
    assert coordinator.schedule(step, args=(it,)).fetch()[0] in {"worker-0", "worker-1"}
