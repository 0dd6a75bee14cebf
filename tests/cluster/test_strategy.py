"""ParameterServerStrategy on a real cluster."""

import pickle
import subprocess
import sys

import dask.config
import numpy as np
import pytest
from distributed import Client

import daskps as dps


def test_accepts_client_address_resolver_and_default(client):
    s1 = dps.ParameterServerStrategy(client)
    s2 = dps.ParameterServerStrategy(dps.DaskClusterResolver(client))
    s3 = dps.ParameterServerStrategy(client.scheduler.address)
    try:
        with client.as_current():
            s4 = dps.ParameterServerStrategy()
        for s in (s1, s2, s3, s4):
            assert len(s.extended.parameter_devices) == 2
            assert len(s.extended.worker_devices) == 2
    finally:
        s3.client.close()


def test_rejects_bad_cluster_resolver():
    with pytest.raises(TypeError, match="cluster_resolver"):
        dps.ParameterServerStrategy(cluster_resolver=3)


@pytest.mark.cluster
def test_no_default_client_is_a_clear_error():
    code = (
        "import daskps as dps\n"
        "try:\n    dps.ParameterServerStrategy()\n"
        "except ValueError as e:\n    print('ValueError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ValueError:" in out.stdout and "default Dask client" in out.stdout


@pytest.mark.cluster
@pytest.mark.parametrize("num_ps, num_workers, missing", [(0, 1, "parameter server"), (1, 0, "training worker")])
def test_cluster_without_ps_or_workers(num_ps, num_workers, missing):
    with dps.LocalPSCluster(num_ps=num_ps, num_workers=num_workers, processes=False) as cluster:
        with Client(cluster) as client:
            with dask.config.set({"daskps.workers-timeout": "1s"}), pytest.raises(ValueError, match=missing):
                dps.ParameterServerStrategy(client)


def test_a_wrong_scheduler_address_fails_within_the_timeout_naming_it():
    import socket
    import time

    with socket.socket() as s:  # a port on this machine where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    started = time.monotonic()
    with dask.config.set({"daskps.scheduler-timeout": "2s"}), pytest.raises(OSError) as info:
        dps.ParameterServerStrategy(address)
    assert time.monotonic() - started < 15  # Dask's own connect timeout is 30 s
    assert f"cannot reach a Dask scheduler at {address!r} within 2 s (daskps.scheduler-timeout)" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_an_address_that_is_not_one_is_named():
    with pytest.raises(ValueError, match=r"cluster_resolver 'ftp://x:1' is not a scheduler address"):
        dps.ParameterServerStrategy("ftp://x:1")


def test_one_actor_per_ps_pinned_by_address(strategy, client):
    spec = strategy.cluster_resolver.cluster_spec()
    where = client.who_has(strategy.group.futures)
    assert [where[f.key][0] for f in strategy.group.futures] == spec["ps"]
    stats = strategy.ps_stats()
    assert [s["task_id"] for s in stats] == [0, 1]


def test_variable_partitioner_must_be_callable(client):
    with pytest.raises(TypeError, match="variable_partitioner"):
        dps.ParameterServerStrategy(client, variable_partitioner=2)


def test_scope_makes_strategy_current(strategy):
    assert dps.get_strategy() is not strategy
    with strategy.scope():
        assert dps.get_strategy() is strategy
        assert dps.has_strategy()
        assert dps.in_cross_replica_context()
        assert dps.get_replica_context() is None
    assert not dps.has_strategy()


def test_scopes_of_two_strategies_do_not_mix(strategy, client):
    other = dps.ParameterServerStrategy(client)
    with strategy.scope():
        with pytest.raises(RuntimeError, match="scope"):
            with other.scope():
                pass


def test_run_and_reduce_need_a_scheduled_function(strategy):
    with pytest.raises(NotImplementedError, match="schedule"):
        strategy.run(lambda: 1)
    with pytest.raises(NotImplementedError, match="schedule"):
        strategy.reduce("SUM", 1.0)


def test_run_inside_scheduled_function_is_replica_zero(strategy, coordinator):
    def step(x):
        def replica_fn(y):
            ctx = dps.get_replica_context()
            return (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync,
                    dps.in_cross_replica_context(), dps.get_strategy() is strategy, y * 2)
        return strategy.run(replica_fn, args=(x,))

    # replica 0 of 1, in a replica context (not cross-replica), under the strategy that scheduled it
    assert coordinator.schedule(step, args=(21,)).fetch() == (0, 1, False, True, 42)


def test_scheduled_function_runs_in_cross_replica_scope(strategy, coordinator):
    def step():
        return dps.has_strategy(), dps.in_cross_replica_context()

    assert coordinator.schedule(step).fetch() == (True, True)


def test_reduce_inside_scheduled_function(strategy, coordinator):
    def step():
        per_replica = strategy.run(lambda: np.arange(6.0).reshape(2, 3))
        return (strategy.reduce("SUM", per_replica, axis=None),
                strategy.reduce(dps.ReduceOp.SUM, per_replica, axis=0),
                strategy.reduce("mean", per_replica, axis=1))

    none, sum0, mean1 = coordinator.schedule(step).fetch()
    np.testing.assert_array_equal(none, np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(sum0, [3, 5, 7])
    np.testing.assert_array_equal(mean1, [1, 4])


def test_reduce_errors_inside_scheduled_function(strategy, coordinator):
    coordinator.schedule(lambda: strategy.reduce("max", 1.0))
    with pytest.raises(ValueError, match="reduce_op"):
        coordinator.join()
    coordinator.schedule(lambda: strategy.reduce("SUM", np.ones(3), axis=1))
    with pytest.raises(ValueError, match="axis"):
        coordinator.join()


def test_gather_and_local_results(strategy, coordinator):
    with strategy.scope():
        np.testing.assert_array_equal(strategy.gather(np.ones((2, 1)), axis=0), np.ones((2, 1)))
    assert strategy.experimental_local_results("x") == ("x",)

    def step():
        return strategy.run(lambda: strategy.gather(1, 0))

    coordinator.schedule(step)
    with pytest.raises(RuntimeError, match="all_gather"):
        coordinator.join()


def test_distribute_values_from_function(strategy):
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
    assert strategy.experimental_local_results(values) == (1,)
    assert strategy.num_replicas_in_sync == 1


def test_distribute_dataset_only_inside_dataset_fn(strategy, coordinator):
    with pytest.raises(ValueError, match="create_per_worker_dataset"):
        strategy.experimental_distribute_dataset([1, 2])
    with pytest.raises(ValueError, match="create_per_worker_dataset"):
        strategy.distribute_datasets_from_function(lambda ctx: [1])

    def dataset_fn(ctx):
        return strategy.distribute_datasets_from_function(
            lambda c: strategy.experimental_distribute_dataset([c.input_pipeline_id] * 3)
        )

    it = iter(coordinator.create_per_worker_dataset(dataset_fn))
    ids = coordinator.fetch([coordinator.schedule(lambda it: next(it), args=(it,)) for _ in range(4)])
    assert set(ids) <= {0, 1}


def test_strategy_pickles_to_a_small_worker_view(strategy):
    blob = pickle.dumps(strategy)
    assert len(blob) < 2000
    view = pickle.loads(blob)
    assert view.extended.parameter_devices == strategy.extended.parameter_devices
    assert view.client is None


def test_variables_cannot_be_created_inside_scheduled_function(strategy, coordinator):
    def step():
        with strategy.scope():
            dps.Variable(1.0)

    coordinator.schedule(step)
    with pytest.raises(RuntimeError, match="coordinator"):
        coordinator.join()


def test_cluster_resolver_property(strategy, client):
    resolver = strategy.cluster_resolver
    assert resolver.task_type == "chief" and resolver.task_id == 0
    assert resolver.num_ps == 2 and resolver.num_workers == 2
