"""The server's end of a direct channel (:mod:`daskps.client.channel` is the caller's).

A parameter server's actor listens on its worker's host (port 0), from the
worker's event loop; each connection reads requests
(``[8-byte count][8-byte length per frame][frames]``, :mod:`daskps._core.wire`),
runs them on the server one at a time, in order, and writes the answer
(``("ok", results)`` or ``("error", exception)``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import weakref
from collections.abc import Callable
from typing import Any

from daskps._core import wire

_MAX_PARTS = 512  # buffers per writev (the system's limit is 1024 or more)


def open_channel(server: Any, host: str, loop: asyncio.AbstractEventLoop,
                 alive: Callable[[], bool] = lambda: True) -> tuple[str, Callable[[], None]]:
    """Listen for ``server`` on ``host`` (a free port) from ``loop``; return ``host:port`` and a closer.

    Connections hold the server weakly: once Dask drops the actor, they close. So they do at the first
    request that finds ``alive()`` false (its worker closed, though this process and the actor live on:
    a worker thread's, or one an operator closed), and the caller learns the server is gone.
    """
    ref = weakref.ref(server)
    connections: weakref.WeakSet[_Serving] = weakref.WeakSet()
    # Our own listening socket and accept, not ``loop.create_server``: asyncio (3.11) drops a connection it
    # accepted just before its server closed without closing it, and a caller that had connected and sent
    # a request then waited for an answer until the garbage collector closed that socket (about a minute).
    # Here every accepted connection gets its transport, and one whose server is gone is closed at its
    # first request.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, 0), family=family)
    listener.setblocking(False)

    def serving() -> _Serving:
        connection = _Serving(ref, alive)
        connections.add(connection)
        return connection

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # none waiting (BlockingIOError), or the listener closed meanwhile
                return
            conn.setblocking(False)
            loop.create_task(_attach(loop, serving, conn))

    def close_all() -> None:
        loop.remove_reader(listener.fileno())
        listener.close()  # connections still waiting to be accepted are refused
        for connection in list(connections):
            if connection.transport is not None:
                connection.transport.close()

    def close() -> None:
        try:
            loop.call_soon_threadsafe(close_all)
        except RuntimeError:  # the loop is closed: so is everything on it
            listener.close()

    port = listener.getsockname()[1]
    loop.call_soon_threadsafe(loop.add_reader, listener.fileno(), accept)
    return f"{host}:{port}", close


async def _attach(loop: asyncio.AbstractEventLoop, serving: Callable[[], _Serving], conn: socket.socket) -> None:
    try:
        await loop.connect_accepted_socket(serving, conn)
    except OSError:  # the caller went away before its connection was set up
        conn.close()


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
        count = wire.COUNT.unpack(raw)[0]
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
        self._write(wire.framed(wire.pack_answer(answer)))

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
