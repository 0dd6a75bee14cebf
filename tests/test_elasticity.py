"""Trainers that leave gracefully lose nothing."""

import time

import pytest

import daskps as dps
from daskps.distribute.cluster import cluster_workers

from .conftest import worker_address


@pytest.mark.timeout(180)
def test_a_retired_trainer_loses_nothing(fresh_cluster):
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    with strategy.scope():
        count = dps.Variable(0)

    def step(i):
        time.sleep(0.01)
        count.assign_add(1)
        return i

    remotes = [coordinator.schedule(step, args=(i,)) for i in range(400)]
    while coordinator.summary()["done"] < 50:
        time.sleep(0.05)
    client.retire_workers(workers=[worker_address(client, "worker-1")])
    assert "worker-1" not in {w["name"] for w in cluster_workers(client).values()}
    coordinator.join()
    assert [r.fetch() for r in remotes] == list(range(400))
    ran = int(count.numpy())
    assert 400 <= ran <= 404, f"{ran - 400} functions ran twice"
    # And the one trainer left goes on taking work.
    more = [coordinator.schedule(step, args=(i,)) for i in range(20)]
    assert [r.fetch() for r in more] == list(range(20))
