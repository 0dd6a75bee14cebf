"""How a message reaches a parameter server: Dask's comms, the direct channel, or a direct call.

- the actor Dask hosts is :class:`daskps.server.actor.DaskParameterServer`;
  on a worker that talks plain TCP it also listens on a direct channel
  (:mod:`daskps.server.serving`; the caller's end is :mod:`daskps.client.channel`).
- :class:`DaskTransport` sends messages over one process's Dask connection
  pool, as Dask's own ``actor_execute``: from a trainer inside a scheduled
  function (worker to worker), the coordinator (without the scheduler's
  proxy), or the scheduler for the dashboard.
- :class:`Channels` is this process's cache of direct channels; it sends a
  message to every server at once and, when a channel fails, asks Dask what
  became of the server so that the error says so (loss detection).
- :data:`LOCAL_SERVER` is the server of local variables, called directly.

Every failure to reach a server becomes a :class:`PSUnavailableError` worded
by :data:`daskps.client.routing.ROUTES`. The operations themselves are built in
:mod:`daskps.client.protocol`.
"""

from __future__ import annotations

import asyncio
import queue
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from distributed import default_client
from distributed.core import send_recv
from distributed.utils import sync
from distributed.worker import get_worker

from daskps._core.config import setting
from daskps.client import channel
from daskps.client.routing import ROUTES, ServerRef, connect_timeout
from daskps.client.worker_state import part_on
from daskps.errors import ClosedError, PSUnavailableError
from daskps.server import ops
from daskps.server.actor import answer_of, serialized
from daskps.server.local import LocalTransport

Message = Sequence[ops.Op]
Answers = dict[ServerRef, Any]  # each server's results (a list) or the exception it raised


def check_client(client: Any) -> None:
    """Refuse to go on through a closed Dask client."""
    if client is not None and client.status in ("closing", "closed"):
        raise _closed(client)


def _closed(client: Any) -> ClosedError:
    return ClosedError(
        f"the Dask client {client!r} was closed (client.close()); daskps reaches the "
        "parameter servers through it, so make a new client and strategy"
    )


class DaskTransport:
    """Sends messages over one process's Dask connection pool."""

    def __init__(self, loop: Any, pool: Any, client: Any = None):
        self.loop = loop
        self.pool = pool
        self._client = None if client is None else weakref.ref(client)  # never keep a client alive
        # Releases come from finalizers, maybe inside a garbage collection on any thread:
        # a SimpleQueue takes them without a lock that such a thread could already hold.
        self._releases: queue.SimpleQueue[tuple[ServerRef, str, str]] = queue.SimpleQueue()
        self._flush_queued = False

    @property
    def client(self) -> Any:
        return None if self._client is None else self._client()

    def call(self, coroutine_fn: Any, *args: Any) -> Any:
        """Run ``coroutine_fn(*args)`` on this transport's loop and wait for it."""
        if self._client is not None:
            client = self.client
            if client is None:  # collected: it was closed and dropped
                raise _closed(client)
            check_client(client)
        return sync(self.loop, coroutine_fn, *args)

    def run(self, batches: Mapping[ServerRef, Message], answers: Answers) -> dict[ServerRef, list]:
        """Send every batch at once; return each server's results, or raise the first error.

        ``answers`` gets each server's results or error, also when one of them is raised.
        """
        self.call(self._gather, batches, answers)
        for got in answers.values():
            if isinstance(got, BaseException):
                raise got
        return answers

    async def _gather(self, batches: Mapping[ServerRef, Message], answers: Answers) -> None:
        servers = list(batches)
        results = await asyncio.gather(*(self.send(s, batches[s]) for s in servers), return_exceptions=True)
        answers.update(zip(servers, results))

    def run_each(self, batches: Mapping[ServerRef, Message], timeout: float) -> Answers:
        """Each server's results or exception, within ``timeout`` seconds."""
        return self.call(self.each, batches, timeout)

    async def each(self, batches: Mapping[ServerRef, Message], timeout: float) -> Answers:
        """:meth:`run_each` from inside this transport's event loop."""
        return dict(zip(batches, await self.apart(list(batches.items()), timeout)))

    def run_apart(self, messages: list[tuple[ServerRef, Message]]) -> list[Any]:
        """Send each ``(server, message)`` on its own, all at once: each one's results or exception."""
        return self.call(self.apart, messages)

    async def apart(self, messages: list[tuple[ServerRef, Message]], timeout: float | None = None) -> list[Any]:
        async def one(server: ServerRef, message: Message) -> Any:
            try:
                sent = self.send(server, message)
                return await (sent if timeout is None else asyncio.wait_for(sent, timeout))
            except asyncio.TimeoutError:
                return TimeoutError(f"parameter server {server.label} did not answer within {timeout}s")
            except Exception as exc:
                return exc

        return list(await asyncio.gather(*(one(s, m) for s, m in messages)))

    async def send(self, server: ServerRef, message: Message) -> list:
        try:
            # Dask retries refused connections until its (30 s) connect timeout;
            # a parameter server that is gone should be reported sooner.
            comm = await self.pool.connect(server.address, timeout=connect_timeout())
            try:
                # Run on the worker's event loop (no thread hop): every operation goes this way,
                # so they still run one at a time.
                response = await send_recv(comm=comm, op="actor_execute", actor=server.actor_key,
                                           function="handle", args=[serialized(message, ops.carries_code(message))],
                                           kwargs={"separate_thread": False})
            finally:
                self.pool.reuse(server.address, comm)
        except OSError as exc:
            raise ROUTES.unavailable(server, "cannot be reached: its worker died or is cut off", exc) from exc
        except KeyError as exc:
            if server.actor_key in str(exc):
                raise ROUTES.unavailable(server, "is up but its actor is gone: the worker restarted, or "
                                                 "the strategy's servers were released") from exc
            raise
        if response["status"] == "OK":
            return answer_of(response["result"])
        raise answer_of(response["exception"])

    def release_later(self, server: ServerRef, key: str, holder: str) -> None:
        """Queue one release of ``key``; a callback on the loop sends the queue (one message per server)."""
        self._releases.put((server, holder, key))
        if self._flush_queued:
            return
        self._flush_queued = True
        try:
            self.loop.add_callback(self._flush)
        except Exception:  # the loop is closed: the servers are going away too
            pass

    async def _flush(self) -> None:
        self._flush_queued = False  # before draining: a release queued from now on schedules another flush
        by_server: dict[ServerRef, dict[str, list[str]]] = {}
        while True:
            try:
                server, holder, key = self._releases.get_nowait()
            except queue.Empty:
                break
            by_server.setdefault(server, {}).setdefault(holder, []).append(key)
        client = self.client
        if self._client is not None and (client is None or client.status != "running"):
            return  # the client went, and the scheduler released its servers with it
        sends = [self.send(s, [ops.Release(keys, h) for h, keys in per.items()]) for s, per in by_server.items()]
        await asyncio.gather(*sends, return_exceptions=True)


# -- which transport, from here ------------------------------------------------------------
LOCAL_SERVER = LocalTransport()
_CLIENT_TRANSPORTS: weakref.WeakKeyDictionary[Any, DaskTransport] = weakref.WeakKeyDictionary()


def _worker_transport(worker: Any) -> DaskTransport:
    return DaskTransport(worker.loop, worker.rpc)


def transport_here(owner: Any = None) -> DaskTransport:
    """The Dask transport of this process: the worker's inside a task, else ``owner``'s client's."""
    try:
        worker = get_worker()
    except ValueError:
        worker = None
    if worker is not None:
        return part_on(worker, "transport", _worker_transport)
    client = getattr(owner, "client", None) or default_client()
    transport = _CLIENT_TRANSPORTS.get(client)
    if transport is None or transport.pool is not client.rpc:
        transport = _CLIENT_TRANSPORTS[client] = DaskTransport(client.loop, client.rpc, client)
    return transport


def sender_for(server: ServerRef, owner: Any = None) -> Any:
    """What later releases of ``server``'s objects go through, from this process."""
    return LOCAL_SERVER if server.is_local else transport_here(owner)


def pool_transport(pool: Any) -> DaskTransport:
    """A transport over ``pool`` for code already on an event loop (the scheduler's plugin and dashboard)."""
    return DaskTransport(None, pool)


# -- direct channels ------------------------------------------------------------------------
# Seconds to wait for Dask's account of a server whose channel failed.
LOST_PROBE = 1.0
# Seconds a probe's finding that a server is gone stands, for this process's next failures on it.
FOUND_GONE_STANDS = 10.0
_FOUND_GONE: dict[str, float] = {}  # actor key -> when a probe here found the server gone


class Channels:
    """This process's direct channels, by server: its channel's address and its actor key.

    Not by address alone: a server made after another's release may listen on
    the port the released one had, and a channel still open to the old one
    must not carry its requests.
    """

    def __init__(self) -> None:
        self.open: dict[tuple[str, str], channel.Channel] = {}

    @staticmethod
    def _key(server: ServerRef) -> tuple[str, str]:
        return str(server.channel), server.actor_key

    def get(self, server: ServerRef) -> channel.Channel:
        key = self._key(server)
        found = self.open.get(key)
        if found is None:
            channel.prune(self.open)  # a new server: a good moment to drop channels to servers gone
            found = self.open.setdefault(key, channel.Channel(str(server.channel), connect_timeout(),
                                                                      setting("channel_shared_memory")))
        return found

    def forget(self, servers: Sequence[ServerRef]) -> None:
        """Close the channels to ``servers`` (their group was released)."""
        for server in servers:
            found = self.open.pop(self._key(server), None) if server.channel else None
            if found is not None:
                with found.lock:
                    found.close()

    def run(self, batches: Mapping[ServerRef, Message], owner: Any, answers: Answers) -> dict[ServerRef, list]:
        """Send every batch on its server's channel, then read every answer (so all servers work at once).

        ``answers`` gets each server's results or error, also when one of them is raised.
        """
        if not batches:
            return {}
        if owner is not None:
            check_client(getattr(owner, "client", None))
        servers = sorted(batches, key=lambda s: s.channel or "")
        chans = [self.get(s) for s in servers if s.channel]
        for ch in chans:
            ch.lock.acquire()
        awaiting: list[channel.Channel] = []  # sent to, answer not read yet
        try:
            results, errors = {}, {}
            for server, ch in zip(servers, chans):
                try:
                    ch.send(batches[server], ops.carries_code(batches[server]))
                    awaiting.append(ch)
                except channel.ChannelError as exc:
                    errors[server] = _lost(server, owner, exc)
            for server, ch in zip(servers, chans):
                if server in errors:
                    continue
                try:
                    awaiting.remove(ch)
                    results[server] = ch.receive()  # every answer is read, so each channel stays in step
                except channel.ChannelError as exc:
                    errors[server] = _lost(server, owner, exc)
                except Exception as exc:  # the server's answer
                    errors[server] = exc
            answers.update(results)
            answers.update(errors)
            if errors:
                raise next(iter(errors.values()))
            return results
        except BaseException:  # interrupted, or a message that would not pack: unread answers would
            for ch in awaiting:  # come back as the answers to later requests
                ch.close()
            raise
        finally:
            for ch in chans:
                ch.lock.release()


CHANNELS = Channels()


def _lost(server: ServerRef, owner: Any, exc: OSError) -> BaseException:
    """The channel failed: ask through Dask what happened to the server, for an accurate error.

    Briefly (``LOST_PROBE`` seconds): Dask retries a refused connection
    until its connect timeout, and a dead server should be reported at once.
    Not at all for a server this process knows was re-created elsewhere, or
    that a probe here found gone in the last ``FOUND_GONE_STANDS`` seconds:
    every thread whose held pushes still name it fails here, one after
    another under the channel's lock (64 trainers of one process waited a
    second each, a minute in all, after a recovery). An older finding is
    checked again (a probe that timed out may have met a busy server).
    """
    found = _FOUND_GONE.get(server.actor_key)
    if server.actor_key in ROUTES.moved or (found is not None and time.monotonic() - found < FOUND_GONE_STANDS):
        return ROUTES.unavailable(server, "was found gone earlier", exc)
    try:
        reason = transport_here(owner).run_each({server: [ops.Stats()]}, LOST_PROBE)[server]
    except Exception:
        reason = None
    if isinstance(reason, list):  # it answers Dask: only the channel broke
        _FOUND_GONE.pop(server.actor_key, None)
        return ROUTES.unavailable(server, "dropped its channel", exc, gone=False)
    _FOUND_GONE[server.actor_key] = time.monotonic()
    if isinstance(reason, PSUnavailableError):
        return reason
    return ROUTES.unavailable(server, "cannot be reached: its worker died or is cut off", exc)
