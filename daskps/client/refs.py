"""Lifetimes of server-side objects: reference counting across processes.

Every variable, optimizer and dataset blob on a server is named by a key
and counted per *holder* (a process; on a worker, tied to its address; see
``ParameterServer.acquire``). In each process one :class:`Ref` stands for
one ``(server, key)``; user-facing handles hold it, and handles that arrive
by pickle find the same one.

- The process that creates an object holds it (the server counts it at
  creation); when its last handle dies, the Ref's finalizer sends a release.
- A handle pickled into a scheduled function is kept alive on the
  coordinator until the function has run (:func:`collecting`).
- On the trainer, handles that the function leaves behind (in a cache, a
  dataset, a global) are *escapes*: before the function returns,
  :func:`borrowing` acquires them for the trainer, which then releases them
  when they die (or the servers forget them when the trainer dies). Handles
  that die with the function cost nothing.
- A server's objects also keep its group (the Dask actors) alive.

This is how Dask counts futures, with the servers as the scheduler.
Releases run from ``weakref.finalize``: after a Ref's weak references are
cleared, so a dying Ref can never be found and reused.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

from daskps.client import protocol
from daskps.client.group import group_of
from daskps.client.routing import HOLDER, ROUTES, ServerRef, holder_here
from daskps.client.transport import sender_for
from daskps.errors import PSUnavailableError
from daskps.server import ops

logger = logging.getLogger("daskps")

# While a scheduled function runs on this worker: the Refs its unpickling made.
_BORROWED: contextvars.ContextVar[list[weakref.ref] | None] = contextvars.ContextVar("daskps_borrowed", default=None)
# While the coordinator pickles a scheduled function: what must live until it has run.
_COLLECT: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("daskps_collect", default=None)


class Ref:
    """This process's hold on one object on one server.

    ``owner`` is the group of the servers (on the coordinator), or ``None``.
    ``holder`` is whom the server counts this Ref for; ``None`` means it
    borrows a hold that another process keeps.
    """

    __slots__ = ("server", "key", "name", "owner", "holder", "recipe", "__weakref__")

    def __init__(self, server: ServerRef, key: str, name: str, owner: Any, holder: str | None):
        self.server, self.key, self.name, self.owner = server, key, name, owner
        self.holder: str | None = None
        # On the coordinator: how to make the object again if its server is lost
        # (see daskps.coordinator.recovery): the operation that made it (Create, AddOptimizer, PutBlob).
        self.recipe: ops.Op | None = None
        ROUTES.add(server, key, self)
        if holder is not None:
            self.register(holder)

    @property
    def registered(self) -> bool:
        return self.holder is not None

    def register(self, holder: str) -> None:
        """The server now counts this Ref for ``holder``: release when it dies."""
        self.holder = holder
        sender = sender_for(self.server, self.owner)
        group = None if self.owner is None else weakref.ref(self.owner)
        weakref.finalize(self, _release, sender, self.server, self.key, holder, group).atexit = False

    def __reduce__(self) -> Any:
        if self.server.is_local:
            raise TypeError(f"{self.name!r} lives in this process only and cannot be sent elsewhere")
        keep_alive(self)
        return (borrow, (self.server, self.key, self.name))

    def __repr__(self) -> str:
        return f"<Ref {self.name!r} {self.key} on {self.server.label}{'' if self.registered else ' (borrowed)'}>"


def _release(sender: Any, server: ServerRef, key: str, holder: str, group: weakref.ref | None) -> None:
    alive = None if group is None else group()
    if group is not None and (alive is None or alive.closed):
        return  # its servers were released already, and everything on them
    sender.release_later(ROUTES.current(server), key, holder)


def owned(server: ServerRef, key: str, name: str, owner: Any = None) -> Ref:
    """The Ref of an object this process has just created (the server already counts it)."""
    return Ref(server, key, name, owner, HOLDER)


def borrow(server: ServerRef, key: str, name: str) -> Ref:
    """The Ref for a handle that arrived by pickle: this process's own, or a new borrowed one."""
    server = ROUTES.current(server)
    ref = ROUTES.find(server, key)
    if ref is None:
        ref = Ref(server, key, name, group_of(server), None)
        borrowed = _BORROWED.get()
        if borrowed is not None:
            borrowed.append(weakref.ref(ref))
    return ref


def keep_alive(obj: Any) -> None:
    """Called while pickling: keep ``obj`` alive until the function being scheduled has run."""
    found = _COLLECT.get()
    if found is not None:
        found.append(obj)


def scheduling() -> bool:
    """True while the coordinator pickles a scheduled function."""
    return _COLLECT.get() is not None


@contextlib.contextmanager
def collecting() -> Iterator[list[Any]]:
    """Collect what the objects pickled inside this block need kept alive."""
    found: list[Any] = []
    token = _COLLECT.set(found)
    try:
        yield found
    finally:
        _COLLECT.reset(token)


@contextlib.contextmanager
def borrowing(made: list[weakref.ref]) -> Iterator[None]:
    """Around a scheduled function on a worker: note in ``made`` the handles its unpickling makes.

    Call :func:`keep_escaped` with ``made`` after the function, once any
    exception it raised is dropped (a traceback keeps the function, and its
    handles, alive).
    """
    token = _BORROWED.set(made)
    try:
        yield
    finally:
        _BORROWED.reset(token)


def keep_escaped(made: list[weakref.ref]) -> None:
    """Acquire for this worker the handles of ``made`` still alive: the function left them behind."""
    escaped = [r for r in (w() for w in made) if r is not None and not r.registered]
    if escaped:
        _acquire(escaped)


def drop_traceback(exc: BaseException) -> None:
    """Let go of the frames ``exc`` and its causes keep (and the handles in them); the text is kept elsewhere."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]


def follow(moves: dict[str, ServerRef]) -> None:
    """On a trainer: servers were re-created after a loss; move this process's handles to them.

    The handles this worker holds (escapes) are counted again on the new
    servers, which the coordinator filled with what it holds.
    """
    held = [r for r in ROUTES.move(moves) if r.registered and r.owner is None]
    if not held:
        return
    outcome = protocol.acquire([(r.server, r.key) for r in held], holder_here())
    failed = {s.label: str(e) for s, e in outcome.items() if e is not None}
    if failed:
        logger.warning("daskps: handles kept on this worker were not re-created with their server: %s", failed)


def _acquire(refs: list[Ref]) -> None:
    """Register ``refs`` for this worker, each server all or nothing."""
    holder = holder_here()
    outcome = protocol.acquire([(r.server, r.key) for r in refs], holder)
    for r in refs:
        if outcome.get(r.server) is None:
            r.register(holder)
    # A server that is gone has lost them anyway (its functions fail, or its coordinator recovers it).
    failed = {s: e for s, e in outcome.items() if e is not None and not isinstance(e, PSUnavailableError)}
    if failed:  # the objects are gone already: the handles will say so when used
        logger.warning("daskps: could not keep handles alive on %s", {s.label: str(e) for s, e in failed.items()})
