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
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from daskps._core.updates import Refused

_CURRENT: contextvars.ContextVar[Pipeline | None] = contextvars.ContextVar("daskps_pipeline", default=None)


class Pipeline:
    """The held-back pushes of one trainer thread, by server, and which function queued them."""

    def __init__(self) -> None:
        self.function: int | None = None  # the function running now
        self.pending: dict[Any, list[tuple[str, tuple]]] = {}
        self.owners: dict[Any, list[int]] = {}  # server -> the function that queued each pending push
        self.taken: dict[Any, list[int]] = {}  # the same, for pushes sent and not yet acknowledged
        self.errors: dict[int, BaseException] = {}

    def defer(self, server: Any, op: str, args: tuple) -> None:
        """Hold ``op`` for ``server``; its arrays are copied now (the caller may reuse its buffers)."""
        self.pending.setdefault(server, []).append((op, _copied(args)))
        self.owners.setdefault(server, []).append(self.function)  # type: ignore[arg-type]

    def take(self, servers: Iterable[Any]) -> dict[Any, list[tuple[str, tuple]]]:
        """The pushes held for ``servers``, to send now (ahead of anything else, each on its own)."""
        out = {}
        for s in list(servers):
            if s in self.pending:
                out[s] = self.pending.pop(s)
                self.taken[s] = self.owners.pop(s)
        return out

    def acknowledged(self, server: Any, outcomes: list | None = None, error: BaseException | None = None) -> None:
        """The pushes taken for ``server`` ran: ``outcomes`` has a ``Refused`` for each one refused.

        Without ``outcomes``, ``error`` is what became of all of them (the
        message failed before they ran, or how they went is unknown).
        """
        for i, function in enumerate(self.taken.pop(server, ())):
            refused = outcomes[i] if outcomes is not None else None
            why = refused.error if isinstance(refused, Refused) else (error if outcomes is None else None)
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
