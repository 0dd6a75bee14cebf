"""LocalPSCluster(security=...): TLS end to end, parameter-server traffic included."""

from __future__ import annotations

import asyncio
import ssl

import numpy as np
import pytest
from distributed.comm import connect
from distributed.security import Security

import daskps as dps
from daskps.distribute.cluster import cluster_workers

pytestmark = pytest.mark.cluster  # every test here starts a cluster or a process

pytest.importorskip("cryptography")  # the [tls] extra (in [test] too)


def test_a_tls_cluster_trains_and_refuses_clients_without_its_certificates():
    with dps.LocalPSCluster(num_ps=2, num_workers=2, security=Security.temporary()) as cluster:
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        with cluster.get_client() as client:
            workers = cluster_workers(client)
            assert len(workers) == 4 and all(addr.startswith("tls://127.0.0.1:") for addr in workers)
            with dps.ParameterServerStrategy(client, variable_partitioner=dps.partitioners.FixedShardsPartitioner(2)) as strategy:
                assert all(server.channel is None for server in strategy.servers)  # no plain-TCP side door
                coordinator = dps.ClusterCoordinator(strategy)
                with strategy.scope():
                    w = dps.Variable(np.zeros((4, 2), np.float32), name="w")
                    opt = dps.optimizers.SGD(0.5)

                def step():
                    opt.apply_gradients([(np.ones((4, 2), np.float32), w)])
                    return float(np.asarray(w).sum())

                results = [coordinator.schedule(step) for _ in range(10)]
                coordinator.join()
                np.testing.assert_allclose(w.numpy(), np.full((4, 2), -5.0))
                assert min(r.fetch() for r in results) < 0
        address = cluster.scheduler_address
        no_cert = ssl.create_default_context()  # TLS, but no certificate of ours to show
        no_cert.check_hostname, no_cert.verify_mode = False, ssl.CERT_NONE
        for refused in ({"ssl_context": no_cert}, Security.temporary().get_connection_args("client")):
            with pytest.raises(OSError):
                asyncio.run(_ask_identity(address, refused))
        assert asyncio.run(_ask_identity(address, cluster.security.get_connection_args("client")))["type"] == "Scheduler"


async def _ask_identity(address, connection_args):
    comm = await connect(address, timeout="5s", **connection_args)
    try:
        await comm.write({"op": "identity"})
        return await comm.read()
    finally:
        comm.abort()


def test_security_true_makes_a_temporary_authority():
    with dps.LocalPSCluster(num_ps=1, num_workers=1, security=True, processes=False) as cluster:
        assert cluster.scheduler_address.startswith("tls://")
        assert cluster.security.require_encryption
        with cluster.get_client() as client, dps.ParameterServerStrategy(client) as strategy:
            with strategy.scope():
                v = dps.Variable([1.0, 2.0])
            v.assign_add([1.0, 1.0])
            np.testing.assert_array_equal(v.numpy(), [2.0, 3.0])


def test_security_must_be_a_security_object():
    with pytest.raises(TypeError, match="security must be a distributed.Security"):
        dps.LocalPSCluster(num_ps=1, num_workers=1, security="yes")


def test_a_tls_cluster_trains_while_another_clusters_client_is_current(client):
    """Another cluster's client entered as the current one (``with Client(...)``, the session fixture's):
    the strategy's servers still talk through the TLS cluster's own client. They were bound to the current
    client, whose plain-TCP scheduler cannot reach a TLS worker ("TLS expects a ssl_context ...")."""
    from distributed import default_client

    assert default_client() is client  # the other cluster's client is the current one
    with dps.LocalPSCluster(num_ps=1, num_workers=1, security=True) as cluster:
        assert cluster.scheduler_address.startswith("tls://")
        strategy = dps.ParameterServerStrategy(cluster)
        coordinator = dps.ClusterCoordinator(strategy)
        with strategy.scope():
            w = dps.Variable(np.zeros(3, np.float32), name="w")
        for _ in range(5):
            coordinator.schedule(lambda: w.assign_add(np.ones(3, np.float32)))
        coordinator.join()
        np.testing.assert_array_equal(w.numpy(), np.full(3, 5.0, np.float32))
        strategy.close()
