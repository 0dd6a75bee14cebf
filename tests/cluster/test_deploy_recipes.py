"""The deployment recipes of docs/howto/cluster-managers.md: what each asks of Dask works, and each matches its library's current API."""

from __future__ import annotations

import inspect
import json
import signal
import urllib.request

import numpy as np
import pytest

import daskps as dps
from daskps.ui.plots import PAGES
from tests.helpers.cluster import dask_cli_cluster

PS = {"DASK_DISTRIBUTED__WORKER__RESOURCES__PS": "1"}
TRAINER = {"DASK_DISTRIBUTED__WORKER__RESOURCES__WORKER": "1"}
PRELOAD = {"DASK_DISTRIBUTED__SCHEDULER__PRELOAD": '["daskps.dashboard"]'}


@pytest.mark.cluster
def test_roles_and_the_dashboard_from_environment_variables_alone(tmp_path):
    """What the Kubernetes recipe relies on: no command-line flags, only Dask config from the environment."""
    with dask_cli_cluster(tmp_path, [PS, PS, TRAINER], scheduler_env=PRELOAD) as client:
        strategy = dps.ParameterServerStrategy(client)
        spec = strategy.cluster_resolver.cluster_spec()
        assert len(spec["ps"]) == 2 and len(spec["worker"]) == 1
        with strategy.scope():
            w = dps.Variable(np.zeros((8, 4), np.float32), name="w")  # on one server, whole
        coordinator = dps.ClusterCoordinator(strategy)
        for _ in range(5):
            coordinator.schedule(lambda: w.assign_add(np.ones((8, 4), np.float32)))
        coordinator.join()
        np.testing.assert_array_equal(w.numpy(), np.full((8, 4), 5, np.float32))
        base = client.dashboard_link.rsplit("/", 1)[0]
        plots = json.loads(urllib.request.urlopen(base + "/individual-plots.json").read())
        assert {"/individual-daskps", *PAGES} <= set(plots.values())  # the preload came from the environment


@pytest.fixture
def sigint_kept():
    """Importing ``dask_jobqueue`` installs its own SIGINT handler in this process (``dask_jobqueue.runner``,
    which exits): put Python's back, or a later test's simulated Ctrl-C ends in SystemExit."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def test_the_jobqueue_recipe_writes_job_scripts_with_the_roles(tmp_path, sigint_kept):
    jobqueue = pytest.importorskip("dask_jobqueue")  # in the test extra
    from dask_jobqueue.slurm import SLURMJob

    cluster = jobqueue.SLURMCluster(cores=4, memory="16GB", processes=1, walltime="04:00:00",
                                    worker_extra_args=["--resources", "ps=1"],
                                    scheduler_options={"host": "127.0.0.1", "port": 0,
                                                       "dashboard_address": "127.0.0.1:0",
                                                       "preload": ["daskps.dashboard"]})
    try:
        assert cluster.job_script().rstrip().endswith("--resources ps=1")
        trainer = SLURMJob(scheduler=cluster.scheduler_address, name="trainer", cores=8, memory="32GB",
                           processes=1, walltime="04:00:00", worker_extra_args=["--resources", "worker=1"])
        script = trainer.job_script()
        assert cluster.scheduler_address in script and script.rstrip().endswith("--resources worker=1")
        base = cluster.dashboard_link.rsplit("/", 1)[0]
        plots = json.loads(urllib.request.urlopen(base + "/individual-plots.json").read())
        assert "/individual-daskps" in plots.values()
    finally:
        cluster.close()


def test_the_kubernetes_recipe_matches_the_operator_api():
    operator = pytest.importorskip("dask_kubernetes.operator")  # in the test extra; no Kubernetes needed
    for name in ("name", "n_workers", "env", "resources"):
        assert name in inspect.signature(operator.KubeCluster).parameters
    group = inspect.signature(operator.KubeCluster.add_worker_group).parameters
    assert {"name", "n_workers", "env", "resources"} <= set(group)
    spec = operator.make_worker_spec(n_workers=2, env=PS, resources={"limits": {"memory": "8Gi"}})
    container = spec["spec"]["containers"][0]
    assert {"name": "DASK_DISTRIBUTED__WORKER__RESOURCES__PS", "value": "1"} in container["env"]
    assert container["args"][0] == "dask-worker" and spec["replicas"] == 2
    cluster = operator.make_cluster_spec(name="daskps", n_workers=4, env={**TRAINER, **PRELOAD})
    for role in ("scheduler", "worker"):
        env = cluster["spec"][role]["spec"]["containers"][0]["env"]
        assert {"name": "DASK_DISTRIBUTED__SCHEDULER__PRELOAD", "value": '["daskps.dashboard"]'} in env


def test_the_ssh_recipe_matches_distributed():
    from distributed import SpecCluster
    from distributed.deploy.ssh import Scheduler, Worker

    assert list(inspect.signature(Scheduler).parameters)[:3] == ["address", "connect_options", "kwargs"]
    assert list(inspect.signature(Worker).parameters)[:4] == ["scheduler", "address", "connect_options", "kwargs"]
    assert {"workers", "scheduler"} <= set(inspect.signature(SpecCluster).parameters)
