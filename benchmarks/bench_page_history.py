"""How long a plot page's first refresh holds the scheduler's event loop, against the point-by-point way.

A daskps plot page (``/individual-daskps-servers`` and the others) is filled
from the timeline the scheduler's plugin keeps (600 ticks, a line per server
of every strategy seen). Its first refresh runs on the scheduler's event loop,
so while it runs the scheduler answers nothing. This builds a timeline of
``--ticks`` ticks in which ``--strategies`` strategies of two servers each come
and go (two or three at a time, as in a notebook where a user makes one
after another), then times the servers page's first refresh into a Bokeh
document, as a browser's session has it:

- ``now``: the pages as they are (one message per figure; the lines added in
  one walk of the document);
- ``point by point``: each tick streamed as it is read and each line added
  to the shown page one by one (how the pages filled themselves before
  2026-11-26, stop 36), written here from that rule.

Both arms alternate, ``--rounds`` times; prints each arm's median and their ratio.

    python benchmarks/bench_page_history.py
    python benchmarks/bench_page_history.py --ticks 600 --strategies 20 --rounds 3
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from bokeh.document import Document
from bokeh.layouts import column

from daskps.scheduler.timeline import Timeline
from daskps.ui.plots import KEEP, SeriesFigure, ServersPage


class PointByPoint(SeriesFigure):
    """Each point sent as it is added; a shown page walked again for every new line."""

    def add(self, x: float, values: dict[str, float]) -> None:
        for name in values:
            if name not in self.names:
                self.source.data[name] = [math.nan] * len(self.source.data[self.x])
                self._new_line(name)
        row = {self.x: [x * 1000]}
        row.update({n: [values.get(n, math.nan)] for n in self.names})
        self.source.stream(row, rollover=KEEP)


def timeline(ticks: int, strategies: int) -> Timeline:
    def row(task: int, strategy: int, nbytes: int) -> dict:
        return {"key": f"daskps-ps-{task}-{strategy:08x}abcd", "task": task, "address": "tcp://127.0.0.1:1",
                "nbytes": nbytes, "slot_nbytes": 0, "reads": nbytes, "updates": 0, "bytes_read": 0,
                "bytes_received": 0}

    out = Timeline()
    span = max(1, ticks // strategies)
    for i in range(ticks):
        live = [s for s in range(strategies) if s * span <= i < s * span + 2 * span]
        out.record(1000.0 + i, [row(t, s, 100 * i + t) for s in live for t in range(2)], {}, {}, {})
    return out


def first_refresh(history: Timeline, point_by_point: bool) -> float:
    page = ServersPage()
    if point_by_point:
        for figure in list(vars(page).values()):
            if isinstance(figure, SeriesFigure):
                figure.__class__ = PointByPoint
    document = Document()
    document.add_root(column(*page.roots()))
    start = time.perf_counter()
    page.update(history)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ticks", type=int, default=600)
    parser.add_argument("--strategies", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    history = timeline(args.ticks, args.strategies)
    lines = len({s for tick in history.ticks for s in tick.servers})
    now, old = [], []
    for r in range(args.rounds):
        for point_by_point in ((False, True) if r % 2 == 0 else (True, False)):
            (old if point_by_point else now).append(first_refresh(history, point_by_point))
    print(f"servers page, first refresh of {len(history.ticks)} ticks and {lines} lines, {args.rounds} rounds:")
    print(f"  now:            {', '.join(f'{s:.2f}' for s in now)} s (median {statistics.median(now):.2f})")
    print(f"  point by point: {', '.join(f'{s:.2f}' for s in old)} s (median {statistics.median(old):.2f})")
    print(f"  point by point / now: {statistics.median(old) / statistics.median(now):.1f}x")


if __name__ == "__main__":
    main()
