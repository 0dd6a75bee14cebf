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

_CURRENT: contextvars.ContextVar[Pipeline | None] = contextvars.ContextVar("daskps_pipeline", default=None)


class Pipeline:
    """The held-back pushes of one trainer thread, by server, and which function queued them."""

    def __init__(self) -> None:
        self.function: int | None = None  # the function running now
        self.pending: dict[Any, list[tuple[str, tuple]]] = {}
        self.waiting: dict[Any, set[int]] = {}  # server -> functions with pushes there not yet acknowledged
        self.errors: dict[int, BaseException] = {}

    def defer(self, server: Any, op: str, args: tuple) -> None:
        self.pending.setdefault(server, []).append((op, args))
        self.waiting.setdefault(server, set()).add(self.function)  # type: ignore[arg-type]

    def take(self, servers: Iterable[Any]) -> dict[Any, list[tuple[str, tuple]]]:
        """The pushes held for ``servers``, to send now (ahead of anything else)."""
        return {s: self.pending.pop(s) for s in list(servers) if s in self.pending}

    def acknowledged(self, servers: Iterable[Any], error: BaseException | None = None) -> None:
        """The pushes taken for ``servers`` were applied (or failed with ``error``)."""
        for server in servers:
            for function in self.waiting.pop(server, ()):
                if error is not None:
                    self.errors.setdefault(function, error)

    def settled(self, function: int) -> bool:
        return not any(function in fs for fs in self.waiting.values())


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
