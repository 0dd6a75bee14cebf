"""A parameter server SIGKILLed while 64 trainers work: nothing reported twice, nothing lost that should stay.

The trainers are 64 Dask workers in one process (``benchmarks/_scale_host.py``, as the scale harness
runs them); the two servers are ``dask worker`` processes with their Nannies, so the killed one comes
back under its name; the scheduler is a ``dask scheduler`` process. Each function ``i`` adds 1 to
element ``i`` of ``a`` (on the server killed) and of ``b`` (on the other), and the functions after the
checkpoint each take one batch of an exactly-once Dask input. So the variables say, element by element,
which function's update each server holds, and each function returns the rows it read and whether it
began knowing the re-created server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client

import daskps as dps
from daskps.client.group import generation_known
from tests.helpers.cluster import (
    start_dask_scheduler,
    start_dask_worker,
    stop_processes,
    wait_done,
    wait_for_recovery,
    worker_address,
    worker_pid,
)
from tests.helpers.paths import ROOT
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(420)

TRAINERS = 64
SAVED = 128  # functions before the checkpoint
AFTER = 1536  # functions after it, one batch of the input each
BATCH = 4


def _saved_step(i, a, b, size):
    one = np.zeros(size, np.float32)
    one[i] = 1.0
    a.assign_add(one)
    b.assign_add(one)
    return i


def _step(i, a, b, size, it, token):
    known = generation_known(token)  # the servers this run of the function knew as it began
    rows = next(it)
    time.sleep(0.02)
    one = np.zeros(size, np.float32)
    one[i] = 1.0
    a.assign_add(one)
    b.assign_add(one)
    return i, known, rows


@pytest.fixture
def many_trainers(tmp_path):
    """A scheduler, 2 ps workers (``dask worker`` with a Nanny each) and 64 trainers in one process."""
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # this module, by name
    procs: list[subprocess.Popen] = []
    try:
        address = start_dask_scheduler(tmp_path, procs, env)
        for name in ("ps-0", "ps-1"):
            procs.append(start_dask_worker(address, env, "--resources", "ps=1", "--name", name,
                                           stderr=open(tmp_path / f"{name}.log", "w")))
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "_scale_host.py"), str(tmp_path / "scheduler.json"), "worker",
             "0", str(TRAINERS)], env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "trainers.log", "w")))
        # The lost server comes back on its own worker, once the Nanny has restarted it (on a loaded
        # machine that can take longer than the 10 s the recovery waits for it by default).
        with Client(address) as client, dask.config.set({"daskps.recovery-same-worker-wait": "120s"}):
            client.wait_for_workers(TRAINERS + 2, timeout=120)
            yield client
    finally:
        stop_processes(procs)


@pytest.mark.cluster
def test_a_server_killed_under_64_trainers_loses_exactly_the_updates_since_its_checkpoint(many_trainers, tmp_path):
    client = many_trainers
    size = SAVED + AFTER
    strategy = dps.ParameterServerStrategy(client)
    assert len(strategy.trainer_names) == TRAINERS
    with strategy.scope():
        a = dps.Variable(np.zeros(size, np.float32), name="a")  # ps-0: killed
        b = dps.Variable(np.zeros(size, np.float32), name="b")  # ps-1
    assert "/task:0/" in a.device and "/task:1/" in b.device, (a.device, b.device)
    assert strategy.servers[0].address == worker_address(client, "ps-0")
    manager = dps.CheckpointManager(dps.Checkpoint(a=a, b=b), str(tmp_path / "ckpt"))
    coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)
    for i in range(SAVED):
        coordinator.schedule(_saved_step, args=(i, a, b, size))
    coordinator.join()
    manager.save()

    rows = AFTER * BATCH
    data = dps.data.from_dask(da.arange(rows, chunks=rows // TRAINERS), batch_size=BATCH, exactly_once=True)
    it = iter(coordinator.create_per_worker_dataset(data))
    remotes = [coordinator.schedule(_step, args=(SAVED + i, a, b, size, it, strategy.token)) for i in range(AFTER)]
    wait_done(coordinator, SAVED + AFTER // 4, timeout=120)
    done_before = {i for i, r in enumerate(remotes) if r.status == "finished"}
    pid, old = worker_pid(client, "ps-0"), worker_address(client, "ps-0")
    os.kill(pid, 9)
    assert 0 < len(done_before) < AFTER, len(done_before)  # some finished before the kill, some after
    wait_for_recovery(coordinator, timeout=120)
    coordinator.join()
    wait_until(lambda: not _alive(pid), 10, failure=f"ps-0 (pid {pid}) still runs after SIGKILL", collect=False)
    assert len(coordinator.recoveries) == 1, coordinator.recoveries
    assert strategy.servers[0].address == worker_address(client, "ps-0") != old  # its Nanny's new worker

    results = coordinator.fetch(remotes)
    summary = coordinator.summary()
    # Every function reported once, with its own result.
    assert [r[0] for r in results] == list(range(SAVED, size))
    assert summary["done"] == SAVED + AFTER and summary["failed"] == 0, summary
    known = np.array([r[1] for r in results])
    assert known.min() == 0 and known.max() == 1, np.bincount(known)
    # The recovered server: the checkpoint, plus exactly the updates of the functions that ran against it.
    got_a = a.numpy()
    assert np.array_equal(got_a[:SAVED], np.ones(SAVED)), got_a[:SAVED]
    expected = (known >= 1).astype(np.float32)
    wrong = np.flatnonzero(got_a[SAVED:] != expected)
    assert wrong.size == 0, (f"{wrong.size} elements of a differ from checkpoint + updates since: "
                             f"{[(int(j), float(got_a[SAVED + j]), int(known[j])) for j in wrong[:10]]}")
    assert all(known[i] == 0 for i in done_before)  # (so their updates, made before the kill, are gone)
    # The other server kept every update: each function's at least once, twice only for functions run again.
    got_b = b.numpy()
    assert np.array_equal(got_b[:SAVED], np.ones(SAVED)) and got_b[SAVED:].min() >= 1.0, got_b
    assert 0 <= got_b.sum() - size <= summary["rerun"], (got_b.sum() - size, summary)
    # Exactly-once input: every row in exactly one function's final run.
    seen = np.concatenate([r[2] for r in results])
    assert np.array_equal(np.sort(seen), np.arange(rows))
    strategy.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_function_keeps_to_the_servers_it_knew_as_it_began():
    """Thread workers share a process: one trainer can learn of a re-created server while another's function
    runs. That function's calls still go to the server it began with (the coordinator counts its updates as
    made there); functions begun knowing the new server, and the coordinator's own calls, go to the new one."""
    from daskps.client import pipeline, protocol
    from daskps.client.group import server_key
    from daskps.client.routing import ROUTES, ServerRef

    old = ServerRef("tcp://127.0.0.1:1", server_key(0, "0123456789abcdef"), 0)
    new = ServerRef("tcp://127.0.0.1:2", server_key(0, "0123456789abcdef", generation=1), 0)
    ROUTES.moved[old.actor_key] = new
    try:
        assert protocol.route(old, None) == new  # outside a scheduled function: the coordinator's calls
        with pipeline.pipelined() as pipe:
            pipe.generation = 0
            assert protocol.route(old, pipe.generation) == old
            pipe.generation = 1
            assert protocol.route(old, pipe.generation) == new
        other = ServerRef("tcp://127.0.0.1:3", server_key(1, "0123456789abcdef"), 1)
        assert protocol.route(other, 0) == other  # not moved
    finally:
        del ROUTES.moved[old.actor_key]
