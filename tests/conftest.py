"""Shared cluster fixtures: real LocalPSClusters, real worker processes."""

from __future__ import annotations

import os
import signal
import time

import pytest
from distributed import Client

import daskps as dps

# tests/data holds generated fixtures and the script (needing TensorFlow) that makes them.
collect_ignore_glob = ["data/*"]


@pytest.fixture(scope="session")
def cluster():
    """A 2-ps, 2-worker cluster shared by tests that do not break it."""
    with dps.LocalPSCluster(num_ps=2, num_workers=2) as c:
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
    for addr, info in client.scheduler_info(n_workers=-1)["workers"].items():
        if info["name"] == name:
            return addr
    raise LookupError(name)


def kill_worker(client: Client, name: str) -> str:
    """SIGKILL the worker process called ``name``; return its old address."""
    addr = worker_address(client, name)
    pid = client.run(os.getpid, workers=[addr])[addr]
    os.kill(pid, signal.SIGKILL)
    return addr


def wait_for_worker(client: Client, name: str, old_address: str, timeout: float = 60) -> str:
    """Wait until the Nanny has brought ``name`` back at a new address."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            addr = worker_address(client, name)
            if addr != old_address:
                return addr
        except LookupError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"worker {name} did not come back in {timeout}s")
