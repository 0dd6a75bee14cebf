"""A direct, ordered channel to a parameter server: one connection per process and server.

Dask's RPC costs about a millisecond of CPU per message at each end on a
small machine, and a hop to the event loop on the caller. On the hot path
daskps sends its own messages instead: the server's actor listens on the
worker's host (port 0), serving each connection from a thread of its own
(:mod:`daskps.server.serving`), and a caller writes a request and reads the
answer on a plain blocking socket from its own thread. On the server's own
machine that socket is a Unix one (Linux' abstract namespace, under a random
name the server gives beside its port): a message costs about half the
kernel CPU of loopback TCP at each end. Elsewhere it is TCP.
A message is ``[8-byte count][8-byte length per frame][frames]``, the frames
being the wire format (:mod:`daskps._core.wire`); an answer is
``("ok", results)`` or ``("error", exception)``. Requests on one connection
are answered in order, and the server runs one message at a time, whichever
connection, or Dask call, it came from.

Clusters whose workers talk TLS do not open channels: everything goes
through Dask's comms there, encrypted.
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

from daskps._core import shared, trace, wire
from daskps._core.wire import LOCAL_SEP, receive_exactly
from daskps.server import compact


# -- the caller's end ----------------------------------------------------------------------------
class ChannelError(ConnectionError):
    """The connection itself failed (not the server's answer): the server may be gone."""


class Channel:
    """This process's connection to one server; used by one thread at a time (``lock``).

    A channel whose server has gone notices at its next use (or at :func:`prune`).
    """

    def __init__(self, address: str, timeout: float, shared_bytes: int = 0):
        self.address = address
        self.timeout = timeout
        self.lock = threading.Lock()
        self._sock: socket.socket | None = None
        # Large frames through shared memory (:mod:`daskps._core.shared`): the largest area to offer (0:
        # the socket alone), the region the server took, and the most bytes of large frames a message held.
        self.shared_bytes = shared_bytes
        self._region: shared.Region | None = None
        self._want = 0
        # The strings each end has named to the other on this connection (:mod:`daskps.server.compact`).
        self._names_out, self._names_in = compact.Names(), compact.Names()

    def connect(self) -> socket.socket:
        """The open connection to the server, opened now if there is none (it opens at first use)."""
        if self._sock is None:
            tcp, _, local = self.address.partition(LOCAL_SEP)
            sock = _connect_local(local, self.timeout) if local else None
            if sock is None:  # another machine (or network namespace), or no local name: TCP
                host, port = tcp.rsplit(":", 1)
                sock = socket.create_connection((host, int(port)), timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)
            self._sock = sock
        return self._sock

    @property
    def local(self) -> bool:
        """Whether the open connection is the server's local socket (``False`` for TCP, or none open)."""
        return self._sock is not None and self._sock.family == _UNIX

    @property
    def connected(self) -> bool:
        """Whether a connection is open (none before the first use, nor once closed)."""
        return self._sock is not None

    def send(self, ops: Sequence[object], by_value: bool = False) -> None:
        started = trace.now() if trace.ON else 0.0
        parts = None if by_value else compact.encode_request(ops, self._names_out)
        if parts is None:
            parts = wire.pack_grouped(ops, by_value)
        try:
            sock = self.connect()
            if self.shared_bytes:
                self._offer_region(sock, parts)
            _send_all(sock, shared.place(parts, None if self._region is None else self._region.requests))
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
            lengths = struct.unpack(f"!{count}Q", receive_exactly(sock, 8 * count))
            region = self._region
            frames = shared.read(lengths, None if region is None else region.answers,
                                 lambda n: receive_exactly(sock, n))
            if self.shared_bytes:
                self._want = max(self._want, shared.need(lengths))
            status, value = (compact.decode(frames, self._names_in) if compact.is_compact(frames)
                             else wire.unpack_grouped(frames))
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
        region, self._region = self._region, None  # the server's end unmaps its own as the connection ends
        self._names_out, self._names_in = compact.Names(), compact.Names()  # a new connection names anew
        if sock is not None:
            sock.close()
        if region is not None:
            region.close()

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

    def _offer_region(self, sock: socket.socket, parts: list) -> None:
        """Offer the server a shared region (a larger one than it has) when this message's large frames, or
        an answer's before, would not fit the one in use. Refused, or not possible here: the socket alone
        from then on."""
        need = max(self._want, shared.need([memoryview(p).nbytes for p in parts]))
        if not need:
            return
        area = shared.area_for(need, self.shared_bytes)
        if area < shared.MIN_FRAME or (self._region is not None and area <= self._region.area):
            return
        made = shared.create(area)
        if made is None:
            self.shared_bytes = 0
            return
        region, path, token = made
        taken = False
        try:
            offer = pickle.dumps((path, token, area))
            _send_all(sock, [memoryview(wire.COUNT.pack(shared.ATTACH | 1) + wire.COUNT.pack(len(offer))),
                             memoryview(offer)])
            taken = self.receive() is True
        finally:
            shared.unlink(path)  # both ends have it mapped (or the server never will): the file has done its part
            if not taken:  # refused (another machine, another /dev/shm), or the handshake broke off
                region.close()
        if taken:
            old, self._region = self._region, region
            if old is not None:
                old.close()
        else:
            self.shared_bytes = 0


_UNIX = getattr(socket, "AF_UNIX", None)  # (not on Windows)


def _connect_local(name: str, timeout: float) -> socket.socket | None:
    """A connection to the server's abstract Unix socket ``name``, or ``None`` where there is none to reach
    from here (a caller on another machine finds no socket of that random name in its own namespace)."""
    if _UNIX is None:
        return None
    sock = socket.socket(_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect("\0" + name)
    except OSError:
        sock.close()
        return None
    return sock


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
