"""Where each server is, and what this process holds there: the one owner of handles, moves and holds.

- :class:`ServerRef` names a server (worker address, actor key, task,
  direct channel); :data:`LOCAL` is the server of local variables.
- :data:`ROUTES` (one :class:`Routes` per process) keeps every live handle
  by ``(server, key)``, the servers found gone, the servers that replaced
  lost ones (a handle naming an old server finds the new one), and the
  servers held while a recovery restores them (other threads' calls wait).
- It words the error for a server that is gone, naming the variables this
  process held there.

The transport (:mod:`daskps.client.transport`) reports losses here; the
operations (:mod:`daskps.client.protocol`) route every call through here.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from distributed.worker import get_worker

from daskps._core.config import setting
from daskps.errors import PSUnavailableError

# This process, as a holder of server-side objects (see ParameterServer.acquire).
HOLDER = uuid.uuid4().hex


def holder_here() -> str:
    """The holder id for handles registered here: on a worker, tied to its address (see forget_place)."""
    try:
        return f"{HOLDER}@{get_worker().address}"
    except ValueError:
        return HOLDER


def connect_timeout() -> float:
    """Seconds to wait for a connection to a parameter server (config ``daskps.connect-timeout``)."""
    return setting("connect_timeout")


def recovery_timeout() -> float:
    """Seconds a lost server's recovery may take (config ``daskps.recovery-timeout``)."""
    return setting("recovery_timeout")


class ServerRef(NamedTuple):
    """Where one parameter server lives: worker address, actor key, task index, channel.

    A tuple: it is a dictionary key on every call, and travels with every handle.
    ``channel`` is the ``host:port`` of its direct channel (:mod:`daskps.client.channel`), if any.
    """

    address: str
    actor_key: str
    task_id: int | None
    channel: str | None = None

    @property
    def is_local(self) -> bool:
        return self.task_id is None

    @property
    def device(self) -> str:
        if self.task_id is None:
            return "/job:chief/replica:0/task:0/device:CPU:0"
        return f"/job:ps/replica:0/task:{self.task_id}/device:CPU:0"

    @property
    def label(self) -> str:
        return "this process" if self.task_id is None else f"ps:{self.task_id} at {self.address}"


LOCAL = ServerRef("inproc://local", "local", None)


def quoted(names: Sequence[str], most: int = 8) -> str:
    """``'a', 'b' and 3 more``."""
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class Routes:
    """This process's handles by server, the servers gone or moved, and the servers on hold."""

    def __init__(self) -> None:
        # Every live handle by (server, key): at most one each (see daskps.client.refs).
        self.handles: weakref.WeakValueDictionary[tuple[ServerRef, str], Any] = weakref.WeakValueDictionary()
        self.gone: set[str] = set()  # actor keys of servers found unreachable or gone
        # Old actor key -> the server that replaced it (see daskps.coordinator.recovery).
        self.moved: dict[str, ServerRef] = {}
        self.holds: dict[str, threading.Event] = {}  # re-created, not yet restored
        self._past_holds = threading.local()

    # -- handles ---------------------------------------------------------------------
    def add(self, server: ServerRef, key: str, handle: Any) -> None:
        self.handles[(server, key)] = handle

    def find(self, server: ServerRef, key: str) -> Any:
        return self.handles.get((server, key))

    def on(self, server: ServerRef) -> list[Any]:
        """The live handles of objects on ``server``."""
        return [h for (s, _), h in list(self.handles.items()) if s == server]

    def held_names(self, server: ServerRef) -> list[str]:
        """Names of the variables on ``server`` that this process holds handles to."""
        return sorted({h.name for h in self.on(server) if not h.name.startswith("<")})

    # -- losses ----------------------------------------------------------------------
    def unavailable(self, server: ServerRef, what: str, exc: BaseException | None = None,
                    gone: bool = True) -> PSUnavailableError:
        """The error for ``server`` being out of reach (``gone``: not just a broken channel)."""
        cause = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
        happened = f"parameter server {server.label} {what}{cause}."
        if gone:
            self.gone.add(server.actor_key)
        return PSUnavailableError(self._lost_text(happened, server), server.actor_key, happened)

    def _lost_text(self, what: str, server: ServerRef) -> str:
        names = self.held_names(server)
        held = f" It held {quoted(names)}: their values are lost." if names else ""
        return (f"{what}{held} Give the ClusterCoordinator a checkpoint manager "
                "(dps.ClusterCoordinator(strategy, checkpoint_manager=manager)) to have lost servers re-created "
                "and restored during training; otherwise restore them from a checkpoint "
                "(dps.CheckpointManager.restore_or_initialize) or re-create them.")

    def name_what_was_held(self, error: BaseException) -> None:
        """Reword a :class:`PSUnavailableError` raised elsewhere (on a trainer) to name what this process holds."""
        if not isinstance(error, PSUnavailableError) or not error.server_key or not error.what:
            return
        server = next((s for s, _ in list(self.handles) if s.actor_key == error.server_key), None)
        if server is not None and self.held_names(server):
            error.args = (self._lost_text(error.what, server),)

    # -- servers re-created after a loss --------------------------------------------
    def current(self, server: ServerRef) -> ServerRef:
        """Where ``server`` is now: itself, unless it was re-created after a loss."""
        return self.moved.get(server.actor_key, server) if self.moved else server

    def move(self, moves: dict[str, ServerRef]) -> list[Any]:
        """Servers were re-created (``{old actor key: new server}``): point this process's handles there.

        Returns the handles that moved.
        """
        changed = {old: new for old, new in moves.items() if self.moved.get(old) != new}
        if not changed:
            return []
        moved = self.moved
        moved.update(changed)
        for old, new in list(moved.items()):  # a server re-created twice: follow the chain
            while new.actor_key in moved and moved[new.actor_key] != new:
                new = moved[new.actor_key]
            moved[old] = new
        out = []
        for (server, key), handle in list(self.handles.items()):
            to = moved.get(server.actor_key)
            if to is not None and to != server:
                handle.server = to
                self.handles.pop((server, key), None)
                self.handles[(to, key)] = handle
                out.append(handle)
        return out

    def hold(self, servers: Sequence[ServerRef]) -> None:
        """Make calls to ``servers`` from other threads wait until :meth:`release_holds` (a restore runs)."""
        for server in servers:
            self.holds[server.actor_key] = threading.Event()

    def release_holds(self, servers: Sequence[ServerRef]) -> None:
        for server in servers:
            event = self.holds.pop(server.actor_key, None)
            if event is not None:
                event.set()

    @contextlib.contextmanager
    def past_holds(self) -> Iterator[None]:
        """The recovery's own calls go to the servers it holds."""
        self._past_holds.active = True
        try:
            yield
        finally:
            self._past_holds.active = False

    def wait_for_holds(self, servers: Iterable[ServerRef]) -> None:
        if getattr(self._past_holds, "active", False):
            return
        for server in servers:
            event = self.holds.get(server.actor_key)
            if event is not None:
                event.wait(recovery_timeout())


ROUTES = Routes()
