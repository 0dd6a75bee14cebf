"""Scheduler-side bookkeeping: where the servers are, what trainers did, who left.

``ParameterServerStrategy`` makes sure the scheduler runs one
:class:`DaskPSSchedulerPlugin` (``dask scheduler --preload daskps.dashboard``
adds it at start). It notes where each parameter-server actor lives,
which scheduled functions of each batch have reported (a batch that runs
again after its trainer died skips them), each coordinator's counts (per
strategy and per trainer: :mod:`daskps.scheduler.quantities`) and each trainer's
function durations; when a worker leaves it tells every server
to forget the handles that worker's process held, so a trainer that dies
holding handles leaks nothing. Code above can also leave a *cleanup* with it:
a function to run on every worker once a given server is gone, however it
went (``strategy.close()``, everything dropped, or the coordinator's process
ending); per-worker datasets use this so that trainers never keep them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from daskps._core import views
from daskps._core.config import setting
from daskps.client import protocol
from daskps.client.group import parse_server_key
from daskps.client.routing import ServerRef
from daskps.client.worker_state import WORKER_PLUGIN_NAME
from daskps.client.worker_state import register as register_worker_plugin
from daskps.scheduler import messages
from daskps.scheduler.ledger import InputLedger
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
    FunctionReport,
    Reported,
)
from daskps.scheduler.quantities import TrainerCounts, trainer_counts
from daskps.scheduler.timeline import KEEP_STRATEGIES, Timeline

logger = logging.getLogger(__name__)

class DaskPSSchedulerPlugin(SchedulerPlugin):
    """The scheduler's view of daskps (see the module docstring)."""

    name = PLUGIN_NAME

    def __init__(self, scheduler: Any = None) -> None:
        self.scheduler = scheduler
        self.servers: dict[str, str] = {}  # actor key -> worker address
        self.trainer_names: dict[str, str] = {}  # worker address -> name, of trainers that reported
        self.cleanups: dict[str, dict[str, tuple[bytes, bytes]]] = {}  # server key -> id -> (function, args)
        self.reported: dict[str, set[int]] = {}  # batch key -> functions whose result went out
        self.replaced: dict[str, str] = {}  # actor key of a lost server -> the server that took its place
        self.moves: dict[str, tuple] = {}  # actor key of a lost server -> the new server (a ServerRef's fields)
        self.hosts: dict[str, str] = {}  # actor key -> worker address, until the key is forgotten
        self.inputs: dict[str, InputLedger] = {}  # dps.data datasets: who reads which partition or batch
        # For the Prometheus endpoint (daskps.ui.prometheus): the latest of each.
        self.server_snapshot: list[dict[str, Any]] = []  # each server's stats() as a row
        self.coordinator_stats: dict[str, dict[str, Any]] = {}  # strategy token -> its coordinator's counts
        self.retired_trainer_counts: dict[str, TrainerCounts] = {}  # of strategies no longer kept
        self.checkpoint_saves = {"count": 0, "seconds": 0.0, "bytes": 0, "last_seconds": 0.0}
        self._refresher: asyncio.Task | None = None
        self.timeline = Timeline()  # what the dashboard's plots show
        self._said_interval = False  # a bad daskps.metrics-interval was logged

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.handlers[REPORTED_HANDLER] = self.batch_reported
        scheduler.handlers[TRAINERS_HANDLER] = self.count_workers_with
        scheduler.handlers[INPUT_HANDLER] = self.input_claim
        scheduler.handlers[STATS_HANDLER] = self.coordinator_reported
        for extra in views.SCHEDULER_EXTRAS:  # the scheduler's /metrics (with prometheus_client) shows daskps too
            extra.start(self)
        self._refresher = asyncio.ensure_future(self._refresh_servers())  # for it and the dashboard's plots
        scheduler.handlers[CLEANUP_HANDLER] = self.run_cleanup
        for key, ts in scheduler.tasks.items():  # servers made before the plugin
            if parse_server_key(key) and ts.who_has:
                self.servers[key] = next(iter(ts.who_has)).address

    async def close(self) -> None:
        for extra in views.SCHEDULER_EXTRAS:
            extra.close(self)
        if self._refresher is not None:
            self._refresher.cancel()

    async def _refresh_servers(self) -> None:
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
                if self.servers:
                    self.server_snapshot = await self.fetch_server_stats(
                        setting("display_timeout"))
                elif self.server_snapshot:
                    self.server_snapshot = []
                if self.servers or self.coordinator_stats:
                    self.timeline.record(time.time(), self.server_snapshot, self.coordinator_stats,
                                         self.trainer_counts())
            except Exception:  # never stop looking: the next tick may do
                logger.exception("daskps: could not refresh the parameter servers' numbers")
            try:
                interval = max(0.1, setting("metrics_interval"))
            except ValueError as exc:  # said once, not silently: it looks every second meanwhile
                if not self._said_interval:
                    self._said_interval = True
                    logger.error("daskps: %s; the scheduler at %s asks the servers every 1 s meanwhile", exc,
                                 getattr(self.scheduler, "address", "?"))
                interval = 1.0
            await asyncio.sleep(interval)

    async def fetch_server_stats(self, timeout: float) -> list[dict[str, Any]]:
        """``stats()`` of every parameter server, asked directly: a row each (``"error"`` where one did not answer)."""
        servers = self.server_refs()
        rows = []
        for server, result in zip(servers, await protocol.stats_async(self.scheduler.rpc, servers, timeout)):
            row: dict[str, Any] = {"key": server.actor_key, "address": server.address, "task": server.task_id}
            if isinstance(result, BaseException):
                row["error"] = f"{type(result).__name__}: {result}"
            else:
                row.update(result.as_dict())
            rows.append(row)
        return rows

    def _forget_strategy_if_gone(self, server_key: str) -> None:
        """The last server of a strategy is gone: its counts leave /metrics and the plots."""
        token = parse_server_key(server_key)[1]  # type: ignore[index]
        if not any(parse_server_key(k)[1] == token for k in self.hosts):  # type: ignore[index]
            self._retire(token)
            self.timeline.metrics.pop(token, None)

    def _retire(self, token: str) -> None:
        """A strategy's counts leave; what its functions did on each trainer stays in the trainers' totals
        (a counter of /metrics never goes down while the trainer is there)."""
        stats = self.coordinator_stats.pop(token, None)
        if stats is not None:
            self.retired_trainer_counts = trainer_counts({token: stats}, base=self.retired_trainer_counts)

    def trainer_counts(self) -> dict[str, TrainerCounts]:
        """Per trainer name: functions completed, failed and re-run, of every strategy (see quantities)."""
        return trainer_counts(self.coordinator_stats, base=self.retired_trainer_counts)

    def coordinator_reported(self, token: str, stats: dict[str, Any]) -> None:
        """A coordinator's counts (it sends them at most twice a second): the latest are kept, for 64 strategies."""
        self.coordinator_stats.pop(token, None)
        self.coordinator_stats[token] = stats
        while len(self.coordinator_stats) > KEEP_STRATEGIES:
            self._retire(next(iter(self.coordinator_stats)))
    def transition(self, key: Any, start: str, finish: str, *args: Any, stimulus_id: str, **kwargs: Any) -> None:
        if not isinstance(key, str) or not key.startswith("daskps-"):
            return
        if not parse_server_key(key):
            if finish == "forgotten":
                self.reported.pop(key, None)
            return
        ts = self.scheduler.tasks.get(key) if self.scheduler is not None else None
        where = kwargs.get("worker") or (next(iter(ts.who_has)).address if ts is not None and ts.who_has else None)
        if finish == "memory" and where:
            self.servers[key] = self.hosts[key] = where
        elif finish in ("forgotten", "released", "erred"):
            self.servers.pop(key, None)
            if finish == "forgotten":
                self.hosts.pop(key, None)
                self._forget_strategy_if_gone(key)
            todo = self.cleanups.pop(key, {}) if finish == "forgotten" else {}
            if todo and self.scheduler is not None:
                asyncio.ensure_future(_run_on_workers(self.scheduler, list(todo.values())))

    def log_event(self, topic: str, msg: Any) -> None:
        """Scheduled functions finished: ``[batch_key, [FunctionReport fields, ...], trainer name]``; checkpoints written."""
        if topic == METRICS_TOPIC:
            self.timeline.metric_values(str(msg["strategy"]), time.time(), int(msg["step"]),
                                        {str(k): float(v) for k, v in msg["values"].items()})
            return
        if topic == CHECKPOINT_TOPIC:
            saves = self.checkpoint_saves
            saves["count"] += 1
            saves["seconds"] += float(msg["seconds"])
            saves["bytes"] += int(msg["bytes"])
            saves["last_seconds"] = float(msg["seconds"])
            return
        if not topic.startswith(BATCH_TOPIC_PREFIX):
            return
        batch_key, finished, *by = msg  # [batch key, reports, the trainer's name]
        if batch_key == LOST:
            return
        ts = self.scheduler.tasks.get(batch_key) if self.scheduler is not None else None
        # A batch the scheduler has forgotten (cancelled) never runs again: its late report is not kept.
        reported = self.reported.setdefault(batch_key, set()) if ts is not None else set()
        ws = ts.processing_on if ts is not None else None
        if ws is not None:
            self.trainer_names[ws.address] = str(ws.name)
        # the trainer that ran them, as it says (the batch may be processing elsewhere by now)
        where = str(by[0]) if by else (str(ws.name) if ws is not None else None)
        safe = []
        for report in (FunctionReport(*row) for row in finished):
            if report.status != "big":  # a big value lives on its trainer until the batch ends: not safe yet
                reported.add(report.function)
            if report.status == "ok":  # one that failed may run again (its server was lost): same batches
                safe.append(report.function)
            if where is not None:
                self.timeline.function_ran(where, report.seconds)
        for ledger in self.inputs.values():
            if ledger.topic == topic and ledger.queues:
                ledger.reported(safe)

    def batch_reported(self, key: str) -> Reported:
        """Asked by every batch as it starts: :class:`~daskps.scheduler.messages.Reported`.

        ``reported`` are the functions of batch ``key`` whose results went out
        (a batch that runs again skips them); ``moves`` the servers re-created
        after losses, so a batch submitted before a recovery, or moved to a
        new trainer, reaches the new servers.
        """
        return Reported(sorted(self.reported.get(key, ())), dict(self.moves))

    async def run_cleanup(self, server_key: str, cleanup_id: str) -> None:
        """Run a cleanup (see :class:`~daskps.scheduler.messages.AddCleanup`) on every worker now, and forget it: its object was dropped."""
        while server_key in self.replaced:
            server_key = self.replaced[server_key]
        todo = self.cleanups.get(server_key, {}).pop(cleanup_id, None)
        if todo is not None:
            await _run_on_workers(self.scheduler, [todo])

    def count_workers_with(self, resource: str) -> int:
        """How many live workers hold ``resource`` (the coordinator sizes its batches by it)."""
        return sum(1 for amount in self.scheduler.resources.get(resource, {}).values() if amount > 0)

    def input_claim(self, dataset: str, iterator: int, name: str, address: str, function: int | None = None,
                    n: int = 0, want: int = 1, started: list[int] | None = None) -> dict[str, Any]:
        """Asked by a trainer reading a ``dps.data`` dataset: its next partitions (or batch, exactly once)."""
        ledger = self.inputs.get(dataset)
        if ledger is None:
            return {"gone": True}
        if ledger.exactly_once:
            return ledger.claim_batch(self.scheduler, iterator, name, address, function, n)
        return ledger.claim(self.scheduler, iterator, name, address, want, started or ())

    def answer(self, request: messages.Request) -> None:
        """A request a client sent with ``client.run_on_scheduler(messages.ask, request)``."""
        if isinstance(request, messages.AddCleanup):
            self.cleanups.setdefault(request.server_key, {})[request.cleanup_id] = (request.function, request.args)
        elif isinstance(request, messages.MoveCleanups):
            self.replaced[request.old_key] = request.new_key
            moved = self.cleanups.pop(request.old_key, None)
            if moved:
                self.cleanups.setdefault(request.new_key, {}).update(moved)
        elif isinstance(request, messages.RecordMoves):
            self.moves.update(request.moves)
        elif isinstance(request, messages.OpenInput):
            self.inputs[request.dataset] = InputLedger(request.keys, request.rows, request.trainers, request.resource,
                                                       **request.options)
        elif isinstance(request, messages.CloseInput):
            self.inputs.pop(request.dataset, None)
        else:
            raise TypeError(f"the daskps plugin takes a request of daskps.scheduler.messages, got {request!r}")

    def server_refs(self) -> list[ServerRef]:
        return [ServerRef(address, key, parse_server_key(key)[0])  # type: ignore[index]
                for key, address in sorted(self.servers.items())]

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        name = self.trainer_names.pop(worker, None)
        if name is not None and name not in self.trainer_names.values():  # not back under a new address
            self.timeline.trainer_left(name)  # its durations go; workers that come and go leave nothing behind
        for ledger in self.inputs.values():
            ledger.lost(worker)
        servers = [s for s in self.server_refs() if s.address != worker]
        if servers:
            asyncio.ensure_future(protocol.forget_place_async(scheduler.rpc, servers, worker))
        lost: dict[str, list[str]] = {}  # servers that lived there, by strategy: tell their coordinators
        for key in [k for k, address in self.hosts.items() if address == worker]:
            del self.hosts[key]
            lost.setdefault(parse_server_key(key)[1], []).append(key)  # type: ignore[index]
        for token, keys in lost.items():
            scheduler.log_event(f"{BATCH_TOPIC_PREFIX}{token}", [LOST, keys])


async def _run_on_workers(scheduler: Any, calls: list[tuple[bytes, bytes]]) -> None:
    """Run each pickled ``(function, args)`` on every running worker, all at once, ignoring failures.

    Not ``scheduler.broadcast``: that logs an error for each worker it cannot
    reach, and a worker closing with its cluster has nothing left to clean.
    """
    async def one(address: str, function: bytes, args: bytes) -> None:
        with contextlib.suppress(Exception):  # a worker that is gone has nothing to clean
            await scheduler.rpc(address).run(function=function, args=args, kwargs=dumps({}), wait=True)

    for function, args in calls:
        running = [a for a, ws in scheduler.workers.items() if ws.status == Status.running]
        await asyncio.gather(*(one(a, function, args) for a in running))


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
