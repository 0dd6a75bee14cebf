"""The server of local variables: a ``ParameterServer`` in this process, called directly.

Variables made outside any strategy scope live here, so they take the same
code path (the protocol's) as variables on parameter servers.
"""

from __future__ import annotations

import threading
from typing import Any

from daskps.ps.server import ParameterServer

Ops = list[tuple[str, tuple]]


class LocalTransport:
    """The server of local variables, called directly under a lock."""

    def __init__(self, holder: str) -> None:
        self.server = ParameterServer(None)
        self.holder = holder
        self._lock = threading.Lock()
        self._releases: list[str] = []

    def run(self, ops: Ops) -> list:
        with self._lock:
            try:
                return self.server.execute(ops)
            finally:
                self._drain()

    def release_later(self, server: Any, key: str, holder: str) -> None:
        # Called from __del__, possibly inside run() on this thread: apply now only if free.
        self._releases.append(key)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        while self._releases:
            self.server.release([self._releases.pop()], self.holder)
