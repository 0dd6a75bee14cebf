"""Helpers for tests on real clusters: finding, killing and waiting for workers; training that two
parameter servers share; a ``dask scheduler`` and ``dask worker`` processes started from the command line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np
from distributed import Client

import daskps as dps
from daskps._core.transforms import SGDState
from daskps.distribute.cluster import cluster_workers

from .waiting import wait_until


def worker_address(client: Client, name: str) -> str:
    for addr, info in cluster_workers(client).items():
        if info["name"] == name:
            return addr
    raise LookupError(name)


def datasets_built(dask_worker) -> list[str]:
    """The ids of the per-worker datasets built on ``dask_worker`` (run it with ``client.run``)."""
    from daskps.client.worker_state import existing_part

    state = existing_part(dask_worker, "datasets")
    return sorted(state.datasets) if state is not None else []


def worker_pid(client: Client, name: str) -> int:
    """The process id of the worker called ``name`` (asked ahead, a kill is one system call)."""
    addr = worker_address(client, name)
    return client.run(os.getpid, workers=[addr])[addr]


async def _set_worker_resource(amount, dask_worker=None):
    await dask_worker.set_resources(worker=amount)


def set_trainer_slots(client: Client, name: str, amount: int) -> None:
    """Give trainer ``name`` ``amount`` of the ``worker`` resource: 0 sends no batch there (Dask might
    otherwise give a lone batch to either idle trainer)."""
    client.run(_set_worker_resource, amount, workers=[worker_address(client, name)])


def kill_worker(client: Client, name: str) -> str:
    """SIGKILL the worker process called ``name``; return its old address."""
    addr = worker_address(client, name)
    os.kill(worker_pid(client, name), signal.SIGKILL)
    return addr


def wait_done(coordinator, n: int, timeout: float = 60) -> None:
    """Wait until ``coordinator`` has finished ``n`` functions."""
    wait_for_summary(coordinator, lambda s: s["done"] >= n, timeout)


def wait_for_summary(coordinator, ok, timeout: float = 60) -> None:
    """Wait until ``ok(coordinator.summary())`` (which raises nothing, unlike join())."""
    wait_until(lambda: ok(coordinator.summary()), timeout, failure=lambda: coordinator.summary(), interval=0.01,
               collect=False)


def wait_for_recovery(coordinator, count: int = 1, timeout: float = 60) -> None:
    """Wait until ``coordinator`` is recovering from a loss, or has recovered from ``count`` of them.

    After a SIGKILL, before ``join()``: the functions still pending may all
    finish before the loss is noticed, and ``join()`` would then return at once.
    """
    wait_until(lambda: coordinator.recovery_state.name == "RECOVERING" or len(coordinator.recoveries) >= count,
               timeout, failure="a parameter server was killed, but no recovery began", interval=0.02, collect=False)


def kill_for_good(cluster, client: Client, name: str) -> str:
    """SIGKILL the worker ``name`` after telling its Nanny not to restart it: a machine gone for good."""
    cluster.workers[name].close_gracefully(reason="test: gone for good")
    return kill_worker(client, name)


def one_checkpointed_variable(client: Client, directory):
    """A strategy on ``client`` with one variable ``a`` (0.0), a CheckpointManager of it in ``directory``, and
    a coordinator that recovers from it: ``(strategy, a, manager, coordinator)``."""
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        a = dps.Variable(0.0, name="a")
    manager = dps.CheckpointManager(dps.Checkpoint(a=a), str(directory))
    return strategy, a, manager, dps.ClusterCoordinator(strategy, checkpoint_manager=manager)


def two_ps_training(client: Client, directory, sleep: float = 0.0, saved_after: int = 0):
    """Variable ``a`` on ps-0 and ``b`` on ps-1, a checkpoint manager in ``directory``, its coordinator,
    and a step adding 1 to both (``step(i)`` returns ``i``): ``(strategy, a, b, manager, coordinator, step)``.

    With ``saved_after``, that many steps have run and been saved in a checkpoint.
    """
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        a = dps.Variable(0.0, name="a")  # ps-0
        b = dps.Variable(0.0, name="b")  # ps-1
    manager = dps.CheckpointManager(dps.Checkpoint(a=a, b=b), str(directory))
    coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)

    def step(i=None):
        time.sleep(sleep)
        a.assign_add(1.0)
        b.assign_add(1.0)
        return i

    if saved_after:
        for _ in range(saved_after):
            coordinator.schedule(step)
        coordinator.join()
        manager.save()
    return strategy, a, b, manager, coordinator, step


def _running(address: str, dask_scheduler=None) -> bool:
    ws = dask_scheduler.workers.get(address)
    return ws is not None and ws.status.name == "running"


def wait_for_worker(client: Client, name: str, old_address: str | None, timeout: float = 60) -> str:
    """Wait until the Nanny has brought ``name`` back at a new address (or a new worker ``name`` came),
    and the scheduler sees it running (a worker still starting, its plugins being set up, takes no tasks)."""
    def back() -> str | None:
        try:
            addr = worker_address(client, name)
        except LookupError:
            return None
        return addr if addr != old_address and client.run_on_scheduler(_running, addr) else None

    return wait_until(back, timeout, failure=f"worker {name} did not come back in {timeout}s", interval=0.1,
                      collect=False)


def _start(args, env):
    return subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_dask_scheduler(tmp_path, procs: list, env, args=()) -> str:
    """``dask scheduler`` on 127.0.0.1 (its process appended to ``procs``); its address once it is up."""
    sched_file = tmp_path / "scheduler.json"
    procs.append(_start(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
                         "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(sched_file), *args], env))

    def address() -> str | None:  # the file appears before Dask has written it: wait for the whole of it
        try:
            return json.loads(sched_file.read_text())["address"]
        except (OSError, ValueError, KeyError):
            return None

    return wait_until(address, 60, failure="dask scheduler did not start", collect=False)


@contextlib.contextmanager
def dask_cli_cluster(tmp_path, resources, scheduler_args=(), worker_env=None, scheduler_env=None):
    """A real ``dask scheduler`` and one ``dask worker`` per resource, on 127.0.0.1; yields a Client.

    ``worker_env``: environment variables of the worker processes only. A
    resource given as a dict is a worker started with no ``--resources`` and
    those environment variables instead. ``scheduler_env``: the scheduler's.
    """
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    procs: list[subprocess.Popen] = []
    try:
        address = start_dask_scheduler(tmp_path, procs, {**env, **(scheduler_env or {})}, scheduler_args)
        for resource in resources:
            flag = [] if isinstance(resource, dict) else ["--resources", resource]
            own = resource if isinstance(resource, dict) else {}
            procs.append(start_dask_worker(address, {**env, **(worker_env or {}), **own}, *flag))
        with Client(address) as client:
            client.wait_for_workers(len(resources), timeout=60)
            yield client
    finally:
        stop_processes(procs)


def start_dask_worker(address: str, env, *args: str, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """``dask worker`` (with its Nanny) on 127.0.0.1, one thread, ``args`` added (``--resources``, ``--name``)."""
    return subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--host", "127.0.0.1",
                             "--nthreads", "1", *args, "--no-dashboard",
                             "--dashboard-address", "127.0.0.1:0"],  # its HTTP server stays up
                            env=env, stdout=subprocess.DEVNULL, stderr=stderr)


def stop_processes(procs: list) -> None:
    """Terminate ``procs`` (the last started first), killing any that has not ended 30 s later."""
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


class PickySGD(NamedTuple):
    """SGD that refuses negative gradients on the server (the client cannot know): a push the server refuses."""

    learning_rate: float = 1.0

    def init(self, param):
        return SGDState(0, None)

    def update(self, grad, state, param):
        if np.any(grad < 0):
            raise ValueError("negative gradient refused")
        return grad * -param.dtype.type(self.learning_rate), SGDState(state.count + 1)
