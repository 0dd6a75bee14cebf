"""A strategy's parameter servers: started together, released together.

A ``ServerGroup`` submits one ``ParameterServer`` actor to each ps-tagged
worker, pinned there by address (Dask releases an actor's resources once its
constructor returns, so resources alone would not pin it), and holds the
Dask futures that keep those actors alive. Every handle made through the
strategy (variables, optimizers, metrics, datasets) holds the group, so the
servers outlive the strategy object for as long as anything needs them;
:meth:`ServerGroup.close` releases them at once.
"""

from __future__ import annotations

import re
import uuid
import weakref
from typing import Any

from daskps.errors import ClosedError
from daskps.ps import protocol
from daskps.ps.protocol import DaskParameterServer, ServerRef

SERVER_KEY_PREFIX = "daskps-ps-"
_KEY = re.compile(rf"{SERVER_KEY_PREFIX}(\d+)-([0-9a-f]+)$")

_GROUPS: weakref.WeakValueDictionary[str, ServerGroup] = weakref.WeakValueDictionary()


def server_key(task_id: int, token: str) -> str:
    """The Dask key of the actor of server ``task_id`` in group ``token``."""
    return f"{SERVER_KEY_PREFIX}{task_id}-{token}"


def parse_server_key(key: Any) -> tuple[int, str] | None:
    """``(task_id, token)`` of a server's actor key, or ``None`` for any other key."""
    m = _KEY.match(key) if isinstance(key, str) else None
    return (int(m.group(1)), m.group(2)) if m else None


def group_of(server: ServerRef) -> ServerGroup | None:
    """The live group of ``server`` in this process, if any."""
    if not _GROUPS:  # a worker's process: no groups
        return None
    parsed = parse_server_key(server.actor_key)
    return None if parsed is None else _GROUPS.get(parsed[1])


class ServerGroup:
    """The parameter servers of one strategy.

    Parameters
    ----------
    client : distributed.Client
    ps_workers : list of (name, address)
        The ps-tagged workers, one server each, in task order.
    """

    def __init__(self, client: Any, ps_workers: list[tuple[str, str]]):
        self.client = client
        self.token = uuid.uuid4().hex[:16]
        self.closed = False
        self._futures = [
            client.submit(DaskParameterServer, i, actor=True, workers=[addr], allow_other_workers=False,
                          pure=False, key=server_key(i, self.token))
            for i, (_, addr) in enumerate(ps_workers)
        ]
        channels = [fut.result().channel for fut in self._futures]
        self.servers = [ServerRef(addr, str(fut.key), i, ch)
                        for i, ((_, addr), fut, ch) in enumerate(zip(ps_workers, self._futures, channels))]
        _GROUPS[self.token] = self
        weakref.finalize(self, protocol.forget_channels, list(self.servers))

    @property
    def futures(self) -> list[Any]:
        return list(self._futures)

    def check_open(self, what: str = "it") -> None:
        """Raise :class:`~daskps.errors.ClosedError` if the servers were released."""
        if self.closed:
            raise ClosedError(
                f"cannot use {what}: the ParameterServerStrategy it belongs to was closed "
                "(strategy.close()), which released its parameter servers and everything on them"
            )

    def close(self) -> None:
        """Release the actors now (their variables go with them); later calls raise ``ClosedError``."""
        if self.closed:
            return
        self.closed = True
        futures, self._futures = self._futures, []
        protocol.forget_channels(self.servers)
        for fut in futures:
            try:
                fut.release()
            except Exception:  # the client is gone: so are its actors
                pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.servers)} servers"
        return f"<ServerGroup {self.token[:8]} {state}>"
