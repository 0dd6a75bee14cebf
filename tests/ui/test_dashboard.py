"""The parameter-server page of the Dask dashboard, fetched over HTTP from the scheduler."""

from __future__ import annotations

import gc
import json
import math
import re
import time
import urllib.request
from typing import Any

import numpy as np
import pytest
from distributed import Client

import daskps as dps
from daskps.scheduler.quantities import TrainerCounts
from daskps.ui.plots import PAGES
from tests.helpers.cluster import dask_cli_cluster
from tests.helpers.waiting import wait_until

ROUTE = "/individual-daskps"


def dashboard_base(client: Client) -> str:
    base = client.dashboard_link.rsplit("/", 1)[0]
    assert base.startswith("http://127.0.0.1:")
    return base


def page_text(base: str, want: str, timeout: float = 30) -> str:
    """The page's content as a new visitor gets it (Bokeh sends it over its websocket), as plain text;
    the page is opened again until ``want`` is in it (the plugin's numbers arrive once a tick)."""
    from bokeh.client import pull_session

    seen = {"text": ""}

    def shows() -> bool:
        with pull_session(url=base + ROUTE) as session:
            time.sleep(0.3)  # the first refresh runs on the next tick
            session.pull()
            text = re.sub(r"<[^>]+>", " ", session.document.roots[0].text)
            seen["text"] = re.sub(r"\s+", " ", text)
        return want in seen["text"]

    try:
        wait_until(shows, timeout, interval=0.5, collect=False)
    except AssertionError:
        pass  # the caller's assertions say what is missing
    return seen["text"]


def exercise(client: Client) -> tuple[Any, list[str]]:
    gc.collect()  # what earlier tests dropped leaves the servers (a page counts every variable they hold)
    strategy = dps.ParameterServerStrategy(client, variable_partitioner=dps.partitioners.FixedShardsPartitioner(2))
    coordinator = dps.ClusterCoordinator(strategy)
    with strategy.scope():
        table = dps.Variable(np.zeros((1000, 4), np.float32), name="table")
    for _ in range(6):
        coordinator.schedule(lambda: table.scatter_add(dps.IndexedSlices(np.ones((1, 4), np.float32), [1])))
    coordinator.join()
    return (strategy, table), [ps.address for ps in strategy.servers]  # held: dropped variables are freed


def check_page(client: Client) -> str:
    held, addresses = exercise(client)
    base = dashboard_base(client)
    plots = json.loads(urllib.request.urlopen(base + "/individual-plots.json").read())
    assert ROUTE in plots.values()  # what dask-labextension lists as panels
    assert urllib.request.urlopen(base + ROUTE).status == 200
    for route in PAGES:  # the plot pages too (drawn in a browser by test_dashboard_browser.py)
        assert route in plots.values()
        assert urllib.request.urlopen(base + route).status == 200
    for route in ("/status", "/workers", "/daskps"):  # Dask's own navigation bar links the page, on every page
        nav = urllib.request.urlopen(base + route).read().decode()
        assert re.search(r'<a href="daskps">\s*Daskps\s*</a>', nav), (route, nav[:3000])
    text = page_text(base, want="7.81 kiB")  # the servers' numbers arrive within a tick of the plugin
    for addr in addresses:
        assert addr in text
    assert "ps-0" in text and "ps-1" in text and "7.81 kiB" in text
    for ps in held[0].servers:  # each server's row: its bytes, 1 variable, 1 shard (the headers alone say nothing)
        assert re.search(rf"ps-{ps.task_id} {re.escape(ps.address)} 7\.81 kiB 1 1 [\d.,]+ [\d.,]+ ok", text), text
    trainers = text.split("Trainers", 1)[1]  # counts of 1,000 and more have a separator
    completed = [int(n.replace(",", "")) for n in re.findall(r"tcp://127\.0\.0\.1:\d+ ([\d,]+) [\d,]+ [\d,]+", trainers)]
    assert sum(completed) >= 6, text
    return text


def test_page_on_a_local_cluster(client):
    text = check_page(client)
    assert "reads/s" in text and "updates/s" in text and "shards" in text


@pytest.mark.cluster
def test_page_on_a_dask_scheduler_started_with_preload(tmp_path):
    with dask_cli_cluster(tmp_path, ["ps=1", "ps=1", "worker=1"], ["--preload", "daskps.dashboard"]) as client:
        check_page(client)


def test_page_shows_each_embedding_table_per_server(client):
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        table = dps.EmbeddingTable(2, name="items_on_page", capacity=6)
    dps.embedding_lookup(table, np.arange(30))
    counts = table.stats()
    tasks = [h.server.task_id for h in table.handles]
    text = page_text(dashboard_base(client), want="items_on_page")
    section = text.split("Embedding tables", 1)[1]
    for task, c in zip(tasks, counts):
        assert f"items_on_page ps-{task} {c['rows']:,} {c['admitted']:,} {c['evicted']:,}" in section
    assert sum(c["rows"] for c in counts) == 6 and sum(c["evicted"] for c in counts) == 24


def test_pages_keep_showing_new_points_once_the_timeline_is_full():
    """The timeline keeps the latest points only; a page shows each new one once, however full it is."""
    from bokeh.models import ColumnDataSource  # noqa: F401  (bokeh is in the test extra)

    from daskps.scheduler.timeline import Timeline
    from daskps.ui.plots import MetricsPage, TrainersPage

    timeline = Timeline(keep=3, metric_points=3)
    page = MetricsPage()
    for step in range(5):
        timeline.metric_values("token", 1000.0 + step, step, {"loss": float(step), "daskps/failed": 0.0})
    page.update(timeline)
    assert list(page.values.source.data["step"]) == [2, 3, 4]  # the 3 kept; daskps' own tags are not metrics
    for step in range(5, 7):
        timeline.metric_values("token", 1000.0 + step, step, {"loss": float(step)})
    page.update(timeline)
    assert list(page.values.source.data["step"]) == [2, 3, 4, 5, 6]
    assert list(page.values.source.data["loss"]) == [2.0, 3.0, 4.0, 5.0, 6.0]

    trainers = TrainersPage()
    for i in range(5):  # a trainer completes 10 functions a second
        timeline.record(1000.0 + i, [], {"t": {"rerun": i}}, {"worker-0": TrainerCounts(10 * i, 0, 0)})
    trainers.update(timeline)
    assert list(trainers.functions.source.data["worker-0"]) == [10.0, 10.0]  # 3 ticks kept: 2 rates
    assert list(trainers.failures.source.data["re-run"]) == [3.0, 4.0]
    timeline.record(1005.0, [], {"t": {"rerun": 5, "failed": 1}}, {"worker-0": TrainerCounts(70, 1, 0)})
    trainers.update(timeline)
    assert list(trainers.functions.source.data["worker-0"]) == [10.0, 10.0, 30.0]
    assert list(trainers.failures.source.data["failed"]) == [0.0, 0.0, 1.0]


def test_the_trainers_page_of_500_trainers_draws_a_few_lines_and_the_slowest_trainers():
    """Past 16 trainers, one line each would be hundreds: the page draws their mean, slowest and fastest;
    the durations chart shows all trainers together and the 39 slowest by p99 (numbers from numpy here)."""
    from daskps.scheduler.timeline import Timeline
    from daskps.ui.plots import TrainersPage

    timeline, page = Timeline(), TrainersPage()
    names = [f"worker-{i}" for i in range(500)]
    for t in range(3):  # trainer i completes i + 1 functions a second
        timeline.record(1000.0 + t, [], {}, {n: TrainerCounts(t * (i + 1), 0, 0) for i, n in enumerate(names)})
    durations = {n: [0.001 * (i + 1), 0.002 * (i + 1)] for i, n in enumerate(names)}  # trainer i: i+1, 2(i+1) ms
    for n, seconds in durations.items():
        for x in seconds:
            timeline.function_ran(n, x)
    page.update(timeline)
    data = page.functions.source.data
    assert sorted(k for k in data if k != "time") == ["fastest trainer", "mean per trainer", "slowest trainer"]
    assert list(data["mean per trainer"]) == [250.5, 250.5]  # (1 + ... + 500) / 500
    assert list(data["slowest trainer"]) == [1.0, 1.0] and list(data["fastest trainer"]) == [500.0, 500.0]
    bars = page.durations.source.data
    assert bars["category"][0] == "all 500 trainers" and len(bars["category"]) == 40
    every = np.concatenate([np.array(v) for v in durations.values()]) * 1000
    assert bars["p99"][0] == round(float(np.percentile(every, 99)), 3)
    assert sorted(bars["category"][1:]) == sorted(f"worker-{i}" for i in range(461, 500))
    assert bars["category"][1:] == sorted(bars["category"][1:])  # in name order: a steady layout
    i = bars["category"].index("worker-499")
    assert bars["p50"][i] == round(float(np.percentile([500.0, 1000.0], 50)), 3)

    few, small = Timeline(), TrainersPage()  # 16 trainers: a line each, as before
    for t in range(2):
        few.record(1000.0 + t, [], {}, {f"worker-{i}": TrainerCounts(t * 3, 0, 0) for i in range(16)})
    small.update(few)
    assert sorted(k for k in small.functions.source.data if k != "time") == sorted(f"worker-{i}" for i in range(16))

    joining, page = Timeline(), TrainersPage()  # trainers joining one by one, 40 in the end: three lines only
    for t in range(40):
        joining.record(1000.0 + t, [], {}, {f"worker-{i}": TrainerCounts(t, 0, 0) for i in range(t + 1)})
    page.update(joining)
    assert sorted(k for k in page.functions.source.data if k != "time") == [
        "fastest trainer", "mean per trainer", "slowest trainer"]


def test_servers_of_two_strategies_keep_their_own_lines():
    """Each strategy numbers its servers from 0: with two on one scheduler, their lines stay apart."""
    from daskps.scheduler.timeline import Timeline

    def row(task, token, reads):
        return {"key": f"daskps-ps-{task}-{token}", "task": task, "address": "tcp://127.0.0.1:1", "nbytes": 8,
                "slot_nbytes": 0, "reads": reads, "updates": 0, "bytes_read": 0, "bytes_received": 0,
                "variables": {f"v-{token}": ("v", (1,), "<f4")}, "table_reads": {f"v-{token}": reads}}

    timeline = Timeline()
    timeline.record(1.0, [row(0, "aaaaaaaaaaaa", 5)], {}, {})
    assert set(timeline.ticks[-1].servers) == {"ps-0"}  # one strategy: plain names
    timeline.record(2.0, [row(0, "aaaaaaaaaaaa", 7), row(0, "bbbbbbbbbbbb", 100)], {}, {})
    servers = timeline.ticks[-1].servers
    assert set(servers) == {"ps-0 (aaaaaaaa)", "ps-0 (bbbbbbbb)"}
    assert servers["ps-0 (aaaaaaaa)"][1] == 7 and servers["ps-0 (bbbbbbbb)"][1] == 100
    assert {server for _, server, _, _ in timeline.tables.values()} == {"ps-0 (aaaaaaaa)", "ps-0 (bbbbbbbb)"}


def test_a_page_opened_on_a_long_history_gets_it_in_one_message_per_figure():
    """A page's first refresh holds the whole timeline: here 60 ticks of 20 strategies' servers come and
    go, 42 lines (20 strategies' two, and plain ps-0 and ps-1 while only the first was there). Each figure gets its history, in order and with gaps where a server was not there, in
    one message (point by point it held the scheduler's event loop for 15-20 s; see benchmarks/README)."""
    from bokeh.document import Document
    from bokeh.document.events import ColumnsStreamedEvent
    from bokeh.layouts import column

    from daskps.scheduler.timeline import Timeline
    from daskps.ui.plots import ServersPage

    def row(task, strategy, nbytes):
        return {"key": f"daskps-ps-{task}-{strategy:08d}abcd", "task": task, "address": "tcp://127.0.0.1:1",
                "nbytes": nbytes, "slot_nbytes": 0, "reads": 0, "updates": 0, "bytes_read": 0,
                "bytes_received": 0}

    timeline = Timeline()
    for i in range(60):  # strategy s lives from tick 3s to 3s + 5: two or three at a time
        live = [s for s in range(20) if 3 * s <= i < 3 * s + 6]
        timeline.record(1000.0 + i, [row(t, s, 100 * i + t) for s in live for t in range(2)], {}, {})
    page = ServersPage()
    document = Document()
    document.add_root(column(*page.roots()))
    events, walks = [], []
    document.on_change(events.append)
    walk = document.models.recompute  # a walk of the page's whole model graph: once per figure, not per line
    document.models.recompute = lambda: walks.append(1) or walk()
    page.update(timeline)
    assert len(walks) == 5
    streamed = [e for e in events if isinstance(e, ColumnsStreamedEvent)]
    assert len(streamed) == 5  # one per figure
    data = page.bytes.source.data
    assert len(page.bytes.names) == 42 and list(data["time"]) == [(1000.0 + i) * 1000 for i in range(1, 60)]
    want = [100 * i + 1 if 21 <= i < 27 else math.nan for i in range(1, 60)]  # strategy 7's ps-1
    np.testing.assert_array_equal(data["ps-1 (00000007)"], want)
    events.clear()
    timeline.record(1060.0, [row(0, 18, 5), row(0, 19, 6)], {}, {})
    page.update(timeline)
    assert [type(e) for e in events] == [ColumnsStreamedEvent] * 5  # a tick later: a point each, no new line
    assert data["ps-0 (00000019)"][-2:] == [5900.0, 6.0] and len(page.bytes.names) == 42


def test_a_plot_page_says_there_are_no_servers_until_the_plugin_is_there():
    """A plot page opened on a scheduler no strategy has used says so, and stops saying it once one has."""
    from bokeh.document import Document
    from distributed import LocalCluster

    from daskps.scheduler.messages import PLUGIN_NAME
    from daskps.scheduler.plugin import DaskPSSchedulerPlugin
    from daskps.ui.plots import ThroughputPage, make_app

    with LocalCluster(n_workers=0, processes=False, protocol="tcp://", host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster:
        scheduler = cluster.scheduler
        doc = Document()
        make_app(ThroughputPage)(scheduler, {}, doc)
        note = doc.roots[0].children[0]

        def refresh():
            for callback in doc.session_callbacks:
                callback.callback()

        refresh()
        assert note.text == "<p>No parameter servers yet: create a ParameterServerStrategy on this cluster.</p>"
        scheduler.add_plugin(DaskPSSchedulerPlugin(scheduler), name=PLUGIN_NAME)
        refresh()
        assert note.text == ""


def test_axes_read_as_plain_numbers_and_bytes_in_binary_steps():
    """Counts and rates with separators, not 1.400e+5; bytes in KiB/MiB with ticks a power of two of bytes
    apart, so neighbouring ticks of a narrow range read differently."""
    from bokeh.models import AdaptiveTicker

    from daskps.ui.plots import SeriesFigure

    held = SeriesFigure("Bytes held", "bytes").figure.yaxis[0]
    assert held.formatter.format == "0.[000] b"
    assert isinstance(held.ticker, AdaptiveTicker) and held.ticker.base == 2 and list(held.ticker.mantissas) == [1]
    rate = SeriesFigure("Reads per second", "values/s").figure.yaxis[0]
    assert rate.formatter.format == "0,0.[000]"


def test_a_closed_strategys_functions_stay_in_its_trainers_totals():
    """Per-trainer counts are counters: a strategy whose servers are gone (or the 65th) leaves its
    per-strategy series, but what its functions did on each trainer stays counted there."""
    from daskps.scheduler.reports import Reports
    from daskps.scheduler.timeline import KEEP_STRATEGIES

    reports = Reports()
    reports.coordinator_reported("a", {"done": 5, "trainers": {"worker-0": {"done": 3, "failed": 1},
                                                             "worker-1": {"done": 2, "rerun": 2}}})
    reports.coordinator_reported("b", {"done": 4, "trainers": {"worker-0": {"done": 4}}})
    assert reports.trainer_counts() == {"worker-0": TrainerCounts(7, 1, 0), "worker-1": TrainerCounts(2, 0, 2)}
    reports.retire("a")
    assert set(reports.coordinator_stats) == {"b"}
    assert reports.trainer_counts() == {"worker-0": TrainerCounts(7, 1, 0), "worker-1": TrainerCounts(2, 0, 2)}
    for i in range(KEEP_STRATEGIES):  # "b" is pushed out by 64 newer strategies
        reports.coordinator_reported(f"n{i}", {"done": 1, "trainers": {"worker-1": {"done": 1}}})
    assert "b" not in reports.coordinator_stats
    assert reports.trainer_counts() == {"worker-0": TrainerCounts(7, 1, 0),
                                       "worker-1": TrainerCounts(2 + KEEP_STRATEGIES, 0, 2)}
