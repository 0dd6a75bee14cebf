"""The scheduler's /metrics (Dask's Prometheus endpoint) shows daskps' documented series, and they grow."""

from __future__ import annotations

import re
import time
import urllib.request

import distributed
import numpy as np
import pytest

import daskps as dps
from daskps.ui.prometheus import METRICS

pytest.importorskip("prometheus_client")  # in the test extra: this runs in CI
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.helpers.paths import ROOT
from tests.helpers.waiting import wait_until


def scrape(cluster) -> dict[tuple[str, tuple], float]:
    """Every sample on the scheduler's /metrics: (name, sorted labels) -> value."""
    url = cluster.dashboard_link.replace("/status", "/metrics")
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


SCHEDULER: list[str] = []  # the address of this test's scheduler: a process may run others (the suite's own)


def daskps_samples(samples, name):
    return {labels: v for (n, labels), v in samples.items()
            if n == name and dict(labels).get("scheduler") in SCHEDULER}


@pytest.mark.cluster
def test_metrics_endpoint_shows_daskps_during_training(tmp_path):
    import dask.config

    with dask.config.set({"daskps.metrics-interval": "100ms"}), \
            dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster, cluster.get_client() as client:
        assert "127.0.0.1" in cluster.dashboard_link
        SCHEDULER[:] = [cluster.scheduler_address]
        strategy = dps.ParameterServerStrategy(client)
        with strategy.scope():
            w = dps.Variable(np.zeros((256, 64), np.float32), name="w")
            b = dps.Variable(np.zeros(64, np.float32), name="b")
            opt = dps.optimizers.SGD(0.01)
        coordinator = dps.ClusterCoordinator(strategy)

        def step():
            w_now, _ = dps.read_values([w, b])
            opt.apply_gradients([(np.ones_like(w_now), w), (np.ones(64, np.float32), b)])

        def train(n):
            for _ in range(n):
                coordinator.schedule(step)
            coordinator.join()

        def scrape_when(n, saves):
            """/metrics once it shows ``n`` functions done and their pushes received, and ``saves`` saves (the
            coordinator sends its counts at most twice a second, the servers are asked every 100 ms)."""
            seen = {}

            def shown():
                seen["samples"] = samples = scrape(cluster)
                seen["done"] = done = daskps_samples(samples, "dask_daskps_functions_completed_total")
                seen["received"] = received = daskps_samples(samples, "dask_daskps_server_bytes_received_total")
                seen["saved"] = saved = daskps_samples(samples, "dask_daskps_checkpoint_saves_total")
                return (list(done.values()) == [n] and sum(received.values()) == n * (256 + 65536)
                        and sum(saved.values()) == saves)

            wait_until(shown, 15, failure=lambda: (n, seen["done"], seen["received"], seen["saved"]), interval=0.1,
                       collect=False)
            return seen["samples"]

        train(20)
        first = scrape_when(20, 0)
        train(30)
        dps.Checkpoint(w=w, b=b).write(str(tmp_path / "ckpt"))
        second = scrape_when(50, 1)

    prefix = "dask_daskps_"
    for name, kind, _, _ in METRICS:
        full = prefix + name + ("_total" if kind == "counter" else "")
        if name != "checkpoint_last_save_seconds":  # shown once a checkpoint was written
            assert daskps_samples(first, full), f"{full} missing from /metrics"
        assert daskps_samples(second, full), f"{full} missing from /metrics"

    token = strategy.token
    def one(samples, name, **labels):
        found = [v for ls, v in daskps_samples(samples, prefix + name).items()
                 if all(dict(ls).get(k) == x for k, x in labels.items())]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    assert one(first, "functions_scheduled_total", strategy=token) == 20
    assert one(first, "functions_completed_total", strategy=token) == 20
    assert one(second, "functions_scheduled_total", strategy=token) == 50
    assert one(second, "functions_completed_total", strategy=token) == 50
    assert one(second, "functions_failed_total", strategy=token) == 0
    assert one(second, "functions_in_flight", strategy=token) == 0
    assert sum(daskps_samples(second, prefix + "trainer_functions_completed_total").values()) == 50
    servers = {dict(ls)["server"] for ls in daskps_samples(second, prefix + "server_bytes")}
    assert servers == {"ps-0", "ps-1"}
    # w (64 KiB) on one server, b (256 bytes) on the other, the optimizer's step count (8 bytes); SGD keeps no slots
    held = sorted(daskps_samples(second, prefix + "server_bytes").values())
    assert sum(held) == 256 + 256 * 64 * 4 + 8 and held[1] >= 256 * 64 * 4
    for name in ("server_reads_total", "server_updates_total", "server_bytes_sent_total",
                 "server_bytes_received_total", "server_messages_total"):
        before, after = daskps_samples(first, prefix + name), daskps_samples(second, prefix + name)
        assert len(before) == 2 and all(after[k] > before[k] for k in before), name  # both servers' counts grew
    # every step reads w and b whole and pushes a gradient of each: 20 steps, then 50 in all
    sent = {dict(ls)["server"]: v for ls, v in daskps_samples(second, prefix + "server_bytes_sent_total").items()}
    received = {dict(ls)["server"]: v for ls, v in daskps_samples(second, prefix + "server_bytes_received_total").items()}
    small, large = sorted(sent.values())  # each at least its reads (a list >= compares the first only)
    assert small >= 50 * 256 and large >= 50 * 65536  # plus the checkpoint's and the tests' reads
    assert sorted(received.values()) == [50 * 256, 50 * 65536]
    assert sorted(daskps_samples(second, prefix + "server_up").values()) == [1, 1]
    assert one(second, "checkpoint_saves_total") == 1
    assert one(second, "checkpoint_bytes_total") == 256 + 65536
    assert 0 < one(second, "checkpoint_last_save_seconds") == one(second, "checkpoint_save_seconds_total") < 60
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", dict(next(iter(daskps_samples(second, prefix + "server_up"))))["scheduler"])


def test_the_docs_document_every_series():

    readme = (ROOT / "docs" / "user-guide" / "dashboard.md").read_text()
    for name, kind, labels, _ in METRICS:
        full = f"dask_daskps_{name}{'_total' if kind == 'counter' else ''}"
        assert f"| `{full}` | {kind} | {', '.join(['scheduler', *labels])} |" in readme, full


@pytest.mark.cluster
def test_a_plugin_removed_by_hand_stops_refreshing_and_leaves_metrics():
    """Dask's ``remove_plugin`` calls no ``close``: the plugin notices, stops asking the servers, and its
    series leave ``/metrics``."""
    import dask.config

    with dask.config.set({"daskps.metrics-interval": "100ms"}), \
            dps.LocalPSCluster(num_ps=1, num_workers=1) as cluster, cluster.get_client() as client:
        SCHEDULER[:] = [cluster.scheduler_address]
        strategy = dps.ParameterServerStrategy(client)
        with strategy.scope():
            dps.Variable(np.zeros(4, np.float32), name="v")
        plugin = cluster.scheduler.plugins["daskps"]

        def last_tick():
            return plugin.telemetry.timeline.ticks[-1].time if plugin.telemetry.timeline.ticks else 0.0

        wait_until(lambda: last_tick() != 0.0, 20, failure="the plugin never ticked", collect=False)
        first = last_tick()
        time.sleep(0.5)
        assert last_tick() > first  # refreshing while registered
        assert daskps_samples(scrape(cluster), "dask_daskps_server_up")
        client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.remove_plugin("daskps"))
        time.sleep(0.5)  # the refresher looks once per 100 ms
        stopped = last_tick()
        time.sleep(0.5)
        assert last_tick() == stopped
        assert not daskps_samples(scrape(cluster), "dask_daskps_server_up")


@pytest.mark.cluster
def test_a_checkpoint_is_counted_by_the_scheduler_of_its_variables_not_the_default_clients(tmp_path):
    with dps.LocalPSCluster(num_ps=1, num_workers=1) as ours, ours.get_client() as client, \
            dps.LocalPSCluster(num_ps=1, num_workers=1) as other, other.get_client() as other_client:
        assert distributed.default_client() is other_client  # the newest client is the default
        dps.ParameterServerStrategy(other_client)  # its scheduler counts checkpoints too
        strategy = dps.ParameterServerStrategy(client)
        with strategy.scope():
            v = dps.Variable(np.zeros(4, np.float32), name="v")
        dps.Checkpoint(v=v).write(str(tmp_path / "ckpt"))

        def saves(cluster):
            return cluster.scheduler.plugins["daskps"].telemetry.checkpoint_saves["count"]

        wait_until(lambda: saves(ours) == 1, 10, failure=lambda: f"{saves(ours)} saves counted", collect=False)
        assert saves(other) == 0  # (its event went to ours: had it gone to the other, it would be there by now)
