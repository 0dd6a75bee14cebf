"""The server of local variables: a ``ParameterServer`` in this process, called directly.

Variables made outside any strategy scope live here, so they take the same
code path (the protocol's) as variables on parameter servers.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from daskps.server import ops
from daskps.server.parameter_server import ParameterServer


class LocalTransport:
    """The server of local variables, called directly under a lock."""

    def __init__(self) -> None:
        self.server = ParameterServer(None)
        self._lock = threading.Lock()
        self._releases: collections.deque[tuple[str, str]] = collections.deque()

    def run(self, message: list[ops.Op]) -> list:
        with self._lock:
            result = self.server.execute(message)
        self._drain_if_free()
        self.server.trim_if_due()
        return result

    def release_later(self, server: Any, key: str, holder: str) -> None:
        # From a finalizer, maybe during run() on this very thread: queue, and apply only if free.
        self._releases.append((key, holder))
        self._drain_if_free()

    def _drain_if_free(self) -> None:
        # Looping covers a release queued by another thread just before this one let go of the lock.
        while self._releases and self._lock.acquire(blocking=False):
            try:
                while self._releases:
                    key, holder = self._releases.popleft()
                    self.server.release(ops.Release([key], holder))
            finally:
                self._lock.release()
