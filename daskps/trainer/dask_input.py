"""Dask DataFrames and Arrays as per-worker input, read where their partitions live.

``from_dask(collection, batch_size, ...)`` checks the collection and the
options and returns a :class:`DaskInput`; ``create_per_worker_dataset`` turns
it into a :class:`~daskps.trainer.datasets.PerWorkerDataset` by
:func:`dask_dataset`:

1. the collection is persisted on the trainers, unless it was persisted
   already (then its partitions are used where they lie); their rows are
   counted;
2. the scheduler keeps a ledger of the dataset (:mod:`daskps.scheduler.ledger`):
   each trainer asks it which partition to read next (streaming: the
   partitions it holds, balanced by rows; those of a trainer that died go to
   the others) or, with ``exactly_once``, which batch;
3. the trainer reads that partition from its own worker's memory when it
   holds it, fetched straight from the worker holding it otherwise (once:
   kept for later epochs). Nothing passes through the coordinator, and only
   partition numbers through the scheduler.

Streaming batches span partition boundaries. With ``shuffle=True`` each
epoch reads the partitions in a new order and shuffles rows within a
bounded buffer (``daskps.data.shuffle-buffer-rows`` rows, at least one
partition); ``seed`` makes the order repeatable. At the end ``next``
raises ``StopIteration`` in the scheduled function.

The coordinator keeps the persisted partitions (futures) alive as long as
the dataset; dropping it releases them, the scheduler forgets the ledger and
the trainers forget what they fetched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from distributed import Future, get_client, get_worker
from distributed.utils import sync

from daskps.distribute.dask_data import (
    Batcher,
    read_partition,
    slice_rows,
    take_rows,
)
from daskps.scheduler.messages import END, EPOCH_END, INPUT_HANDLER, Handed, Slice
from daskps.trainer.datasets import call_position

__all__ = ["Source"]

# Seconds a trainer's "I started these partitions" notes wait, to go to the scheduler together.
NOTE_EVERY = 0.05
# Partitions a trainer has handed out to it ahead of reading them (asking for more when a quarter
# are left): with a stable set of trainers, usually its whole share of an epoch in one answer.
LOOKAHEAD = 64


# -- on each trainer: ask the ledger, read, batch ----------------------------------------------


class Source:
    """A dataset on one trainer: asks the scheduler's ledger what to read, keeps what it fetched."""

    def __init__(self, reader: Any):  # a daskps.trainer.messages.Reader
        self.reader = reader
        self.worker = get_worker()
        self.fetched: dict[int, list[Any]] = {}  # partitions fetched from other workers, kept for later epochs
        self.futures: list[tuple[Future, ...]] | None = None

    def daskps_iterator(self, iterator_id: int) -> Iterator[Any]:
        """The iterator ``iterator_id`` of the dataset on this trainer."""
        return (Once if self.reader.exactly_once else Streaming)(self, iterator_id)

    def __iter__(self) -> Iterator[Any]:
        return self.daskps_iterator(0)

    def ask(self, iterator_id: int, **extra: Any) -> Any:
        """The ledger's answer (see :mod:`daskps.scheduler.ledger`), waited for."""
        w = self.worker
        return sync(w.loop, getattr(w.scheduler, INPUT_HANDLER), dataset=self.reader.published,
                    iterator=iterator_id, name=str(w.name), address=w.address, **extra)

    def ask_ahead(self, iterator_id: int, **extra: Any) -> concurrent.futures.Future:
        """The ledger's answer, asked now from the worker's event loop; ``.result()`` when needed."""
        w = self.worker
        call = getattr(w.scheduler, INPUT_HANDLER)(dataset=self.reader.published, iterator=iterator_id,
                                                   name=str(w.name), address=w.address, **extra)
        return asyncio.run_coroutine_threadsafe(call, w.loop.asyncio_loop)  # type: ignore[attr-defined]

    def load(self, i: int) -> list[Any]:
        """Partition ``i`` of every component, as numpy (a dict of columns for a DataFrame)."""
        if i in self.fetched:
            return self.fetched[i]
        if self.futures is None:
            # Futures from the scheduler, not made from keys here: with them the worker's client
            # hears of a partition Dask recomputes after its worker died.
            self.futures = get_client().get_dataset(self.reader.published)
        out, local = read_partition(self.worker, self.futures[i])
        if not local:
            self.fetched[i] = out
        return out


class Streaming:
    """A trainer's iterator over its share: partitions from the ledger, batched across their ends.

    It has up to ``LOOKAHEAD`` partitions handed out ahead and asks for
    more, without waiting, when a quarter are left or an epoch's end is in
    sight (a scheduler round trip per partition costs more than batching a
    partition); it tells the ledger which it started, without waiting (the
    notes of ``NOTE_EVERY`` seconds go together, or with the next request),
    so a trainer that dies leaves those it had not started to the others. Asks again after the end: a trainer that died meanwhile may
    have left partitions nobody read (then they are read here).
    """

    def __init__(self, source: Source, iterator_id: int):
        self.source, self.id = source, iterator_id
        self.batcher = Batcher(source.reader)
        self.epoch: int | None = None
        self.handed: deque[list[int]] = deque()  # [partition, epoch, number], not started yet
        self.then: Handed | None = None  # what comes after them: the end of an epoch, or of all
        self.asking: concurrent.futures.Future | None = None
        self.unsent: list[int] = []  # partitions started, not yet said to the ledger
        self.lock = threading.Lock()
        self.timer = False

    def __iter__(self) -> Streaming:
        return self

    def __next__(self) -> Any:
        batcher = self.batcher
        while not batcher.ready:
            if self.handed:
                self._start(*self.handed.popleft())
            elif self.then is not None:  # the end of this trainer's epoch, or of its data
                then, self.then = self.then, None
                batcher.flush()
                self.epoch = None
                if then.then != EPOCH_END and not batcher.ready:
                    raise StopIteration
            else:
                asking, self.asking = self.asking, None
                answer = Handed.of(asking.result()) if asking is not None else None
                if answer is None or (answer.then == END and not answer.partitions):
                    # Asked afresh at the end: a trainer that died since the answer came may have left
                    # partitions to read.
                    answer = Handed.of(self.source.ask(self.id, want=LOOKAHEAD, started=self._take_unsent()))
                self._heard(answer)
        return batcher.ready.popleft()

    def _start(self, partition: int, epoch: int, number: int) -> None:
        batcher = self.batcher
        with self.lock:
            self.unsent.append(partition)
        if self.asking is None and self.then is None and len(self.handed) < LOOKAHEAD // 4:
            self.asking = self.source.ask_ahead(self.id, want=LOOKAHEAD, started=self._take_unsent())
        else:
            with self.lock:
                timer, self.timer = self.timer, True
            if not timer:
                loop = self.source.worker.loop
                loop.add_callback(loop.call_later, NOTE_EVERY, self._send_notes)
        if epoch != self.epoch:  # batches do not span epochs
            batcher.flush()
            self.epoch, seed = epoch, self.source.reader.seed
            batcher.rng = np.random.default_rng(None if seed is None else [seed, epoch, number])
        batcher.add(self.source.load(partition))

    def _take_unsent(self) -> list[int]:
        with self.lock:
            started, self.unsent = self.unsent, []
            return started

    def _send_notes(self) -> None:
        """On the worker's event loop: tell the ledger the partitions started meanwhile (not waited for)."""
        with self.lock:
            self.timer = False
        started = self._take_unsent()
        if started:
            self.source.ask_ahead(self.id, want=0, started=started)

    def _heard(self, answer: Handed) -> None:
        self.handed.extend(answer.partitions)
        if answer.then:  # the dataset was dropped, or an end
            self.then = answer
        if answer.then == EPOCH_END:  # the next epoch's share, asked for while this one is read
            self.asking = self.source.ask_ahead(self.id, want=LOOKAHEAD, started=self._take_unsent())


class Once:
    """An iterator handing out one batch per ``next`` from the whole cluster's queue (``exactly_once``)."""

    def __init__(self, source: Source, iterator_id: int):
        self.source, self.id, self.r = source, iterator_id, source.reader
        self.batcher = Batcher(source.reader)  # only shapes batches here
        self.orders: dict[tuple[int, int], np.ndarray] = {}  # (partition, epoch) -> its rows' shuffled order

    def __iter__(self) -> Once:
        return self

    def __next__(self) -> Any:
        function, n = call_position(self)
        answer = Slice.of(self.source.ask(self.id, function=function, n=n))
        if answer.then:  # the end, or the dataset was dropped
            raise StopIteration
        i, start, stop = answer.partition, answer.start, answer.stop
        part = self.source.load(i)
        if not self.r.shuffle:
            return self.batcher.batch([slice_rows(a, start, stop) for a in part])
        order = self.orders.get((i, answer.epoch))
        if order is None:
            if len(self.orders) > 64:
                self.orders.clear()
            # The same on every trainer: a function run again reads the same rows.
            rng = np.random.default_rng([self.r.seed, answer.epoch, i])
            order = self.orders[i, answer.epoch] = rng.permutation(self.r.rows[i])
        return self.batcher.batch([take_rows(a, order[start:stop]) for a in part])
