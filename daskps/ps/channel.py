"""A direct, ordered channel to a parameter server: one TCP connection per process and server.

Dask's RPC costs about a millisecond of CPU per message at each end on a
small machine, and a hop to the event loop on the caller. On the hot path
daskps sends its own messages instead: the server's actor listens on the
worker's host (port 0) from the worker's event loop, and a caller writes a
request and reads the answer on a plain blocking socket from its own thread.
A message is ``[8-byte count][8-byte length per frame][frames]``, the frames
being the wire format (:mod:`daskps._core.wire`); an answer is
``("ok", results)`` or ``("error", exception)``. Requests on one connection
are answered in order, and the server runs every operation on its event loop,
one at a time, as it runs those that come through Dask.

Clusters whose workers talk TLS do not open channels: everything goes
through Dask's comms there, encrypted.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from daskps._core import wire

_COUNT = struct.Struct("!Q")
_MAX_PARTS = 512  # buffers per writev (the system's limit is 1024 or more)


# -- the server's end --------------------------------------------------------------------------
def open_channel(server: Any, host: str, loop: asyncio.AbstractEventLoop,
                 alive: Callable[[], bool] = lambda: True) -> tuple[str, Callable[[], None]]:
    """Listen for ``server`` on ``host`` (a free port) from ``loop``; return ``host:port`` and a closer.

    Connections hold the server weakly: once Dask drops the actor, they close. So they do at the first
    request that finds ``alive()`` false (its worker closed, though this process and the actor live on:
    a worker thread's, or one an operator closed), and the caller learns the server is gone.
    """
    ref = weakref.ref(server)
    connections: weakref.WeakSet[_Serving] = weakref.WeakSet()

    def serving() -> _Serving:
        connection = _Serving(ref, alive)
        connections.add(connection)
        return connection

    async def start() -> asyncio.Server:
        return await loop.create_server(serving, host, 0)

    listener = asyncio.run_coroutine_threadsafe(start(), loop).result()
    port = listener.sockets[0].getsockname()[1]

    def close_all() -> None:
        listener.close()
        for connection in list(connections):
            if connection.transport is not None:
                connection.transport.close()

    def close() -> None:
        try:
            loop.call_soon_threadsafe(close_all)
        except RuntimeError:  # the loop is closed: so is everything on it
            pass

    return f"{host}:{port}", close


class _Serving(asyncio.BufferedProtocol):
    """One caller's connection: reads each frame straight into its own buffer, answers in order."""

    def __init__(self, ref: weakref.ref, alive: Callable[[], bool]):
        self.ref = ref
        self.alive = alive
        self.transport: Any = None
        self._expect(8, self._got_count)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def _expect(self, n: int, then: Callable[[bytearray], None]) -> None:
        self.buffer, self.filled, self.then = bytearray(n), 0, then
        if n == 0:
            then(self.buffer)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buffer)[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled == len(self.buffer):
            self.then(self.buffer)

    def _got_count(self, raw: bytearray) -> None:
        count = _COUNT.unpack(raw)[0]
        self._expect(8 * count, self._got_sizes)

    def _got_sizes(self, raw: bytearray) -> None:
        self.sizes = list(struct.unpack(f"!{len(raw) // 8}Q", raw))
        self.frames: list[bytearray] = []
        self._next_frame()

    def _next_frame(self) -> None:
        if len(self.frames) == len(self.sizes):
            self._answer(self.frames)
            self._expect(8, self._got_count)
        else:
            self._expect(self.sizes[len(self.frames)], self._got_frame)

    def _got_frame(self, raw: bytearray) -> None:
        self.frames.append(raw)
        self._next_frame()

    def _answer(self, frames: list[bytearray]) -> None:
        server = self.ref()
        if server is None or not self.alive():  # the actor, or its worker, is gone
            self.transport.close()
            return
        try:
            # Reads may hand over the server's own arrays: _write sends or copies them before anything else runs.
            answer: tuple = ("ok", server.execute(wire.unpack_grouped(frames), shared_reads=True))
        except Exception as exc:
            answer = ("error", exc)
        self._write(_framed(_pack_answer(answer)))

    def _write(self, parts: list) -> None:
        """Send ``parts`` now, as far as the socket takes them; queue a copy of the rest.

        Whatever is left is copied before this returns, so a reply may hold
        the server's own arrays (nothing else runs meanwhile).
        """
        transport = self.transport
        if transport.is_closing():
            return
        sent = 0
        if not transport.get_write_buffer_size() and len(parts) <= _MAX_PARTS:  # the socket is ours to write
            try:
                sent = os.writev(transport.get_extra_info("socket").fileno(), parts)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                transport.close()
                return
        rest = []
        for part in parts:
            n = memoryview(part).nbytes
            if sent >= n:
                sent -= n
                continue
            rest.append(memoryview(part).cast("B")[sent:])
            sent = 0
        if rest:
            transport.write(b"".join(rest))


def _framed(frames: list) -> list:
    """``[count and sizes, *frames]``: a message as the other end reads it."""
    sizes = [memoryview(f).nbytes for f in frames]
    return [_COUNT.pack(len(frames)) + struct.pack(f"!{len(frames)}Q", *sizes), *frames]


def _pack_answer(answer: tuple) -> list:
    try:
        return wire.pack_grouped(answer)
    except Exception as exc:  # an exception that does not pickle
        return wire.pack_grouped(("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}; ({exc})")))


# -- the caller's end ----------------------------------------------------------------------------
class ChannelError(ConnectionError):
    """The connection itself failed (not the server's answer): the server may be gone."""


class Channel:
    """This process's connection to one server; used by one thread at a time (``lock``).

    A channel whose server has gone notices at its next use (or at :func:`prune`).
    """

    def __init__(self, address: str, timeout: float):
        self.address = address
        self.timeout = timeout
        self.lock = threading.Lock()
        self._sock: socket.socket | None = None

    def _connected(self) -> socket.socket:
        if self._sock is None:
            host, port = self.address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=self.timeout)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def send(self, ops: Sequence[object], by_value: bool = False) -> None:
        parts = _framed(wire.pack_grouped(ops, by_value))
        try:
            _send_all(self._connected(), [memoryview(p).cast("B") for p in parts])
        except OSError as exc:
            self.close()
            raise ChannelError(f"sending to {self.address} failed: {exc}") from exc
        except BaseException:  # an interrupt part-way: the stream is out of step
            self.close()
            raise

    def receive(self) -> Any:
        """The results of the request sent last; raises the server's error, or :class:`ChannelError`."""
        try:
            sock = self._connected()
            count = _COUNT.unpack(_receive(sock, 8))[0]
            sizes = struct.unpack(f"!{count}Q", _receive(sock, 8 * count))
            status, value = wire.unpack_grouped([_receive(sock, n) for n in sizes])
        except OSError as exc:
            self.close()
            raise ChannelError(f"receiving from {self.address} failed: {exc}") from exc
        except BaseException:  # an interrupt (Ctrl-C) part-way: the answer is not all read
            self.close()
            raise
        if status == "error":
            raise value  # the server's own error (even an OSError: a full disk, say), not a broken channel
        return value

    def close(self) -> None:
        sock, self._sock = self._sock, None  # cleared first: a thread that looks next finds no socket
        if sock is not None:
            sock.close()

    def close_if_dead(self) -> bool:
        """Close the connection if its server has closed it (checked without waiting); whether it did.

        Under the lock: a thread pruning at the same moment neither looks at a socket being closed here
        nor closes one in use.
        """
        if not self.lock.acquire(blocking=False):
            return False  # in use
        try:
            if self._sock is None:
                return False  # not connected yet (or closed already): holds nothing
            try:
                readable, _, _ = select.select([self._sock], [], [], 0)
                gone = bool(readable) and not self._sock.recv(1, socket.MSG_PEEK)
            except OSError:
                gone = True
            if gone:
                self.close()
            return gone
        finally:
            self.lock.release()


def prune(channels: dict[Any, Channel]) -> None:
    """Close and forget the channels whose servers have gone (they would hold file descriptors)."""
    for key, ch in list(channels.items()):
        if ch.close_if_dead():
            channels.pop(key, None)


def _send_all(sock: socket.socket, parts: list[memoryview]) -> None:
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= parts[0].nbytes:
            sent -= parts[0].nbytes
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


def _receive(sock: socket.socket, n: int) -> bytearray:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionResetError("the parameter server closed the channel")
        got += k
    return buffer
