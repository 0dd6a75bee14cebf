"""A direct, ordered channel to a parameter server: one TCP connection per process and server.

Dask's RPC costs about a millisecond of CPU per message at each end on a
small machine, and a hop to the event loop on the caller. On the hot path
daskps sends its own messages instead: the server's actor listens on the
worker's host (port 0), serving each connection from a thread of its own
(:mod:`daskps.server.serving`), and a caller writes a request and reads the
answer on a plain blocking socket from its own thread.
A message is ``[8-byte count][8-byte length per frame][frames]``, the frames
being the wire format (:mod:`daskps._core.wire`); an answer is
``("ok", results)`` or ``("error", exception)``. Requests on one connection
are answered in order, and the server runs one message at a time, whichever
connection, or Dask call, it came from.

Clusters whose workers talk TLS do not open channels: everything goes
through Dask's comms there, encrypted.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

from daskps._core import trace, wire
from daskps._core.wire import receive_exactly


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

    def connect(self) -> socket.socket:
        """The open connection to the server, opened now if there is none (it opens at first use)."""
        if self._sock is None:
            host, port = self.address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=self.timeout)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    @property
    def connected(self) -> bool:
        """Whether a connection is open (none before the first use, nor once closed)."""
        return self._sock is not None

    def send(self, ops: Sequence[object], by_value: bool = False) -> None:
        started = trace.now() if trace.ON else 0.0
        parts = wire.framed(wire.pack_grouped(ops, by_value))
        try:
            _send_all(self.connect(), [memoryview(p).cast("B") for p in parts])
            if trace.ON:
                trace.span("send", started)
        except OSError as exc:
            self.close()
            raise ChannelError(f"sending to {self.address} failed: {exc}") from exc
        except BaseException:  # an interrupt part-way: the stream is out of step
            self.close()
            raise

    def receive(self) -> Any:
        """The results of the request sent last; raises the server's error, or :class:`ChannelError`."""
        try:
            sock = self.connect()
            started = trace.now() if trace.ON else 0.0
            count = wire.COUNT.unpack(receive_exactly(sock, 8))[0]
            arrived = trace.now() if trace.ON else 0.0
            sizes = struct.unpack(f"!{count}Q", receive_exactly(sock, 8 * count))
            status, value = wire.unpack_grouped([receive_exactly(sock, n) for n in sizes])
            if trace.ON:
                trace.span("wait", started, arrived)
                trace.span("receive", arrived)
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
