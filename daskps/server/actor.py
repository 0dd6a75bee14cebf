"""The actor Dask hosts: a parameter server reached through Dask's comms, and directly.

A strategy asks Dask for one :class:`DaskParameterServer` per ``ps`` worker
(``client.submit(DaskParameterServer, ..., actor=True)``); Dask calls its
``handle`` with a message, whose answer travels in our wire format
(:func:`serialized`: Dask's "pickle" layout, so Dask only frames it). On a
worker that talks plain TCP the actor also listens on a direct channel
(:mod:`daskps.server.serving`). This module, :mod:`daskps.server.ops` and the
in-process :mod:`daskps.server.local` are all a caller imports of the server.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from distributed.core import Status
from distributed.protocol.serialize import Serialized, deserialize
from distributed.worker import get_worker

from daskps._core import wire
from daskps.server import ops, serving
from daskps.server.parameter_server import ParameterServer

Message = Sequence[ops.Op]


def serialized(obj: Any, by_value: bool = False) -> Serialized:
    """``obj`` ready for Dask's comms: our wire format is Dask's "pickle" layout, so Dask only frames it."""
    frames = wire.pack(obj, by_value)
    return Serialized({"serializer": "pickle", "writeable": (True,) * (len(frames) - 1)}, frames)


def answer_of(value: Any) -> Any:
    """What came back through Dask's comms: our frames unpacked, anything else as it is."""
    return deserialize(value.header, value.frames) if isinstance(value, Serialized) else value


class DaskParameterServer(ParameterServer):
    """The actor Dask hosts: a ParameterServer whose answers are ready for Dask's comms.

    On a worker that talks plain TCP it also opens a direct channel (``.channel``).
    """

    channel: str | None = None  # (on the class too: Dask's actor handles look there first)

    def __init__(self, task_id: int | None):
        super().__init__(task_id)
        self._lock = threading.Lock()  # one message at a time, from Dask's actor thread or a channel's
        worker = get_worker()
        scheme, _, rest = worker.address.partition("://")
        if scheme == "tcp":
            host = rest.rsplit(":", 1)[0].strip("[]")
            self.channel, close = serving.open_channel(self, host, worker.loop.asyncio_loop,  # type: ignore[attr-defined]
                                                       functools.partial(_worker_open, weakref.ref(worker)),
                                                       self._lock)
            weakref.finalize(self, close)

    def handle(self, message: Message) -> Serialized:
        with self._lock:
            answer = serialized(self.execute(message))
        self.trim_if_due()
        return answer


def _worker_open(worker: weakref.ref) -> bool:
    """Whether the worker has not begun to close (a server on a closed worker must not answer)."""
    w = worker()
    return w is not None and w.status not in _CLOSED


_CLOSED = frozenset({Status.closing, Status.closed, Status.failed})
