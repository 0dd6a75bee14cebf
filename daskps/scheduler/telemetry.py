"""The scheduler plugin's telemetry job: what the dashboard, ``/metrics`` and the plots read.

Every ``daskps.metrics-interval`` the plugin asks each parameter server for
its ``stats()`` and records a tick of the :class:`~daskps.scheduler.timeline.Timeline`;
this job keeps the latest of those rows, the checkpoint writes it heard of,
each trainer's function durations and the metric values a ``ScalarLogger``
sent. The pages and ``/metrics`` (``daskps.ui``) read it and never ask the
servers themselves.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from daskps._core.config import setting
from daskps.scheduler.messages import FunctionReport
from daskps.scheduler.reports import Reports
from daskps.scheduler.servers import ServerPlaces
from daskps.scheduler.timeline import Timeline

logger = logging.getLogger(__name__)


class Telemetry:
    """The latest servers' rows, checkpoint writes, and the timeline the plots show."""

    def __init__(self) -> None:
        self.server_snapshot: list[dict[str, Any]] = []  # each server's stats() as a row
        self.checkpoint_saves = {"count": 0, "seconds": 0.0, "bytes": 0, "last_seconds": 0.0}
        self.timeline = Timeline()
        self._said_interval = False  # a bad daskps.metrics-interval was logged

    async def tick(self, scheduler: Any, places: ServerPlaces, reports: Reports) -> None:
        """Ask the servers for their numbers and record a tick of the timeline."""
        if places.servers:
            self.server_snapshot = await places.stats(scheduler.rpc, setting("display_timeout"))
        elif self.server_snapshot:
            self.server_snapshot = []
        if places.servers or reports.coordinator_stats:
            self.timeline.record(time.time(), self.server_snapshot, reports.coordinator_stats,
                                 reports.trainer_counts())

    def interval(self, scheduler: Any) -> float:
        """Seconds to the next tick: ``daskps.metrics-interval``, or 1 s (said once) while it is bad."""
        try:
            return max(0.1, setting("metrics_interval"))
        except ValueError as exc:
            if not self._said_interval:
                self._said_interval = True
                logger.error("daskps: %s; the scheduler at %s asks the servers every 1 s meanwhile", exc,
                             getattr(scheduler, "address", "?"))
            return 1.0

    def metric_values(self, msg: dict[str, Any]) -> None:
        self.timeline.metric_values(str(msg["strategy"]), time.time(), int(msg["step"]),
                                    {str(k): float(v) for k, v in msg["values"].items()})

    def checkpoint_written(self, msg: dict[str, Any]) -> None:
        saves = self.checkpoint_saves
        saves["count"] += 1
        saves["seconds"] += float(msg["seconds"])
        saves["bytes"] += int(msg["bytes"])
        saves["last_seconds"] = float(msg["seconds"])

    def functions_ran(self, where: str | None, reports: list[FunctionReport]) -> None:
        if where is not None:
            for report in reports:
                self.timeline.function_ran(where, report.seconds)

    def trainer_left(self, name: str) -> None:
        self.timeline.trainer_left(name)  # its durations go; workers that come and go leave nothing behind

    def strategy_gone(self, token: str) -> None:
        self.timeline.metrics.pop(token, None)
