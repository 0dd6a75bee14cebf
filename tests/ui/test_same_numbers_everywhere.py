"""Every number, the same wherever it is shown: the table page, the plots (read in a real browser),
``/metrics``, the TensorBoard event file and the coordinator's own summary, after a run with a metric reset
every epoch, a parameter server killed and recovered, a function that fails, and two checkpoints.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request

import dask.config
import numpy as np
import pytest
from dask.utils import format_bytes

import daskps as dps
from tests.helpers.cluster import kill_worker, wait_for_recovery
from tests.helpers.events import read_scalars
from tests.helpers.waiting import wait_until

CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no {CHROMIUM} (apt-get install chromium)"), pytest.mark.cluster]

# Every data source of a page, in the browser: {source name: {column: [values]}}.
READ_SOURCES = """() => {
  if (!window.Bokeh || !Bokeh.documents || !Bokeh.documents.length) return null;
  const found = {};
  for (const m of Bokeh.documents[0].all_models) {
    if (m.data !== undefined && m.name && typeof m.get_length === "function") {
      const columns = {};
      for (const [k, v] of Object.entries(m.data)) columns[k] = Array.from(v);
      found[m.name] = columns;
    }
  }
  return found;
}"""
READ_TABLE = "() => (window.Bokeh && Bokeh.documents.length) ? Bokeh.documents[0].roots()[0].text : null"


def _scrape(base: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _series(samples, name, scheduler):
    return {dict(labels).get("server") or dict(labels).get("trainer") or dict(labels).get("strategy"): v
            for (n, labels), v in samples.items() if n == name and dict(labels)["scheduler"] == scheduler}


def _cells(table_html: str, heading: str) -> list[list[str]]:
    """The rows of the table after ``heading`` on the page, as cell texts."""
    part = table_html.split(f"<h3>{heading}</h3>", 1)[1].split("</table>", 1)[0]
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", part)
            if "<td" in row]


def _step(x, table, w, opt, loss, i):
    ids = np.array([i % 50, (i * 7) % 50, 3])
    rows, w_now = dps.read_values([(table, ids), w])
    err = rows @ w_now - 1.0
    opt.apply_gradients([(dps.IndexedSlices(np.outer(err, w_now) / 3, ids), table), (rows.T @ err / 3, w)])
    if loss is not None:
        loss.update_state(float(np.mean(err ** 2)) + 1e-3)  # > 0 always: a 0 anywhere is a spurious one


def _fails():
    raise ValueError("a bad batch, on purpose")


@pytest.mark.timeout(600)
def test_every_surface_shows_the_same_numbers(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    logdir = tmp_path / "tb"
    with dask.config.set({"daskps.metrics-interval": "200ms"}), pytest.warns(dps.errors.RollbackWarning), \
            dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster, cluster.get_client() as client:
        base = cluster.dashboard_link.rsplit("/", 1)[0]
        scheduler = cluster.scheduler_address
        strategy = dps.ParameterServerStrategy(client)
        with strategy.scope():
            w = dps.Variable(np.full(4, 0.1, np.float32), name="w")  # ps-0
            table = dps.Variable(np.full((50, 4), 0.1, np.float32), name="table")  # ps-1
            opt = dps.optimizers.Adam(0.01)  # slots: the bytes held are more than the values
            loss = dps.metrics.Mean(name="loss")
        manager = dps.CheckpointManager(dps.Checkpoint(w=w, table=table, opt=opt), str(tmp_path / "ck"))
        coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)
        logger = dps.summary.ScalarLogger(coordinator, str(logdir), {"loss": loss}, every_n_steps=10,
                                          interval=0.05).start()
        failed, empty_steps = 0, []
        for epoch in range(3):
            loss.reset_state()  # a Mean of nothing until the epoch's first update: never logged as 0
            before = coordinator.summary()["done"]
            for i in range(10):  # steps that leave the metric alone: the logger writes while it is empty
                coordinator.schedule(_step, args=(None, table, w, opt, None, i))
            coordinator.join()
            # 10 more done: a write (every_n_steps)
            wait_until(lambda before=before: not (not logger.steps or logger.steps[-1] <= before), 30,
                       failure=lambda: logger.steps, interval=0.02, collect=False)
            empty_steps.append(logger.steps[-1])
            for i in range(60):
                coordinator.schedule(_step, args=(None, table, w, opt, loss, i))
                if epoch == 1 and i == 30:
                    coordinator.schedule(_fails)
                if epoch == 2 and i == 20:
                    kill_worker(client, "ps-0")
                    wait_for_recovery(coordinator)
            try:
                coordinator.join()
            except ValueError as exc:
                assert "on purpose" in str(exc)
                failed += 1
            if epoch < 2:
                manager.save()  # two checkpoints
        coordinator.join()
        logger.stop()
        assert failed == 1 and len(coordinator.recoveries) == 1  # the failure and the kill both happened
        summary = coordinator.summary()
        assert summary["failed"] == 1  # (functions after the failing one in its
        assert summary["done"] + summary["cancelled"] == 210 and summary["done"] > 100  # batch are cancelled)

        # Quiet now: wait until the scheduler has the coordinator's final counts and a fresh look at the servers.
        def final(samples):
            done = _series(samples, "dask_daskps_functions_completed_total", scheduler)
            return (list(done.values()) == [summary["done"]]
                    and len(_series(samples, "dask_daskps_server_bytes", scheduler)) == 2)

        wait_until(lambda: final(_scrape(base)), 30, failure=lambda: _scrape(base), interval=0.2, collect=False)
        time.sleep(1.0)  # a few more ticks of the timeline at these numbers
        samples = _scrape(base)

        seen = {}
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1200, "height": 600})
            page.goto(base + "/individual-daskps")
            deadline = time.monotonic() + 30
            while not (text := page.evaluate(READ_TABLE)) or "ps-1" not in text or "worker-1" not in text:
                assert time.monotonic() < deadline, text
                page.wait_for_timeout(200)
            seen["table"] = text
            for route in ("servers", "trainers", "metrics"):
                page.goto(f"{base}/individual-daskps-{route}")
                deadline = time.monotonic() + 30
                while not (found := page.evaluate(READ_SOURCES)) or not any(
                        len(next(iter(c.values()), ())) > 1 for c in found.values()):
                    assert time.monotonic() < deadline, found
                    page.wait_for_timeout(200)
                page.wait_for_timeout(500)
                seen[route] = page.evaluate(READ_SOURCES)
            browser.close()
        scalars = read_scalars(logdir)

        # Bytes held per server (values and slots): the table, the plot and /metrics.
        held = _series(samples, "dask_daskps_server_bytes", scheduler)
        assert set(held) == {"ps-0", "ps-1"}
        table_servers = {row[0]: row for row in _cells(seen["table"], "daskps parameter servers")}
        bytes_plot = seen["servers"]["Bytes held (values and optimizer slots) data"]
        for server, value in held.items():
            assert table_servers[server][2] == format_bytes(int(value))
            assert bytes_plot[server][-1] == value
        # w, table and Adam's m and v of each (the values alone would be a third), the optimizer's iterations
        # (an int64, ps-0) and the metric's total and count (two float64, ps-1)
        assert held["ps-0"] == 3 * 4 * 4 + 8 and held["ps-1"] == 3 * 50 * 4 * 4 + 16
        # One strategy label for both servers, the re-created one too.
        tokens = {dict(labels)["strategy"] for (n, labels) in samples if n == "dask_daskps_server_bytes"
                  and dict(labels)["scheduler"] == scheduler}
        assert tokens == {strategy.token}

        # Per trainer: completed, failed, re-run on the table and in /metrics, named by worker name.
        trainers = {row[0]: row for row in _cells(seen["table"], "Trainers")}
        assert set(trainers) == {"worker-0", "worker-1"}
        for field, column in (("completed", 2), ("failed", 3), ("rerun", 4)):
            series = _series(samples, f"dask_daskps_trainer_functions_{field}_total", scheduler)
            assert set(series) == set(trainers)
            for name, value in series.items():
                assert trainers[name][column] == f"{int(value):,}"
        per_trainer = {f: sum(_series(samples, f"dask_daskps_trainer_functions_{f}_total", scheduler).values())
                       for f in ("completed", "failed", "rerun")}
        assert per_trainer["completed"] == summary["done"] and per_trainer["failed"] == 1
        # re-run per trainer: those that failed there; the strategy's count adds those queued again unrun
        # (none at all when every function had finished as the server went)
        assert per_trainer["rerun"] <= summary["rerun"]

        # Per strategy: the coordinator's summary, /metrics, the Trainers plot and TensorBoard.
        for field, name, tag in (("failed", "failed", "daskps/failed"), ("rerun", "rerun", "daskps/rerun")):
            assert _series(samples, f"dask_daskps_functions_{name}_total", scheduler) == {strategy.token: summary[field]}
            assert seen["trainers"]["Failed and re-run functions (all strategies) data"][
                "failed" if field == "failed" else "re-run"][-1] == summary[field]
            assert scalars[tag][-1][1] == summary[field]
        assert _series(samples, "dask_daskps_recoveries_total", scheduler) == {strategy.token: 1}
        assert _series(samples, "dask_daskps_checkpoint_saves_total", scheduler) == {None: 2}  # the two saves

        # The metric: the same (step, value) points in TensorBoard and on the Metrics plot, none a 0.
        logged = scalars["loss"]
        plotted = seen["metrics"]["Metrics (ScalarLogger), by step data"]
        points = [(int(s), v) for s, v in zip(plotted["step"], plotted["loss"]) if v == v]  # NaN: a gap
        assert [s for s, _ in logged] == [s for s, _ in points]
        assert all(np.float32(v) == np.float32(tv) for (_, v), (_, tv) in zip(points, logged))
        assert all(v > 0 for _, v in logged)
        # written while the Mean was empty: no point in TensorBoard, a gap (NaN) on the plot, at each epoch start
        gaps = [int(s) for s, v in zip(plotted["step"], plotted["loss"]) if v != v]
        assert set(empty_steps) <= set(gaps) and not set(empty_steps) & {s for s, _ in logged}
        assert set(empty_steps) <= {s for s, _ in scalars["daskps/failed"]}  # those steps were written
        strategy.close()
