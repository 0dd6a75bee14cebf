"""The coordinator's batching policy: how many queued functions go into the next batch, and when.

Every batch is one Dask task on one trainer, so a batch should hold enough
work to be worth its round trip (about ``BATCH_SECONDS``, from how long
functions have taken: a moving average of their reports) and no more than
``daskps.max-batch`` functions. Past 20 trainers a batch holds more
(:func:`batch_seconds`: the trainers over ``MAX_BATCHES_PER_SECOND``) and
trainers report less often (:func:`report_seconds`), so that the tasks and
events a coordinator sends through the scheduler each second stay bounded
as trainers are added. Only as many trainers as the outstanding work
needs get batches, one each; then, while a whole batch more is queued for
each, a second one each, which waits on its trainer and starts the moment
the first ends (a trainer with none idles a round trip through the
scheduler). So short functions go out in few big batches to one trainer
(more would only add overhead), long ones in small batches spread over every
trainer; the last batches are short.
Until durations are known, the queue is split evenly over every trainer.

The policy is pure arithmetic on counts; :class:`BatchPolicy` holds only the
moving average. The coordinator asks it under its lock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from daskps._core.config import setting

# About how long one batch should run (with up to 20 trainers; see batch_seconds).
BATCH_SECONDS = 0.2
# Past 20 trainers, batches run longer, and trainers report less often, so that what one coordinator sends
# through the scheduler stays bounded however many trainers there are: about this many batch tasks a
# second (each is about five task transitions and their messages) ...
MAX_BATCHES_PER_SECOND = 100
# ... and about this many report events a second (a trainer reports every 20 ms up to 10 trainers).
MAX_REPORTS_PER_SECOND = 500
REPORT_SECONDS = 0.02


def batch_seconds(trainers: int) -> float:
    """How long a batch should run with ``trainers`` live trainers."""
    return max(BATCH_SECONDS, trainers / MAX_BATCHES_PER_SECOND)


def report_seconds(trainers: int) -> float:
    """How long a trainer gathers finished functions into one report event, with ``trainers`` live trainers."""
    return max(REPORT_SECONDS, trainers / MAX_REPORTS_PER_SECOND)


class BatchPolicy:
    """Batch sizes from how long functions take."""

    def __init__(self) -> None:
        self.seconds_per_function: float | None = None  # a moving average, from the reports

    def observe(self, seconds: Sequence[float]) -> None:
        """An event's functions ran this long (a few events follow a change)."""
        took = sum(seconds) / len(seconds)
        per = self.seconds_per_function
        self.seconds_per_function = took if per is None else per + 0.5 * (took - per)

    def next_size(self, queued: int, pending: int, trainers: int, in_flight: int) -> int:
        """How many of the ``queued`` functions the next batch takes (0: none now).

        ``pending`` counts the functions queued and running, ``in_flight`` the
        batches submitted and not finished, ``trainers`` the live trainers.
        """
        per = self.seconds_per_function
        if per is None:
            useful, size = trainers, math.ceil(queued / trainers)
        else:
            target = batch_seconds(trainers)
            work = pending * per  # queued and running
            useful = max(1, min(trainers, math.ceil(work / target)))
            # (rounded, not truncated: functions of 0.1001 s are two to a 0.2 s batch, not one)
            size = min(max(1, round(target / per)), math.ceil(queued / useful))
        size = min(size, setting("max_batch"))
        # Batches capped at daskps.max-batch: the work is more than one batch per trainer can carry, so
        # spread it (short functions would otherwise wait for a round trip per batch on one trainer).
        useful = min(trainers, max(useful, math.ceil(queued / size)))
        # Each trainer busy: a second batch each waits on its trainer and starts the moment the first ends
        # (else the trainer idles a round trip through the scheduler), when a whole one is queued for each;
        # not until durations are known (the queue was split evenly over the trainers).
        if in_flight >= 2 * useful or (in_flight >= useful and (per is None or queued < useful * size)):
            return 0
        return min(size, queued)
