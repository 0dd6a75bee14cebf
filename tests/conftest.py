"""Shared cluster fixtures: real LocalPSClusters, real worker processes."""

from __future__ import annotations

import inspect
import multiprocessing
import os
import pathlib

import dask
import pytest
from _pytest.doctest import DoctestItem
from distributed import Client
from distributed.utils import get_mp_context

# Keras 3 runs on JAX in the tests (its default backend, TensorFlow, is not installed); worker
# processes inherit this.
os.environ.setdefault("KERAS_BACKEND", "jax")

import daskps as dps

# Worker processes of the clusters made here fork from one process that has imported Dask, numpy and
# pandas already (Dask's own test suite does the same): a cluster starts in 0.4 s instead of 2 s. Scripts
# and notebooks the tests run in a process of their own keep Dask's default (spawn).
dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
# ...and that process has imported daskps too (which each worker imports for its plugin): Dask's own list,
# set on first use, is replaced here (it is read once, when the fork server starts).
get_mp_context()
multiprocessing.get_context("forkserver").set_forkserver_preload(["distributed", "pandas", "daskps"])

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


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    if config.getoption("--in-process"):  # under a minute: one process (the selection is made per process)
        config.option.numprocesses = 0


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
