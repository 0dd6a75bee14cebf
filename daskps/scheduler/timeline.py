"""What the dashboard's plots show: the scheduler plugin's numbers, a snapshot a tick, over the last minutes.

The scheduler plugin asks every parameter server for its ``stats()`` every
``daskps.metrics-interval`` and records here, at each tick, per server its
bytes and counters (reads, updates, bytes sent and received), each
coordinator's counts and each trainer's completed and failed functions. It
also keeps each trainer's latest function durations (from the functions'
reports) and the metric values :class:`daskps.summary.ScalarLogger` sends.
The dashboard pages (:mod:`daskps.ui.dashboard`) read it: they never ask the
servers themselves, so an open page costs the servers nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

from daskps.scheduler.quantities import TrainerCounts, bytes_held, server_name

SERVER_FIELDS = ("bytes", "reads", "updates", "bytes_read", "bytes_received")  # bytes: quantities.bytes_held
KEEP_STRATEGIES = 64  # strategies whose metric values are kept


def server_label(row: dict[str, Any], with_strategy: bool) -> str:
    """``ps-N`` for a server's stats row; with its strategy's token where several strategies have servers."""
    from daskps.client.group import strategy_token  # (the server key's format)

    token = strategy_token(row.get("key", ""))[:8]
    return f"{server_name(row)} ({token})" if with_strategy else server_name(row)


class Tick(NamedTuple):
    time: float  # seconds since the epoch
    servers: dict[str, tuple[int, ...]]  # "ps-N" -> SERVER_FIELDS
    coordinators: dict[str, dict[str, Any]]  # strategy token -> its counts
    trainers: dict[str, TrainerCounts]  # trainer name -> (completed, failed, rerun)


class Timeline:
    """The last ``keep`` ticks, the latest load per table, durations per trainer, metric values per strategy."""

    def __init__(self, keep: int = 600, durations: int = 2000, metric_points: int = 2000):
        self.ticks: deque[Tick] = deque(maxlen=keep)
        self.tables: dict[str, tuple[str, str, int, int]] = {}  # table key -> (name, server, reads, updates)
        self.durations: dict[str, deque[float]] = {}  # trainer -> seconds of its latest functions
        self.metrics: dict[str, deque[tuple[float, int, dict[str, float]]]] = {}  # token -> (time, step, values)
        self._durations, self._metric_points = durations, metric_points

    def record(self, now: float, servers: list[dict[str, Any]], coordinators: dict[str, dict[str, Any]],
               trainers: dict[str, TrainerCounts]) -> None:
        """One tick: the servers' stats rows (as the plugin fetched them) and the counts at ``now``."""
        rows: dict[str, tuple[int, ...]] = {}
        tables = {}
        several = len({server_label(row, True) for row in servers}) > len({server_label(row, False) for row in servers})
        for row in servers:
            if "error" in row:
                continue
            label = server_label(row, several)
            rows[label] = (bytes_held(row), row["reads"], row["updates"], row["bytes_read"],
                           row.get("bytes_received", 0))
            names = row.get("variables", {})
            reads, updates = row.get("table_reads", {}), row.get("table_updates", {})
            for key in names:
                tables[key] = (names[key][0], label, reads.get(key, 0), updates.get(key, 0))
        self.tables = tables
        self.ticks.append(Tick(now, rows, {k: dict(v) for k, v in coordinators.items()}, dict(trainers)))

    def function_ran(self, trainer: str, seconds: float) -> None:
        self.durations.setdefault(trainer, deque(maxlen=self._durations)).append(seconds)

    def metric_values(self, token: str, now: float, step: int, values: dict[str, float]) -> None:
        points = self.metrics.pop(token, None) or deque(maxlen=self._metric_points)
        self.metrics[token] = points  # the strategy that logged last is the last to be dropped
        points.append((now, step, dict(values)))
        while len(self.metrics) > KEEP_STRATEGIES:  # the oldest strategy's values go first
            del self.metrics[next(iter(self.metrics))]

    def trainer_left(self, trainer: str) -> None:
        self.durations.pop(trainer, None)
