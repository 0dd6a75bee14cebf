"""Settling scheduled functions: what trainers report, and what a finished batch leaves.

Each function reports as soon as it finishes, through an event on the
strategy's topic (see :mod:`daskps.trainer.batches`): its RemoteValue is
ready then, and a batch that Dask runs again after its trainer died skips
the functions that already reported. When a batch's task finishes, its
future is released (its result, the values too big for an event, is fetched
first if it has any), so nothing finished is ever recomputed; a function of
that batch that never reported is settled here too, one way or another,
never left pending.
"""

from __future__ import annotations

import weakref
from typing import Any

from distributed import as_completed

from daskps._core import trace
from daskps.client.routing import ROUTES
from daskps.coordinator.remote import FAILED, PENDING
from daskps.errors import CancelledError
from daskps.scheduler.messages import BIG, ERROR, LOST, FunctionReport, load_error


class Settler:
    """Settles functions from their reports and their batches' ends; a lost server goes to ``recovery``."""

    def __init__(self, book: Any, recovery: Any, policy: Any, publisher: Any, client: Any) -> None:
        self._book, self._recovery, self._policy, self._publisher = book, recovery, policy, publisher
        self._client = client

    @staticmethod
    def deliver(settler: weakref.ref, event: Any) -> None:
        """A topic's event, for the settler if it is still alive (the subscription holds it weakly)."""
        alive = settler()
        if alive is not None:
            started = trace.now() if trace.ON else 0.0
            alive.on_event(event)
            if trace.ON:
                trace.span("events", started)

    def on_event(self, event: tuple[float, Any]) -> None:
        """On the client's event loop: functions finished on a trainer, or servers seen lost."""
        _, (batch_key, finished, *by) = event
        if batch_key == LOST:
            self._recovery.on_lost(finished)
            return
        trainer = str(by[0]) if by else ""
        book = self._book
        with book.lock:
            reports = [FunctionReport(*row) for row in finished]
            self._policy.observe([r.seconds for r in reports])
            for cid, status, payload, _, generation in reports:
                closure = book.pending.get(cid)
                if closure is None or closure.outcome.state != PENDING or closure.batch != batch_key:
                    continue  # cancelled or queued again meanwhile
                closure.generation = generation
                closure.trainer = trainer
                if status == BIG:
                    continue  # its result comes with the batch
                if status == ERROR:
                    assert payload is not None  # an error always carries itself
                    error = load_error(payload)  # one that cannot be rebuilt here: a RuntimeError with its text
                    if self._recovery.run_again(closure, error):
                        self._recovery.stopped_batch(batch_key)
                    else:
                        ROUTES.name_what_was_held(error)
                        book.fail(closure, error)
                else:
                    closure.outcome.finish(payload)
                    book.done(closure)
        self._publisher.publish()

    async def watch(self, key: str, future: Any) -> None:
        """A batch's task finished: take its big results, settle the rest, release the future."""
        async for _ in as_completed([future], loop=self._client.loop):  # Dask's own wait, on this loop
            pass
        book = self._book
        results, error = {}, None
        with book.lock:  # every function reported (none too big for its event): nothing to fetch
            _, closures = book.batches.get(key, (None, []))
            unsettled = any(c.outcome.state == PENDING and c.id in book.pending for c in closures)
        if future.status == "finished" and unsettled:
            try:
                results = await future
            except Exception as exc:  # its result was lost with its worker
                error = exc
        elif future.status == "error":
            try:
                await future  # raises the task's exception
            except Exception as exc:
                error = exc
        elif future.status == "cancelled":  # not by us (we forget what we cancel): client.restart(), say
            error = CancelledError(f"the Dask task of batch {key!r} was cancelled outside the coordinator "
                                   "(client.restart() or client.cancel()); its functions did not all run")
        future.release()
        with book.lock:
            _, closures = book.batches.pop(key, (None, []))
            failed = any(c.outcome.state == FAILED for c in closures)
            lossy = self._recovery.batch_ended(key)
            for c in closures:
                if c.outcome.state != PENDING or c.id not in book.pending or c.batch != key:
                    continue  # settled, or queued again (a lost server)
                if c.id in results:
                    c.outcome.finish(None, results[c.id])
                    book.done(c)
                elif error is not None:
                    if not self._recovery.run_again(c, error):
                        book.fail(c, error)
                elif failed:  # not run: an earlier function of its batch failed (the batch stops there)
                    book.not_run(c)
                elif lossy:  # not run: an earlier one failed because a parameter server was lost
                    self._recovery.requeue(c)
                else:  # never reported, yet the batch ended: say so rather than wait forever
                    book.fail(c, RuntimeError(f"scheduled function {c.id} of batch {key!r} ended without "
                                              "reporting its result"))
