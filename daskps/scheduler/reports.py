"""The scheduler plugin's reports job: which functions of each batch reported, and what coordinators counted.

Every batch's functions report on their coordinator's topic as they finish
(:class:`~daskps.scheduler.messages.FunctionReport` rows); this job keeps,
per batch still known to the scheduler, the functions whose results went
out, so that a batch Dask runs again after its trainer died skips them
(:meth:`Reports.batch_reported`). It also keeps each coordinator's latest
counts (per strategy and per trainer, :mod:`daskps.scheduler.quantities`)
and the trainers' names by address.
"""

from __future__ import annotations

from typing import Any

from daskps.scheduler.messages import BIG, OK, FunctionReport, Reported
from daskps.scheduler.quantities import TrainerCounts, trainer_counts
from daskps.scheduler.timeline import KEEP_STRATEGIES


class Reports:
    """Reported functions per batch, coordinators' counts, trainers' names."""

    def __init__(self) -> None:
        self.reported: dict[str, set[int]] = {}  # batch key -> functions whose result went out
        self.trainer_names: dict[str, str] = {}  # worker address -> name, of trainers that reported
        self.coordinator_stats: dict[str, dict[str, Any]] = {}  # strategy token -> its coordinator's counts
        self.retired_trainer_counts: dict[str, TrainerCounts] = {}  # of strategies no longer kept

    def functions_finished(self, scheduler: Any, batch_key: str, rows: list, by: list
                           ) -> tuple[str | None, list[FunctionReport], list[int]]:
        """A batch's event: its trainer's name, the reports, and the functions that succeeded for good."""
        ts = scheduler.tasks.get(batch_key) if scheduler is not None else None
        # A batch the scheduler has forgotten (cancelled) never runs again: its late report is not kept.
        reported = self.reported.setdefault(batch_key, set()) if ts is not None else set()
        ws = ts.processing_on if ts is not None else None
        if ws is not None:
            self.trainer_names[ws.address] = str(ws.name)
        # the trainer that ran them, as it says (the batch may be processing elsewhere by now)
        where = str(by[0]) if by else (str(ws.name) if ws is not None else None)
        reports = [FunctionReport(*row) for row in rows]
        safe = []
        for report in reports:
            if report.status != BIG:  # a big value lives on its trainer until the batch ends: not safe yet
                reported.add(report.function)
            if report.status == OK:  # one that failed may run again (its server was lost): same batches
                safe.append(report.function)
        return where, reports, safe

    def batch_forgotten(self, key: str) -> None:
        self.reported.pop(key, None)

    def batch_reported(self, key: str, moves: dict[str, tuple]) -> Reported:
        """What a batch asks as it starts: its functions that already reported, and the servers that moved."""
        return Reported(sorted(self.reported.get(key, ())), dict(moves))

    def coordinator_reported(self, token: str, stats: dict[str, Any]) -> None:
        """A coordinator's counts (it sends them at most twice a second): the latest are kept, for 64 strategies."""
        self.coordinator_stats.pop(token, None)
        self.coordinator_stats[token] = stats
        while len(self.coordinator_stats) > KEEP_STRATEGIES:
            self.retire(next(iter(self.coordinator_stats)))

    def retire(self, token: str) -> None:
        """A strategy's counts leave; what its functions did on each trainer stays in the trainers' totals
        (a counter of /metrics never goes down while the trainer is there)."""
        stats = self.coordinator_stats.pop(token, None)
        if stats is not None:
            self.retired_trainer_counts = trainer_counts({token: stats}, base=self.retired_trainer_counts)

    def trainer_counts(self) -> dict[str, TrainerCounts]:
        """Per trainer name: functions completed, failed and re-run, of every strategy (see quantities)."""
        return trainer_counts(self.coordinator_stats, base=self.retired_trainer_counts)

    def worker_left(self, worker: str) -> str | None:
        """The name of a trainer that left and is not back under a new address, if it was one."""
        name = self.trainer_names.pop(worker, None)
        return name if name is not None and name not in self.trainer_names.values() else None
