"""ClusterCoordinator: scheduling, joining, fetching and the error contract."""

import threading
import time

import numpy as np
import pytest
from distributed import Client, Event

import daskps as dps
from daskps.errors import CancelledError, ClosedError, PSUnavailableError
from daskps.scheduler.messages import BATCH_TOPIC_PREFIX, LOST
from tests.helpers.cluster import kill_worker, wait_for_worker, worker_address
from tests.helpers.waiting import wait_until


def _sized(n):
    return np.arange(n, dtype=np.float64)


def test_results_too_big_for_an_event_come_back_with_their_batch(coordinator):
    """Results over 64 KiB travel as the batch task's result, small ones in the events: each reaches its
    own RemoteValue, whichever way it came, in one batch."""
    sizes = [100_000, 3, 20_000, 5]  # 800 KB and 160 KB (too big for an event), and two small ones
    with coordinator.hold():  # one pump sees them all: they share batches
        remotes = [coordinator.schedule(_sized, args=(n,)) for n in sizes]
    coordinator.join()
    for n, remote in zip(sizes, remotes):
        np.testing.assert_array_equal(remote.fetch(), np.arange(n, dtype=np.float64))


def _a_lock():
    return threading.Lock()


def test_a_result_that_cannot_be_pickled_fails_its_function_with_type_error(coordinator):
    remote = coordinator.schedule(_a_lock)
    with pytest.raises(TypeError) as err:
        coordinator.join()
    assert str(err.value) == "the result of a scheduled function cannot be pickled: cannot pickle '_thread.lock' object"
    with pytest.raises(TypeError, match="cannot be pickled"):
        remote.fetch()
    assert coordinator.schedule(lambda: 7).fetch() == 7  # raised once: the coordinator goes on


def _described(a, plain, *, b, c=None):
    return a, plain, b, c


def test_a_function_gets_its_keyword_arguments_and_per_worker_values_in_either(coordinator, strategy):
    n = len(strategy.trainer_names)
    values = dps.PerWorkerValues([f"value of worker {i}" for i in range(n)])
    remote = coordinator.schedule(_described, args=(values, "plain"), kwargs={"b": values, "c": [1, (2, 3)]})
    a, plain, b, c = remote.fetch()
    assert a in {f"value of worker {i}" for i in range(n)} and b == a  # the same worker's value, either way
    assert plain == "plain" and c == [1, (2, 3)]  # the rest as given


def _durations_seen(dask_scheduler=None, forget=False):
    """Every function duration the scheduler's plugin holds, per trainer (the dashboard's percentiles);
    ``forget`` empties them first (each trainer keeps its latest 2,000: once earlier tests filled that,
    what a test added cannot be told by position)."""
    from daskps.scheduler.messages import PLUGIN_NAME

    durations = dask_scheduler.plugins[PLUGIN_NAME].telemetry.timeline.durations
    if forget:
        durations.clear()
    return {t: list(d) for t, d in durations.items()}


def test_each_function_reports_how_long_it_ran(coordinator, client):
    assert client.run_on_scheduler(_durations_seen, forget=True) == {}
    for _ in range(4):
        coordinator.schedule(time.sleep, args=(0.25,))
    coordinator.join()
    def durations():  # the reports reach the plugin through the scheduler
        return [s for d in client.run_on_scheduler(_durations_seen).values() for s in d]

    wait_until(lambda: len(durations()) >= 4, 30, failure=lambda: durations(), collect=False)
    new = durations()
    assert len(new) == 4 and all(0.25 <= s < 2.0 for s in new), new


def test_one_coordinator_per_strategy(strategy):
    c1 = dps.ClusterCoordinator(strategy)
    assert dps.ClusterCoordinator(strategy) is c1
    assert c1.strategy is strategy


def test_coordinator_needs_a_strategy():
    with pytest.raises(TypeError, match="strategy"):
        dps.ClusterCoordinator(object())


def _wait_for(event_name):
    Event(event_name).wait()
    return "released"


def test_schedule_returns_at_once(coordinator, client):
    gate = Event("daskps-test-gate", client=client)
    remote = coordinator.schedule(_wait_for, args=("daskps-test-gate",))
    # schedule came back while the function is still blocked on the event
    assert isinstance(remote, dps.RemoteValue)
    assert not coordinator.done()
    gate.set()
    coordinator.join()
    assert coordinator.done()
    assert remote.fetch() == "released"


def test_scheduled_functions_update_ps_variables(strategy, coordinator):
    with strategy.scope():
        v = dps.Variable(0.0)

    def step():
        v.assign_add(1.0)
        return v.read_value()

    remotes = [coordinator.schedule(step) for _ in range(20)]
    coordinator.join()
    assert float(v.numpy()) == 20.0
    assert sorted(float(r.fetch()) for r in remotes)[-1] == 20.0


def test_schedule_runs_on_training_workers_only(strategy, coordinator, client):
    from distributed import get_worker

    names = coordinator.fetch([coordinator.schedule(lambda: get_worker().name) for _ in range(10)])
    assert set(names) <= {"worker-0", "worker-1"}


def test_fetch_keeps_nested_structure(strategy, coordinator):
    with strategy.scope():
        v = dps.Variable([1.0, 2.0])
    a = coordinator.schedule(lambda: 1)
    b = coordinator.schedule(lambda: {"x": np.arange(3)})
    out = coordinator.fetch({"a": [a, (b, "plain")], "v": v, "n": 5})
    assert out["a"][0] == 1
    np.testing.assert_array_equal(out["a"][1][0]["x"], np.arange(3))
    assert out["a"][1][1] == "plain"
    np.testing.assert_array_equal(out["v"], [1.0, 2.0])
    assert out["n"] == 5
    assert a.get() == 1


def test_remote_value_argument_is_refused(coordinator):
    remote = coordinator.schedule(lambda: 1)
    with pytest.raises(ValueError, match="RemoteValue"):
        coordinator.schedule(lambda x: x, args=(remote,))
    with pytest.raises(ValueError, match="RemoteValue"):
        coordinator.schedule(lambda x: x, kwargs={"x": [remote]})
    coordinator.join()


def test_non_callable_is_refused(coordinator):
    with pytest.raises(TypeError, match="fn must be callable"):
        coordinator.schedule(42)
    with pytest.raises(TypeError, match="args"):
        coordinator.schedule(print, args=5)
    with pytest.raises(TypeError, match="kwargs"):
        coordinator.schedule(print, kwargs=[1])


def test_unpicklable_function_is_refused_with_its_name(coordinator):
    guard = threading.Lock()

    def step():
        with guard:
            return 1

    with pytest.raises(TypeError, match="'guard' captured by"):
        coordinator.schedule(step)
    with pytest.raises(TypeError, match=r"args.*\[1\]|\[1\]"):
        coordinator.schedule(lambda a, b: 1, args=(1, threading.Lock()))
    assert coordinator.done()


class Boom(Exception):
    pass


def _fail_after(delay, tag):
    time.sleep(delay)
    raise Boom(tag)


def test_first_error_is_raised_once_and_pending_functions_cancelled(coordinator):
    first = coordinator.schedule(_fail_after, args=(0.0, "first"))
    slow = [coordinator.schedule(time.sleep, args=(0.3,)) for _ in range(6)]
    with pytest.raises(Boom, match="first"):
        coordinator.join()
    with pytest.raises(Boom, match="first"):
        first.fetch()
    cancelled = 0
    for remote in slow:
        try:
            remote.fetch()
        except CancelledError:
            cancelled += 1
    assert cancelled >= 1
    # raised once: the coordinator is clean again and works normally
    coordinator.join()
    assert coordinator.done()
    assert coordinator.schedule(lambda: 7).fetch() == 7


def _slow_counted(runs, i):
    time.sleep(0.2)
    runs.scatter_add(dps.IndexedSlices(np.ones(1, np.int64), np.array([i])))


def test_a_batch_already_running_stops_at_its_next_function_once_cancelled(strategy, coordinator):
    """The first error cancels what is left, including the batch another trainer is running: it starts
    no function after the cancellation reaches it."""
    with strategy.scope():
        runs = dps.Variable(np.zeros(80, np.int64), name="runs")
    with coordinator.hold():  # one pump, durations unknown: a batch of 40 (the first 40) and one of 20, a trainer each
        first = coordinator.schedule(_fail_after, args=(0.3, "first"))
        for i in range(1, 80):
            coordinator.schedule(_slow_counted, args=(runs, i))
    with pytest.raises(Boom, match="first"):
        coordinator.join()
    seen = {"ran": np.flatnonzero(runs.numpy()), "still": 0}

    def settled():  # no function has run for 1 s (had the other batch gone on: all 20, 0.2 s each)
        now = np.flatnonzero(runs.numpy())
        seen["still"] = seen["still"] + 1 if len(now) == len(seen["ran"]) else 0
        seen["ran"] = now
        return seen["still"] >= 10

    wait_until(settled, 30, failure=lambda: f"functions kept running: {seen['ran']}", interval=0.1, collect=False)
    ran = seen["ran"]
    assert all(40 <= i < 60 for i in ran), ran  # the failing batch started nothing after its error
    assert 1 <= len(ran) <= 10, f"the other batch ran {len(ran)} of its 20 functions, most after the cancellation"
    with pytest.raises(Boom, match="first"):
        first.fetch()


def _fail_when_set(event_name, tag):
    Event(f"{event_name}-started").set()
    Event(event_name).wait(60)
    Event(f"{event_name}-raised").set()
    raise Boom(tag)


def _fail_once_set(event_name, tag):
    assert Event(event_name).wait(30), "the other function never started"
    raise Boom(tag)


def test_first_error_wins(coordinator, client):
    import uuid

    name = f"daskps-late-failure-{uuid.uuid4().hex}"
    with coordinator.hold():  # one batch each: the late one is running when the early one fails
        coordinator.schedule(_fail_once_set, args=(f"{name}-started", "early"))
        coordinator.schedule(_fail_when_set, args=(name, "late"))
    with pytest.raises(Boom, match="early"):
        coordinator.join()
    token = coordinator.strategy.token[:8]

    def batches(dask_scheduler):  # this coordinator's batches the scheduler still knows
        return [key for key in dask_scheduler.tasks if key.startswith("daskps-batch-") and key.endswith(token)]

    # join() cancels them as it raises; the scheduler forgets them
    wait_until(lambda: not client.run_on_scheduler(batches), 30,
               failure="the late function's batch was never cancelled", interval=0.01, collect=False)
    Event(name, client=client).set()  # the second failure comes after the first was raised: not raised again
    assert Event(f"{name}-raised", client=client).wait(30), "the late function never raised"

    topic = f"{BATCH_TOPIC_PREFIX}{coordinator.strategy.token}"  # where this coordinator's trainers report

    def reported():  # this coordinator's functions whose reports reached the scheduler (its event log)
        return {row[0] for _, (key, rows, *_) in client.get_events(topic) if key != LOST for row in rows}

    # the second scheduled (ids count from 0)
    wait_until(lambda: 1 in reported(), 30,
               failure="the late function's report never reached the scheduler", interval=0.01, collect=False)
    (late_batch, reported_at), = [(key, at) for at, (key, rows, *_) in client.get_events(topic)
                                  if key != LOST and any(row[0] == 1 for row in rows)]

    def forgotten_at(dask_scheduler):  # when the scheduler forgot the late function's batch (cancelled)
        return [t[-1] for t in dask_scheduler.story(late_batch) if t[0] == late_batch and t[2] == "forgotten"]

    (forgotten,) = client.run_on_scheduler(forgotten_at)
    assert forgotten < reported_at, "the late function reported before its batch was cancelled"

    def kept(dask_scheduler):  # a cancelled batch never runs again: its late report is not kept
        return late_batch in dask_scheduler.plugins["daskps"].reports.reported

    assert not client.run_on_scheduler(kept)
    # its report goes to the coordinator before this one's (one stream, in order): then it has been seen
    assert coordinator.schedule(int, args=("7",)).fetch() == 7
    assert coordinator.done()  # raises a pending error, if the late one had been kept
    coordinator.join()
    summary = coordinator.summary()
    assert (summary["failed"], summary["last_error"]) == (1, "Boom('early')"), summary


def test_error_surfaces_from_schedule(coordinator):
    coordinator.schedule(_fail_after, args=(0.0, "x"))
    with pytest.raises(Boom):  # scheduling goes on until a call raises the error
        wait_until(lambda: coordinator.schedule(time.sleep, args=(0.05,)) is None, 30, collect=False)
    coordinator.join()


def test_error_surfaces_from_done(coordinator):
    coordinator.schedule(_fail_after, args=(0.0, "d"))
    with pytest.raises(Boom):  # done() is asked until it raises the error
        wait_until(lambda: coordinator.done() is None, 30, interval=0.02, collect=False)
    assert coordinator.done()


def test_worker_death_reruns_closures(fresh_cluster):
    """At-least-once: a killed worker's functions run again elsewhere; join succeeds."""
    import os

    from distributed import get_worker

    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    with strategy.scope():
        count = dps.Variable(0)

    def step():
        time.sleep(0.05)
        count.assign_add(1)
        return get_worker().get_current_task(), os.getpid()  # its batch, and the process that ran it

    with coordinator.hold():  # one pump sees all 60: two batches of 30 (1.5 s each), one per trainer
        remotes = [coordinator.schedule(step) for _ in range(60)]
    victim = client.run(os.getpid, workers=[worker_address(client, "worker-0")])
    (victim,) = victim.values()
    wait_until(lambda: any((r.status == 'finished' and r.fetch()[1] == victim for r in remotes)), 60,
               failure="worker-0 never finished a function", interval=0.01, collect=False)
    old = kill_worker(client, "worker-0")  # part-way through its batch
    coordinator.join()
    ran = [r.fetch() for r in remotes]
    by_batch = {}
    for batch, pid in ran:
        by_batch.setdefault(batch, set()).add(pid)
    (killed,) = [pids for pids in by_batch.values() if victim in pids]
    # the killed worker's batch: some functions reported from it, the rest ran again in another process
    assert len(killed) == 2, by_batch
    assert int(count.numpy()) >= 60
    wait_for_worker(client, "worker-0", old)


def test_ps_death_raises_ps_unavailable(fresh_cluster):
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    with strategy.scope():
        a = dps.Variable(1.0, name="a")  # ps-0
        b = dps.Variable(2.0, name="b")  # ps-1
        c = dps.Variable(3.0, name="c")  # ps-0, held here only: the function below does not use it
    old = kill_worker(client, "ps-0")
    with pytest.raises(PSUnavailableError, match="ps:0"):
        for _ in range(100):
            a.numpy()
            time.sleep(0.1)
    assert float(b.numpy()) == 2.0
    coordinator.schedule(lambda: a.assign_add(1.0))
    with pytest.raises(PSUnavailableError) as lost:
        coordinator.join()
    # the trainer knew of `a` only: the coordinator names all that this process held on the lost server
    assert "ps:0" in str(lost.value) and "It held 'a', 'c': their values are lost." in str(lost.value)
    assert c.shape == ()
    wait_for_worker(client, "ps-0", old)
    with pytest.raises(PSUnavailableError):
        a.numpy()


def test_a_variable_made_outside_the_scope_is_refused(strategy, coordinator):
    local = dps.Variable([0.0], name="local_w")
    loss = dps.metrics.Mean(name="loss")  # also outside the scope: its state is local
    with pytest.raises(ValueError, match=r"'local_w' was created outside strategy.scope\(\)") as raised:
        coordinator.schedule(lambda: local.assign_add([1.0]))
    # the message first: no internal error chained before it (a cache lookup's KeyError once was)
    assert raised.value.__context__ is None and raised.value.__cause__ is None
    with pytest.raises(ValueError, match="outside strategy.scope"):
        coordinator.schedule(lambda x: loss.update_state(x), args=(1.0,))
    with pytest.raises(ValueError, match="outside strategy.scope"):
        coordinator.schedule(lambda v: v.numpy(), args=(local,))
    assert local.numpy().tolist() == [0.0] and coordinator.done()


def test_after_client_close_the_error_says_so(cluster):
    client = Client(cluster)
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        v = dps.Variable(1.0)
    client.close()
    with pytest.raises(ClosedError, match="client"):
        v.numpy()
    with pytest.raises(ClosedError, match="client"):
        v.assign(2.0)


def test_ps_unavailable_says_what_happened_and_what_was_lost(fresh_cluster):
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        w = dps.Variable(1.0, name="w")  # ps-0
        b = dps.Variable(2.0, name="b")  # ps-1
        table = dps.Variable(np.zeros(3), name="table")  # ps-0
    for fut in strategy.group.futures[1:]:
        fut.release()  # ps-1's actor goes while its worker stays up
    with pytest.raises(PSUnavailableError, match=r"ps:1 .*actor is gone.*'b'") as lost:
        for _ in range(100):
            b.numpy()
            time.sleep(0.1)
    assert "'w'" not in str(lost.value)
    kill_worker(client, "ps-0")
    with pytest.raises(PSUnavailableError, match=r"ps:0 .*cannot be reached.*'table', 'w'"):
        for _ in range(100):
            w.numpy()
            time.sleep(0.1)
    assert table.shape == (3,)  # held until here: the message names what is held


def _counted_step(runs, i):
    time.sleep(0.01)
    runs.scatter_add(dps.IndexedSlices(np.ones(1, np.int64), np.array([i])))
    return i


def test_three_trainer_kills_lose_no_value_and_rerun_little(fresh_cluster):
    """A function whose result reached the coordinator never runs again; every value arrives."""
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    n = 1500
    with strategy.scope():
        runs = dps.Variable(np.zeros(n, np.int64), name="runs")  # runs[i]: how many times function i ran
    remotes = [coordinator.schedule(_counted_step, args=(runs, i)) for i in range(n)]
    snapshots = []  # before each kill: the functions reported so far, and how many times each had run
    for k in range(3):
        while coordinator.summary()["done"] < 300 * (k + 1):
            time.sleep(0.05)
        reported = [i for i, r in enumerate(remotes) if r.status == "finished"]
        snapshots.append((reported, runs.numpy()[reported]))  # a reported function's update is applied
        name = f"worker-{k % 2}"
        wait_for_worker(client, name, kill_worker(client, name))
    coordinator.join()
    assert [r.fetch() for r in remotes] == list(range(n))
    got = runs.numpy()
    for reported, then in snapshots:
        again = [i for i, t in zip(reported, then) if got[i] != t]
        assert not again, f"functions whose result had reached the coordinator ran again: {again}"
    extra = int(got.sum()) - n
    assert 0 <= extra < 75, f"{extra} extra runs"


def _early_and_batch():
    from distributed import get_worker

    return "early", get_worker().get_current_task()


def _released_and_batch(event_name):
    from distributed import get_worker

    Event(event_name).wait(60)
    return "released", get_worker().get_current_task()


def test_results_reach_the_coordinator_before_the_batch_ends(strategy, coordinator, client):
    import uuid

    name = f"daskps-batch-gate-{uuid.uuid4().hex}"
    with coordinator.hold():  # queued together, durations unknown: batches of 4 (the first with it) and 3
        first = coordinator.schedule(_early_and_batch)
        blocked = [coordinator.schedule(_released_and_batch, args=(name,)) for _ in range(6)]
    got: list = []
    fetching = threading.Thread(target=lambda: got.append(first.fetch()), daemon=True)
    fetching.start()
    fetching.join(20)
    arrived, pending = bool(got), [b.status for b in blocked]
    Event(name, client=client).set()
    coordinator.join()
    assert arrived and got[0][0] == "early", "the first result came only when its batch ended"
    assert pending == ["pending"] * 6  # every function after it still waited when it came
    batches = [b.fetch() for b in blocked]
    assert {r for r, _ in batches} == {"released"}
    assert got[0][1] in {key for _, key in batches}  # it shared its batch with functions still waiting


def _fails_on(i):
    if i < 0:
        raise ValueError(f"function {i} fails")
    return i


def test_finished_functions_are_counted_once_each_by_the_servers_they_knew(coordinator):
    """What a recovery reads to tell how many functions finished since a save: each one that returned, once,
    under generation 0 (no server re-created yet); one that raised is not counted."""
    remotes = [coordinator.schedule(_fails_on, args=(i,)) for i in range(7)]
    coordinator.join()
    assert [r.fetch() for r in remotes] == list(range(7))
    assert dict(coordinator.finished_by_generation()) == {0: 7}
    coordinator.schedule(_fails_on, args=(-1,))
    with pytest.raises(ValueError, match="function -1 fails"):
        coordinator.join()
    assert dict(coordinator.finished_by_generation()) == {0: 7}
