"""Dispatch: queued functions packed into batches, each one Dask task on a trainer.

A pump on the client's event loop takes queued functions from the book in
batches sized by :mod:`daskps.coordinator.batching` (a share of the queue
per trainer, about a fifth of a second of work, at most ``daskps.max-batch``),
with one batch in flight per trainer, and a second one when the backlog is
deep, so every trainer stays busy and the last batches are short. Each batch
is one task restricted to ``worker``-tagged workers: the scheduler sees one
task per batch, not per function. The pump runs when functions are
scheduled (one wake-up serves every call made meanwhile), when a batch
ends, when a recovery has brought the servers back, and as a
``ClusterCoordinator.hold()`` block ends; inside one, while a recovery runs,
or after one failed, it sends nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
import time
from typing import Any

from daskps._core.pickling import dumps_or_explain
from daskps.coordinator.batching import BatchPolicy, report_seconds
from daskps.trainer.messages import run_batch

# While there is work to dispatch, trainers are counted again this often (seconds).
TRAINERS_REFRESH = 1.0


class Dispatcher:
    """Sends the book's queued functions to trainers, in batches; ``settler`` watches each batch end."""

    def __init__(self, book: Any, strategy: Any, client: Any, topic: str, recovery: Any, settler: Any,
                 policy: BatchPolicy, publisher: Any) -> None:
        self._book, self._strategy, self._client, self._topic = book, strategy, client, topic
        self._recovery, self._settler, self._policy, self._publisher = recovery, settler, policy, publisher
        self._strategy_blob = dumps_or_explain(strategy, "strategy")
        self._woken = False  # a pump is on the loop already
        self._held = 0  # ClusterCoordinator.hold() blocks entered and not left: nothing goes out
        self._batch_ids = itertools.count()
        self.trainers = len(strategy.trainer_names)  # live trainers, counted again as work is dispatched
        self._trainers_at = time.monotonic()
        recovery.on_moved(self._moved)
        recovery.on_recovered(self._recovered)

    def wake(self) -> None:
        """Functions were queued (under the book's lock): have the loop pump once for all of them."""
        if not self._woken and not self._held:
            self._woken = True
            self._client.loop.add_callback(self.pump)

    def hold(self) -> None:
        """Send nothing until :meth:`release` (calls nest)."""
        with self._book.lock:
            self._held += 1

    def release(self) -> None:
        """The outermost release: what was queued meanwhile goes out."""
        with self._book.lock:
            self._held -= 1
            if not self._held:
                self.wake()

    def _moved(self) -> None:
        """Lost servers run at new addresses: trainers learn them from the strategy the next batch carries."""
        self._strategy_blob = dumps_or_explain(self._strategy, "strategy")

    def _recovered(self) -> None:
        """Every lost server is back: what waited goes out."""
        with contextlib.suppress(Exception):  # the client is closing: nothing to dispatch
            self._client.loop.add_callback(self.pump)

    def pump(self) -> None:
        """On the client's event loop: put queued functions into batches while trainers need work."""
        if self._client.status in ("closing", "closed"):
            return  # the script is ending (Ctrl-C, a closed cluster): what is queued stays queued
        trainers = max(1, self.trainers)
        book = self._book
        if time.monotonic() - self._trainers_at > TRAINERS_REFRESH and book.queue:
            self._trainers_at = time.monotonic()
            asyncio.ensure_future(self._count_trainers())
        with book.lock:
            self._woken = False
            if self._held or not self._recovery.dispatching:
                return  # released by hold()'s end; when the lost server is back; after a failed recovery, join() raises
            batches: list[list[Any]] = []
            while book.queue:
                size = self._policy.next_size(len(book.queue), len(book.pending), trainers,
                                              len(book.batches) + len(batches))
                if not size:
                    break
                batches.append(book.take(size))
            for closures in batches:
                number = next(self._batch_ids)
                key = f"daskps-batch-{number}-{self._strategy.token[:8]}"
                # One bytes object: Dask walks every nested list and tuple of a task's arguments.
                payload = pickle.dumps([(c.id, c.blob, c.staleness) for c in closures], protocol=5)
                # Batches waiting on one trainer start in the order they were made: Dask ranks tasks submitted
                # within 100 ms of each other alike, and then by key, where batch 10 comes before batch 9.
                future = self._client.submit(
                    run_batch, self._strategy_blob, self._topic, key, payload, report_seconds(trainers),
                    key=key, resources={"worker": 1}, pure=False, priority=-number,
                )
                book.batches[key] = (future, closures)
                for c in closures:
                    c.batch = key
                asyncio.ensure_future(self._settle(key, future))
        self._publisher.publish()

    async def _settle(self, key: str, future: Any) -> None:
        await self._settler.watch(key, future)
        self.pump()

    async def _count_trainers(self) -> None:
        """Ask the scheduler how many trainers there are now (workers come and go); pump if it changed."""
        resolver = self._strategy.cluster_resolver
        resource = resolver.worker_resource if resolver is not None else "worker"
        with contextlib.suppress(Exception):  # an older scheduler plugin, or the client closing: keep the count
            count = await self._client.scheduler.daskps_trainers(resource=resource)
            if count and count != self.trainers:
                self.trainers = count
                self.pump()
