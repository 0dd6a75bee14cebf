"""What the coordinator hands to trainers, and how their answers read: all it knows of ``daskps.trainer``.

- :func:`run_batch` is the task a batch runs on a trainer (Dask submits a
  function, so the coordinator needs this one, and nothing else of the trainers' code);
- :class:`Reader` is the dataset function a ``dps.data.from_dask`` dataset
  stores for the trainers;

How the trainers answer (each function's :class:`~daskps.scheduler.messages.FunctionReport`)
is in :mod:`daskps.scheduler.messages`, which their reports pass through.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def run_batch(strategy_blob: bytes, topic: str, batch_key: str, batch: bytes, report_every: float) -> dict[int, Any]:
    """The task of one batch, run on a trainer (see :func:`daskps.trainer.batches.run_batch_here`); its finished
    functions are reported in events at most ``report_every`` seconds apart."""
    from daskps.trainer.batches import run_batch_here  # (on the trainer)

    return run_batch_here(strategy_blob, topic, batch_key, batch, report_every)


@dataclasses.dataclass(frozen=True)
class Reader:
    """The dataset function stored for the trainers: where the ledger is and how to batch (a few KB)."""

    published: str  # the ledger's name, and the partitions' futures published on the scheduler
    names: tuple[Any, ...] | None
    single: bool
    batch_size: int
    shuffle: bool
    seed: int | None
    drop_remainder: bool
    exactly_once: bool
    rows: tuple[int, ...]

    def __call__(self) -> Any:
        from daskps.trainer.dask_input import Source  # (on the trainer)

        return Source(self)
