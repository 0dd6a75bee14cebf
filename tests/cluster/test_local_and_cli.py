"""LocalPSCluster, DaskClusterResolver, and the CLI recipe with real processes."""

import os
import subprocess
import sys
import urllib.request

import numpy as np
import psutil
import pytest

import daskps as dps
from daskps.distribute.cluster import cluster_workers
from tests.helpers.cluster import dask_cli_cluster, kill_worker, wait_for_worker

pytestmark = pytest.mark.cluster  # every test here starts a cluster or a process


def test_workers_have_their_resources_and_names(client):
    workers = cluster_workers(client).values()
    by_name = {w["name"]: w["resources"] for w in workers}
    assert by_name == {"ps-0": {"ps": 1}, "ps-1": {"ps": 1}, "worker-0": {"worker": 1}, "worker-1": {"worker": 1}}


def test_everything_binds_to_loopback(cluster, client):
    assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    assert cluster.dashboard_link.startswith("http://127.0.0.1:")
    for addr in cluster_workers(client):
        assert addr.startswith("tcp://127.0.0.1:")
    for nanny in cluster.workers.values():
        assert nanny.address.startswith("tcp://127.0.0.1:")


def test_dashboard_answers_on_loopback(cluster):
    with urllib.request.urlopen(cluster.dashboard_link.replace("/status", "/health"), timeout=10) as r:
        assert r.read() == b"ok"


@pytest.mark.parametrize(
    "kwargs, match",
    [({"num_ps": -1}, "num_ps"), ({"num_workers": "2"}, "num_workers"), ({"threads_per_worker": 0}, "threads_per_worker")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dps.LocalPSCluster(**kwargs)


def test_killed_worker_comes_back(fresh_cluster):
    cluster, client = fresh_cluster
    old = kill_worker(client, "worker-0")
    new = wait_for_worker(client, "worker-0", old)
    info = cluster_workers(client)[new]
    assert info["resources"] == {"worker": 1}


def test_resolver_cluster_spec(client):
    resolver = dps.DaskClusterResolver(client)
    spec = resolver.cluster_spec()
    assert set(spec) == {"chief", "ps", "worker"}
    assert len(spec["ps"]) == 2 and len(spec["worker"]) == 2 and len(spec["chief"]) == 1
    assert resolver.task_type == "chief" and resolver.task_id == 0
    assert resolver.num_ps == 2 and resolver.num_workers == 2


def test_resolver_with_other_resource_names(client):
    resolver = dps.DaskClusterResolver(client, ps_resource="worker", worker_resource="ps")
    assert resolver.cluster_spec()["ps"] == dps.DaskClusterResolver(client).cluster_spec()["worker"]


def test_resolver_validates_arguments(client):
    with pytest.raises(TypeError, match="client"):
        dps.DaskClusterResolver("tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="ps_resource"):
        dps.DaskClusterResolver(client, ps_resource="")
    with pytest.raises(ValueError, match="differ"):
        dps.DaskClusterResolver(client, ps_resource="x", worker_resource="x")


def test_cli_recipe_dask_scheduler_and_workers(tmp_path):
    """The multi-machine recipe (docs/howto/cluster.md), on one machine: real dask CLI processes."""
    with dask_cli_cluster(tmp_path, ["ps=1", "worker=1", "worker=1"]) as client:
        strategy = dps.ParameterServerStrategy(client)
        coordinator = dps.ClusterCoordinator(strategy)
        with strategy.scope():
            v = dps.Variable(np.zeros(3, np.float32))
        for _ in range(10):
            coordinator.schedule(lambda: v.assign_add(np.ones(3, np.float32)))
        coordinator.join()
        np.testing.assert_array_equal(v.numpy(), np.full(3, 10.0))


UNGUARDED_SCRIPT = """\
import daskps as dps

cluster = dps.LocalPSCluster(num_ps=2, num_workers=2)
print("training")
"""


@pytest.mark.timeout(180)
def test_a_script_without_the_main_guard_gets_one_clear_error(tmp_path):
    """Worker processes re-run a script's top level: without the guard, one short error names it, instead
    of Dask's tracebacks from every worker process ending in "Nanny failed to start"."""
    script = tmp_path / "script.py"
    script.write_text(UNGUARDED_SCRIPT)
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where the worker processes leave their mark
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=150)
    assert out.returncode != 0 and "training" not in out.stdout
    assert f"RuntimeError: LocalPSCluster was started while a worker process imported your script {script}" in out.stderr
    assert out.stderr.rstrip().endswith('under if __name__ == "__main__":'), out.stderr
    assert out.stderr.count("Traceback") == 1 and "Nanny" not in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) <= 12, out.stderr
    assert not list(tmp_path.glob("daskps-unguarded-*")), "the mark is left behind"


def _listening(pids):
    """``(pid, ip)`` of every TCP socket these processes listen on."""
    out = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                out.append((pid, conn.laddr.ip))
    return out


def _everything_listens_on_loopback(client):
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        v = dps.Variable(np.zeros(3, np.float32))
    coordinator = dps.ClusterCoordinator(strategy)
    coordinator.schedule(lambda: v.assign_add(np.ones(3, np.float32))).fetch()  # channels open, servers up
    pids = set(client.run(os.getpid).values()) | {client.run_on_scheduler(os.getpid)}
    pids |= {p.ppid() for p in map(psutil.Process, list(pids))} - {os.getpid(), 1}  # nannies
    found = _listening(pids)
    assert len({pid for pid, _ in found}) >= 3, found  # the check saw the servers
    assert {ip for _, ip in found} == {"127.0.0.1"}, found
    strategy.close()


def test_a_local_cluster_listens_on_loopback_only(cluster, client):
    _everything_listens_on_loopback(client)


@pytest.mark.timeout(180)
def test_the_cli_recipe_listens_on_loopback_only(tmp_path):
    with dask_cli_cluster(tmp_path, ["ps=1", "worker=1"]) as client:
        _everything_listens_on_loopback(client)
