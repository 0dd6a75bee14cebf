"""Shared memory beside a direct channel: large frames copied through a mapped file, not the socket.

A trainer and a parameter server on one machine still talk over loopback
TCP, and a large frame then costs its copy into the kernel, the TCP stack's
work on every segment, and its copy out, at both ends (about 0.25 ms of CPU
per 400 KB each way on a 2-core VM). When both ends can map the same file in
``/dev/shm``, a large frame is copied once into the region by the sender and
once out of it by the receiver; the socket still carries the message's
header and small frames, and its order.

The caller of a channel makes the region (:func:`create`), offers it to the
server in an attach message (its path, a random token written at its start,
and the size of each area), and removes the file once the server answered:
the mappings outlive it, and nothing is left in ``/dev/shm`` when either
process ends (a file whose maker was killed during that handshake is
removed by the next process here that makes a region). A server that cannot open the file (another machine, another
``/dev/shm``) or finds another token says no, and the channel goes on with
the socket alone.

A region is ``[token | requests area | answers area]``. One request is
outstanding on a channel at a time (the caller reads each answer before it
sends again), so each area holds one message's large frames: the caller
writes a request's, the server copies them out before it runs the message,
then writes the answer's, which the caller copies out before its next
request. A frame that does not fit travels on the socket.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
import struct
from collections.abc import Sequence
from typing import Any

SHARED = 1 << 63  # a frame length with this bit set: the frame lies in the area, not on the socket
ATTACH = 1 << 62  # a request's frame count with this bit set: the caller offers a region
MIN_FRAME = 16 << 10  # smaller frames go on the socket (a copy through the region saves nothing there)
TOKEN = 16
HEAD = 64  # the token, and the first area's alignment
ALIGN = 64  # each frame starts at a multiple of this in its area
DIRECTORY = "/dev/shm"
PREFIX = "daskps-"  # a region's file: daskps-<pid of its maker>-<random>


class Region:
    """A mapped region: ``requests`` and ``answers``, each ``area`` bytes (writable memoryviews)."""

    def __init__(self, mapping: Any, area: int):
        self.mapping, self.area = mapping, area
        view = memoryview(mapping)
        self.requests = view[HEAD:HEAD + area]
        self.answers = view[HEAD + area:HEAD + 2 * area]
        view.release()

    def close(self) -> None:
        self.requests.release()
        self.answers.release()
        try:
            self.mapping.close()
        except BufferError:  # a view of it is still held somewhere: the garbage collector unmaps it later
            pass


def create(area: int) -> tuple[Region, str, bytes] | None:
    """A new region with two areas of ``area`` bytes, its file's path and its token; ``None`` when this
    machine cannot make one (no ``/dev/shm``, or it would take more than half the room left there)."""
    if not hasattr(os, "posix_fallocate") or not os.path.isdir(DIRECTORY):
        return None
    _sweep()
    size = HEAD + 2 * area
    try:
        room = os.statvfs(DIRECTORY)
    except OSError:
        return None
    if size > room.f_bavail * room.f_frsize // 2:  # /dev/shm is shared with everything else on the machine
        return None
    path = os.path.join(DIRECTORY, f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        # Every page now: writing through a mapping past what a full /dev/shm holds would kill the process
        # (SIGBUS); allocated up front, a full one is an error here instead.
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size)
    except (OSError, ValueError):
        unlink(path)
        return None
    except BaseException:  # an interrupt: no file left behind
        unlink(path)
        raise
    finally:
        os.close(fd)
    token = secrets.token_bytes(TOKEN)
    mapping[:TOKEN] = token
    return Region(mapping, area), path, token


def unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # removed already (a cleaner of /dev/shm, say)
        os.unlink(path)


_SWEPT = False


def _sweep() -> None:
    """Remove the region files of this user's processes that have ended (once per process).

    A region's file lives only for its handshake; a process killed in that
    moment leaves it, and the next process here to make a region removes it.
    """
    global _SWEPT
    if _SWEPT:
        return
    _SWEPT = True
    uid = os.getuid()
    for name in os.listdir(DIRECTORY):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        path = os.path.join(DIRECTORY, name)
        try:
            if not pid.isdigit() or os.stat(path, follow_symlinks=False).st_uid != uid:
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its maker has ended
            unlink(path)
        except OSError:  # alive under another user, or gone already
            continue


def attach(path: str, token: bytes, area: int) -> Region | None:
    """The region a caller made at ``path``, mapped here; ``None`` if this process cannot open it, or it is
    not the one offered (another token, another size)."""
    size = HEAD + 2 * area
    if not path.startswith(DIRECTORY + os.sep) or not os.path.basename(path).startswith(PREFIX) \
            or os.sep in path[len(DIRECTORY) + 1:]:
        return None  # only a region file directly in /dev/shm: a request cannot make the server open another
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_size != size:
            return None
        mapping = mmap.mmap(fd, size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if mapping[:TOKEN] != token:
        mapping.close()
        return None
    return Region(mapping, area)


def place(parts: Sequence[Any], area: memoryview | None) -> list[memoryview]:
    """``parts`` as a channel message: ``[count and lengths, *frames on the socket]``, copying each large
    frame that fits into ``area`` (its length then marked :data:`SHARED`)."""
    views = [memoryview(p).cast("B") for p in parts]
    lengths, on_socket, offset = [], [], 0
    room = 0 if area is None else area.nbytes
    for view in views:
        n = view.nbytes
        if n >= MIN_FRAME and offset + n <= room:
            area[offset:offset + n] = view  # type: ignore[index]
            offset += n + (-n) % ALIGN
            lengths.append(n | SHARED)
        else:
            lengths.append(n)
            on_socket.append(view)
    header = struct.pack(f"!{len(lengths) + 1}Q", len(lengths), *lengths)
    return [memoryview(header), *on_socket]


def read(lengths: Sequence[int], area: memoryview | None, receive: Any, in_place: Any = None) -> list[Any]:
    """A message's frames: each marked :data:`SHARED` copied out of ``area`` (a buffer of its own), the
    others ``receive(n)`` from the socket, in order.

    ``in_place(first frame)``, asked at the first shared frame: whether this message's shared frames
    may be left in the area (views of it) because nothing of the message outlives its handling, which
    ends before the other end writes the area again.
    """
    frames: list[Any] = []
    offset = 0
    leave: bool | None = None
    for n in lengths:
        if n & SHARED:
            n &= ~SHARED
            if area is None or offset + n > area.nbytes:
                raise ConnectionError("a frame was sent through shared memory that this end has not mapped")
            if leave is None:
                leave = bool(in_place is not None and frames and in_place(frames[0]))
            frames.append(area[offset:offset + n] if leave else bytearray(area[offset:offset + n]))
            offset += n + (-n) % ALIGN
        else:
            frames.append(receive(n))
    return frames


def area_for(needed: int, largest: int) -> int:
    """The area to offer for large frames of ``needed`` bytes (their padding counted): a power of two of
    at least 1 MiB, at most ``largest`` rounded down to whole :data:`ALIGN` blocks (frames beyond it take the
    socket)."""
    area = 1 << 20
    while area < needed:
        area <<= 1
    return min(area, largest - largest % ALIGN)


def need(lengths: Sequence[int]) -> int:
    """Room a message's frames large enough for the region take there, padding included."""
    total = 0
    for n in lengths:
        n &= ~SHARED
        if n >= MIN_FRAME:
            total += n + (-n) % ALIGN
    return total
