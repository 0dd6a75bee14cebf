"""Pushes held back until the next message to their server: one step's push rides with the next step's reads.

Inside a batch of scheduled functions on a trainer (see
:mod:`daskps.coordinator.batches`), updates and gradient pushes do not wait
for a reply of their own: :mod:`daskps.ps.protocol` queues them per server
and sends them at the front of the next message to that server (usually the
next step's reads), or when the batch flushes. A server runs a message's
operations in order, so a read still sees every earlier push of this
trainer, and everything that completed before it was issued.

A function counts as finished only when every push it queued has been
acknowledged (:meth:`Pipeline.settled`); its result is reported then, so
TensorFlow's meaning of a finished function (its updates are applied) holds.

The contract, all of it here: held pushes go first in their server's next
message, behind an ``Isolate(n)`` so that each succeeds or fails on its
own (:meth:`Pipeline.take`); once that message is answered, or fails,
:meth:`Pipeline.acknowledge` records each push's outcome against the
function that queued it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from daskps._core.updates import Refused
from daskps.errors import PartlyAppliedError
from daskps.ps import ops

_CURRENT: contextvars.ContextVar[Pipeline | None] = contextvars.ContextVar("daskps_pipeline", default=None)


class Pipeline:
    """The held-back pushes of one trainer thread, by server, and which function queued them."""

    def __init__(self) -> None:
        self.function: int | None = None  # the function running now
        self.pending: dict[Any, list[ops.Op]] = {}
        self.owners: dict[Any, list[int]] = {}  # server -> the function that queued each pending push
        self.taken: dict[Any, list[int]] = {}  # the same, for pushes sent and not yet acknowledged
        self.errors: dict[int, BaseException] = {}

    def defer(self, server: Any, op: ops.Op) -> None:
        """Hold ``op`` for ``server``; its arrays are copied now (the caller may reuse its buffers)."""
        self.pending.setdefault(server, []).append(_copied(op))
        self.owners.setdefault(server, []).append(self.function)  # type: ignore[arg-type]

    def take(self, servers: Iterable[Any]) -> dict[Any, list[ops.Op]]:
        """The pushes held for ``servers``, to send now: each server's message starts with these."""
        out: dict[Any, list[ops.Op]] = {}
        for s in list(servers):
            if s in self.pending:
                held = self.pending.pop(s)
                out[s] = [ops.Isolate(len(held)), *held]
                self.taken[s] = self.owners.pop(s)
        return out

    def acknowledge(self, answers: dict[Any, Any], error: BaseException | None = None) -> None:
        """The messages carrying the taken pushes were answered (``answers``: results or exception, by server).

        A server's results hold a ``Refused`` for each push it refused; a
        :class:`PartlyAppliedError` says the same of a message that failed
        later on. Where the answer is missing or another error, ``error``
        (or that error) is what became of all its pushes.
        """
        for server in list(self.taken):
            got = answers.get(server)
            if isinstance(got, list):
                outcomes: list | None = got[1 : 1 + len(self.taken[server])]
            elif isinstance(got, PartlyAppliedError):
                outcomes = got.outcomes
            else:
                outcomes = None
            failed = got if isinstance(got, BaseException) else error
            for i, function in enumerate(self.taken.pop(server)):
                refused = outcomes[i] if outcomes is not None else None
                why = refused.error if isinstance(refused, Refused) else (failed if outcomes is None else None)
                if why is not None:
                    self.errors.setdefault(function, why)

    def settled(self, function: int) -> bool:
        """Whether every push ``function`` queued has been acknowledged."""
        return not any(function in fs for fs in (*self.owners.values(), *self.taken.values()))


def current() -> Pipeline | None:
    """The pipeline of the batch running in this thread, if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def pipelined() -> Iterator[Pipeline]:
    """Hold pushes back inside this block (the caller flushes before leaving)."""
    pipe = Pipeline()
    token = _CURRENT.set(pipe)
    try:
        yield pipe
    finally:
        _CURRENT.reset(token)


def _copied(obj: Any) -> Any:
    """``obj`` with every numpy array in it (through lists, tuples and dicts) copied."""
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, (list, tuple)):
        items = [_copied(x) for x in obj]
        return type(obj)(items) if type(obj) in (list, tuple) else type(obj)(*items)
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    return obj
