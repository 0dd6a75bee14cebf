"""A parameter server SIGKILLed during training: re-created, restored from the latest checkpoint, training goes on."""

from __future__ import annotations

import re
import time
import warnings

import numpy as np
import pytest

import daskps as dps
from daskps.errors import PSUnavailableError, RollbackWarning
from tests.helpers.cluster import (
    kill_for_good,
    kill_worker,
    one_checkpointed_variable,
    two_ps_training,
    wait_done,
    wait_for_recovery,
    worker_address,
)
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


def _step(a, b, opt, it):
    time.sleep(0.005)
    x = next(it)
    a.assign_add(1.0)
    opt.apply_gradients([(np.float32(-1.0), b)])  # SGD, learning rate 1: b += 1
    return x


def test_killed_ps_is_recreated_and_restored_while_400_functions_are_pending(fresh_cluster, tmp_path):
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        a = dps.Variable(0.0, name="a")  # ps-0
        b = dps.Variable(0.0, name="b")  # ps-1
        opt = dps.optimizers.SGD(learning_rate=1.0, momentum=0.5)  # iterations on ps-0; b's slot on ps-1
        untracked = dps.Variable(7.0, name="untracked")  # ps-1: in no checkpoint, never lost
        counter = dps.Variable(3.0, name="counter")  # ps-0: in no checkpoint
    manager = dps.CheckpointManager(dps.Checkpoint(a=a, b=b, opt=opt), str(tmp_path), max_to_keep=2)
    coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)
    assert coordinator.checkpoint_manager is manager
    dataset = coordinator.create_per_worker_dataset(lambda: iter(range(10**6)))
    it = iter(dataset)
    step = lambda: _step(a, b, opt, it)  # noqa: E731
    for _ in range(50):
        coordinator.schedule(step)
    coordinator.join()
    path = manager.save()
    saved_a, saved_b = float(a.numpy()), float(b.numpy())
    assert saved_a == 50.0 and saved_b > 50.0  # momentum: b moves by more than 1 a step
    counter.assign(5.0)  # after the checkpoint, on the server that will be lost

    remotes = [coordinator.schedule(step) for _ in range(400)]
    wait_done(coordinator, 70)
    lost = coordinator.summary()["done"] - 50  # finished before the kill: their updates to a are lost
    kill_worker(client, "ps-0")
    with pytest.warns(RollbackWarning) as caught:
        wait_for_recovery(coordinator)
        coordinator.join()
    assert all(r.fetch() is not None for r in remotes)  # every function finished
    text = str(caught[0].message)
    assert "ps:0" in text and path in text, text
    assert re.search(r"Rolled back to checkpoint [^:]+: 'a', 'opt/iterations'; every update", text), text
    assert re.search(r"Back to their initial value \(in no checkpoint\): 'counter'\.", text), text
    assert "'b'" not in text, text
    assert "every update made to them after it is lost" in text, text
    (report,) = coordinator.recoveries
    assert report.functions_since is not None and report.functions_since >= 20, report

    # Both variables trained on past their checkpointed values; b (on the surviving server) lost nothing.
    assert float(a.numpy()) > saved_a
    assert float(b.numpy()) > saved_b and float(untracked.numpy()) == 7.0
    assert float(counter.numpy()) == 3.0
    # rolled back to the checkpoint's 50 (not to 0, not kept), then 1 added by each function not finished
    # before the kill, at least by each that began knowing the new server (a generation after 0)
    after = sum(n for generation, n in coordinator.finished_by_generation().items() if generation > 0)
    assert lost >= 20 and after > 0, (lost, after)
    assert saved_a + after <= float(a.numpy()) <= saved_a + 400 - lost, (lost, after, float(a.numpy()))
    assert float(a.numpy()) == int(opt.iterations.numpy())  # both on ps-0, both rolled back to 50
    # The strategy, variables, optimizer and dataset keep working, nothing made again by hand.
    before_a, before_iters = float(a.numpy()), int(opt.iterations.numpy())
    for _ in range(20):
        coordinator.schedule(step)
    coordinator.join()
    assert float(a.numpy()) == before_a + 20 and int(opt.iterations.numpy()) == before_iters + 20
    assert strategy.ps_stats()[0]["num_variables"] == 3  # a, iterations, counter: nothing else there
    manager.save()  # the re-created server writes its part
    assert len(manager.checkpoints) == 2


def test_without_a_manager_a_lost_ps_raises_promptly_and_says_what_to_do(fresh_cluster):
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        a = dps.Variable(0.0, name="a")
    coordinator = dps.ClusterCoordinator(strategy)
    def step():
        time.sleep(0.005)
        a.assign_add(1.0)

    for _ in range(2000):  # far more than run before the kill lands; the failing join() cancels the rest
        coordinator.schedule(step)
    wait_done(coordinator, 10)
    kill_worker(client, "ps-0")
    with pytest.raises(PSUnavailableError, match=r"ps:0.*'a'.*checkpoint_manager=manager"):
        coordinator.join()  # (how soon is measured, not asserted: pytest-timeout bounds a hang)
    assert not coordinator.recoveries
    # Here too, the first call to find the server gone asks Dask what became of it; the next ones do not ask
    # again (each would wait out the probe, one after another under the channel's lock).
    with pytest.raises(PSUnavailableError, match=r"ps:0 at \S+ cannot be reached"):
        a.numpy()
    for _ in range(2):
        with pytest.raises(PSUnavailableError, match=r"ps:0 at \S+ was found gone earlier .*'a'"):
            a.numpy()


def test_checkpoint_manager_argument_is_checked(strategy):
    with pytest.raises(TypeError, match="checkpoint_manager must be a dps.CheckpointManager"):
        dps.ClusterCoordinator(strategy, checkpoint_manager="ckpt")
    coordinator = dps.ClusterCoordinator(strategy)
    assert coordinator.checkpoint_manager is None


def test_manager_given_later_and_recovery_before_any_checkpoint(fresh_cluster, tmp_path):
    """No checkpoint yet: the lost server's variables start again from their initial values."""
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        a = dps.Variable(np.full(4, 2.0), name="a")  # ps-0
        b = dps.Variable(0.0, name="b")  # ps-1
    coordinator = dps.ClusterCoordinator(strategy)
    manager = dps.CheckpointManager(dps.Checkpoint(a=a, b=b), str(tmp_path))
    assert dps.ClusterCoordinator(strategy, checkpoint_manager=manager) is coordinator
    assert coordinator.checkpoint_manager is manager

    def step():
        time.sleep(0.005)
        a.assign_add(np.ones(4))
        b.assign_add(1.0)

    for _ in range(300):
        coordinator.schedule(step)
    wait_done(coordinator, 20)
    lost = coordinator.summary()["done"]  # finished before the kill: their updates to a are lost
    kill_worker(client, "ps-0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wait_for_recovery(coordinator)
        coordinator.join()
    (warning,) = [w for w in caught if issubclass(w.category, RollbackWarning)]
    assert "No checkpoint had been saved yet" in str(warning.message)
    assert "'a'" in str(warning.message)
    assert float(b.numpy()) >= 300.0  # every function ran (a few maybe twice)
    assert lost >= 20 and (a.numpy() > 2.0).all() and (a.numpy() <= 2.0 + 300 - lost).all(), (lost, a.numpy())


def _sgd_momentum(w, m, g, lr, mu, steps):
    for _ in range(steps):
        m = m * mu - g * lr
        w = w + m
    return w, m


def test_shards_and_slots_of_the_lost_server_come_back_from_the_checkpoint(fresh_cluster, tmp_path):
    """Exact numbers: the lost server's shard and its momentum restart from the checkpoint; the other shard keeps its updates."""
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client, variable_partitioner=dps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        w = dps.Variable(np.zeros((4, 3), np.float32), name="w")  # rows 0-1 on ps-0, rows 2-3 on ps-1
        opt = dps.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    assert ["task:0" in w.variables[0].device, "task:1" in w.variables[1].device] == [True, True]
    manager = dps.CheckpointManager(dps.Checkpoint(w=w, opt=opt), str(tmp_path))
    coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)
    g = np.ones((4, 3), np.float32)

    def step():
        opt.apply_gradients([(g, w)])

    started, go = tmp_path / "started", tmp_path / "go"

    def step_after_the_kill():
        started.touch()
        while not go.exists():
            time.sleep(0.01)
        step()

    for _ in range(3):
        coordinator.schedule(step)
        coordinator.join()
    manager.save()
    for _ in range(2):
        coordinator.schedule(step)
        coordinator.join()
    coordinator.schedule(step_after_the_kill)  # running before the kill: it fails, then runs again
    while not started.exists():
        time.sleep(0.01)
    kill_worker(client, "ps-0")
    go.touch()
    with pytest.warns(RollbackWarning, match=r"'w'"):
        coordinator.join()
    zero = np.zeros((4, 3), np.float32)
    w3, m3 = _sgd_momentum(zero, zero, g, 0.1, 0.9, 3)
    lost_rows, _ = _sgd_momentum(w3, m3, g, 0.1, 0.9, 1)  # from the checkpoint, then the function run again
    # ps-1 applied the failed attempt's push too (one message per server, sent to both): at-least-once
    kept_rows, _ = _sgd_momentum(zero, zero, g, 0.1, 0.9, 7)
    got = w.numpy()
    np.testing.assert_allclose(got[:2], lost_rows[:2], rtol=1e-5)
    np.testing.assert_allclose(got[2:], kept_rows[2:], rtol=1e-5)


def test_a_ps_gone_for_good_is_recreated_on_another_ps_worker(fresh_cluster, tmp_path):
    import dask.config

    cluster, client = fresh_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    with dask.config.set({"daskps.recovery-same-worker-wait": "1s"}):
        kill_for_good(cluster, client, "ps-0")
        for _ in range(20):
            coordinator.schedule(step)
        with pytest.warns(RollbackWarning, match="ps:0"):
            coordinator.join()
    ps1 = worker_address(client, "ps-1")
    assert [s.address for s in strategy.servers] == [ps1, ps1]  # both servers on ps-1 now
    assert float(a.numpy()) >= 21.0 - 1 and float(b.numpy()) >= 21.0
    assert "task:0" in a.device


def _mark_ran(name):
    from distributed import Event

    Event(name).set()


def test_functions_scheduled_during_a_recovery_wait_for_it(fresh_cluster, tmp_path):
    """While lost servers are re-created, nothing queued goes out, not even a function that touches none."""
    import uuid

    import dask.config
    from distributed import Event

    from daskps.coordinator.recovery import RecoveryState

    cluster, client = fresh_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    ran = f"daskps-ran-during-recovery-{uuid.uuid4().hex}"
    with dask.config.set({"daskps.recovery-same-worker-wait": "6s"}):  # waits 6 s for ps-0 before moving it
        kill_for_good(cluster, client, "ps-0")
        wait_until(lambda: coordinator.recovery_state is RecoveryState.RECOVERING, 60,
                   failure="no recovery began", interval=0.02, collect=False)
        coordinator.schedule(_mark_ran, args=(ran,))
        ran_early = Event(ran, client=client).wait(2)
        assert coordinator.recovery_state is RecoveryState.RECOVERING, "the recovery ended too soon to tell"
        assert not ran_early, "a function went out while the servers were being recovered"
        with pytest.warns(RollbackWarning, match="ps:0"):
            coordinator.join()
    assert Event(ran, client=client).is_set() and coordinator.recoveries


def test_no_ps_worker_in_time_fails_join_with_a_clear_error(fresh_cluster, tmp_path):
    import dask.config

    cluster, client = fresh_cluster
    strategy, a, manager, coordinator = one_checkpointed_variable(client, tmp_path)
    with dask.config.set({"daskps.recovery-timeout": "2s"}):
        kill_for_good(cluster, client, "ps-0")
        kill_for_good(cluster, client, "ps-1")
        remotes = [coordinator.schedule(lambda: a.assign_add(1.0) and None) for _ in range(5)]
        with pytest.raises(PSUnavailableError, match=r"ps:\d was lost and no worker with resource 'ps' came"):
            coordinator.join()
    assert coordinator.done() and not coordinator.recoveries
    for r in remotes:  # queued again for the recovery, then cancelled with the error: none waits forever
        with pytest.raises((dps.errors.CancelledError, PSUnavailableError)):
            r.fetch()


def test_server_keys_of_recreated_servers_parse():
    from daskps.client.group import parse_server_key, server_key

    assert parse_server_key(server_key(3, "abc123")) == (3, "abc123")
    assert parse_server_key(server_key(3, "abc123", 2)) == (3, "abc123")
    assert server_key(3, "abc123", 2) != server_key(3, "abc123", 1)
    assert parse_server_key("daskps-ps-3-abc123-gx") is None


def test_a_ps_lost_while_nothing_runs_is_recovered_at_once(fresh_cluster, tmp_path):
    """The scheduler tells the coordinator when a server's worker leaves: no function has to fail first."""
    cluster, client = fresh_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=10)
    a.assign(100.0)  # after the checkpoint: lost with the server
    kill_worker(client, "ps-0")
    with pytest.warns(RollbackWarning, match=r"'a'; every update made to them after it is lost \(0 scheduled"):
        wait_until(lambda: coordinator.recoveries, 60, failure="no recovery", interval=0.05, collect=False)
        coordinator.join()  # waits for a recovery under way
    assert float(a.numpy()) == 10.0 and float(b.numpy()) == 10.0
    assert manager.save() is not None  # the loop's next save works
