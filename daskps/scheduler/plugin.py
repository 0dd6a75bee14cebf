"""daskps on the scheduler: one ``SchedulerPlugin`` that hands each event to the job it concerns.

``ParameterServerStrategy`` makes sure the scheduler runs one
:class:`DaskPSSchedulerPlugin` (``dask scheduler --preload daskps.dashboard``
adds it at start). Its jobs, each a module of this package:

- **placement** (:mod:`~daskps.scheduler.servers`): where each server's actor
  lives, servers re-created after a loss, cleanups waiting for a server to go;
  when a worker leaves, the servers forget the handles its process held, so a
  trainer that dies holding handles leaks nothing;
- **reports** (:mod:`~daskps.scheduler.reports`): which functions of each batch
  reported (a batch that runs again after its trainer died skips them) and
  each coordinator's counts;
- **input** (:mod:`~daskps.scheduler.ledger`): who reads which partition or
  batch of a ``dps.data`` dataset;
- **telemetry** (:mod:`~daskps.scheduler.telemetry`): the numbers the
  dashboard, ``/metrics`` and the plots read.

Other processes reach it only through :mod:`daskps.scheduler.messages`:
handlers on the scheduler's connection, events, and typed requests
(``client.run_on_scheduler(messages.ask, request)``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from daskps._core import views
from daskps._core.config import setting
from daskps.client.group import parse_server_key
from daskps.client.worker_state import WORKER_PLUGIN_NAME
from daskps.client.worker_state import register as register_worker_plugin
from daskps.scheduler import messages
from daskps.scheduler.ledger import Inputs
from daskps.scheduler.messages import (
    BATCH_TOPIC_PREFIX,
    CHECKPOINT_TOPIC,
    CLEANUP_HANDLER,
    INPUT_HANDLER,
    LOST,
    METRICS_TOPIC,
    PLUGIN_NAME,
    REPORTED_HANDLER,
    STATS_HANDLER,
    TRAINERS_HANDLER,
    Reported,
)
from daskps.scheduler.reports import Reports
from daskps.scheduler.servers import ServerPlaces
from daskps.scheduler.telemetry import Telemetry

logger = logging.getLogger(__name__)

class DaskPSSchedulerPlugin(SchedulerPlugin):
    """The scheduler's view of daskps (see the module docstring): four jobs, each in its own module."""

    name = PLUGIN_NAME

    def __init__(self, scheduler: Any = None) -> None:
        self.scheduler = scheduler
        self.places = ServerPlaces()  # where the servers are, moves, cleanups
        self.reports = Reports()  # functions reported per batch, coordinators' counts, trainers' names
        self.inputs = Inputs()  # dps.data datasets: who reads which partition or batch
        self.telemetry = Telemetry()  # what the dashboard, /metrics and the plots read
        self._refresher: asyncio.Task | None = None

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers[REPORTED_HANDLER] = self.batch_reported
        scheduler.handlers[TRAINERS_HANDLER] = self.count_workers_with
        scheduler.handlers[INPUT_HANDLER] = self.input_claim
        scheduler.handlers[STATS_HANDLER] = self.reports.coordinator_reported
        scheduler.handlers[CLEANUP_HANDLER] = self.run_cleanup
        for extra in views.SCHEDULER_EXTRAS:  # the scheduler's /metrics (with prometheus_client) shows daskps too
            extra.start(self)
        self._refresher = asyncio.ensure_future(self._refresh())  # for it and the dashboard's plots
        self.places.found(scheduler)

    async def close(self) -> None:
        for extra in views.SCHEDULER_EXTRAS:
            extra.close(self)
        if self._refresher is not None:
            self._refresher.cancel()

    async def _refresh(self) -> None:
        """Every ``daskps.metrics-interval``: each server's stats, and a tick of the timeline.

        Stops once this plugin is no longer the scheduler's (Dask's ``remove_plugin`` calls no ``close``).
        """
        registered = False
        while True:
            if self.scheduler.plugins.get(PLUGIN_NAME) is self:
                registered = True
            elif registered:
                for extra in views.SCHEDULER_EXTRAS:
                    extra.close(self)
                return
            try:
                await self.telemetry.tick(self.scheduler, self.places, self.reports)
            except Exception:  # never stop looking: the next tick may do
                logger.exception("daskps: could not refresh the parameter servers' numbers")
            await asyncio.sleep(self.telemetry.interval(self.scheduler))

    def transition(self, key: Any, start: str, finish: str, *args: Any, stimulus_id: str, **kwargs: Any) -> None:
        if not isinstance(key, str) or not key.startswith("daskps-"):
            return
        if not parse_server_key(key):
            if finish == "forgotten":
                self.reports.batch_forgotten(key)
            return
        ts = self.scheduler.tasks.get(key) if self.scheduler is not None else None
        where = kwargs.get("worker") or (next(iter(ts.who_has)).address if ts is not None and ts.who_has else None)
        if self.places.transition(self.scheduler, key, finish, where):
            token = parse_server_key(key)[1]  # type: ignore[index]
            if self.places.strategy_gone(token):  # its counts leave /metrics and the plots
                self.reports.retire(token)
                self.telemetry.strategy_gone(token)

    def log_event(self, topic: str, msg: Any) -> None:
        """Scheduled functions finished: ``[batch_key, [FunctionReport fields, ...], trainer name]``; metric
        values; checkpoints written."""
        if topic == METRICS_TOPIC:
            self.telemetry.metric_values(msg)
        elif topic == CHECKPOINT_TOPIC:
            self.telemetry.checkpoint_written(msg)
        elif topic.startswith(BATCH_TOPIC_PREFIX) and msg[0] != LOST:
            batch_key, rows, *by = msg  # [batch key, reports, the trainer's name]
            where, reports, safe = self.reports.functions_finished(self.scheduler, batch_key, rows, by)
            self.telemetry.functions_ran(where, reports)
            self.inputs.functions_reported(topic, safe)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        name = self.reports.worker_left(worker)
        if name is not None:
            self.telemetry.trainer_left(name)
        self.inputs.worker_left(worker)
        self.places.worker_left(scheduler, worker)

    # -- handlers and requests ----------------------------------------------------------------
    def batch_reported(self, key: str) -> Reported:
        """Asked by every batch as it starts (``REPORTED_HANDLER``): :class:`~daskps.scheduler.messages.Reported`."""
        return self.reports.batch_reported(key, self.places.moves)

    async def run_cleanup(self, server_key: str, cleanup_id: str) -> None:
        """Run a cleanup (see :class:`~daskps.scheduler.messages.AddCleanup`) on every worker now, and forget it."""
        await self.places.run_cleanup(self.scheduler, server_key, cleanup_id)

    def count_workers_with(self, resource: str) -> int:
        """How many live workers hold ``resource`` (the coordinator sizes its batches by it)."""
        return sum(1 for amount in self.scheduler.resources.get(resource, {}).values() if amount > 0)

    def input_claim(self, dataset: str, iterator: int, name: str, address: str, function: int | None = None,
                    n: int = 0, want: int = 1, started: list[int] | None = None) -> Any:
        """Asked by a trainer reading a ``dps.data`` dataset: its next partitions (``messages.Handed``) or,
        exactly once, its batch (``messages.Slice``), or ``messages.GONE`` for a dataset dropped."""
        return self.inputs.claim(self.scheduler, dataset, iterator, name, address, function, n, want, started)

    def answer(self, request: messages.Request) -> None:
        """A request a client sent with ``client.run_on_scheduler(messages.ask, request)``."""
        if isinstance(request, messages.AddCleanup):
            self.places.add_cleanup(request)
        elif isinstance(request, messages.MoveCleanups):
            self.places.move_cleanups(request)
        elif isinstance(request, messages.RecordMoves):
            self.places.record_moves(request)
        elif isinstance(request, messages.OpenInput):
            self.inputs.add(request)
        elif isinstance(request, messages.CloseInput):
            self.inputs.drop(request)
        else:
            raise TypeError(f"the daskps plugin takes a request of daskps.scheduler.messages, got {request!r}")


def install_plugin(client: Any) -> None:
    """Make sure the scheduler of ``client`` runs the plugin, and its workers daskps' worker plugin (once)."""
    setting("worker_mmap_threshold")  # a bad value is refused before anything

    def has_plugins(dask_scheduler: Any) -> tuple[bool, bool]:
        return PLUGIN_NAME in dask_scheduler.plugins, WORKER_PLUGIN_NAME in dask_scheduler.worker_plugins

    on_scheduler, on_workers = client.run_on_scheduler(has_plugins)
    if not on_scheduler:
        client.register_plugin(DaskPSSchedulerPlugin(), name=PLUGIN_NAME)
    if not on_workers:
        register_worker_plugin(client)
