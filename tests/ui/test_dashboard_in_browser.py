"""The dashboard's plot pages seen as a person sees them: a real headless Chromium, during training.

Needs Debian's ``chromium`` (``/usr/bin/chromium``; the test command
of the README installs it where it can) and Playwright's Python package (in the
test extra; no browser download: Playwright drives that Chromium).
Set ``DASKPS_SCREENSHOTS=1`` to also write each page's screenshot to ``docs/``.
"""

from __future__ import annotations

import os
import re
import threading
import time

import numpy as np
import pytest

import daskps as dps
from daskps.ui.plots import PAGES
from tests.helpers.paths import ROOT

CHROMIUM = "/usr/bin/chromium"
DOCS = ROOT / "docs"
pytestmark = [pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no {CHROMIUM} (apt-get install chromium)"), pytest.mark.cluster]

# Each page's figures (by title, as the page names them) and the data sources that must hold points.
FIGURES = {
    "/individual-daskps-throughput": ["Functions completed per second", "Examples per second (reported by ScalarLogger)"],
    "/individual-daskps-metrics": ["Metrics (ScalarLogger), by step"],
    "/individual-daskps-servers": ["Bytes held (values and optimizer slots)", "Reads per second",
                                   "Updates per second (updates and gradients applied)",
                                   "Bytes received per second (updates and gradients)",
                                   "Bytes sent per second (values read)"],
    "/individual-daskps-shards": ["Reads and updates per second of each table or shard (the 40 busiest)"],
    "/individual-daskps-trainers": ["Functions completed per second, per trainer",
                                    "Function durations, latest 2,000 per trainer: percentiles",
                                    "Failed and re-run functions (all strategies)"],
}

# What the page's Bokeh document holds, read in the browser: roots, figures, points per data source.
READ_DOCUMENT = """() => {
  if (!window.Bokeh || !Bokeh.documents || !Bokeh.documents.length) return null;
  const doc = Bokeh.documents[0];
  const figures = [], sources = {};
  for (const m of doc.all_models) {
    if (m.title !== undefined && m.renderers !== undefined && m.title && m.title.text !== undefined)
      figures.push(m.title.text);
    if (m.data !== undefined && typeof m.get_length === "function" && m.name)
      sources[m.name] = m.get_length() || 0;
  }
  return {roots: doc.roots().length, figures, sources};
}"""


def test_every_plot_page_draws_its_figures_during_training(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    with dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster, cluster.get_client() as client:
        strategy = dps.ParameterServerStrategy(client, variable_partitioner=dps.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            table = dps.Variable(np.zeros((4000, 8), np.float32), name="table")
            w = dps.Variable(np.zeros(8, np.float32), name="w")
            opt = dps.optimizers.Adagrad(0.1)
            loss = dps.metrics.Mean(name="loss")
        coordinator = dps.ClusterCoordinator(strategy)

        def step(seed):
            rng = np.random.default_rng(seed)
            ids = rng.zipf(1.3, 64) % 4000  # a hot first shard
            rows, w_now = dps.embedding_lookup(table, ids), w.numpy()
            err = rows @ w_now - 1.0
            opt.apply_gradients([(dps.IndexedSlices(np.outer(err, w_now + 0.1) / 64, ids), table),
                                 (rows.T @ err / 64, w)])
            loss.update_state(float(np.mean(err ** 2)))
            time.sleep(0.002)

        stop, failures = threading.Event(), []

        def train():
            i = 0
            try:
                while not stop.is_set():
                    for _ in range(40):
                        coordinator.schedule(step, args=(i,))
                        i += 1
                    coordinator.join()
            except Exception as exc:  # the test fails on it below
                failures.append(exc)

        base = cluster.dashboard_link.rsplit("/", 1)[0]
        assert base.startswith("http://127.0.0.1:")
        seen, sent = {}, []  # sent: what the pages sent the dashboard back over their websockets
        with dps.summary.ScalarLogger(coordinator, None, {"loss": loss}, every_n_steps=40, examples_per_step=64,
                                      interval=0.1):
            trainer = threading.Thread(target=train, daemon=True)
            trainer.start()
            try:
                with sync_api.sync_playwright() as p:
                    browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
                    page = browser.new_page(viewport={"width": 1200, "height": 500})
                    page.on("websocket", lambda ws: ws.on("framesent", lambda frame: sent.append(frame)))
                    for route, titles in FIGURES.items():
                        page.goto(base + route)
                        deadline, state = time.monotonic() + 60, None
                        while time.monotonic() < deadline:
                            state = page.evaluate(READ_DOCUMENT)
                            if state and all(state["sources"].get(f"{t} data", 0) > 1 for t in titles):
                                break
                            page.wait_for_timeout(500)
                        seen[route] = state
                        canvases = page.locator("canvas").count()
                        assert canvases >= len(titles), (route, canvases)
                        page.wait_for_timeout(8000 if os.environ.get("DASKPS_SCREENSHOTS") else 1000)  # more points
                        page.screenshot(path=str(tmp_path / f"{route.strip('/')}.png"), full_page=True)
                        if os.environ.get("DASKPS_SCREENSHOTS"):
                            DOCS.mkdir(exist_ok=True)
                            page.screenshot(path=str(DOCS / f"{route.strip('/')}.png"), full_page=True)
                    browser.close()
            finally:
                stop.set()
                trainer.join(60)
        assert not failures, failures

    assert set(FIGURES) == set(PAGES)  # every page is checked
    # The axes follow the data in the browser: their new bounds stay there (sent back, they were two
    # messages per figure per second for the scheduler's event loop).
    assert sent, "no websocket frames seen"
    bounds = [f for f in sent if isinstance(f, str) and re.search(r'"attr":\s*"(start|end)"', f)]
    assert not bounds, bounds[:3]
    for route, titles in FIGURES.items():
        state = seen[route]
        assert state is not None and state["roots"] >= 1, route
        assert set(titles) <= set(state["figures"]), (route, state["figures"])
        for title in titles:
            assert state["sources"].get(f"{title} data", 0) > 1, (route, title, state["sources"])
        assert (tmp_path / f"{route.strip('/')}.png").stat().st_size > 10_000



def test_dasks_navigation_bar_leads_to_the_daskps_page():
    """A person on Dask's Status page finds "Daskps" in the bar, clicks it and sees the servers' table."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with dps.LocalPSCluster(num_ps=2, num_workers=1) as cluster, cluster.get_client() as client:
        strategy = dps.ParameterServerStrategy(client)
        with strategy.scope():
            w = dps.Variable(np.zeros((100, 4), np.float32), name="w")
        base = cluster.dashboard_link.rsplit("/", 1)[0]
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1200, "height": 700})
            page.goto(base + "/status")
            page.get_by_role("link", name="Daskps", exact=True).click()
            page.wait_for_url(re.compile(r"/daskps$"))
            page.get_by_text("daskps parameter servers").wait_for(timeout=30_000)
            page.get_by_text("1.56 kiB").first.wait_for(timeout=30_000)  # the servers' numbers arrive
            assert page.get_by_role("link", name="Status", exact=True).count() == 1  # still in Dask's frame
            browser.close()
        del w
        strategy.close()
