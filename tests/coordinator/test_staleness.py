"""Bounded staleness (``schedule(..., staleness=k)``): its promises, on a real cluster.

Each trainer has a counter of its own on a server (a row of one variable),
which goes up by one with every gradient push of that trainer (SGD, learning
rate 1, gradient -1). Each function reads its trainer's counter, then pushes;
it also counts its trainer's own steps (state a function keeps on its
trainer). A read at a trainer's own step ``t`` has seen at least ``t - k`` of
that trainer's own pushes: never older than ``k`` of its own steps. (One
counter for all would hide a read too old: the other trainer's pushes make up
for it.)
"""

import time

import numpy as np
import pytest
from distributed import get_worker

import daskps as dps
from tests.helpers.cluster import PickySGD, kill_worker, wait_for_worker


def _counting_step(counter, opt, rows):
    own: dict[str, list[float]] = {}  # each trainer's reads, one per own step: the function is kept per trainer

    def step():
        name = get_worker().name
        value = float(counter.numpy()[rows[name]])  # a whole-value read: may be served stale
        own.setdefault(name, []).append(value)
        grad = np.zeros(len(rows), np.float32)
        grad[rows[name]] = -1.0
        opt.apply_gradients([(grad, counter)])
        return name, len(own[name]) - 1, value

    return step


def _run(strategy, coordinator, n, **schedule_kw):
    rows = {name: i for i, name in enumerate(strategy.trainer_names)}  # each trainer's own counter
    with strategy.scope():
        counter = dps.Variable(np.zeros(len(rows), np.float32), name="counter")
        opt = dps.optimizers.SGD(1.0)
    step = _counting_step(counter, opt, rows)
    results = coordinator.fetch([coordinator.schedule(step, **schedule_kw) for _ in range(n)])
    coordinator.join()
    by_trainer: dict[str, list[tuple[int, float]]] = {}
    for name, t, value in results:
        by_trainer.setdefault(name, []).append((t, value))
    return counter, {name: [v for _, v in sorted(reads)] for name, reads in by_trainer.items()}


@pytest.mark.parametrize("k", [1, 4, 8])
def test_no_read_is_older_than_k_own_steps(strategy, coordinator, k):
    counter, reads = _run(strategy, coordinator, 300, staleness=k)
    for name, values in reads.items():
        for t, value in enumerate(values):
            assert t - k <= value <= t, f"{name} read {value} at its own step {t}, more than {k} steps old"
    # The mode does something: some trainer read the same value at two own steps in a row, its own
    # push in between unseen (with k=0 a trainer's reads always go up).
    assert any(a == b for values in reads.values() for a, b in zip(values, values[1:]))
    assert counter.numpy().sum() == 300  # every push applied by join()


def _applied(strategy, name):
    """Gradient pushes and updates the servers applied to variable ``name`` (all its shards)."""
    return sum(n for s in strategy.ps_stats() for key, n in s["table_updates"].items() if key.startswith(name + "@"))


def test_sgd_pushes_held_together_are_applied_as_their_sum_and_every_step_counts(strategy, coordinator):
    """Plain SGD's steps add up: a trainer merges the pushes it holds for a server, at most k + 1 into one."""
    with strategy.scope():
        w = dps.Variable(np.zeros((2, 64), np.float32), name="merged")
        opt = dps.optimizers.SGD(0.5)
    g = np.arange(128, dtype=np.float32).reshape(2, 64)

    def step():
        w.numpy()
        opt.apply_gradients([(g, w)])

    for _ in range(200):
        coordinator.schedule(step, staleness=4)
    coordinator.join()
    np.testing.assert_allclose(w.numpy(), -0.5 * 200 * g, rtol=1e-6)
    assert opt.iterations.numpy() == 200  # the counter advanced once per step, merged or not
    applied = _applied(strategy, "merged")
    assert 200 // 5 <= applied < 200, applied  # merged, never more than k + 1 steps in one push


def test_pushes_of_an_optimizer_whose_steps_do_not_add_up_are_applied_one_by_one(strategy, coordinator):
    """SGD with momentum (Keras' rule ``m = mu * m - lr * g; w += m``) gets each gradient in turn."""
    with strategy.scope():
        w = dps.Variable(np.zeros(8, np.float32), name="momentum_w")
        opt = dps.optimizers.SGD(0.1, momentum=0.9)

    def step():
        w.numpy()
        opt.apply_gradients([(np.ones(8, np.float32), w)])

    n = 60
    for _ in range(n):
        coordinator.schedule(step, staleness=4)
    coordinator.join()
    m = want = np.float32(0)
    for _ in range(n):
        m = np.float32(0.9) * m - np.float32(0.1)
        want += m
    np.testing.assert_allclose(w.numpy(), np.full(8, want), rtol=1e-5)
    assert _applied(strategy, "momentum_w") == n


@pytest.mark.parametrize("how", ["default", "explicit"])
def test_k0_reads_see_every_own_push(strategy, coordinator, how):
    counter, reads = _run(strategy, coordinator, 200, **({"staleness": 0} if how == "explicit" else {}))
    for name, values in reads.items():
        assert values == list(range(len(values))), f"{name} missed an own push"
    assert counter.numpy().sum() == 200


def test_the_coordinators_staleness_is_the_default_and_schedule_overrides_it(strategy, coordinator):
    coordinator.staleness = 8
    assert dps.ClusterCoordinator(strategy).staleness == 8
    _, stale = _run(strategy, coordinator, 200)
    assert any(a == b for values in stale.values() for a, b in zip(values, values[1:]))
    _, fresh = _run(strategy, coordinator, 200, staleness=0)
    for values in fresh.values():
        assert all(b > a for a, b in zip(values, values[1:]))
    assert dps.ClusterCoordinator(strategy, staleness=0).staleness == 0


def test_every_push_is_applied_by_join(strategy, coordinator):
    with strategy.scope():
        w = dps.Variable(np.zeros(1000, np.float32), name="w")
        big = dps.Variable(np.zeros(4_000_000, np.float32), name="big")  # its push takes a while to arrive
        opt = dps.optimizers.SGD(0.5)

    def step(last):
        w.numpy()
        opt.apply_gradients([(np.full(1000, -2.0, np.float32), w)])
        if last:
            opt.apply_gradients([(np.full(4_000_000, -2.0, np.float32), big)])

    for r in range(3):  # join after join: nothing left behind in between
        for i in range(97):
            coordinator.schedule(step, args=(i == 96,), staleness=8)
        coordinator.join()
        assert big.numpy()[::100_000].tolist() == [r + 1.0] * 40  # read at once after join
    np.testing.assert_array_equal(w.numpy(), np.full(1000, 3 * 97 * 1.0, np.float32))


def test_an_own_assign_is_seen_at_once(strategy, coordinator):
    with strategy.scope():
        v = dps.Variable(np.zeros(3, np.float32), name="v")

    def step(i):
        v.numpy()  # cached
        v.assign(np.full(3, i, np.float32))
        return float(v.numpy()[0])

    got = coordinator.fetch([coordinator.schedule(step, args=(i,), staleness=8) for i in range(40)])
    assert got == [float(i) for i in range(40)]


def test_a_push_the_server_refuses_after_its_function_reported_fails_join(strategy, coordinator):
    with strategy.scope():
        w = dps.Variable(np.zeros(4, np.float32), name="w")
        opt = dps.optimizers.Optimizer(PickySGD(), name="picky")

    def step(g):
        w.numpy()
        opt.apply_gradients([(np.full(4, g, np.float32), w)])

    rvs = [coordinator.schedule(step, args=(-1.0 if i == 3 else 1.0,), staleness=4) for i in range(30)]
    with pytest.raises(ValueError, match="negative gradient refused"):
        coordinator.join()
    assert sum(rv.status == "error" for rv in rvs) == 1  # one function carries it (4, or 3 if last in its batch)
    coordinator.join()  # raised once; scheduling works again
    assert coordinator.schedule(lambda: 1, staleness=4).fetch() == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_bad_staleness_is_refused_naming_it(strategy, coordinator, bad):
    if bad is not None:
        with pytest.raises(ValueError, match="staleness"):
            coordinator.schedule(lambda: 1, staleness=bad)
        with pytest.raises(ValueError, match="staleness"):
            dps.ClusterCoordinator(strategy, staleness=bad)
        with pytest.raises(ValueError, match="staleness"):
            coordinator.staleness = bad
    assert coordinator.staleness == 0
    assert coordinator.summary()["scheduled"] == 0


@pytest.mark.timeout(180)
def test_a_trainer_killed_loses_at_most_k_plus_one_steps_of_pushes(fresh_cluster):
    """Each function ``i`` adds 1 to row ``i`` (a sparse push). A trainer SIGKILLed mid-run takes with it
    the pushes it held for functions that had reported; functions that had not reported run again."""
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy, staleness=4)
    n = 200
    with strategy.scope():
        marks = dps.Variable(np.zeros((n, 1), np.float32), name="marks")
        opt = dps.optimizers.SGD(1.0)

    def step(i):
        marks.numpy()  # a whole-value read: served stale most steps, so pushes are held
        time.sleep(0.01)
        opt.apply_gradients([(dps.IndexedSlices(-np.ones((1, 1), np.float32), np.array([i])), marks)])

    rvs = [coordinator.schedule(step, args=(i,)) for i in range(n)]
    while coordinator.summary()["done"] < 40:
        time.sleep(0.01)
    old = kill_worker(client, "worker-1")
    assert coordinator.summary()["done"] < n  # killed mid-run
    coordinator.join()
    assert all(rv.fetch() is None for rv in rvs)
    applied = marks.numpy()[:, 0]
    assert (applied >= 0).all()
    assert (applied == 0).sum() <= 4 + 1, np.flatnonzero(applied == 0)  # at most k + 1 steps' pushes lost
    wait_for_worker(client, "worker-1", old)
