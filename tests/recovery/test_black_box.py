"""Black-box checks of the README's promises about a lost parameter server and trainers coming and going.

Written from the README only ("When a parameter server is lost", "Trainers come and go", the demo command).
Real LocalPSClusters, real SIGKILLs.

Every step function ``k`` marks itself in two tracking arrays, ``sa`` on ps-0 (the server we kill) and ``sb``
on ps-1 (the survivor), with a sparse add of 1 at row ``k``.  After training, ``sb[k]`` is how many times
``k`` ran (ps-1 never loses anything) and ``sa[k]`` how many of its runs survived on ps-0, so "rolled back to
the latest checkpoint plus what ran since" can be checked function by function.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import warnings

import numpy as np
import pytest

import daskps as dps
from daskps.errors import PSUnavailableError, RollbackWarning
from tests.helpers.cluster import (
    kill_worker,
    wait_done,
    wait_for_recovery,
    wait_for_worker,
    worker_address,
    worker_pid,
)
from tests.helpers.waiting import wait_until

TIMEOUT = pytest.mark.timeout(180)


# ----------------------------------------------------------------------------------------------- helpers


def _onehot(k):
    return dps.IndexedSlices(np.ones(1), np.array([k]))


class Tracked:
    """``sa``/``a`` on ps-0, ``sb``/``b`` on ps-1; ``step(k)`` adds 1 to row k of both arrays and to both scalars."""

    def __init__(self, client, directory, n, *, sleep=0.004, big=0, manager_kwargs=None):
        self.strategy = dps.ParameterServerStrategy(client)
        with self.strategy.scope():
            self.sa = dps.Variable(np.zeros(n), name="sa")  # ps-0
            self.sb = dps.Variable(np.zeros(n), name="sb")  # ps-1
            self.a = dps.Variable(0.0, name="a")  # ps-0
            self.b = dps.Variable(0.0, name="b")  # ps-1
            objs = dict(sa=self.sa, sb=self.sb, a=self.a, b=self.b)
            if big:
                with self.strategy.extended.colocate_vars_with(self.sa):
                    self.big = dps.Variable(np.ones(big), name="big")  # ps-0: makes a save take a while
                objs["big"] = self.big
        assert "task:0" in self.sa.device and "task:0" in self.a.device, (self.sa.device, self.a.device)
        assert "task:1" in self.sb.device and "task:1" in self.b.device, (self.sb.device, self.b.device)
        self.directory = str(directory)
        self.manager = dps.CheckpointManager(dps.Checkpoint(**objs), self.directory, max_to_keep=10,
                                             **(manager_kwargs or {}))
        self.coordinator = dps.ClusterCoordinator(self.strategy, checkpoint_manager=self.manager)
        sa, sb, a, b = self.sa, self.sb, self.a, self.b

        def step(k):
            time.sleep(sleep)
            sa.scatter_add(_onehot(k))
            sb.scatter_add(_onehot(k))
            a.assign_add(1.0)
            b.assign_add(1.0)
            return k

        self.step = step

    def reading(self, dataset_fn, sleep):
        """An iterator over a per-worker dataset of ``dataset_fn``, and ``step(k, iterator)``: takes an
        element, then marks k as ``step`` does; returns the element."""
        it = iter(self.coordinator.create_per_worker_dataset(dataset_fn))
        sa, sb = self.sa, self.sb

        def step(k, iterator):
            x = next(iterator)
            time.sleep(sleep)
            sa.scatter_add(_onehot(k))
            sb.scatter_add(_onehot(k))
            return x

        return it, step

    def restore_local(self, path):
        """The values in checkpoint ``path``, read into local variables (the README: a restore works into
        a plain, even local, variable)."""
        n = self.sa.shape[0]
        sa, sb = dps.Variable(np.zeros(n), name="sa"), dps.Variable(np.zeros(n), name="sb")
        a, b = dps.Variable(0.0, name="a"), dps.Variable(0.0, name="b")
        objs = dict(sa=sa, sb=sb, a=a, b=b)
        if hasattr(self, "big"):
            objs["big"] = dps.Variable(np.zeros(self.big.shape[0]), name="big")
        dps.Checkpoint(**objs).restore(path)
        return sa.numpy(), sb.numpy(), float(a.numpy()), float(b.numpy())


def _rollbacks(caught):
    return [w for w in caught if issubclass(w.category, RollbackWarning)]


def _kill_when(coordinator, client, name, done, box):
    """SIGKILL worker ``name`` from a thread once ``coordinator`` has finished ``done`` functions."""
    pid = worker_pid(client, name)  # asked now: the kill itself is one system call

    def run():
        try:
            wait_done(coordinator, done)
            os.kill(pid, signal.SIGKILL)
            box["pending at the kill"] = coordinator.summary()["in_flight"]  # pending after it: pending at it
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _kill_when_a_save_starts(client, name, directory, box):
    """SIGKILL worker ``name`` from a thread as soon as a new entry appears in ``directory`` (a save began)."""
    pid = worker_pid(client, name)  # asked now: the kill itself is one system call
    before = set(os.listdir(directory))

    def run():
        try:
            wait_until(lambda: set(os.listdir(directory)) - before, 60,
                       failure="no save began", interval=0.0005, collect=False)
            os.kill(pid, signal.SIGKILL)
            box["killed"] = True
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# ------------------------------------------------- 1. the README's loop with ps-0 SIGKILLed at random moments

EPOCHS, STEPS = 3, 120


@TIMEOUT
@pytest.mark.parametrize("moment", ["scheduling", "join", "after_join", "save"])
def test_readme_loop_survives_a_ps_sigkill(fresh_cluster, tmp_path, moment):
    """The README's loop (schedule, join, manager.save() each epoch), ps-0 SIGKILLed in epoch 1 at ``moment``:
    between two schedule calls with functions pending, during join(), between join() and save(), or during save().

    README: join() does not raise when a ps dies; the lost server's variables go back to the latest checkpoint
    plus what ran since; the other server keeps every update; a save that reaches the lost server before the
    recovery is done raises PSUnavailableError (so that one is allowed, for the kills around save)."""
    cluster, client = fresh_cluster
    n = EPOCHS * STEPS
    # a save moves ps-0's 24 MB while it is killed; join() waits for at least 90 functions of 10 ms as it is
    t = Tracked(client, tmp_path, n, big=3_000_000 if moment == "save" else 0, sleep=0.01 if moment == "join" else 0.004)
    coordinator, manager = t.coordinator, t.manager
    rng = np.random.default_rng()
    kill_epoch = 1
    remotes, saved, save_errors = [], {}, []
    box = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(EPOCHS):
            ks = range(epoch * STEPS, (epoch + 1) * STEPS)
            if epoch == kill_epoch and moment == "scheduling":
                cut = int(rng.integers(STEPS // 4, 3 * STEPS // 4))
                pid = worker_pid(client, "ps-0")  # asked now: the kill itself is one system call
                for k in ks[:cut]:
                    remotes.append(coordinator.schedule(t.step, args=(k,)))
                wait_done(coordinator, epoch * STEPS + int(rng.integers(1, cut // 4)))
                os.kill(pid, signal.SIGKILL)
                # pending now, so pending at the kill: it landed while functions of the epoch were in flight
                box["pending at the kill"] = sum(r.status == "pending" for r in remotes)
                for k in ks[cut:]:
                    remotes.append(coordinator.schedule(t.step, args=(k,)))
            else:
                for k in ks:
                    remotes.append(coordinator.schedule(t.step, args=(k,)))
            if epoch == kill_epoch and moment == "join":
                killer = _kill_when(coordinator, client, "ps-0",
                                    epoch * STEPS + int(rng.integers(5, STEPS // 4)), box)
            coordinator.join()  # README: does not raise when a ps dies
            if epoch == kill_epoch and moment == "join":
                killer.join(5)
                assert "error" not in box, box
                # nothing was scheduled meanwhile: functions pending after the kill were pending at it, so
                # join() was still waiting when it landed
                assert box["pending at the kill"] > 0, box
                wait_for_recovery(coordinator)
                coordinator.join()
            if epoch == kill_epoch and moment == "after_join":
                box["pending at the kill"] = coordinator.summary()["in_flight"]  # join() returned: none
                kill_worker(client, "ps-0")
            if epoch == kill_epoch and moment == "save":
                killer = _kill_when_a_save_starts(client, "ps-0", t.directory, box)
            before = t.sa.numpy() if epoch != kill_epoch else None
            try:
                path = manager.save()
                saved[path] = epoch
            except PSUnavailableError as e:  # README: a save that reaches the lost server raises this
                assert epoch == kill_epoch and moment in ("after_join", "save"), e
                save_errors.append(e)
            if before is not None:
                np.testing.assert_array_equal(t.sa.numpy(), before)  # nothing ran between join and save
            if epoch == kill_epoch and moment == "save":
                killer.join(5)
                assert box.get("killed") and "error" not in box, box
                assert save_errors, "the kill landed after ps-0 had written its part of the save"

    rollbacks = _rollbacks(caught)
    assert len(rollbacks) == 1, [str(w.message) for w in caught]
    text = str(rollbacks[0].message)
    (report,) = coordinator.recoveries
    assert "ps:0" in text, text
    assert report.checkpoint in saved, (report.checkpoint, saved)
    assert report.checkpoint in text, text
    assert set(report.rolled_back) == {"sa", "a"} | ({"big"} if moment == "save" else set()), report
    assert "'sb'" not in text and "'b'" not in text, text

    if moment == "scheduling":
        assert box["pending at the kill"] > 0, box
        # functions scheduled after the kill cannot have finished before it: none of their updates is lost
        scheduled_after = np.arange(kill_epoch * STEPS + cut, (kill_epoch + 1) * STEPS)
        assert (t.sa.numpy()[scheduled_after] >= 1).all(), scheduled_after[t.sa.numpy()[scheduled_after] < 1]
    if moment == "after_join":
        assert box["pending at the kill"] == 0, box
        # every function of the epoch had finished before the kill: all their updates to ps-0 are lost, and
        # none ran again
        epoch_rows = slice(kill_epoch * STEPS, (kill_epoch + 1) * STEPS)
        assert (t.sa.numpy()[epoch_rows] == 0).all() and (t.sb.numpy()[epoch_rows] == 1).all()
        assert report.functions_since == STEPS, report

    # every RemoteValue, from before the loss too, fetches its own value
    assert [r.fetch() for r in remotes] == list(range(n))

    sa, sb = t.sa.numpy(), t.sb.numpy()
    assert (sb >= 1).all(), np.flatnonzero(sb < 1)  # at-least-once: every function ran, ps-1 lost nothing
    assert float(t.b.numpy()) == sb.sum()
    assert float(t.a.numpy()) == sa.sum()  # a and sa live on the same server and move together

    # the rollback target is the latest checkpoint saved before the loss ...
    ck_epoch = saved[report.checkpoint]
    assert ck_epoch == 0, (ck_epoch, saved)  # the latest checkpoint committed before the kill
    ck_sa, ck_sb, ck_a, ck_b = t.restore_local(report.checkpoint)
    covered = (ck_epoch + 1) * STEPS
    assert (ck_sa[:covered] >= 1).all() and (ck_sa[covered:] == 0).all(), "checkpoint is not the epoch's state"
    # ... plus what ran since: rows of the checkpoint's epochs are untouched, later epochs all ran
    np.testing.assert_array_equal(sa[:covered], ck_sa[:covered])
    after = (ck_epoch + 2) * STEPS  # functions of epochs scheduled after the join that recovered
    assert (sa[after:] >= 1).all(), np.flatnonzero(sa[after:] < 1) + after
    lost = np.flatnonzero(sa[covered:] == 0) + covered
    assert report.functions_since is not None
    # no function lost beyond those that finished before the loss, and every lost one was not run again
    assert (sb[lost] == 1).all(), lost[sb[lost] != 1]

    # every committed checkpoint is a real state (never an empty re-created server's)
    for path, epoch in saved.items():
        c_sa, c_sb, c_a, c_b = t.restore_local(path)
        assert (c_sa[:covered if epoch >= ck_epoch else (epoch + 1) * STEPS] >= 1).all(), (path, epoch)
        assert c_a == c_sa.sum() and c_b == c_sb.sum(), path
        assert (c_sb[:(epoch + 1) * STEPS] >= 1).all(), path


@TIMEOUT
def test_warning_counts_every_finished_function_whose_updates_were_lost(fresh_cluster, tmp_path):
    """README: the RollbackWarning says "how many finished functions' updates to them were lost"."""
    cluster, client = fresh_cluster
    n = 600
    t = Tracked(client, tmp_path, n)
    remotes = [t.coordinator.schedule(t.step, args=(k,)) for k in range(200)]
    t.coordinator.join()
    ck = t.manager.save()
    remotes += [t.coordinator.schedule(t.step, args=(k,)) for k in range(200, n)]
    wait_done(t.coordinator, 330)
    kill_worker(client, "ps-0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wait_for_recovery(t.coordinator)
        t.coordinator.join()
    (w,) = _rollbacks(caught)
    (report,) = t.coordinator.recoveries
    assert report.checkpoint == ck
    assert [r.fetch() for r in remotes] == list(range(n))
    sa = t.sa.numpy()
    lost = np.flatnonzero(sa == 0)
    said = f"({len(lost)} scheduled function(s) that reached the lost server finished since it was saved)"
    assert said in str(w.message), f"{len(lost)} finished functions' updates were lost; the warning says: {w.message}"
    assert report.functions_since == len(lost)


@TIMEOUT
def test_a_second_loss_counts_only_what_reached_the_re_created_server(fresh_cluster, tmp_path):
    """ps-0 lost twice with no save between: each warning counts the functions whose updates that loss took."""
    cluster, client = fresh_cluster
    n = 900
    t = Tracked(client, tmp_path, n)
    for k in range(100):
        t.coordinator.schedule(t.step, args=(k,))
    t.coordinator.join()
    t.manager.save()
    counts = []
    for first, last in ((100, 500), (500, n)):
        for k in range(first, last):
            t.coordinator.schedule(t.step, args=(k,))
        wait_done(t.coordinator, first + 150)
        kill_worker(client, "ps-0")
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            wait_for_recovery(t.coordinator, len(counts) + 1)
            t.coordinator.join()
        counts.append(t.coordinator.recoveries[-1].functions_since)
        lost = np.flatnonzero(t.sa.numpy()[:last] == 0)
        assert sum(counts) == len(lost), (counts, len(lost))  # each lost function counted by one loss
    assert (t.sb.numpy() >= 1).all() and counts[1] >= 1


# --------------------------------------------- 2. metrics and optimizers in scheduled functions, across a loss


def _adam_traj(steps, g=1.0, lr=0.05, b1=0.9, b2=0.999, eps=1e-7):
    """Keras 3 Adam on a scalar parameter from 0 with a constant gradient: w after t steps, t = 0..steps."""
    w, m, v, out = 0.0, 0.0, 0.0, [0.0]
    for t in range(1, steps + 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        w = w - alpha * m / (np.sqrt(v) + eps)
        out.append(w)
    return np.array(out)


def _sgd_traj(steps, g=1.0, lr=0.01, mu=0.9):
    w, m, out = 0.0, 0.0, [0.0]
    for _ in range(steps):
        m = mu * m - lr * g
        w = w + m
        out.append(w)
    return np.array(out)


def _steps_of(value, traj, rtol=2e-4):
    """Which step count t gives trajectory value ``value`` (None if none does)."""
    hits = np.flatnonzero(np.isclose(traj, value, rtol=rtol, atol=1e-6))
    return int(hits[0]) if len(hits) else None


@TIMEOUT
def test_metrics_and_optimizers_across_a_loss(fresh_cluster, tmp_path):
    """Adam and SGD-with-momentum, two Means, inside scheduled functions; ps-0 SIGKILLed during training.

    README: the lost server's variables and *their optimizer slots* come back from the checkpoint; a variable
    (or metric) the checkpoint does not hold goes back to its initial value, with fresh slots; the other
    server keeps every update."""
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    n = 450
    with strategy.scope():
        sa = dps.Variable(np.zeros(n), name="sa")  # ps-0
        sb = dps.Variable(np.zeros(n), name="sb")  # ps-1
        with strategy.extended.colocate_vars_with(sa):  # on ps-0, the server we kill
            w_adam = dps.Variable(np.zeros(2, np.float32), name="w_adam")
            w_sgd = dps.Variable(np.zeros(2, np.float32), name="w_sgd")
            w_free = dps.Variable(np.zeros(2, np.float32), name="w_free")  # trained, in no checkpoint
            m_in = dps.metrics.Mean(name="m_in")
            m_out = dps.metrics.Mean(name="m_out")  # in no checkpoint
        with strategy.extended.colocate_vars_with(sb):  # on ps-1, the survivor
            s_adam = dps.Variable(np.zeros(2, np.float32), name="s_adam")
            s_sgd = dps.Variable(np.zeros(2, np.float32), name="s_sgd")
            s_mean = dps.metrics.Mean(name="s_mean")
        adam = dps.optimizers.Adam(0.05)
        sgd = dps.optimizers.SGD(learning_rate=0.01, momentum=0.9)
    for v in (w_adam, w_sgd, w_free):
        assert "task:0" in v.device, v.device
    for v in (s_adam, s_sgd):
        assert "task:1" in v.device, v.device
    for m, task in ((m_in, 0), (m_out, 0), (s_mean, 1)):
        assert all(f"task:{task}" in v.device for v in m.variables), (m.name, [v.device for v in m.variables])
    manager = dps.CheckpointManager(
        dps.Checkpoint(model={"w_adam": w_adam, "w_sgd": w_sgd, "s_adam": s_adam, "s_sgd": s_sgd, "sa": sa,
                              "sb": sb}, adam=adam, sgd=sgd, m_in=m_in, s_mean=s_mean), str(tmp_path))
    coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)
    g = np.ones(2, np.float32)

    def step(k):
        time.sleep(0.004)
        adam.apply_gradients([(g, w_adam), (g, s_adam), (g, w_free)])
        sgd.apply_gradients([(g, w_sgd), (g, s_sgd)])
        m_in.update_state(float(k))
        m_out.update_state(float(k))
        s_mean.update_state(float(k))
        sa.scatter_add(_onehot(k))
        sb.scatter_add(_onehot(k))
        return k

    remotes = [coordinator.schedule(step, args=(k,)) for k in range(150)]
    coordinator.join()
    manager.save()
    sa_ck = sa.numpy()
    remotes += [coordinator.schedule(step, args=(k,)) for k in range(150, 350)]
    box = {}
    killer = _kill_when(coordinator, client, "ps-0", 220, box)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        coordinator.join()
        killer.join(5)
        assert "error" not in box, box
        manager.save()
        remotes += [coordinator.schedule(step, args=(k,)) for k in range(350, n)]
        coordinator.join()
    (w,) = _rollbacks(caught)
    text = str(w.message)
    assert "'m_out" in text and "initial value" in text, text
    assert [r.fetch() for r in remotes] == list(range(n))

    sa_now, sb_now = sa.numpy(), sb.numpy()
    ks = np.arange(n, dtype=np.float64)
    runs_ps0 = sa_now.sum()  # applications that survived on ps-0 (checkpoint + since)
    runs_ps1 = sb_now.sum()  # every application (ps-1 loses nothing)
    post = sa_now - sa_ck  # applied on the re-created ps-0 (the checkpoint held sa_ck)
    assert (post >= 0).all()

    # metrics: the one in the checkpoint is checkpoint + since; the one outside starts again from zero
    assert float(m_in.result()) == pytest.approx((ks * sa_now).sum() / runs_ps0)
    assert float(m_out.result()) == pytest.approx((ks * post).sum() / post.sum())
    assert float(s_mean.result()) == pytest.approx((ks * sb_now).sum() / runs_ps1)

    # optimizers: each variable sits exactly on its optimizer's trajectory at the step count it lived through
    adam_traj, sgd_traj = _adam_traj(n * 2), _sgd_traj(n * 2)
    got = {name: float(v.numpy()[0]) for name, v in
           dict(w_adam=w_adam, s_adam=s_adam, w_free=w_free, w_sgd=w_sgd, s_sgd=s_sgd).items()}
    steps = {name: _steps_of(val, adam_traj if "adam" in name or name == "w_free" else sgd_traj)
             for name, val in got.items()}
    assert steps["s_adam"] == runs_ps1 and steps["s_sgd"] == runs_ps1, (steps, runs_ps1, got)
    assert steps["w_adam"] == runs_ps0 and steps["w_sgd"] == runs_ps0, (steps, runs_ps0, got)
    assert steps["w_free"] == post.sum(), (steps, post.sum(), got)


# ------------------------------------------------------------------- 3. per-worker datasets across a loss


def _stream(ctx):
    i = 0
    while True:
        yield ctx.input_pipeline_id, i
        i += 1


@TIMEOUT
def test_per_worker_iterators_keep_their_position_across_a_loss(fresh_cluster, tmp_path):
    """README: "datasets keep their position"; only functions run again take extra elements."""
    cluster, client = fresh_cluster
    n = 600
    t = Tracked(client, tmp_path, n)
    coordinator = t.coordinator
    it, step = t.reading(_stream, 0.003)
    remotes = [coordinator.schedule(step, args=(k, it)) for k in range(200)]
    coordinator.join()
    t.manager.save()
    remotes += [coordinator.schedule(step, args=(k, it)) for k in range(200, 450)]
    wait_done(coordinator, 280)
    kill_worker(client, "ps-0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wait_for_recovery(coordinator)
        coordinator.join()
        remotes += [coordinator.schedule(step, args=(k, it)) for k in range(450, n)]
        coordinator.join()
    assert len(_rollbacks(caught)) == 1
    values = [r.fetch() for r in remotes]
    reruns = int(t.sb.numpy().sum()) - n
    per_worker = {}
    for pid, i in values:
        per_worker.setdefault(pid, []).append(i)
    assert set(per_worker) <= {0, 1}, per_worker.keys()
    skipped = 0
    for pid, items in per_worker.items():
        assert len(items) == len(set(items)), f"worker {pid} gave an element twice: the iterator restarted?"
        skipped += max(items) + 1 - len(items)
    assert skipped <= reruns, (skipped, reruns)


# --------------------------------------------------------------------------- 4. trainers come and go


def _named_stream(ctx):
    from distributed import get_worker

    name = get_worker().name
    i = 0
    while True:
        yield name, ctx.input_pipeline_id, ctx.num_input_pipelines, i
        i += 1


def _by_trainer(values):
    """{trainer name: [element index, ...]} from (name, id, num, i) elements; checks one id per trainer."""
    per, ids = {}, {}
    for name, pid, _num, i in values:
        per.setdefault(name, []).append(i)
        ids.setdefault(name, set()).add(pid)
    assert all(len(v) == 1 for v in ids.values()), ids
    return per, {k: v.pop() for k, v in ids.items()}


def _trainer_index():
    from distributed import get_worker

    return int(get_worker().name.split("-")[1])


@TIMEOUT
def test_input_pipeline_id_of_trainers_added_by_scale(fresh_cluster):
    """README (Per-worker data): input_pipeline_id is the trainer's index (worker-1 -> 1); num_input_pipelines
    the number of trainers.  So worker-2 reads pipeline 2, and an id is below num_input_pipelines (as in TF,
    where a dataset_fn shards with ds.shard(num_input_pipelines, input_pipeline_id))."""
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    cluster.scale(6)
    client.wait_for_workers(6, timeout=60)
    it = iter(coordinator.create_per_worker_dataset(_named_stream))

    def step(iterator):
        time.sleep(0.01)
        return next(iterator)

    values = coordinator.fetch([coordinator.schedule(step, args=(it,)) for _ in range(600)])
    per, ids = _by_trainer(values)
    nums = {num for _, _, num, _ in values}
    assert {"worker-2", "worker-3"} <= set(per), {k: len(v) for k, v in per.items()}
    assert ids == {name: int(name.split("-")[1]) for name in ids}, (ids, nums)
    assert all(pid < num for _, pid, num, _ in values), (ids, nums)


@TIMEOUT
def test_scale_up_and_retire_a_trainer_during_a_recovery(fresh_cluster, tmp_path):
    """A ps SIGKILLed, then, while it is recovered, a trainer added with cluster.scale and another retired
    with client.retire_workers: join() returns, every function ran, ps-1 kept everything."""
    cluster, client = fresh_cluster
    n = 700
    t = Tracked(client, tmp_path, n, sleep=0.006)
    coordinator = t.coordinator
    sa, sb = t.sa, t.sb
    it, step = t.reading(_named_stream, 0.006)
    remotes = [coordinator.schedule(step, args=(k, it)) for k in range(100)]
    coordinator.join()
    t.manager.save()
    remotes += [coordinator.schedule(step, args=(k, it)) for k in range(100, n)]
    wait_done(coordinator, 180)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kill_worker(client, "ps-0")
        cluster.scale(5)  # + worker-2
        wait_for_worker(client, "worker-2", None)
        client.retire_workers([worker_address(client, "worker-0")], close_workers=True)
        wait_for_recovery(coordinator)
        coordinator.join()
    (warning,) = _rollbacks(caught)
    rerun = int(re.search(r"(\d+) function\(s\) that failed or were cancelled by the loss run again",
                          str(warning.message)).group(1))
    per, ids = _by_trainer(r.fetch() for r in remotes)
    assert (sb.numpy() >= 1).all()
    for name, items in per.items():
        assert len(items) == len(set(items)), name
    # The newcomer built its own dataset (its elements carry its name) and read it from 0: every element
    # went to a function that reported, or to one that failed on the lost server and ran again (a batch
    # Dask moved to it from the retired trainer can start before the restore is done, and fail there).
    assert "worker-2" in per, {k: len(v) for k, v in per.items()}
    assert max(per["worker-2"]) < len(per["worker-2"]) + rerun, (sorted(per["worker-2"])[:10], rerun)
    lost = np.flatnonzero(sa.numpy() == 0)
    (report,) = coordinator.recoveries
    # only functions that finished before the loss, each once, and the warning counted them
    assert len(lost) == report.functions_since and (sb.numpy()[lost] == 1).all(), (lost, report)


@TIMEOUT
@pytest.mark.filterwarnings("ignore::daskps.errors.RollbackWarning")  # expected; other tests check its text
def test_remote_values_from_before_the_loss_fetch_after_it(fresh_cluster, tmp_path):
    cluster, client = fresh_cluster
    t = Tracked(client, tmp_path, 300)
    coordinator = t.coordinator
    early = [coordinator.schedule(t.step, args=(k,)) for k in range(50)]
    coordinator.join()
    t.manager.save()
    pending = [coordinator.schedule(t.step, args=(k,)) for k in range(50, 300)]
    wait_done(coordinator, 90)
    kill_worker(client, "ps-0")
    # fetch before join(): a pending function's value arrives once it (re)ran, no error
    assert pending[-1].fetch() == 299
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        wait_for_recovery(coordinator)
        coordinator.join()
    assert [r.fetch() for r in early] == list(range(50))
    assert [r.fetch() for r in pending] == list(range(50, 300))
    assert coordinator.fetch(early + pending) == list(range(300))


# ------------------------------------------------------------------------- 6. "What is lost, exactly"


@TIMEOUT
def test_coordinator_reads_during_a_recovery_never_see_a_wrong_value(fresh_cluster, tmp_path):
    """README: a read of the lost server before the recovery is done raises PSUnavailableError; join() waits
    for a recovery under way.  So a read made meanwhile either raises that or gives the restored value: never
    the empty re-created server's initial value.  Reads of the surviving server are not lost updates."""
    cluster, client = fresh_cluster
    t = Tracked(client, tmp_path, 10)
    for k in range(10):
        t.coordinator.schedule(t.step, args=(k,))
    t.coordinator.join()
    t.manager.save()
    t.a.assign(1000.0)  # after the checkpoint: lost
    seen_a, seen_b, errors = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kill_worker(client, "ps-0")
        def read_both():
            try:
                seen_a.append(float(t.a.numpy()))
            except PSUnavailableError as e:
                errors.append(e)
            seen_b.append(float(t.b.numpy()))
            return t.coordinator.recoveries and len(seen_a) >= 3

        wait_until(read_both, 60, failure=lambda: f"recoveries {t.coordinator.recoveries}, a read {seen_a}",
                   interval=0, collect=False)
        t.coordinator.join()
    assert len(_rollbacks(caught)) == 1
    assert errors, "no read reached the lost server before the recovery"  # the scenario happened
    assert all("ps:0" in str(e) for e in errors), errors
    assert set(seen_a) <= {10.0}, sorted(set(seen_a))
    assert set(seen_b) == {10.0}
    assert float(t.a.numpy()) == 10.0


@TIMEOUT
def test_an_object_only_trainers_held_raises_lookup_error_after_the_loss(fresh_cluster, tmp_path):
    """README: an object that only trainers still held is not made again, and using it raises LookupError.
    The recovery itself still succeeds and the rest trains on."""
    import gc

    cluster, client = fresh_cluster
    t = Tracked(client, tmp_path, 400)
    coordinator = t.coordinator
    with t.strategy.scope(), t.strategy.extended.colocate_vars_with(t.sa):
        orphan = dps.Variable(5.0, name="orphan")  # ps-0
    assert "task:0" in orphan.device

    def stash(v):
        import builtins

        if not hasattr(builtins, "readme_test_cache"):
            builtins.readme_test_cache = v
        time.sleep(0.01)
        return os.getpid()

    for _ in range(40):
        coordinator.schedule(stash, args=(orphan,))
    coordinator.join()
    del orphan
    gc.collect()
    for k in range(20):
        coordinator.schedule(t.step, args=(k,))
    coordinator.join()
    t.manager.save()

    def use():
        import builtins

        v = getattr(builtins, "readme_test_cache", None)
        if v is None:
            return None
        v.assign_add(1.0)
        return float(v.numpy())

    got = coordinator.fetch([coordinator.schedule(use) for _ in range(10)])
    coordinator.join()
    assert any(g is not None for g in got) and all(g is None or g >= 6.0 for g in got), got  # kept alive
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kill_worker(client, "ps-0")
        for k in range(20, 200):
            coordinator.schedule(t.step, args=(k,))
        coordinator.join()
    assert len(_rollbacks(caught)) == 1, [str(w.message) for w in caught]
    assert (t.sb.numpy()[:200] >= 1).all()
    for _ in range(10):
        coordinator.schedule(use)
    with pytest.raises(LookupError, match=r"ps task 0 (no longer holds|\(it was released\))"):  # the server's, not any KeyError
        coordinator.join()
    for k in range(200, 220):  # the coordinator works normally afterwards
        coordinator.schedule(t.step, args=(k,))
    coordinator.join()


@TIMEOUT
def test_a_function_that_failed_part_way_runs_again_in_full(fresh_cluster, tmp_path):
    """README: "A function that failed part-way may have applied its updates on the surviving servers before
    it failed; it runs again in full".  Each function updates ps-1 first, then reads ps-0 (which fails on the
    loss), then updates ps-0: the rerun must apply both again."""
    cluster, client = fresh_cluster
    n = 700
    t = Tracked(client, tmp_path, n)
    sa, sb = t.sa, t.sb

    def step(k):
        sb.scatter_add(_onehot(k))
        _ = sb.sparse_read(np.array([k]))  # sends the push to ps-1 now
        time.sleep(0.004)
        _ = sa.sparse_read(np.array([k]))  # a round trip to ps-0
        sa.scatter_add(_onehot(k))
        return k

    for k in range(100):
        t.coordinator.schedule(step, args=(k,))
    t.coordinator.join()
    t.manager.save()
    remotes = [t.coordinator.schedule(step, args=(k,)) for k in range(100, n)]
    wait_done(t.coordinator, 160)
    kill_worker(client, "ps-0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wait_for_recovery(t.coordinator)
        t.coordinator.join()
    (w,) = _rollbacks(caught)
    assert [r.fetch() for r in remotes] == list(range(100, n))
    sa_v, sb_v = sa.numpy(), sb.numpy()
    rerun = np.flatnonzero(sb_v >= 2)
    assert len(rerun) >= 1, "no function was caught part-way"
    # a function run again ran in full the second time: its ps-0 update is there
    assert (sa_v[rerun] >= 1).all(), rerun[sa_v[rerun] < 1]
    assert (sb_v >= 1).all()


# ------------------------------------------------------------------------------------ 7. the demo


def test_demo_kill_ps_flag_reaches_the_demo(monkeypatch):
    """README: `daskps demo --kill-ps-in-epoch 2` SIGKILLs ps-0 part-way through epoch 2.  That the demo then recovers and
    trains on is tested with a real kill in test_demo.py::test_demo_survives_a_killed_parameter_server (run_demo
    with kill_ps_at_epoch=2); here, that the command's flag is what sets it."""
    from daskps import cli

    got = []
    monkeypatch.setattr(cli, "run_demo", lambda config: got.append(config) or {"epochs_trained": 0})
    assert cli.main(["demo", "--kill-ps-in-epoch", "2"]) == 0
    assert cli.main(["demo", "--kill-ps", "3"]) == 0  # the older spelling still works
    assert cli.main(["demo"]) == 0
    assert [c.kill_ps_at_epoch for c in got] == [2, 3, None]


def test_demo_help_shows_every_default_and_what_the_kill_flag_takes(capsys):
    from daskps import cli

    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--kill-ps-in-epoch EPOCH, --kill-ps EPOCH" in out and "an epoch number" in out
    for default in ("(default: 6)", "(default: 120)", "(default: daskps-demo-checkpoints)", "(default: numpy)"):
        assert default in out, default
