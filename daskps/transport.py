"""Calls from any process to parameter-server actors, worker to worker.

daskps does not go through ``distributed.Actor`` handles: it sends Dask's own
``actor_execute`` message straight to the worker that hosts the actor, from
whatever process it runs in (a training worker, or the coordinator's client,
which then skips the scheduler proxy). Calls to several servers go out
concurrently, so a read of many variables costs one round trip per server.

The seam is :class:`Transport`: ``call_many`` takes a list of :class:`Call`
and returns their results. Logic above it never touches comms directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import dask.config
from dask.utils import parse_timedelta
from distributed import default_client
from distributed.core import send_recv
from distributed.protocol import to_serialize
from distributed.utils import sync
from distributed.worker import get_worker

from daskps.errors import PSUnavailableError


def connect_timeout() -> float:
    """Seconds to wait for a connection to a parameter server (config ``daskps.connect-timeout``)."""
    return parse_timedelta(dask.config.get("daskps.connect-timeout", "5s"))


@dataclasses.dataclass(frozen=True)
class PSRef:
    """Where one parameter-server actor lives: worker address and actor key."""

    address: str
    actor_key: str
    task_id: int

    @property
    def device(self) -> str:
        return f"/job:ps/replica:0/task:{self.task_id}/device:CPU:0"


@dataclasses.dataclass(frozen=True)
class Call:
    """One method call on one parameter server."""

    ps: PSRef
    method: str
    args: tuple = ()


class Transport:
    """Runs calls on parameter servers from one process.

    Parameters
    ----------
    loop : tornado.ioloop.IOLoop
        The event loop that owns ``pool``'s connections.
    pool : distributed.core.ConnectionPool
        The process's pool of connections (``worker.rpc`` or ``client.rpc``).
    """

    def __init__(self, loop: Any, pool: Any):
        self._loop = loop
        self._pool = pool

    def call(self, ps: PSRef, method: str, *args: Any) -> Any:
        return self.call_many([Call(ps, method, args)])[0]

    def call_many(self, calls: Sequence[Call]) -> list[Any]:
        """Run ``calls`` concurrently; return results in order, or raise the first error."""
        if not calls:
            return []
        return sync(self._loop, self._gather, list(calls))

    def call_each(self, calls: Sequence[Call], timeout: float) -> list[Any]:
        """Run ``calls`` concurrently for at most ``timeout`` seconds in all.

        Returns each result, or the exception it raised (``TimeoutError`` for
        one still running): for displays that must not hang on a lost server.
        """
        if not calls:
            return []
        return sync(self._loop, self._each, list(calls), timeout)

    async def _each(self, calls: list[Call], timeout: float) -> list[Any]:
        async def one(call: Call) -> Any:
            try:
                return await asyncio.wait_for(self._one(call), timeout)
            except asyncio.TimeoutError:
                return TimeoutError(f"ps:{call.ps.task_id} did not answer {call.method} within {timeout}s")
            except Exception as exc:
                return exc

        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def _gather(self, calls: list[Call]) -> list[Any]:
        if len(calls) == 1:
            return [await self._one(calls[0])]
        results = await asyncio.gather(*(self._one(c) for c in calls), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def _one(self, call: Call) -> Any:
        ps = call.ps
        try:
            # Dask retries refused connections until its (30 s) connect timeout;
            # a parameter server that is gone should be reported sooner.
            comm = await self._pool.connect(ps.address, timeout=connect_timeout())
            try:
                response = await send_recv(
                    comm=comm,
                    op="actor_execute",
                    actor=ps.actor_key,
                    function=call.method,
                    args=[to_serialize(a) for a in call.args],
                    kwargs={},
                )
            finally:
                self._pool.reuse(ps.address, comm)
        except OSError as exc:
            raise PSUnavailableError(
                f"parameter server ps:{ps.task_id} at {ps.address} cannot be reached "
                f"({exc.__class__.__name__}: {exc}); its variables are lost unless "
                "restored from a checkpoint"
            ) from exc
        except KeyError as exc:
            if ps.actor_key in str(exc):
                raise PSUnavailableError(
                    f"parameter server ps:{ps.task_id} at {ps.address} no longer holds its "
                    "state (the worker restarted); restore from a checkpoint"
                ) from exc
            raise
        if response["status"] == "OK":
            return response["result"]
        raise response["exception"]


_client_transports: dict[int, Transport] = {}


def transport_for(client: Any = None) -> Transport:
    """The transport for this process: the worker's comms inside a task, else a client's."""
    try:
        worker = get_worker()
    except ValueError:
        worker = None
    if worker is not None:
        cached = getattr(worker, "_daskps_transport", None)
        if cached is None:
            cached = Transport(worker.loop, worker.rpc)
            worker._daskps_transport = cached  # type: ignore[attr-defined]
        return cached
    if client is None:
        client = default_client()
    transport = _client_transports.get(id(client))
    if transport is None or transport._pool is not client.rpc:
        transport = Transport(client.loop, client.rpc)
        _client_transports[id(client)] = transport
    return transport
