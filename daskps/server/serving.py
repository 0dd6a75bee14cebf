"""The server's end of a direct channel (:mod:`daskps.client.channel` is the caller's).

A parameter server's actor listens on its worker's host (port 0), and on
Linux on a local Unix socket too; the worker's event loop accepts
connections, and each connection gets a thread of its own that reads requests
(``[8-byte count][8-byte length per frame][frames]``, :mod:`daskps._core.wire`)
with blocking calls, runs them on the server under the server's lock (one
message at a time, whichever connection or Dask call it came from), and
writes the answer (``("ok", results)`` or ``("error", exception)``).

A thread per connection, not the event loop: a large message is read in one
call per frame instead of a loop callback per chunk the socket hands over,
an answer is written in one call, and the server's work does not hold up
the worker's own comms and heartbeats.
"""

from __future__ import annotations

import asyncio
import pickle
import secrets
import socket
import struct
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from daskps._core import shared, trace, wire
from daskps._core.wire import LOCAL_SEP
from daskps.server import compact

_MAX_PARTS = 512  # buffers per sendmsg (the system's limit is 1024 or more)


def open_channel(server: Any, host: str, loop: asyncio.AbstractEventLoop,
                 alive: Callable[[], bool] = lambda: True,
                 lock: threading.Lock | None = None) -> tuple[str, Callable[[], None]]:
    """Listen for ``server`` on ``host`` (a free port), accepting from ``loop``; return the address and a closer.

    The address is ``host:port``; on Linux the server also listens on a Unix
    socket under a random name in the abstract namespace, and the address is
    ``host:port|name``: a caller on this machine connects there (half the
    kernel's CPU per message of loopback TCP), any other over TCP.

    ``lock`` (a new one by default) is held while a message runs: pass the
    one the server's other callers take. Connections hold the server weakly: once
    Dask drops the actor, they close. So they do at the first request that
    finds ``alive()`` false (its worker closed, though this process and the
    actor live on: a worker thread's, or one an operator closed), and the
    caller learns the server is gone.
    """
    ref = weakref.ref(server)
    lock = lock or threading.Lock()
    connections: set[socket.socket] = set()
    guard = threading.Lock()  # connections, and whether the channel is closed
    closed = False
    # Our own listening socket and accept, not ``loop.create_server``: asyncio (3.11) drops a connection it
    # accepted just before its server closed without closing it, and a caller that had connected and sent
    # a request then waited for an answer until the garbage collector closed that socket (about a minute).
    # Here every accepted connection gets its thread, and one whose server is gone is closed at its first
    # request.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listeners = [socket.create_server((host, 0), family=family)]
    port = listeners[0].getsockname()[1]
    local = _local_listener()
    if local is not None:  # callers on this machine connect here (:func:`daskps.client.channel._connect_local`)
        listeners.append(local[0])
    for listener in listeners:
        listener.setblocking(False)

    def accept(listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # none waiting (BlockingIOError), or the listener closed meanwhile
                return
            with guard:
                if closed:
                    conn.close()
                    continue
                connections.add(conn)
            conn.setblocking(True)
            if conn.family != _UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_serve, args=(conn, ref, alive, lock, connections, guard),
                             name=f"daskps-channel-{port}", daemon=True).start()

    def close_all() -> None:
        nonlocal closed
        for listener in listeners:
            loop.remove_reader(listener.fileno())
            listener.close()  # connections still waiting to be accepted are refused
        with guard:
            closed = True
            for conn in list(connections):
                _shut(conn)  # its thread's read ends; the thread closes it

    def close() -> None:
        try:
            loop.call_soon_threadsafe(close_all)
        except RuntimeError:  # the loop is closed: so is everything on it
            for listener in listeners:
                listener.close()
            with guard:
                for conn in list(connections):
                    _shut(conn)

    for listener in listeners:
        loop.call_soon_threadsafe(loop.add_reader, listener.fileno(), accept, listener)
    address = f"{host}:{port}"
    return (address if local is None else f"{address}{LOCAL_SEP}{local[1]}"), close


_UNIX = getattr(socket, "AF_UNIX", None)


def _local_listener() -> tuple[socket.socket, str] | None:
    """A listening Unix socket in Linux' abstract namespace (no file to clean up) under a random name, and
    the name; ``None`` elsewhere. The name is random so that no other server, on this machine or on one
    whose caller looks it up in its own namespace, can be reached by mistake."""
    if _UNIX is None or not sys.platform.startswith("linux"):
        return None
    name = f"daskps-{secrets.token_hex(16)}"
    sock = socket.socket(_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(128)
    except OSError:
        sock.close()
        return None
    return sock, name


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected any more
        pass


def _serve(conn: socket.socket, ref: weakref.ref, alive: Callable[[], bool], lock: threading.Lock,
           connections: set[socket.socket], guard: threading.Lock) -> None:
    """One caller's connection, in its own thread: each request read whole, run, answered, in order."""
    region: shared.Region | None = None  # shared memory the caller offered (:mod:`daskps._core.shared`)
    names_in, names_out = compact.Names(), compact.Names()  # what each end has named on this connection

    def receive(n: int) -> bytearray:
        return wire.receive_exactly(conn, n)

    try:
        while True:
            # Ends (ConnectionResetError) once the caller closes it, or the channel does.
            count = wire.COUNT.unpack(receive(8))[0]
            arriving = trace.now() if trace.ON else 0.0
            offer, count = count & shared.ATTACH, count & ~shared.ATTACH
            lengths = struct.unpack(f"!{count}Q", receive(8 * count))
            # A compact message's arrays are gradients, spent by the time it is answered: read in place.
            frames = shared.read(lengths, None if region is None else region.requests, receive, compact.is_lead)
            if offer:
                region = _attach(conn, frames, region)
                continue
            server = ref()
            if server is None or not alive():  # the actor, or its worker, is gone
                return
            with lock:
                started = executed = trace.now() if trace.ON else 0.0
                try:
                    # Reads may hand over the server's own arrays: they are sent, or copied, before the lock goes.
                    message = (compact.decode(frames, names_in) if compact.is_compact(frames)
                               else wire.unpack_grouped(frames))
                    answer: tuple = ("ok", server.execute(message, shared_reads=True))
                except Exception as exc:
                    answer = ("error", exc)
                # Nothing of a message is kept until the next one: a value released meanwhile (a blob's
                # bytes, say) gives its memory back now.
                message, frames = None, []
                trim = getattr(server, "trim_if_due", None)  # after a large drop, outside the lock
                del server
                if trace.ON:
                    executed = trace.now()
                    trace.span("read in", arriving, started)
                    trace.span("execute", started, executed)
                parts = compact.encode_answer(answer, names_out) or wire.pack_answer(answer)
                rest = _send_now(conn, shared.place(parts, None if region is None else region.answers))
                del answer, parts
            if rest:  # what the socket would not take at once, sent outside the lock (a copy)
                conn.sendall(rest)
                rest = b""
            if trim is not None:
                trim()
                trim = None  # (it holds the server)
            if trace.ON:
                trace.span("write", executed)
    except OSError:  # the caller went away mid-message, or the channel closed
        return
    finally:
        with guard:
            connections.discard(conn)
        conn.close()
        if region is not None:
            region.close()


def _attach(conn: socket.socket, frames: list, region: shared.Region | None) -> shared.Region | None:
    """Take the shared region the caller offers (its path, token and area size), answering whether this
    process could map it; the region the connection uses from now on."""
    try:
        path, token, area = pickle.loads(frames[0])
        offered = shared.attach(str(path), bytes(token), int(area))
    except Exception:  # not an offer this end understands: the socket alone
        offered = None
    conn.sendall(b"".join(shared.place(wire.pack_answer(("ok", offered is not None)), None)))
    if offered is None:
        return region
    if region is not None:
        region.close()
    return offered


def _send_now(conn: socket.socket, parts: list) -> bytes:
    """Send ``parts`` as far as the socket takes them without waiting; return a copy of the rest."""
    views = [memoryview(p).cast("B") for p in parts]
    sent = 0
    if len(views) <= _MAX_PARTS:
        try:
            sent = conn.sendmsg(views, [], socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
    rest = []
    for view in views:
        if sent >= view.nbytes:
            sent -= view.nbytes
            continue
        rest.append(view[sent:])
        sent = 0
    return b"".join(rest)
