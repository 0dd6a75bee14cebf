"""Shared cluster fixtures: real LocalPSClusters, real worker processes."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import dask
import numpy as np
import pytest
from _pytest.doctest import DoctestItem
from distributed import Client

# Keras 3 runs on JAX in the tests (its default backend, TensorFlow, is not installed); worker
# processes inherit this.
os.environ.setdefault("KERAS_BACKEND", "jax")

import daskps as dps
from daskps._core.transforms import SGDState
from daskps.distribute.cluster import cluster_workers

from .helpers.waiting import wait_until

# Worker processes of the clusters made here fork from one process that has imported Dask, numpy and
# pandas already (Dask's own test suite does the same): a cluster starts in 0.4 s instead of 2 s. Scripts
# and notebooks the tests run in a process of their own keep Dask's default (spawn).
dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})

# tests/data holds generated fixtures and the script (needing TensorFlow) that makes them.
collect_ignore_glob = ["data/*", "mutation/*"]  # mutation/: tools for mutation testing (tests/README.md)


# -- `pytest --in-process`: the tests that start no cluster and no process (mutation testing's selection)
# A test starts a cluster or a process when it takes one of these fixtures, or carries the `cluster` mark
# (pyproject.toml registers it; a module whose every test does sets it in `pytestmark`).
_CLUSTER_FIXTURES = {"cluster", "client", "strategy", "coordinator", "fresh_cluster"}
# A guard, not the selection: words in a test's source (or its module's helpers') that start a cluster or a
# process. A test --in-process selects whose source has one lacks its mark, and the run stops, naming it.
_STARTS_PROCESSES = ("LocalPSCluster", "Client(", "Scheduler(", "Worker(", "dask_cli_cluster", "subprocess", "Popen",
                     "two_ps_training", "sys.executable", "nbclient", "playwright", "sphinx")


def pytest_addoption(parser):
    parser.addoption("--in-process", action="store_true",
                     help="run only the tests that start no cluster and no other process")
    parser.addoption("--and-cluster-tests-in", action="append", default=[], metavar="FILE",
                     help="with --in-process: keep every test of FILE too (mutation testing of cluster-bound code)")


def _starts_processes(fn, seen=None) -> bool:
    """Whether ``fn``, or a function of its module that it calls, has a word of ``_STARTS_PROCESSES``."""
    seen = set() if seen is None else seen
    if fn in seen:
        return False
    seen.add(fn)
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if any(word in source for word in _STARTS_PROCESSES):
        return True
    module = inspect.getmodule(fn)
    helpers = [getattr(module, name, None) for name in getattr(fn, "__code__", None) and fn.__code__.co_names or ()]
    return any(_starts_processes(h, seen) for h in helpers
               if inspect.isfunction(h) and inspect.getmodule(h) is module)


def _in_process(item) -> bool:
    """By its mark and its fixtures: whether the test starts no cluster and no process."""
    if isinstance(item, DoctestItem):
        return True
    return (isinstance(item, pytest.Function) and item.get_closest_marker("cluster") is None
            and not _CLUSTER_FIXTURES & set(item.fixturenames))


def _unmarked(item) -> bool:
    """A test selected as in-process whose code (or a fixture's) looks as if it started a process."""
    if isinstance(item, DoctestItem):
        return False
    manager = item.session._fixturemanager
    return _starts_processes(item.function) or any(
        _starts_processes(d.func) for name in item.fixturenames for d in manager.getfixturedefs(name, item) or ()
        if d.baseid)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--in-process"):
        return
    files = {pathlib.Path(f).resolve() for f in config.getoption("--and-cluster-tests-in")}
    keep = [item for item in items if _in_process(item) or item.path.resolve() in files]
    unmarked = [item.nodeid for item in keep if item.path.resolve() not in files and _unmarked(item)]
    if unmarked:
        raise pytest.UsageError("these tests start a cluster or a process but carry no @pytest.mark.cluster: "
                                + ", ".join(unmarked))
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


@pytest.fixture(scope="session")
def cluster():
    """A 2-ps, 2-worker cluster shared by tests that do not break it.

    Under mutmut (``MUTANT_UNDER_TEST`` set), or with ``DASKPS_TEST_THREAD_WORKERS=1``, its workers are threads
    of this process: the code they run is then seen by mutmut's coverage map, and a cluster starts in a
    fraction of the time. Tests that kill workers have clusters of their own, with processes.
    """
    threads = bool(os.environ.get("MUTANT_UNDER_TEST")) or os.environ.get("DASKPS_TEST_THREAD_WORKERS") == "1"
    with dps.LocalPSCluster(num_ps=2, num_workers=2, processes=not threads) as c:
        yield c


@pytest.fixture(scope="session")
def client(cluster):
    with Client(cluster) as c:
        yield c


@pytest.fixture
def strategy(client):
    return dps.ParameterServerStrategy(client)


@pytest.fixture
def coordinator(strategy):
    return dps.ClusterCoordinator(strategy)


@pytest.fixture
def fresh_cluster():
    """A cluster of its own, for tests that kill workers."""
    with dps.LocalPSCluster(num_ps=2, num_workers=2) as c:
        with Client(c) as cl:
            yield c, cl


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
    wait_until(sched_file.exists, 60, failure="dask scheduler did not start", collect=False)
    return json.loads(sched_file.read_text())["address"]


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
            procs.append(_start(["distributed.cli.dask_worker", address, "--host", "127.0.0.1",
                                 "--nthreads", "1", *flag, "--no-dashboard",
                                 "--dashboard-address", "127.0.0.1:0"],  # its HTTP server stays up
                                {**env, **(worker_env or {}), **own}))
        with Client(address) as client:
            client.wait_for_workers(len(resources), timeout=60)
            yield client
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


class PickySGD(NamedTuple):
    """SGD that refuses negative gradients on the server (the client cannot know): a push the server refuses."""

    learning_rate: float = 1.0

    def init(self, param):
        return SGDState(0, None)

    def update(self, grad, state, param):
        if np.any(grad < 0):
            raise ValueError("negative gradient refused")
        return grad * -param.dtype.type(self.learning_rate), SGDState(state.count + 1)
