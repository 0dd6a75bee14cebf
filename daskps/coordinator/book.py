"""The coordinator's book: what is scheduled, what is in flight, and what became of each function.

One lock (a condition) guards it, and every part of the coordinator changes
it under that lock: ``schedule`` adds to the queue, dispatch takes batches
from it, settling finishes or fails functions, recovery queues them again,
``join`` and ``fetch`` wait on it. The book knows no Dask: it is the state
those parts share, and the rules for changing it.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import threading
from typing import Any

from daskps.coordinator.closures import Closure
from daskps.coordinator.counts import Counts
from daskps.coordinator.remote import PENDING, Outcome


class Book:
    """Scheduled functions from queued to settled, under one condition (``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.queue: collections.deque[Closure] = collections.deque()  # scheduled, not yet in a batch
        self.pending: dict[int, Closure] = {}  # scheduled, not finished (queued or in a batch)
        self.batches: dict[str, tuple[Any, list[Closure]]] = {}  # in flight: key -> (future, closures)
        self.error: BaseException | None = None  # the first error, until join(), done() or schedule() raises it
        self.last_error: BaseException | None = None
        self.counts = Counts()  # in all and per trainer: what summary(), the dashboard and /metrics show
        self.fetching = 0  # threads waiting in RemoteValue.fetch(): wake them on every result
        # Functions finished, by the generation of servers their trainer knew (see finished_by_generation).
        self.done_by_generation: collections.Counter[int] = collections.Counter()
        self.recoveries: list[Any] = []  # what each recovery did (daskps.coordinator.recovery.Recovered)
        self._ids = itertools.count()

    def add(self, blob: tuple[bytes, bytes], kept: list[Any], staleness: int) -> Closure:
        """Queue a new function (under the lock)."""
        closure = Closure(next(self._ids), blob, kept, Outcome(self.wait_for), staleness)
        self.queue.append(closure)
        self.pending[closure.id] = closure
        self.counts.add("scheduled")
        return closure

    def take(self, size: int) -> list[Closure]:
        """The first ``size`` queued functions, for a batch (under the lock)."""
        return [self.queue.popleft() for _ in range(size)]

    def done(self, closure: Closure) -> None:
        """``closure`` settled, with its result or its error (under the lock)."""
        self.pending.pop(closure.id, None)
        ok = closure.outcome.state != "error"
        self.counts.add("done" if ok else "failed", closure.trainer)
        if ok:
            self.done_by_generation[closure.generation] += 1
        if self.fetching or not self.pending or self.error is not None:
            self.lock.notify_all()  # join() needs waking only when all is done, or on an error

    def fail(self, closure: Closure, error: BaseException) -> None:
        """``closure`` failed for good; the first such error is raised by the next join() (under the lock)."""
        closure.outcome.fail(error)
        self.record_error(error)
        self.done(closure)

    def record_error(self, error: BaseException) -> None:
        self.last_error = error
        if self.error is None:
            self.error = error

    def not_run(self, closure: Closure) -> None:
        """``closure`` did not run: an earlier function of its batch failed (under the lock)."""
        self.pending.pop(closure.id, None)
        self.counts.add("cancelled")
        closure.outcome.cancel()
        self.lock.notify_all()

    def requeue(self, closure: Closure) -> None:
        """Queue ``closure`` again, before the functions scheduled after it (under the lock)."""
        # where it failed (one never run, behind a failed one in its batch, has no trainer)
        self.counts.add("rerun", closure.trainer)
        closure.batch, closure.trainer = None, ""
        index = bisect.bisect_left([c.id for c in self.queue], closure.id)
        self.queue.insert(index, closure)

    def take_error(self) -> BaseException | None:
        """The pending first error, now to be raised (it is raised once)."""
        with self.lock:
            error, self.error = self.error, None
        return error

    def cancel_all(self) -> tuple[int, list[Any]]:
        """Cancel every pending function: how many, and the futures of the batches in flight (under the lock)."""
        cancelled = list(self.pending.values())
        self.pending.clear()
        self.queue.clear()
        self.counts.add("cancelled", n=len(cancelled))
        for c in cancelled:
            c.outcome.cancel()
        self.lock.notify_all()
        return len(cancelled), [f for f, _ in self.batches.values()]

    def wait_for(self, outcome: Outcome) -> None:
        """Block until ``outcome`` is settled (``RemoteValue.fetch``)."""
        with self.lock:
            self.fetching += 1
            try:
                while outcome.state == PENDING:
                    self.lock.wait(timeout=1.0)
            finally:
                self.fetching -= 1

    def finished_by_generation(self) -> collections.Counter[int]:
        """How many functions finished, by the generation of re-created servers their trainer knew.

        A checkpoint manager keeps a copy at each save; a recovery tells from
        them how many finished since then on the lost server.
        """
        with self.lock:
            return collections.Counter(self.done_by_generation)
