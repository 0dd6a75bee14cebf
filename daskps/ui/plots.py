"""The dashboard's plots: Bokeh figures over ``ColumnDataSource``s, streamed each second, like Dask's own.

Five pages, each a Bokeh app of the scheduler's dashboard whose route starts
with ``/individual-`` (so dask-labextension lists each as a JupyterLab panel):

- ``/individual-daskps-throughput``: functions completed per second, per
  strategy, and examples per second where a :class:`daskps.summary.ScalarLogger`
  reports them (``examples_per_step``);
- ``/individual-daskps-metrics``: the values of the metrics a ``ScalarLogger``
  logs (``dps.metrics`` objects by the tags the user gave), by step;
- ``/individual-daskps-servers``: per parameter server, bytes held, reads and
  updates per second, bytes received and sent per second;
- ``/individual-daskps-shards``: reads and updates per second of each table
  (a shard is one), the 40 busiest, by name: a hot shard stands out;
- ``/individual-daskps-trainers``: functions per second per trainer, the
  50th/90th/99th percentile of their latest functions' durations, and
  failures and re-runs over time.

Every number comes from the scheduler plugin's :class:`daskps.scheduler.timeline.Timeline`,
which the plugin fills once a ``daskps.metrics-interval``; a page never asks
the servers anything, so an open page costs them nothing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from daskps.scheduler.messages import PLUGIN_NAME
from daskps.scheduler.timeline import SERVER_FIELDS, Tick, Timeline

KEEP = 600  # points each time series keeps
# Past this many trainers the trainers page draws what a few lines can say about all of them (their mean,
# the slowest and the fastest), not a line each: 500 lines tell nothing, and cost the scheduler to send.
TRAINER_LINES = 16
MOST_BARS = 40  # bars a bar chart shows at most: the busiest servers, the slowest trainers
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf"]
_BYTES, _READS, _UPDATES, _SENT, _RECEIVED = (SERVER_FIELDS.index(f) for f in (
    "bytes", "reads", "updates", "bytes_read", "bytes_received"))


class SeriesFigure:
    """A figure with one line per named series over time; a series gets its line when it first appears."""

    def __init__(self, title: str, y_label: str, x: str = "time"):
        from bokeh.models import AdaptiveTicker, ColumnDataSource, NumeralTickFormatter
        from bokeh.plotting import figure

        self.x = x
        self.source = ColumnDataSource({x: []}, name=f"{title} data")
        self.figure = figure(title=title, x_axis_type="datetime" if x == "time" else "linear", height=230,
                             sizing_mode="stretch_width", tools="pan,wheel_zoom,box_zoom,reset,save",
                             name=title)
        self.figure.yaxis.axis_label = y_label
        self.figure.xaxis.axis_label = "time" if x == "time" else x
        # plain numbers with separators (not 1.400e+5); bytes in binary units with enough digits that
        # neighbouring ticks of a narrow range read differently (469.1 KiB, 469.2 KiB, not 469 KiB twice)
        self.figure.yaxis.formatter = NumeralTickFormatter(
            format="0.[000] b" if y_label.startswith("bytes") else "0,0.[000]")
        if y_label.startswith("bytes"):  # ticks a power of two of bytes apart: 468.5 KiB, 469 KiB, ...
            self.figure.yaxis.ticker = AdaptiveTicker(base=2, mantissas=[1], min_interval=1, num_minor_ticks=0)
        _keep_ranges_in_the_browser(self.figure)
        self.names: list[str] = []
        self._pending: list[tuple[float, dict[str, float]]] = []

    def add(self, x: float, values: dict[str, float]) -> None:
        """One point for each series (NaN for those not in ``values``), sent by :meth:`flush`."""
        self._pending.append((x, values))

    def flush(self) -> None:
        """Send the points added since the last flush to the browser, in one message.

        A page's first refresh holds the timeline's whole history (up to 600
        ticks, a line per server any strategy had): sent point by point, with a
        message per new line, it held the scheduler's event loop for seconds.
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        new = list(dict.fromkeys(n for _, values in pending for n in values if n not in self.names))
        if new:
            length = len(self.source.data[self.x])
            document = self.figure.document
            # each line added to a shown page re-walks the page's whole model graph: once for all of them
            with document.models.freeze() if document is not None else contextlib.nullcontext():
                self.source.data = {**self.source.data, **{n: [math.nan] * length for n in new}}
                for name in new:
                    self._new_line(name)
        row: dict[str, Any] = {self.x: [x * 1000 if self.x == "time" else x for x, _ in pending]}
        row.update({n: [values.get(n, math.nan) for _, values in pending] for n in self.names})
        self.source.stream(row, rollover=KEEP)

    def _new_line(self, name: str) -> None:
        color = PALETTE[len(self.names) % len(PALETTE)]
        self.figure.line(self.x, name, source=self.source, color=color, line_width=2, legend_label=name)
        self.figure.legend.location = "top_left"
        self.figure.legend.click_policy = "hide"
        self.names.append(name)


class BarFigure:
    """Grouped bars: for each category, one bar per measure (``measures``), replaced whole at each update."""

    def __init__(self, title: str, y_label: str, measures: list[str]):
        from bokeh.models import ColumnDataSource, FactorRange
        from bokeh.plotting import figure
        from bokeh.transform import dodge

        self.measures = measures
        self.source = ColumnDataSource({"category": [], "color": [], **{m: [] for m in measures}},
                                       name=f"{title} data")
        self.figure = figure(title=title, x_range=FactorRange(), height=260, sizing_mode="stretch_width",
                             tools="pan,wheel_zoom,reset,save", name=title)
        self.figure.yaxis.axis_label = y_label
        self.figure.xaxis.major_label_orientation = 0.8
        width = 0.8 / len(measures)
        for i, m in enumerate(measures):
            offset = (i - (len(measures) - 1) / 2) * width
            self.figure.vbar(x=dodge("category", offset, range=self.figure.x_range), top=m, width=width * 0.9,
                             source=self.source, legend_label=m,
                             color=PALETTE[i % len(PALETTE)] if len(measures) > 1 else "color")
        self.figure.legend.location = "top_right"
        _keep_ranges_in_the_browser(self.figure)

    def show(self, rows: list[tuple[str, str, list[float]]]) -> None:
        """``rows``: (category, colour, one value per measure). Only what changed goes to the browser:
        new categories re-lay the figure out there, new values only redraw it."""
        factors = [r[0] for r in rows]
        if list(self.figure.x_range.factors) != factors:  # type: ignore[attr-defined]
            self.figure.x_range.factors = factors  # type: ignore[attr-defined]
        data: dict[str, list[Any]] = {"category": factors, "color": [r[1] for r in rows]}
        for i, m in enumerate(self.measures):
            data[m] = [round(r[2][i], 3) for r in rows]
        if any(list(self.source.data.get(k, ())) != v for k, v in data.items()):
            self.source.data = data


def _keep_ranges_in_the_browser(figure: Any) -> None:
    """Keep a figure's ranges from sending their bounds back to the scheduler after every redraw.

    The axes follow the data in the browser and no page reads the bounds; sent
    back, they were two messages per figure per second for the scheduler's
    event loop to take in, for every open page.
    """
    figure.x_range.syncable = False
    figure.y_range.syncable = False


def _rates(previous: Tick, tick: Tick, pick: Callable[[Tick], dict[str, float]]) -> dict[str, float]:
    """Per second between two ticks, of each series ``pick`` finds in both."""
    dt = tick.time - previous.time
    before, now = pick(previous), pick(tick)
    return {k: max(0.0, (v - before[k]) / dt) for k, v in now.items() if k in before and dt > 0}


class Page:
    """A page's figures, fed the timeline's new ticks at each refresh."""

    title = ""

    def __init__(self) -> None:
        self.seen = 0.0  # time of the last tick shown
        self.metrics_seen: dict[str, float] = {}  # strategy token -> time of the last metric point shown

    def roots(self) -> list[Any]:
        raise NotImplementedError

    def update(self, timeline: Timeline) -> None:
        ticks = list(timeline.ticks)
        new = [(a, b) for a, b in zip(ticks, ticks[1:]) if b.time > self.seen]
        for previous, tick in new:
            self.tick(previous, tick)
        if ticks:
            self.seen = ticks[-1].time
        self.refresh(timeline)
        for figure in vars(self).values():
            if isinstance(figure, SeriesFigure):
                figure.flush()

    def tick(self, previous: Tick, tick: Tick) -> None:
        pass

    def refresh(self, timeline: Timeline) -> None:
        pass

    def new_metric_points(self, timeline: Timeline) -> Iterator[tuple[str, float, int, dict[str, float]]]:
        """The metric values ScalarLoggers sent since this page last looked: (strategy, time, step, values)."""
        seen = self.metrics_seen
        for token, points in list(timeline.metrics.items()):
            last = seen.get(token, 0.0)
            new = []
            for point in reversed(points):  # the newest first: stop at the first already shown
                if point[0] <= last:
                    break
                new.append(point)
            for when, step, values in reversed(new):
                seen[token] = when
                yield token, when, step, values


class ThroughputPage(Page):
    title = "daskps: throughput"

    def __init__(self) -> None:
        super().__init__()
        self.functions = SeriesFigure("Functions completed per second", "functions/s")
        self.examples = SeriesFigure("Examples per second (reported by ScalarLogger)", "examples/s")

    def roots(self) -> list[Any]:
        return [self.functions.figure, self.examples.figure]

    def tick(self, previous: Tick, tick: Tick) -> None:
        rates = _rates(previous, tick, lambda t: {f"strategy {k[:8]}": float(v.get("done", 0))
                                                  for k, v in t.coordinators.items()})
        if len(rates) > 1:
            rates["all"] = sum(rates.values())
        if rates:
            self.functions.add(tick.time, rates)

    def refresh(self, timeline: Timeline) -> None:
        for token, when, _, values in self.new_metric_points(timeline):
            if "daskps/examples_per_second" in values:
                self.examples.add(when, {f"strategy {token[:8]}": values["daskps/examples_per_second"]})


class MetricsPage(Page):
    title = "daskps: metrics"

    def __init__(self) -> None:
        super().__init__()
        self.values = SeriesFigure("Metrics (ScalarLogger), by step", "value", x="step")

    def roots(self) -> list[Any]:
        return [self.values.figure]

    def refresh(self, timeline: Timeline) -> None:
        many = len(timeline.metrics) > 1
        for token, _, step, values in self.new_metric_points(timeline):
            mine = {(f"{token[:8]} {k}" if many else k): v for k, v in values.items() if not k.startswith("daskps/")}
            self.values.add(step, mine)  # a metric left out at this step (no value yet) is a NaN: a gap


class ServersPage(Page):
    title = "daskps: parameter servers"

    def __init__(self) -> None:
        super().__init__()
        self.bytes = SeriesFigure("Bytes held (values and optimizer slots)", "bytes")
        self.reads = SeriesFigure("Reads per second", "values/s")
        self.updates = SeriesFigure("Updates per second (updates and gradients applied)", "updates/s")
        self.received = SeriesFigure("Bytes received per second (updates and gradients)", "bytes/s")
        self.sent = SeriesFigure("Bytes sent per second (values read)", "bytes/s")

    def roots(self) -> list[Any]:
        return [f.figure for f in (self.bytes, self.reads, self.updates, self.received, self.sent)]

    def tick(self, previous: Tick, tick: Tick) -> None:
        self.bytes.add(tick.time, {s: float(v[_BYTES]) for s, v in tick.servers.items()})
        for fig, field in ((self.reads, _READS), (self.updates, _UPDATES), (self.received, _RECEIVED),
                           (self.sent, _SENT)):
            fig.add(tick.time, _rates(previous, tick, _server_field(field)))


def _server_field(field: int) -> Callable[[Tick], dict[str, float]]:
    return lambda tick: {s: float(v[field]) for s, v in tick.servers.items()}


class ShardsPage(Page):
    title = "daskps: shards"

    def __init__(self) -> None:
        super().__init__()
        self.load = BarFigure("Reads and updates per second of each table or shard (the 40 busiest)", "per second",
                              ["reads/s", "updates/s"])
        self.previous: tuple[float, dict[str, tuple[str, str, int, int]]] | None = None

    def roots(self) -> list[Any]:
        return [self.load.figure]

    def refresh(self, timeline: Timeline) -> None:
        if not timeline.ticks:
            return
        now, tables = timeline.ticks[-1].time, dict(timeline.tables)
        if self.previous is not None and now > self.previous[0]:
            then, before = self.previous
            servers = sorted({t[1] for t in tables.values()})
            rows = []
            for key, (name, server, reads, updates) in tables.items():
                old = before.get(key, (name, server, reads, updates))
                rate = [max(0.0, (reads - old[2]) / (now - then)), max(0.0, (updates - old[3]) / (now - then))]
                rows.append((f"{name} ({server})", PALETTE[servers.index(server) % len(PALETTE)], rate))
            busiest = sorted(rows, key=lambda r: -sum(r[2]))[:MOST_BARS]
            self.load.show(sorted(busiest, key=lambda r: r[0]))  # in a steady order: the tallest bars stand out
        if self.previous is None or now > self.previous[0]:
            self.previous = (now, tables)


class TrainersPage(Page):
    title = "daskps: trainers"

    def __init__(self) -> None:
        super().__init__()
        self.functions = SeriesFigure("Functions completed per second, per trainer", "functions/s")
        self.durations = BarFigure("Function durations, latest 2,000 per trainer: percentiles", "milliseconds",
                                   ["p50", "p90", "p99"])
        self.failures = SeriesFigure("Failed and re-run functions (all strategies)", "functions")
        # Whether the trainers ever numbered more than TRAINER_LINES: decided on the whole history a page
        # first gets, and kept, so that trainers joining one by one leave no lines of their own behind.
        self.many = False

    def roots(self) -> list[Any]:
        return [self.functions.figure, self.durations.figure, self.failures.figure]

    def update(self, timeline: Timeline) -> None:
        self.many = self.many or any(len(t.trainers) > TRAINER_LINES for t in list(timeline.ticks))
        super().update(timeline)

    def tick(self, previous: Tick, tick: Tick) -> None:
        rates = _rates(previous, tick, lambda t: {w: float(c.completed) for w, c in t.trainers.items()})
        self.functions.add(tick.time, trainer_lines(rates) if self.many else rates)
        self.failures.add(tick.time, {  # the coordinators' counts, as /metrics' functions_failed and _rerun
            "failed": float(sum(s.get("failed", 0) for s in tick.coordinators.values())),
            "re-run": float(sum(s.get("rerun", 0) for s in tick.coordinators.values())),
        })

    def refresh(self, timeline: Timeline) -> None:
        rows, arrays = [], []
        for trainer, seconds in sorted(timeline.durations.items()):
            if seconds:
                arrays.append(np.fromiter(seconds, float))
                p = np.percentile(arrays[-1], [50, 90, 99]) * 1000
                rows.append((trainer, PALETTE[0], [float(x) for x in p]))
        if len(rows) > MOST_BARS:  # the slowest (by p99), in name order, after all of them together
            slowest = sorted(sorted(rows, key=lambda r: -r[2][2])[:MOST_BARS - 1], key=lambda r: r[0])
            whole = [float(x) for x in np.percentile(np.concatenate(arrays), [50, 90, 99]) * 1000]
            rows = [(f"all {len(rows)} trainers", PALETTE[0], whole), *slowest]
        self.durations.show(rows)


def trainer_lines(rates: dict[str, float]) -> dict[str, float]:
    """The lines of the functions-per-second plot past :data:`TRAINER_LINES` trainers: their mean, the
    slowest and the fastest (none without rates)."""
    if not rates:
        return {}
    values = list(rates.values())
    return {"mean per trainer": sum(values) / len(values), "slowest trainer": min(values),
            "fastest trainer": max(values)}


PAGES: dict[str, type[Page]] = {
    "/individual-daskps-throughput": ThroughputPage,
    "/individual-daskps-metrics": MetricsPage,
    "/individual-daskps-servers": ServersPage,
    "/individual-daskps-shards": ShardsPage,
    "/individual-daskps-trainers": TrainersPage,
}


def make_app(kind: type[Page]) -> Callable[[Any, Any, Any], None]:
    """A Bokeh app function for the dashboard (``(scheduler, extra, doc)``) showing a ``kind`` page."""

    def app(scheduler: Any, extra: Any, doc: Any) -> None:
        from bokeh.layouts import column
        from bokeh.models import Div  # type: ignore[attr-defined]

        page = kind()
        note = Div(text="", sizing_mode="stretch_width")

        def refresh() -> None:
            plugin = scheduler.plugins.get(PLUGIN_NAME)
            if plugin is None:
                note.text = "<p>No parameter servers yet: create a ParameterServerStrategy on this cluster.</p>"
                return
            note.text = ""
            page.update(plugin.telemetry.timeline)

        doc.title = page.title
        doc.add_root(column(note, *page.roots(), sizing_mode="stretch_width"))
        doc.add_next_tick_callback(refresh)
        doc.add_periodic_callback(refresh, 1000)

    return app
