"""Scheduler-side ledger of a Dask-collection input: which trainer reads which partition or batch.

``dps.data.from_dask`` input is read by the trainers, but who reads what is
decided in one place, the scheduler (its daskps plugin holds one
:class:`InputLedger` per dataset), because only the scheduler sees every
worker come and go. Trainers ask it over Dask's own connection, with
partition numbers and counts only; the data goes from worker to worker.

Two ways of handing out:

* **Streaming** (training). Each epoch of an iterator has a plan: the
  partitions split over the trainers alive when the epoch was first asked
  for, to the trainers holding them, balanced by rows (:func:`assign`; the
  same plan for the same trainers, so a trainer keeps reading, and caching,
  the same partitions). A trainer asks for its next partition one at a time.
  A trainer asks for a few partitions ahead, so the answer is there when it
  needs it, and says which it starts. When a trainer leaves, the partitions
  it had not started (handed or not) are *orphans*: any trainer asking next takes
  them before its own (also one that had run out), so no row of the epoch
  is lost with it; a partition it was reading when it died is not handed
  out again. A trainer that joins has no share
  of an epoch already planned: it starts with the next one.
* **Exactly once** (evaluation). Batches (``batch_size`` rows within a
  partition) are handed out one per ``next`` from one queue per iterator,
  each to the scheduled function that asked, remembered by that function's
  id and how many batches it had asked for. A function that runs again (its
  trainer died before it reported; a parameter server was lost) asks again
  under the same id and gets the same batches; a function that reported is
  never run again, so its batches are never handed out again (and are
  forgotten once it reports, so the ledger stays small).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import numpy as np

from daskps.scheduler.messages import END, EPOCH_END, GONE, CloseInput, Handed, OpenInput, Slice

__all__ = ["InputLedger", "Inputs", "assign"]


def assign(rows: list[int], holders: list[set[str]], trainers: list[str]) -> tuple[dict[str, list[int]], int]:
    """Partitions to trainers: to one holding it, unless that trainer has its share of rows already.

    Biggest partitions first; each goes to its least-loaded holder among the
    trainers, or to the least-loaded trainer when every holder has reached
    ``total / len(trainers)`` rows and that trainer has not. Returns the
    partitions of each trainer and how many went to one not holding them.
    """
    target = sum(rows) / len(trainers)
    load = {t: 0 for t in trainers}
    out: dict[str, list[int]] = {t: [] for t in trainers}
    moved = 0
    for i in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        lightest = min(trainers, key=lambda t: (load[t], trainers.index(t)))
        mine = [t for t in trainers if t in holders[i]]
        pick = min(mine, key=lambda t: (load[t], trainers.index(t))) if mine else lightest
        if load[pick] >= target and load[lightest] < target and pick != lightest:
            pick = lightest
        moved += pick not in holders[i]
        out[pick].append(i)
        load[pick] += rows[i]
    return out, moved


@dataclasses.dataclass
class _Stream:
    """One iterator read in streaming mode."""

    shares: list[dict[str, deque[int]]] = dataclasses.field(default_factory=list)  # epoch -> trainer -> left
    orphans: list[deque[int]] = dataclasses.field(default_factory=list)  # epoch -> partitions nobody reads
    epoch: dict[str, int] = dataclasses.field(default_factory=dict)  # the epoch each trainer is in
    got: dict[str, int] = dataclasses.field(default_factory=dict)  # partitions each had in its epoch
    # Partitions handed to each trainer that it has not said it started: partition -> its plan's epoch.
    ahead: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Queue:
    """One iterator read exactly once: batches left per partition, and what each function was given."""

    epoch: int = 0
    left: dict[int, deque[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    given: dict[int, dict[int, tuple]] = dataclasses.field(default_factory=dict)  # function -> n -> batch
    reading: dict[str, int] = dataclasses.field(default_factory=dict)  # trainer -> its partition now


class InputLedger:
    """Who reads what of one dataset (see the module docstring).

    ``keys[i]`` are the keys of partition ``i`` (one per component),
    ``rows[i]`` its rows; ``names`` the trainers when the dataset was made.
    """

    def __init__(self, keys: list[tuple], rows: list[int], names: list[str], resource: str, *, batch_size: int,
                 shuffle: bool, seed: int | None, epochs: int | None, drop_remainder: bool, exactly_once: bool,
                 topic: str | None = None):
        self.keys, self.rows, self.resource = keys, [int(n) for n in rows], resource
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.epochs, self.drop_remainder, self.exactly_once = epochs, drop_remainder, exactly_once
        self.index = {name: i for i, name in enumerate(names)}  # a trainer's number (its shuffle's seed)
        self.plans: dict[tuple[str, ...], dict[str, list[int]]] = {}  # trainers -> partitions of each
        self.fetched: dict[str, set[int]] = {}  # partitions each trainer fetched (and keeps)
        self.streams: dict[int, _Stream] = {}
        self.queues: dict[int, _Queue] = {}
        self.addresses: dict[str, str] = {}  # worker address -> trainer name, of the trainers seen
        self.topic = topic  # where the coordinator's functions report (exactly once: what was given is forgotten)

    # -- what the scheduler knows ---------------------------------------------------------------
    def _trainers(self, scheduler: Any) -> list[str]:
        """The names of the live trainers (workers with the trainers' resource), in name order."""
        names = []
        for address, ws in scheduler.workers.items():
            if ws.resources.get(self.resource, 0) > 0 and ws.status.name in ("running", "paused"):
                names.append(str(ws.name))
                self.addresses[address] = str(ws.name)
        return sorted(names)

    def _holders(self, scheduler: Any, i: int) -> set[str]:
        """The trainers holding most of partition ``i``'s components, and those that fetched it."""
        counts: dict[str, int] = {}
        for key in self.keys[i]:
            ts = scheduler.tasks.get(key)
            for ws in (ts.who_has if ts is not None else ()) or ():
                counts[str(ws.name)] = counts.get(str(ws.name), 0) + 1
        top = max(counts.values(), default=0)
        out = {name for name, c in counts.items() if c == top}
        return out | {name for name, parts in self.fetched.items() if i in parts}

    def _number(self, name: str) -> int:
        if name not in self.index:
            self.index[name] = len(self.index)
        return self.index[name]

    def _plan(self, scheduler: Any, trainers: list[str]) -> dict[str, list[int]]:
        key = tuple(trainers)
        if key not in self.plans:
            holders = [self._holders(scheduler, i) for i in range(len(self.rows))]
            self.plans[key], _ = assign(self.rows, holders, trainers)
        return self.plans[key]

    def _rng(self, *parts: int) -> np.random.Generator:
        return np.random.default_rng(None if self.seed is None else [self.seed, *parts])

    # -- streaming ----------------------------------------------------------------------------
    def claim(self, scheduler: Any, iterator: int, name: str, address: str, want: int = 1,
              started: list[int] | tuple[int, ...] = ()) -> Handed:
        """Up to ``want`` next partitions for trainer ``name``, which has started ``started``, then
        ``EPOCH_END`` once its share of the epoch is handed out, or ``END`` once all is. ``want=0``
        only notes what it started.
        """
        self.addresses[address] = name
        st = self.streams.setdefault(iterator, _Stream())
        ahead = st.ahead.setdefault(name, {})
        for partition in started:
            ahead.pop(partition, None)
        partitions: list[list[int]] = []
        while len(partitions) < want:
            answer = self._one(scheduler, st, name)
            if isinstance(answer, Handed):
                return answer._replace(partitions=partitions)
            partitions.append(answer)
        return Handed(partitions)

    def _one(self, scheduler: Any, st: _Stream, name: str) -> list[int] | Handed:
        """The next partition for ``name``, ``[partition, epoch, number]``, or the end of its epoch or of
        everything (a ``Handed`` with no partitions)."""
        if name not in st.epoch:  # a trainer not in a planned epoch starts with the next one
            st.epoch[name] = next((e for e, s in enumerate(st.shares) if name in s), len(st.shares))
        epoch, number = st.epoch[name], self._number(name)
        for e, orphans in enumerate(st.orphans[:epoch + 1]):
            if orphans:
                st.got[name] = st.got.get(name, 0) + 1
                return self._handed(st, name, orphans.popleft(), max(epoch, e), number, e)
        if self.epochs is not None and epoch >= self.epochs:
            return Handed([], END)
        if epoch == len(st.shares):  # the first to reach this epoch plans it, over the trainers alive now
            trainers = sorted(set(self._trainers(scheduler)) | {name})
            plan = self._plan(scheduler, trainers)
            shares = {}
            for t in trainers:
                order = list(plan[t])
                if self.shuffle:
                    self._rng(epoch, self._number(t)).shuffle(order)
                shares[t] = deque(order)
            st.shares.append(shares)
            st.orphans.append(deque())
        share = st.shares[epoch].get(name)
        if share:
            st.got[name] = st.got.get(name, 0) + 1
            return self._handed(st, name, share.popleft(), epoch, number, epoch)
        st.epoch[name] = epoch + 1
        if not st.got.pop(name, 0) and self.epochs is None:
            return Handed([], END)  # nothing here this epoch: repeating forever would only spin
        return Handed([], EPOCH_END, epoch)

    def _handed(self, st: _Stream, name: str, partition: int, epoch: int, number: int, of: int) -> list[int]:
        """Hand ``partition`` (of epoch ``of``'s plan) to ``name``, to read as part of its epoch ``epoch``."""
        self.fetched.setdefault(name, set()).add(partition)  # kept by the trainer (read from memory if held)
        st.ahead.setdefault(name, {})[partition] = of
        return [partition, epoch, number]

    # -- exactly once -------------------------------------------------------------------------
    def claim_batch(self, scheduler: Any, iterator: int, name: str, address: str,
                    function: int | None, n: int) -> Slice:
        """The next batch for the ``n``-th ``next`` of scheduled function ``function``, or ``END``; the
        same answer again when that function runs again."""
        self.addresses[address] = name
        q = self.queues.get(iterator)
        if q is None:
            q = self.queues[iterator] = _Queue()
            self._fill(q)
        if function is not None and n in q.given.get(function, {}):
            return Slice(*q.given[function][n])
        while not any(q.left.values()):
            if self.epochs is not None and q.epoch + 1 >= self.epochs:
                return Slice(then=END)
            q.epoch += 1
            self._fill(q)
        partition = self._pick(scheduler, q, name)
        start, stop = q.left[partition].popleft()
        q.reading[name] = partition
        self.fetched.setdefault(name, set()).add(partition)
        answer = (partition, start, stop, q.epoch)
        if function is not None:
            q.given.setdefault(function, {})[n] = answer
        return Slice(*answer)

    def _fill(self, q: _Queue) -> None:
        """The batches of epoch ``q.epoch``: ``batch_size`` rows at a time within each partition."""
        q.left, q.reading = {}, {}
        order = list(range(len(self.rows)))
        if self.shuffle:
            self._rng(q.epoch).shuffle(order)
        for i in order:
            n = self.rows[i]
            stops = [(s, min(s + self.batch_size, n)) for s in range(0, n, self.batch_size)]
            if self.drop_remainder:
                stops = [(s, e) for s, e in stops if e - s == self.batch_size]
            if stops:
                q.left[i] = deque(stops)

    def _pick(self, scheduler: Any, q: _Queue, name: str) -> int:
        """The partition to take a batch from: the one this trainer reads, one it holds, else the fullest."""
        now = q.reading.get(name)
        if now is not None and q.left.get(now):
            return now
        open_ = [i for i, left in q.left.items() if left]
        mine = [i for i in open_ if name in self._holders(scheduler, i)]
        return max(mine or open_, key=lambda i: len(q.left[i]))

    def reported(self, functions: list[int]) -> None:
        """Scheduled functions whose results reached the coordinator: they never run again, so the
        batches they were given need not be remembered."""
        for q in self.queues.values():
            for function in functions:
                q.given.pop(function, None)

    # -- trainers leaving ---------------------------------------------------------------------
    def lost(self, address: str) -> None:
        """Trainer at ``address`` left: what it had not started goes to whoever asks next."""
        name = self.addresses.pop(address, None)
        if name is None:
            return
        self.fetched.pop(name, None)  # a new process of the same name starts with nothing
        for st in self.streams.values():
            for partition, of in reversed(list(st.ahead.pop(name, {}).items())):
                st.orphans[of].appendleft(partition)  # handed, not started: first in line for the others
            for shares, orphans in zip(st.shares, st.orphans):
                left = shares.get(name)
                if left:
                    orphans.extend(left)
                    left.clear()
        for q in self.queues.values():
            q.reading.pop(name, None)


class Inputs:
    """The scheduler plugin's input job: one :class:`InputLedger` per ``dps.data`` dataset."""

    def __init__(self) -> None:
        self.ledgers: dict[str, InputLedger] = {}

    def add(self, request: OpenInput) -> None:
        self.ledgers[request.dataset] = InputLedger(request.keys, request.rows, request.trainers, request.resource,
                                                    **request.options)

    def drop(self, request: CloseInput) -> None:
        self.ledgers.pop(request.dataset, None)

    def claim(self, scheduler: Any, dataset: str, iterator: int, name: str, address: str,
              function: int | None = None, n: int = 0, want: int = 1,
              started: list[int] | None = None) -> Handed | Slice | str:
        """A trainer reading ``dataset`` asks for its next partitions (or, exactly once, its batch)."""
        ledger = self.ledgers.get(dataset)
        if ledger is None:
            return GONE  # either kind of reader rebuilds it (Handed.of, Slice.of)
        if ledger.exactly_once:
            return ledger.claim_batch(scheduler, iterator, name, address, function, n)
        return ledger.claim(scheduler, iterator, name, address, want, started or ())

    def functions_reported(self, topic: str, safe: list[int]) -> None:
        """Functions of ``topic``'s coordinator succeeded for good: their batches are never handed out again."""
        for ledger in self.ledgers.values():
            if ledger.topic == topic and ledger.queues:
                ledger.reported(safe)

    def worker_left(self, worker: str) -> None:
        for ledger in self.ledgers.values():
            ledger.lost(worker)
