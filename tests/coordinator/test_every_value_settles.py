"""Edge cases of the batched coordinator: every RemoteValue settles (errors, big results, kills, restarts, interrupts)."""

import os
import signal
import threading
import time

import numpy as np
import pytest
from distributed import Event, Variable

import daskps as dps
from tests.helpers.cluster import PickySGD, kill_worker, wait_for_summary, wait_for_worker
from tests.helpers.waiting import in_thread, wait_until

pytestmark = pytest.mark.cluster  # every test here starts a cluster or a process


def _boom():
    raise ValueError("boom")


def _ok(i):
    return i


class _LockedStep:
    """A step object that holds a lock: it cannot go to a trainer."""

    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self):
        return 1


def test_each_thread_waiting_for_a_result_is_counted_until_it_has_it(coordinator, client):
    """A function that finishes wakes the threads waiting in ``fetch()`` only while they are counted: two
    waiting at once are both counted, and none once both have their values."""
    import uuid

    tag = uuid.uuid4().hex

    def gated(i):
        Event(f"go-{tag}").wait(30)
        return i

    values = [coordinator.schedule(gated, args=(i,)) for i in range(2)]
    got: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, values[i].fetch()), daemon=True)
               for i in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: coordinator.fetching == 2, 10,
               failure=lambda: f"threads counted waiting: {coordinator.fetching}, not 2", interval=0.005, collect=False)
    assert all(v.status == "pending" for v in values)  # both threads are waiting, neither has its value
    Event(f"go-{tag}", client=client).set()
    for t in threads:
        t.join(30)
    assert got == {0: 0, 1: 1}
    assert coordinator.fetching == 0


def _first_fails(i):
    if i == 0:
        raise ValueError(f"function {i} failed")
    return i


def test_the_functions_after_a_failure_in_its_batch_are_counted_cancelled_without_join(coordinator):
    """A batch stops at its first failure: the functions after it never run, and are counted cancelled as the
    batch ends (not only when join() raises); nothing stays pending."""
    with coordinator.hold():  # all six queued before the coordinator makes batches: the first holds 0, 1, 2
        remotes = [coordinator.schedule(_first_fails, args=(i,)) for i in range(6)]
    wait_for_summary(coordinator, lambda s: s["in_flight"] == 0, 30)
    s = coordinator.summary()
    assert (s["done"], s["failed"], s["cancelled"], s["in_flight"]) == (3, 1, 2, 0)
    assert [r.status for r in remotes] == ["error", "cancelled", "cancelled", "finished", "finished", "finished"]
    with pytest.raises(dps.errors.CancelledError):
        remotes[1].fetch()
    with pytest.raises(ValueError, match="function 0 failed"):  # the first error, once
        coordinator.join()
    assert coordinator.summary()["cancelled"] == 2


def test_schedule_refuses_what_cannot_go_to_a_trainer_word_for_word(coordinator):
    """Each refusal says what was wrong and where, before anything runs."""
    remote = coordinator.schedule(int, args=("3",))
    with pytest.raises(ValueError) as info:
        coordinator.schedule(print, args=([remote],))
    assert str(info.value) == ("args contains a RemoteValue; using the output of one scheduled function as input "
                               "of another is not supported: fetch() it first")
    dataset = coordinator.create_per_worker_dataset(lambda: iter(range(3)))
    with pytest.raises(TypeError) as info:
        coordinator.schedule(print, kwargs={"data": [1, dataset]})
    assert str(info.value) == ("kwargs['data'][1] is a PerWorkerDataset; pass iter(dataset) instead: a scheduled "
                               "function takes its iterator, and next(iterator) inside the function gives that "
                               "trainer's next element")
    with pytest.raises(TypeError) as info:
        coordinator.schedule(print, args={"a": 1})
    assert str(info.value) == "args must be a tuple or list, got dict"
    with pytest.raises(TypeError) as info:
        coordinator.schedule(print, kwargs=[1])
    assert str(info.value) == "kwargs must be a dict, got list"
    with pytest.raises(TypeError) as info:
        coordinator.schedule(_LockedStep())
    assert str(info.value) == ("cannot pickle attribute 'lock' of the function '_LockedStep' (a _thread.lock): "
                               "TypeError: cannot pickle '_thread.lock' object")
    coordinator.join()
    assert remote.fetch() == 3


def _batch_keys(token, dask_scheduler=None):
    return sorted(k for k in dask_scheduler.tasks if k.startswith("daskps-batch-") and k.endswith(token[:8]))


def test_cancel_stops_the_dask_task_of_a_running_batch_at_once(client):
    """``cancel()`` cancels the Dask task of a batch that is running (the scheduler forgets it while its
    function still runs) and the rest of that batch never starts."""
    import uuid

    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    tag = uuid.uuid4().hex
    ran = Variable(f"ran-{tag}", client=client)
    ran.set(0)

    def blocked():
        Event(f"started-{tag}").set()
        Event(f"go-{tag}").wait(30)

    def count():
        ran.set(ran.get() + 1)

    for _ in range(20):  # the first batches are one function per trainer: the rest are queued
        coordinator.schedule(blocked)
    assert Event(f"started-{tag}", client=client).wait(10), "no function started"
    assert client.run_on_scheduler(_batch_keys, strategy.token)
    assert coordinator.cancel() == 20
    # while the functions still wait for "go"
    wait_until(lambda: not client.run_on_scheduler(_batch_keys, strategy.token), 10,
               failure="the running batches' Dask tasks were not cancelled", interval=0.02, collect=False)
    Event(f"go-{tag}", client=client).set()
    coordinator.schedule(count)
    coordinator.join()
    assert ran.get() == 1
    strategy.close()


def test_a_batch_cancelled_outside_the_coordinator_fails_its_functions_with_cancelled_error(client):
    """Its Dask task cancelled by another hand (``client.cancel(..., force=True)``, as ``client.restart()``
    does): every function of the batch fails with ``CancelledError`` saying so, and the others run."""
    import uuid

    from distributed import Future

    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    tag = uuid.uuid4().hex

    def blocked():
        Event(f"started-{tag}").set()
        Event(f"go-{tag}").wait(30)
        return "ran"

    first = coordinator.schedule(blocked)
    assert Event(f"started-{tag}", client=client).wait(10), "the function never started"
    [key] = client.run_on_scheduler(_batch_keys, strategy.token)
    client.cancel([Future(key, client)], force=True)
    with pytest.raises(dps.errors.CancelledError) as info:
        first.fetch()
    assert str(info.value) == (f"the Dask task of batch {key!r} was cancelled outside the coordinator "
                               "(client.restart() or client.cancel()); its functions did not all run")
    Event(f"go-{tag}", client=client).set()
    with pytest.raises(dps.errors.CancelledError):
        coordinator.join()  # the error, once
    later = coordinator.schedule(lambda: "after")
    coordinator.join()
    assert later.fetch() == "after"
    assert coordinator.summary()["failed"] == 1
    strategy.close()


def test_the_coordinator_counts_a_trainer_that_joins_while_work_is_queued(tmp_path):
    """Workers come and go: while functions are queued, the coordinator asks the scheduler how many
    trainers hold the trainers' resource (each second at most) and sizes its batches by the new count."""
    from distributed import Client, Worker

    with dps.LocalPSCluster(num_ps=1, num_workers=1, processes=False) as cluster, Client(cluster) as client:
        strategy = dps.ParameterServerStrategy(client)
        coordinator = dps.ClusterCoordinator(strategy)
        assert coordinator.trainers == 1

        async def start():
            return await Worker(cluster.scheduler_address, name="worker-1", nthreads=1, host="127.0.0.1",
                                resources={strategy.cluster_resolver.worker_resource: 1})

        extra = cluster.sync(start)
        try:
            def counted():  # counted again as work is dispatched, a second apart
                if coordinator.trainers == 2:
                    return True
                for _ in range(4):
                    coordinator.schedule(time.sleep, args=(0.1,))
                coordinator.join()
                return False

            wait_until(counted, 20, failure=lambda: f"the new trainer was not counted: {coordinator.trainers}",
                       interval=0, collect=False)
        finally:
            strategy.close()
            cluster.sync(extra.close)


def test_fetch_after_a_failed_function_of_the_same_batch_does_not_hang(coordinator):
    # Holding the coordinator's (reentrant) lock keeps the pump off until all four are queued:
    # with 2 trainers and no durations known yet, the split is [boom, ok0], [ok1, ok2].
    with coordinator.hold():
        boom = coordinator.schedule(_boom)
        rvs = [coordinator.schedule(_ok, args=(i,)) for i in range(3)]
    try:
        assert rvs[2].fetch() == 2  # the other batch is done
        with pytest.raises(ValueError):
            boom.fetch()  # the failed function itself has reported
        state = in_thread(rvs[0].fetch, 20)
        assert state[0] != "blocked", (
            "RemoteValue.fetch() of the function after a failed one in its batch is still blocked "
            f"20 s after the batch ended ({rvs[0]!r}); only join/done/schedule would release it"
        )
    finally:
        with pytest.raises(ValueError):
            coordinator.join()


def test_a_refused_push_fails_only_its_own_function(strategy, coordinator):
    with strategy.scope():
        v = dps.Variable(np.zeros(2, np.float32), name="picky_v")
        opt = dps.optimizers.Optimizer(PickySGD(), name="picky")

    def push(g):
        opt.apply_gradients([(np.full(2, g, np.float32), v)])

    with coordinator.hold():  # one batch [good, bad] (and one of two no-ops)
        good = coordinator.schedule(push, args=(1.0,))
        bad = coordinator.schedule(push, args=(-1.0,))
        for _ in range(2):
            coordinator.schedule(_ok, args=(0,))
    with pytest.raises(ValueError, match="negative gradient"):
        coordinator.join()
    assert v.numpy().tolist() == [-1.0, -1.0]  # good's gradient was applied, bad's refused
    with pytest.raises(ValueError, match="negative gradient"):
        bad.fetch()
    good_state = in_thread(good.fetch, 10)
    assert good_state == ("ok", None), (
        f"good's push was applied, yet its RemoteValue reports {good_state!r} (bad's error)"
    )


def _big():
    return np.ones(100_000)  # 800 kB: too big for the event, comes back with the batch's result


def _block(gate, which):
    from distributed import Event, Variable, get_worker

    Variable(which).set(get_worker().name)
    Event(gate).wait()
    return "released"


def _completed_on(name, dask_scheduler=None):
    """How many scheduled functions the scheduler's plugin has seen finish on trainer ``name`` (their reports'
    durations: a big result's report counts there, though its coordinator settles it with the batch)."""
    from daskps.scheduler.messages import PLUGIN_NAME

    return len(dask_scheduler.plugins[PLUGIN_NAME].telemetry.timeline.durations.get(name, ()))


def test_a_big_result_survives_its_trainer_dying_later_in_the_batch(fresh_cluster):
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    gate = Event("edges-big-gate", client=client)
    which = Variable("edges-big-which", client=client)
    with coordinator.hold():  # batches [big, block], [ok0, ok1]
        big = coordinator.schedule(_big)
        blocked = coordinator.schedule(_block, args=("edges-big-gate", "edges-big-which"))
        others = [coordinator.schedule(_ok, args=(i,)) for i in range(2)]
    name = which.get(timeout=60)
    # big has reported (status "big") through the scheduler: the plugin counts it done
    wait_until(lambda: client.run_on_scheduler(_completed_on, name) >= 1, 60,
               failure="big() never reported", interval=0.02, collect=False)
    assert client.run_on_scheduler(_completed_on, name) == 1 and blocked.status == "pending"  # big only
    old = kill_worker(client, name)
    gate.set()
    wait_for_worker(client, name, old)
    assert in_thread(blocked.fetch, 60) == ("ok", "released")
    assert [o.fetch() for o in others] == [0, 1]
    state = in_thread(big.fetch, 30)
    assert state[0] == "ok", (
        f"the big result of a function whose trainer died later in its batch never arrives: "
        f"{big!r}, join would hang (pending={coordinator.summary()['in_flight']})"
    )


class TwoArgError(Exception):
    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def _raise_two_arg():
    raise TwoArgError("bad", 3)


def test_an_error_that_does_not_unpickle_arrives_as_a_runtime_error_with_its_text(coordinator):
    """README: an exception that cannot be rebuilt arrives as a RuntimeError with its text (here it does not
    even unpickle on the worker: extra __init__ arguments)."""
    rv = coordinator.schedule(_raise_two_arg)
    state = in_thread(coordinator.join, 20)
    assert state[0] == "raised", (
        f"join() still blocked 20 s after the function failed ({rv!r}): the event handler died "
        "unpickling the exception"
    )
    assert type(state[1]) is RuntimeError and str(state[1]) == "TwoArgError: bad", repr(state[1])
    with pytest.raises(RuntimeError, match=r"^TwoArgError: bad\n"):  # its own RemoteValue: the same error
        rv.fetch()


class OnlyOnWorkers(Exception):
    """Pickles everywhere, unpickles only in a Dask worker (as a class only the workers can import would)."""

    def __reduce__(self):
        return _only_on_workers, (str(self),)


def _only_on_workers(text):
    from distributed import get_worker

    get_worker()  # ValueError outside a worker
    return OnlyOnWorkers(text)


def _raise_only_on_workers():
    raise OnlyOnWorkers("made on worker 7")


def test_an_error_that_unpickles_only_on_the_workers_arrives_as_a_runtime_error_with_its_text(coordinator):
    rv = coordinator.schedule(_raise_only_on_workers)
    state = in_thread(coordinator.join, 20)
    assert state[0] == "raised", f"join() did not raise: {state!r}"
    assert type(state[1]) is RuntimeError and str(state[1]) == "OnlyOnWorkers: made on worker 7", repr(state[1])
    with pytest.raises(RuntimeError, match=r"^OnlyOnWorkers: made on worker 7\n"):
        rv.fetch()
    assert coordinator.schedule(_ok, args=(3,)).fetch() == 3  # and the coordinator goes on


def _interrupt(*_):
    raise KeyboardInterrupt


def _state(pid):
    """A process's state letter from /proc ("T" when stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_an_interrupted_read_leaves_the_channel_in_step(strategy, client, monkeypatch):
    from daskps.client import channel

    with strategy.scope():
        vs = [dps.Variable(np.full(3, float(i)), name=f"chan_{i}") for i in range(4)]
    server = vs[0].handle.server
    a, b = [v for v in vs if v.handle.server == server][:2]
    assert server.channel, "no direct channel on this cluster"
    assert a.numpy().tolist() == [0.0] * 3  # channel open
    expect_b = b.numpy().tolist()

    # The interrupt lands once the read is sent and its answer awaited: when the channel starts reading.
    waiting = threading.Event()
    real_receive = channel.receive_exactly

    def receiving(sock, n):
        waiting.set()
        try:
            return real_receive(sock, n)
        except KeyboardInterrupt:
            landed["in the read"] = True
            raise

    landed = {}
    monkeypatch.setattr(channel, "receive_exactly", receiving)
    # The server's process is stopped (SIGSTOP) until the interrupt has landed: its channel thread answers
    # without the event loop, so only a stopped process cannot answer meanwhile.
    pid = client.run(os.getpid, workers=[server.address])[server.address]
    if pid == os.getpid():  # workers as threads of this process (DASKPS_TEST_THREAD_WORKERS=1, mutmut)
        pytest.skip("the server runs in this process: stopping it would stop the test")

    me = threading.get_ident()

    def interrupt():
        if waiting.wait(30):
            landed["server stopped"] = _state(pid) == "T"
            # To this thread, blocked in the read: a signal sent to the process may be taken by another
            # thread, and the read would go on waiting for the stopped server (a hang under load).
            signal.pthread_kill(me, signal.SIGUSR1)

    old = signal.signal(signal.SIGUSR1, _interrupt)
    timer = threading.Thread(target=interrupt, daemon=True)
    os.kill(pid, signal.SIGSTOP)
    try:  # a signal is taken when its process next runs: on a loaded machine, a moment later
        wait_until(lambda: _state(pid) == "T", 30, failure=lambda: f"server state {_state(pid)!r} after SIGSTOP",
                   interval=0.01, collect=False)
        timer.start()
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C in a notebook during a read
            a.numpy()
            time.sleep(5)  # a read that returned (no interrupt landed in it): the interrupt must still come
    finally:
        os.kill(pid, signal.SIGCONT)  # it answers a's read now, to a connection the channel has closed
        timer.join(30)
        signal.signal(signal.SIGUSR1, old)
    monkeypatch.undo()
    assert landed == {"server stopped": True, "in the read": True}, \
        f"the interrupt did not land while a's answer was awaited: {landed}"
    got = b.numpy().tolist()
    assert got == expect_b, f"b.numpy() returned {got} (a's stale answer), not {expect_b}"


def _started_then_blocked(gate, which):
    from distributed import Event, Variable

    Variable(which).set("running")
    Event(gate).wait(120)
    return "late"


def test_a_batch_cancelled_by_client_restart_fails_its_functions_with_cancelled_error(fresh_cluster):
    """README: a batch that Dask itself cancels (client.restart()) fails its remaining functions with
    CancelledError, raised by the next join."""
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    running = Variable("edges-restart-running", client=client)
    rv = coordinator.schedule(_started_then_blocked, args=("edges-restart-gate", "edges-restart-running"))
    queued = [coordinator.schedule(_ok, args=(i,)) for i in range(2)]
    assert running.get(timeout=60) == "running"  # the restart lands while the function runs
    assert rv.status == "pending"
    client.restart()
    state = in_thread(coordinator.join, 60)
    assert state[0] != "blocked", f"join() still blocked 60 s after client.restart(): {rv!r}"
    assert state[0] == "raised" and type(state[1]) is dps.errors.CancelledError, state
    assert "client.restart()" in str(state[1]), state
    with pytest.raises(dps.errors.CancelledError):
        rv.fetch()
    for q in queued:  # the other functions: finished before the restart, or cancelled with it
        got = in_thread(q.fetch, 10)
        assert got[0] == "ok" or isinstance(got[1], dps.errors.CancelledError), got
    assert coordinator.done() and coordinator.summary()["in_flight"] == 0
