"""A parameter server whose worker is closed (it leaves the scheduler, as when an autoscaler or an operator
retires it) on a cluster of thread workers: re-created on the other ps worker and restored, in about a
second.

The SIGKILL tests (``test_recovery.py``, ``test_recovery_cases.py``) run worker processes; these run every
part of a recovery in this process, where mutation testing's line map sees it, and pin down the numbers: the
values each variable holds after it, and the warning word for word.
"""

from __future__ import annotations

import collections
import re
import time
import warnings

import dask.config
import numpy as np
import pytest
from distributed import Client

import daskps as dps
from daskps.coordinator.recovery import RecoveryState
from daskps.errors import CancelledError, PSUnavailableError, RollbackWarning
from tests.helpers.cluster import datasets_built, two_ps_training, worker_address
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.timeout(40), pytest.mark.cluster]  # each takes a few seconds at most; a hang fails fast


@pytest.fixture
def thread_cluster():
    with dps.LocalPSCluster(num_ps=2, num_workers=2, processes=False) as cluster:
        with Client(cluster) as client:
            yield cluster, client


def close_worker(cluster, client, name: str) -> str:
    """Close the worker ``name`` and wait until the scheduler has seen it leave; returns its address."""
    address = worker_address(client, name)
    cluster.sync(cluster.workers[name].close, reason="test: worker closed")
    wait_until(lambda: address not in client.scheduler_info()['workers'], 10,
               failure=lambda: f"{name} was closed but the scheduler still lists it", interval=0.01, collect=False)
    return address


def wait_for_recoveries(coordinator, count: int, timeout: float = 10) -> None:
    wait_until(lambda: len(coordinator.recoveries) >= count, timeout,  # one takes well under a second here
               failure="a ps worker left, but no recovery ended", interval=0.01, collect=False)


def wait_for_state(coordinator, state, failing: str) -> None:
    wait_until(lambda: coordinator.recovery_state is state, 10,
               failure=lambda: f"{failing}: {coordinator.recovery_state}", interval=0.01, collect=False)


def _warning(record) -> str:
    texts = [str(w.message) for w in record if issubclass(w.category, RollbackWarning)]
    assert len(texts) == 1, texts
    return texts[0]


def test_a_closed_ps_worker_is_recreated_on_the_other_and_rolled_back_exactly(thread_cluster, tmp_path):
    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    for _ in range(3):  # finished after the save: lost for `a` (on ps-0), kept for `b` (on ps-1)
        coordinator.schedule(step)
    coordinator.join()
    assert (float(a.numpy()), float(b.numpy())) == (4.0, 4.0)
    ps1 = worker_address(client, "ps-1")
    with dask.config.set({"daskps.recovery-same-worker-wait": "0.2s"}):
        with pytest.warns(RollbackWarning) as record:
            began = time.monotonic()
            old = close_worker(cluster, client, "ps-0")
            wait_for_recoveries(coordinator, 1)  # the scheduler told the coordinator: nothing had to fail
            took = time.monotonic() - began
    said = re.fullmatch(
        rf"daskps: lost parameter server re-created in (\d+\.\d)s: ps:0 \(was at {old}\) now runs at {ps1}\. "
        rf"Rolled back to checkpoint {re.escape(str(manager.latest_checkpoint))}: 'a'; every update made to them "
        r"after it is lost \(3 scheduled function\(s\) that reached the lost server finished since it was "
        r"saved\)\. 0 function\(s\) that failed or were cancelled by the loss run again\.", _warning(record))
    # it waited 0.2 s for ps-0 to come back first, within what this test saw it take (rounded to 0.1 s)
    assert said and 0.2 <= float(said.group(1)) <= took + 0.05
    assert [s.address for s in strategy.servers] == [ps1, ps1]
    assert "task:0" in a.device and "task:1" in b.device
    assert (float(a.numpy()), float(b.numpy())) == (1.0, 4.0)
    for _ in range(5):  # training goes on where the rollback left it
        coordinator.schedule(step)
    coordinator.join()
    assert (float(a.numpy()), float(b.numpy())) == (6.0, 9.0)
    assert len(coordinator.recoveries) == 1 and coordinator.done()
    record = coordinator.recoveries[0]
    assert [(lost.address, new.address) for lost, new in record.servers] == [(old, ps1)]
    assert (record.checkpoint, record.functions_since) == (manager.latest_checkpoint, 3)
    saved = manager.save()
    assert saved is not None and manager.latest_checkpoint == saved


def test_functions_scheduled_while_the_server_is_lost_run_once_on_the_new_one(thread_cluster, tmp_path):
    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=2)
    with dask.config.set({"daskps.recovery-same-worker-wait": "0.5s"}):
        with pytest.warns(RollbackWarning) as record:
            close_worker(cluster, client, "ps-0")
            remotes = [coordinator.schedule(step, args=(i,)) for i in range(20)]
            coordinator.join()  # waits for the recovery, then runs the 20
    assert "Rolled back to checkpoint" in _warning(record) and len(coordinator.recoveries) == 1
    assert sorted(r.fetch() for r in remotes) == list(range(20))
    assert (float(a.numpy()), float(b.numpy())) == (22.0, 22.0)


def test_without_a_checkpoint_the_lost_servers_variables_start_again(thread_cluster, tmp_path):
    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path)
    for _ in range(2):
        coordinator.schedule(step)
    coordinator.join()
    assert manager.latest_checkpoint is None
    with dask.config.set({"daskps.recovery-same-worker-wait": "0.2s"}):
        with pytest.warns(RollbackWarning) as record:
            close_worker(cluster, client, "ps-0")
            wait_for_recoveries(coordinator, 1)
    assert _warning(record).endswith(
        ". No checkpoint had been saved yet. Back to their initial value (in no checkpoint): 'a'. "
        "0 function(s) that failed or were cancelled by the loss run again.")
    report = coordinator.recoveries[-1]  # as the warning says it, in fields
    assert (report.checkpoint, report.rolled_back, report.reset, report.functions_since) == (None, [], ["a"], None)
    assert (float(a.numpy()), float(b.numpy())) == (0.0, 2.0)


def test_a_variable_the_checkpoint_lacks_goes_back_to_its_initial_value(thread_cluster, tmp_path):
    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    with strategy.scope():
        c = dps.Variable(7.0, name="c")  # the third variable: on ps-0 again, in no checkpoint
    assert "task:0" in c.device
    c.assign(50.0)
    with dask.config.set({"daskps.recovery-same-worker-wait": "0.2s"}):
        with pytest.warns(RollbackWarning) as record:
            close_worker(cluster, client, "ps-0")
            wait_for_recoveries(coordinator, 1)
    assert re.search(r": 'a'; every update .* \(0 scheduled function\(s\) .*\)\. Back to their initial value "
                     r"\(in no checkpoint\): 'c'\. 0 function", _warning(record))
    assert (float(a.numpy()), float(b.numpy()), float(c.numpy())) == (1.0, 1.0, 7.0)


def test_no_ps_worker_left_fails_join_then_dispatch_goes_on(thread_cluster, tmp_path):
    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    with dask.config.set({"daskps.recovery-timeout": "1s", "daskps.recovery-same-worker-wait": "0.2s"}):
        close_worker(cluster, client, "ps-0")
        close_worker(cluster, client, "ps-1")
        remotes = [coordinator.schedule(step) for _ in range(5)]
        # nothing goes out until join() raises
        wait_for_state(coordinator, RecoveryState.HALTED, "the recovery did not fail")
        with pytest.raises(PSUnavailableError) as err:
            coordinator.join()
    assert re.fullmatch(r"parameter server ps:\d was lost and no worker with resource 'ps' came to take its place "
                        r"within daskps\.recovery-timeout; start one \(`dask worker ADDRESS --resources ps=1`\) "
                        r"and train again", str(err.value))
    assert not coordinator.recoveries and coordinator.done()
    summary = coordinator.summary()
    assert (summary["failed"], summary["cancelled"], summary["rerun"]) == (0, 5, 0)
    assert summary["last_error"] == repr(err.value)
    assert coordinator.recovery_state is RecoveryState.DISPATCHING
    for r in remotes:  # none ran; none waits forever
        with pytest.raises((CancelledError, PSUnavailableError)):
            r.fetch()
    # join() has raised: the coordinator dispatches again (a function that needs no server runs)
    assert coordinator.schedule(lambda: 42).fetch() == 42


def dataset_on_ps0(coordinator):
    """A per-worker dataset of ``range(100, 200)`` whose function is stored on ps:0 (the place is drawn at
    random: datasets are made until one lands there)."""
    made = []
    while not any(d.blob.server.task_id == 0 for d in made):
        assert len(made) < 40, "no dataset's function was stored on ps:0"
        made.append(coordinator.create_per_worker_dataset(lambda: iter(range(100, 200))))
    return made[-1]


def lose_ps0(cluster, client, coordinator) -> None:
    """Close ps-0's worker; its server is re-created on ps-1's (the wait for ps-0 to come back cut short)."""
    with dask.config.set({"daskps.recovery-same-worker-wait": "0.2s"}):
        with pytest.warns(RollbackWarning):
            close_worker(cluster, client, "ps-0")
            wait_for_recoveries(coordinator, 1)


def test_a_dataset_made_before_the_loss_is_first_read_after_it(thread_cluster, tmp_path):
    """Its function was stored on the lost server: the recovery stores it again on the new one."""
    from collections import Counter

    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    dataset = dataset_on_ps0(coordinator)
    lose_ps0(cluster, client, coordinator)
    assert dataset.blob.server.address == worker_address(client, "ps-1")
    it = iter(dataset)  # no trainer has built it yet

    def take(iterator):
        return next(iterator)

    got = Counter(coordinator.schedule(take, args=(it,)).fetch() for _ in range(6))
    # each trainer reads its own copy from the start: the 6 values are two prefixes of 100, 101, ...
    assert any(got == Counter(range(100, 100 + n)) + Counter(range(100, 106 - n)) for n in range(7)), got


def _read_where(iterator):
    from distributed import get_worker

    return get_worker().name, next(iterator)


def test_a_dataset_read_before_the_loss_goes_on_where_it_was_after_it(thread_cluster, tmp_path):
    """Trainers keep a dataset whose function was on the lost server, and their iterators over it: what the
    scheduler would have them do once that server is gone (forget the dataset) waits for the new one."""
    from collections import defaultdict

    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    dataset = dataset_on_ps0(coordinator)
    it = iter(dataset)
    read = coordinator.fetch([coordinator.schedule(_read_where, args=(it,)) for _ in range(8)])
    dataset_id = dataset.dataset_id
    readers = {name for name, _ in read}
    built = {cluster.scheduler.workers[addr].name for addr, ids in client.run(datasets_built).items()
             if dataset_id in ids}
    assert built == readers
    lose_ps0(cluster, client, coordinator)
    assert dataset.blob.server.address == worker_address(client, "ps-1")
    assert {cluster.scheduler.workers[addr].name for addr, ids in client.run(datasets_built).items()
            if dataset_id in ids} == readers  # not forgotten
    read += coordinator.fetch([coordinator.schedule(_read_where, args=(it,)) for _ in range(8)])
    per_trainer = defaultdict(list)
    for name, value in read:
        per_trainer[name].append(value)
    for name, values in per_trainer.items():  # each trainer went on from where it was: no value twice
        assert sorted(values) == list(range(100, 100 + len(values))), (name, values)


def test_trainers_forget_a_dataset_of_a_recovered_server_when_the_coordinator_goes_without_closing(
        thread_cluster, tmp_path):
    """After a recovery, the cleanup the scheduler runs once a dataset's server is released (its client gone,
    as a crashed kernel goes) is the new server's: the trainers forget the dataset then."""
    cluster, observer = thread_cluster
    client = Client(cluster)  # the coordinator's, to be lost
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    dataset = dataset_on_ps0(coordinator)
    it = iter(dataset)
    coordinator.fetch([coordinator.schedule(next, args=(it,)) for _ in range(4)])
    dataset_id = dataset.dataset_id

    def trainers_holding():
        return [addr for addr, ids in observer.run(datasets_built).items() if dataset_id in ids]

    assert trainers_holding()
    lose_ps0(cluster, observer, coordinator)
    assert trainers_holding()
    client.close()  # no strategy.close(), no drop: the scheduler releases the client's servers
    wait_until(lambda: not trainers_holding(), 10,
               failure="the coordinator's client went, and the trainers kept its dataset", interval=0.05, collect=False)


def test_functions_running_at_the_loss_fail_and_run_again_in_full(thread_cluster, tmp_path):
    """Both trainers are inside a step when ps-0's worker closes: their update to ``a`` fails (the server no
    longer answers, though its thread lives on), and both steps run again in full once it is back. Their
    update to ``b`` on ps-1 went through before they failed: at least once (docs/user-guide/recovery.md)."""
    import uuid

    from distributed import Event

    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path)
    a.assign(1.0)
    b.assign(1.0)
    manager.save()  # no function has run: the coordinator splits its first functions over both trainers
    tag = uuid.uuid4().hex
    go = f"go-{tag}"

    def blocked_step(i):
        Event(f"started-{tag}-{i}").set()
        assert Event(go).wait(30), "the test never let the step go on"
        a.assign_add(1.0)  # a lives on ps-0
        b.assign_add(1.0)
        return i

    with dask.config.set({"daskps.recovery-same-worker-wait": "3s"}):
        with pytest.warns(RollbackWarning) as record:
            remotes = [coordinator.schedule(blocked_step, args=(i,)) for i in range(2)]
            for i in range(2):
                assert Event(f"started-{tag}-{i}", client=client).wait(10), f"step {i} never started"
            close_worker(cluster, client, "ps-0")
            Event(go, client=client).set()  # before the recovery can end (it waits 3 s for ps-0 first)
            coordinator.join()
    # the warning counts the failures known when the recovery ended (a failure can take up to
    # daskps.connect-timeout to show); the coordinator's summary counts every function run again
    assert re.search(r"\(0 scheduled function\(s\) that reached the lost server finished since it was saved\)\. "
                     r"[12] function\(s\) that failed or were cancelled by the loss run again\.$", _warning(record))
    assert [r.fetch() for r in remotes] == [0, 1]
    # a: the checkpoint's 1, then each step once; b: 1, each failed step's update, each step again
    assert (float(a.numpy()), float(b.numpy())) == (3.0, 5.0)
    assert coordinator.summary()["rerun"] == 2 and len(coordinator.recoveries) == 1


def test_a_recovery_does_not_wait_for_trainers_busy_in_a_function(thread_cluster, tmp_path):
    """Each trainer is told of the new server by a task of its own, which the recovery waits for a moment
    only (``FOLLOW_WAIT``): a trainer busy in a long function (not using the lost server) follows with its
    next batch, and the recovery ends without it."""
    import uuid

    from distributed import Event

    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path)
    manager.save()  # no function has run: the first two go to both trainers
    tag = uuid.uuid4().hex

    def busy(i):
        Event(f"started-{tag}-{i}").set()
        assert Event(f"go-{tag}").wait(30), "the test never let the function go on"
        b.assign_add(1.0)  # on ps-1, not lost
        return i

    remotes = [coordinator.schedule(busy, args=(i,)) for i in range(2)]
    for i in range(2):
        assert Event(f"started-{tag}-{i}", client=client).wait(10), f"function {i} never started"
    with dask.config.set({"daskps.recovery-same-worker-wait": "0.2s"}):
        with pytest.warns(RollbackWarning):
            close_worker(cluster, client, "ps-0")
            wait_for_recoveries(coordinator, 1)  # (10 s at most; the functions wait 30 s)
            assert not coordinator.done()  # both functions still wait
            Event(f"go-{tag}", client=client).set()
            assert [r.fetch() for r in remotes] == [0, 1]
    for _ in range(4):
        coordinator.schedule(step)
    coordinator.join()
    assert (float(a.numpy()), float(b.numpy())) == (4.0, 6.0)  # a from the checkpoint (0), b kept its 2


def test_with_a_manager_an_error_of_the_function_itself_is_not_run_again(thread_cluster, tmp_path):
    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)

    def bad(x):
        a.assign_add(1.0)
        raise ValueError(f"bad batch {x}")

    coordinator.schedule(bad, args=(7,))
    with pytest.raises(ValueError) as err:
        coordinator.join()
    assert str(err.value) == "bad batch 7"
    summary = coordinator.summary()
    assert (summary["failed"], summary["rerun"], len(coordinator.recoveries)) == (1, 0, 0)
    assert float(a.numpy()) == 2.0  # it ran once


def test_without_a_manager_a_closed_ps_fails_the_functions_that_need_it(thread_cluster):
    cluster, client = thread_cluster
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        a = dps.Variable(0.0, name="a")  # ps-0
    coordinator = dps.ClusterCoordinator(strategy)
    close_worker(cluster, client, "ps-0")
    coordinator.schedule(lambda: a.assign_add(1.0) and None)
    with pytest.raises(PSUnavailableError, match="'a'"):
        coordinator.join()
    summary = coordinator.summary()
    assert (summary["failed"], summary["rerun"], len(coordinator.recoveries)) == (1, 0, 0)


ATTEMPTS: list[int] = []  # the trainers are threads of this process: they append here


def _unlucky():  # at module level: pickled by reference, so it appends to this process's ATTEMPTS
    ATTEMPTS.append(1)
    raise PSUnavailableError("ps:0 cannot be reached (made up by the test)")


def test_a_function_that_keeps_losing_its_server_runs_again_three_times_then_fails(thread_cluster, tmp_path):
    """With a manager, a function that fails because a server is gone runs again after the recovery, at most
    3 times: a fourth loss in a row is its error (no server is lost here, so each recovery finds nothing)."""
    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    ATTEMPTS.clear()
    coordinator.schedule(_unlucky)
    with pytest.raises(PSUnavailableError, match="made up by the test"):
        coordinator.join()
    assert len(ATTEMPTS) == 4 and coordinator.summary()["rerun"] == 3
    assert (float(a.numpy()), float(b.numpy())) == (1.0, 1.0)  # nothing was rolled back


TRIED: collections.Counter[int] = collections.Counter()  # runs of each function, by its argument


def _first_loses_its_server_once(i):  # at module level: pickled by reference, so it counts in TRIED
    TRIED[i] += 1
    if i == 0 and TRIED[i] == 1:
        raise PSUnavailableError("ps:0 cannot be reached (made up by the test)")
    return i


def test_the_functions_after_one_that_lost_its_server_in_its_batch_run_later_once(thread_cluster, tmp_path):
    """A batch stops at a function that lost its server; with a manager, the functions after it in the batch
    (not run) are queued again with it, and each runs once in all."""
    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    TRIED.clear()
    with coordinator.hold():  # the four are queued before the coordinator makes batches: 0 is first in one
        remotes = [coordinator.schedule(_first_loses_its_server_once, args=(i,)) for i in range(4)]
    coordinator.join()
    assert [r.fetch() for r in remotes] == [0, 1, 2, 3]
    assert TRIED == {0: 2, 1: 1, 2: 1, 3: 1}
    # 0 ran again, and at least 1 (its batch's next) was queued again without having run
    assert coordinator.summary()["rerun"] >= 2 and coordinator.summary()["failed"] == 0


def test_a_checkpoint_that_does_not_restore_fails_join_and_says_why(thread_cluster, tmp_path):
    import pathlib

    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)
    latest = str(manager.latest_checkpoint)
    (pathlib.Path(latest) / "a@0.npy").write_bytes(b"not an array")  # a's file spoiled after the save
    with dask.config.set({"daskps.recovery-same-worker-wait": "0.2s"}):
        close_worker(cluster, client, "ps-0")
        coordinator.schedule(step)
        with pytest.raises(PSUnavailableError) as err:
            coordinator.join()
    assert re.fullmatch(rf"parameter server\(s\) ps:0 were lost and re-created, but restoring them from "
                        rf"{re.escape(latest)} failed \(ValueError: {re.escape(latest)}/a@0\.npy is not a readable \.npy "
                        r"file: .+\); their variables hold their initial values",
                        str(err.value), re.S), str(err.value)
    assert not coordinator.recoveries


_INITIALIZED = []


def _zeros_once(shape, dtype):
    """An initializer whose data is there once only (as a file a job deletes after reading it)."""
    _INITIALIZED.append(shape)
    if len(_INITIALIZED) > 1:
        raise RuntimeError("the initial values were already taken")
    return np.zeros(shape, dtype)


def test_a_variable_that_cannot_be_made_again_fails_join_and_says_why(thread_cluster, tmp_path):
    """A lost server's variables are made again from how they were made (here: an initializer run on the
    server, which fails the second time): if that fails, ``join()`` says which server and why."""
    cluster, client = thread_cluster
    _INITIALIZED.clear()
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        a = dps.Variable(_zeros_once, shape=(3,), dtype=np.float32, name="a")  # ps-0
        b = dps.Variable(0.0, name="b")  # ps-1
    manager = dps.CheckpointManager(dps.Checkpoint(a=a, b=b), str(tmp_path))
    coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)
    manager.save()
    assert len(_INITIALIZED) == 1
    with dask.config.set({"daskps.recovery-same-worker-wait": "0.2s"}):
        close_worker(cluster, client, "ps-0")
        coordinator.schedule(b.assign_add, args=(1.0,))
        with pytest.raises(PSUnavailableError) as err:
            coordinator.join()
    assert len(_INITIALIZED) == 2
    assert str(err.value) == ("parameter server ps:0 was lost, and making its variables again failed: "
                              "RuntimeError: the initial values were already taken")
    assert not coordinator.recoveries


def test_a_ps_worker_back_under_its_name_gets_its_server_again(thread_cluster, tmp_path):
    """As when a Nanny restarts a killed worker: a ps worker with the lost one's name comes within
    ``daskps.recovery-same-worker-wait``, and the server is made again there, not on the other ps worker."""
    from distributed import Worker

    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path, saved_after=1)

    async def start():
        return await Worker(cluster.scheduler_address, name="ps-0", nthreads=1, host="127.0.0.1",
                            resources={"ps": 1})

    with dask.config.set({"daskps.recovery-same-worker-wait": "20s"}):
        with pytest.warns(RollbackWarning, match="ps:0"):
            old = close_worker(cluster, client, "ps-0")
            back = cluster.sync(start)
            try:
                wait_for_recoveries(coordinator, 1)
                assert back.address != old and strategy.servers[0].address == back.address
                assert strategy.servers[1].address == worker_address(client, "ps-1")
                coordinator.schedule(step)
                coordinator.join()
                assert (float(a.numpy()), float(b.numpy())) == (2.0, 2.0)
            finally:
                strategy.close()
                cluster.sync(back.close)


def test_updates_lost_are_counted_only_for_functions_that_knew_the_lost_server(thread_cluster, tmp_path):
    """The warning counts the functions that finished after the checkpoint and reached the lost server. A
    function that started before an earlier recovery (it knew the servers before it, and used ps:1 only)
    and finished after the save is not one of them when ps:0's new server is lost; one that ran after the
    save is."""
    import uuid

    from distributed import Event, Worker

    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path)
    tag = uuid.uuid4().hex

    def long_on_ps1():
        Event(f"started-{tag}").set()
        assert Event(f"go-{tag}").wait(30), "the test never let the function go on"
        b.assign_add(1.0)

    async def start():
        return await Worker(cluster.scheduler_address, name="ps-0", nthreads=1, host="127.0.0.1",
                            resources={"ps": 1})

    long = coordinator.schedule(long_on_ps1)
    assert Event(f"started-{tag}", client=client).wait(10), "the long function never started"
    back = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RollbackWarning)
            with dask.config.set({"daskps.recovery-same-worker-wait": "20s"}):
                close_worker(cluster, client, "ps-0")
                back = cluster.sync(start)  # ps:0's new server goes there, alone
                wait_for_recoveries(coordinator, 1)
            assert strategy.servers[0].address == back.address
            manager.save()  # the long function is still running: it finishes after the save
            Event(f"go-{tag}", client=client).set()
            long.fetch()
            coordinator.schedule(step)  # after the save, on ps:0's new server
            coordinator.join()
            with dask.config.set({"daskps.recovery-same-worker-wait": "0.2s"}):
                cluster.sync(back.close)  # (not in cluster.workers: close_worker does not know it)
                wait_for_recoveries(coordinator, 2)
        assert strategy.servers[0].address == worker_address(client, "ps-1")
        assert coordinator.recoveries[1].functions_since == 1
    finally:
        strategy.close()
        if back is not None and back.status.name not in ("closed", "closing"):
            cluster.sync(back.close)


def one_variable_per_server(client, directory, n: int):
    """A strategy with variables ``v0``, ``v1``... holding 0, 1... one on each of its ``n`` servers, saved by a
    checkpoint manager in ``directory``, and its coordinator: ``(strategy, vs, manager, coordinator)``."""
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        vs = [dps.Variable(float(i), name=f"v{i}") for i in range(n)]
    manager = dps.CheckpointManager(dps.Checkpoint(**{v.name: v for v in vs}), str(directory))
    coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)
    manager.save()
    return strategy, vs, manager, coordinator


def test_a_lost_server_goes_to_the_ps_worker_holding_fewest(tmp_path):
    """Four ps workers, one server each: ps-0's goes to ps-1 (a tie, broken by name); then ps-2's goes to ps-3,
    which holds one server, not to ps-1, which holds two."""
    with dps.LocalPSCluster(num_ps=4, num_workers=1, processes=False) as cluster, Client(cluster) as client:
        strategy, vs, manager, coordinator = one_variable_per_server(client, tmp_path, 4)
        ps = {n: worker_address(client, f"ps-{n}") for n in range(4)}
        with dask.config.set({"daskps.recovery-same-worker-wait": "0.2s"}):
            with pytest.warns(RollbackWarning):
                close_worker(cluster, client, "ps-0")
                wait_for_recoveries(coordinator, 1)
            assert [s.address for s in strategy.servers] == [ps[1], ps[1], ps[2], ps[3]]
            with pytest.warns(RollbackWarning):
                close_worker(cluster, client, "ps-2")
                wait_for_recoveries(coordinator, 2)
        assert [s.address for s in strategy.servers] == [ps[1], ps[1], ps[3], ps[3]]
        assert [float(v.numpy()) for v in vs] == [0.0, 1.0, 2.0, 3.0]
        strategy.close()


def test_two_servers_lost_with_one_worker_are_named_together_when_their_restore_fails(tmp_path):
    """ps:0's server moves to ps-1's worker; that worker goes too, with both servers; the checkpoint no longer
    restores: one error names both, as ``ps:0, ps:1``."""
    import pathlib

    with dps.LocalPSCluster(num_ps=3, num_workers=1, processes=False) as cluster, Client(cluster) as client:
        strategy, vs, manager, coordinator = one_variable_per_server(client, tmp_path, 3)
        with dask.config.set({"daskps.recovery-same-worker-wait": "0.2s"}):
            with pytest.warns(RollbackWarning):
                close_worker(cluster, client, "ps-0")
                wait_for_recoveries(coordinator, 1)
            assert [s.address for s in strategy.servers][:2] == [worker_address(client, "ps-1")] * 2
            latest = str(manager.latest_checkpoint)
            (pathlib.Path(latest) / "v1@0.npy").write_bytes(b"not an array")
            close_worker(cluster, client, "ps-1")
            coordinator.schedule(vs[2].assign_add, args=(1.0,))
            with pytest.raises(PSUnavailableError) as err:
                coordinator.join()
        assert str(err.value).startswith(f"parameter server(s) ps:0, ps:1 were lost and re-created, but restoring "
                                         f"them from {latest} failed (ValueError: {latest}/v1@0.npy is not a "
                                         "readable .npy file: "), str(err.value)
        assert str(err.value).endswith("); their variables hold their initial values")
        strategy.close()


def test_a_second_ps_lost_during_a_recovery_is_recovered_after_it(tmp_path):
    """ps-1 goes while ps-0's server is being re-created: the coordinator notes it and recovers it next."""
    with dps.LocalPSCluster(num_ps=3, num_workers=2, processes=False) as cluster, Client(cluster) as client:
        strategy = dps.ParameterServerStrategy(client)
        with strategy.scope():
            vs = [dps.Variable(0.0, name=n) for n in "abc"]  # one on each ps
        manager = dps.CheckpointManager(dps.Checkpoint(a=vs[0], b=vs[1], c=vs[2]), str(tmp_path))
        coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)
        for v in vs:
            v.assign(5.0)
        manager.save()
        ps2 = worker_address(client, "ps-2")
        with dask.config.set({"daskps.recovery-same-worker-wait": "3s"}):
            with pytest.warns(RollbackWarning) as record:
                close_worker(cluster, client, "ps-0")
                wait_for_state(coordinator, RecoveryState.RECOVERING, "no recovery began")
                close_worker(cluster, client, "ps-1")
                assert coordinator.recovery_state is RecoveryState.RECOVERING, "the first recovery ended too soon"
                # each of the two waits 3 s for its worker to come back before it moves: 10 s was too close
                wait_for_recoveries(coordinator, 2, timeout=30)
        texts = [str(w.message) for w in record if issubclass(w.category, RollbackWarning)]
        assert len(texts) == 2 and "ps:0 (was at" in texts[0] and "ps:1 (was at" in texts[1], texts
        assert [s.address for s in strategy.servers] == [ps2, ps2, ps2]
        assert [float(v.numpy()) for v in vs] == [5.0, 5.0, 5.0]
        strategy.close()


def test_an_exactly_once_batch_read_before_a_loss_is_the_batch_its_rerun_reads(thread_cluster, tmp_path):
    """A function that read batches of ``dps.data.from_dask(..., exactly_once=True)`` and then failed at the
    loss reads those same batches when it runs again: no row is lost or read twice over the pass."""
    import uuid

    import dask.dataframe as dd
    import numpy as np
    import pandas as pd
    from distributed import Event

    cluster, client = thread_cluster
    strategy, a, b, manager, coordinator, step = two_ps_training(client, tmp_path)
    manager.save()  # no function has run: the first two go to both trainers
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(800)}), npartitions=8)
    it = iter(coordinator.create_per_worker_dataset(dps.data.from_dask(frame, batch_size=100, exactly_once=True)))
    tag = uuid.uuid4().hex
    go = f"go-{tag}"

    def blocked_read(iterator, i):
        batches = [next(iterator), next(iterator)]  # two: the rerun gets the first and the second again
        Event(f"started-{tag}-{i}").set()
        assert Event(go).wait(30), "the test never let the step go on"
        a.assign_add(1.0)  # fails the first time: ps-0 is gone
        return np.concatenate([np.asarray(b["id"]) for b in batches])

    def read(iterator):
        batch = next(iterator, None)
        return None if batch is None else np.asarray(batch["id"])

    with dask.config.set({"daskps.recovery-same-worker-wait": "3s"}):
        with pytest.warns(RollbackWarning) as record:
            remotes = [coordinator.schedule(blocked_read, args=(it, i)) for i in range(2)]
            for i in range(2):
                assert Event(f"started-{tag}-{i}", client=client).wait(10), f"step {i} never started"
            close_worker(cluster, client, "ps-0")
            Event(go, client=client).set()
            coordinator.join()
    assert re.search(r" [12] function\(s\) that failed or were cancelled by the loss run again\.$", _warning(record))
    assert coordinator.summary()["rerun"] == 2
    first = [r.fetch() for r in remotes]
    rest = [got for got in coordinator.fetch([coordinator.schedule(read, args=(it,)) for _ in range(12)])
            if got is not None]
    ids = np.concatenate(first + rest)
    assert np.array_equal(np.sort(ids), np.arange(800))  # each row once, the reruns' two batches included
