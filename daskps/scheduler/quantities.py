"""Every number daskps shows about servers and trainers, computed in one place (on the scheduler).

The dashboard's table page (:mod:`daskps.ui.dashboard`), its plots (through
:class:`daskps.scheduler.timeline.Timeline`) and ``/metrics``
(:mod:`daskps.ui.prometheus`) read the scheduler plugin's latest figures
through these functions, so a quantity has one definition and one name
everywhere:

- a server is ``ps-N`` (its task id, kept by a server re-created after a
  loss), a trainer is its Dask worker's name (``worker-0``: kept across a
  restart, where its address is not);
- **bytes held** by a server are its values *and* its optimizer slots;
- per trainer, **completed**, **failed** and **re-run** are the counts the
  coordinator keeps as it settles each function (the same it shows as
  ``coordinator.summary()``, TensorBoard's ``daskps/failed`` and the
  per-strategy series), attributed to the trainer whose report settled it:
  *failed* is failed for good (raised to ``join()``), *re-run* is failed on
  that trainer because a parameter server was lost, and queued again.

``docs/user-guide/dashboard.md`` has the table of quantities, where each is
computed and where it is shown.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple


def natural_key(name: str) -> list[Any]:
    """Sorts ``worker-2`` before ``worker-10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def server_name(row: Mapping[str, Any]) -> str:
    """``ps-N`` for a server's stats row (N: its task id, the same after a recovery)."""
    return f"ps-{row['task']}"


def bytes_held(row: Mapping[str, Any]) -> int:
    """The bytes a server holds: every value and every optimizer slot (its stats' two counts)."""
    return int(row["nbytes"]) + int(row.get("slot_nbytes", 0))


class TrainerCounts(NamedTuple):
    completed: int
    failed: int  # for good: raised to join()
    rerun: int  # failed there as a parameter server was lost, and queued again


def trainer_counts(coordinator_stats: Mapping[str, Mapping[str, Any]],
                   base: Mapping[str, TrainerCounts] | None = None) -> dict[str, TrainerCounts]:
    """Per trainer name, its functions of every strategy's coordinator (as each last sent its counts),
    added to ``base`` (those of strategies no longer kept)."""
    totals: dict[str, list[int]] = {name: list(counts) for name, counts in (base or {}).items()}
    for stats in coordinator_stats.values():
        for name, counts in (stats.get("trainers") or {}).items():
            total = totals.setdefault(str(name), [0, 0, 0])
            total[0] += int(counts.get("done", 0))
            total[1] += int(counts.get("failed", 0))
            total[2] += int(counts.get("rerun", 0))
    return {name: TrainerCounts(*totals[name]) for name in sorted(totals)}
