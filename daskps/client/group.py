"""A strategy's parameter servers: started together, released together.

A ``ServerGroup`` submits one ``ParameterServer`` actor to each ps-tagged
worker, pinned there by address (Dask releases an actor's resources once its
constructor returns, so resources alone would not pin it), and holds the
Dask futures that keep those actors alive. Every handle made through the
strategy (variables, optimizers, metrics, datasets) holds the group, so the
servers outlive the strategy object for as long as anything needs them;
:meth:`ServerGroup.close` releases them at once.
"""

from __future__ import annotations

import re
import threading
import uuid
import weakref
from typing import Any

from distributed import wait

from daskps.client.routing import ROUTES, ServerRef
from daskps.client.transport import CHANNELS
from daskps.errors import ClosedError, PSUnavailableError
from daskps.server.actor import DaskParameterServer

SERVER_KEY_PREFIX = "daskps-ps-"
_KEY = re.compile(rf"{SERVER_KEY_PREFIX}(\d+)-([0-9a-f]+)(?:-g(\d+))?$")

_GROUPS: weakref.WeakValueDictionary[str, ServerGroup] = weakref.WeakValueDictionary()


def server_key(task_id: int, token: str, generation: int = 0) -> str:
    """The Dask key of the actor of server ``task_id`` in group ``token`` (re-created ``generation`` times)."""
    return f"{SERVER_KEY_PREFIX}{task_id}-{token}" + (f"-g{generation}" if generation else "")


def _parse(key: Any) -> tuple[int, str, int] | None:
    m = _KEY.match(key) if isinstance(key, str) else None
    return (int(m.group(1)), m.group(2), int(m.group(3) or 0)) if m else None


def parse_server_key(key: Any) -> tuple[int, str] | None:
    """``(task_id, token)`` of a server's actor key, or ``None`` for any other key."""
    parsed = _parse(key)
    return parsed[:2] if parsed else None


def strategy_token(key: Any) -> str:
    """The token of the strategy a server's actor key belongs to, the same for a re-created server
    (``...-g1``); the key itself for any other key."""
    parsed = _parse(key)
    return parsed[1] if parsed else str(key)


def key_generation(key: str) -> int:
    """How many servers of its group had been re-created when the server ``key`` was made (0: an original)."""
    parsed = _parse(key)
    return parsed[2] if parsed else 0


def generation_known(token: str) -> int:
    """The generation of the newest re-created server of group ``token`` this process knows of (0: none).

    A process learns all the servers one recovery made at once (from the
    scheduler as a batch starts, or a follow task), so a function that
    started knowing generation ``k`` used, for every server, the newest one
    made up to generation ``k``: it reached a lost server of generation
    ``g`` when ``g <= k`` and ``k`` is below the generation of its replacement.
    """
    if not ROUTES.moved:
        return 0
    parsed = [_parse(server.actor_key) for server in list(ROUTES.moved.values())]  # a copy: others may add
    return max((p[2] for p in parsed if p is not None and p[1] == token), default=0)


def _channels(keys: list[str], dask_worker: Any = None) -> dict[str, str | None]:
    """On a ps worker: the direct channel of each of its servers among ``keys`` (``None``: it has none)."""
    actors = dask_worker.state.actors
    return {key: getattr(actors[key], "channel", None) for key in keys if key in actors}


def group_of(server: ServerRef) -> ServerGroup | None:
    """The live group of ``server`` in this process, if any."""
    if not _GROUPS:  # a worker's process: no groups
        return None
    parsed = parse_server_key(server.actor_key)
    return None if parsed is None else _GROUPS.get(parsed[1])


class ServerGroup:
    """The parameter servers of one strategy.

    Parameters
    ----------
    client : distributed.Client
    ps_workers : list of (name, address)
        The ps-tagged workers, one server each, in task order.
    """

    def __init__(self, client: Any, ps_workers: list[tuple[str, str]]):
        self.client = client
        self.token = uuid.uuid4().hex[:16]
        self.closed = False
        self.worker_names = [name for name, _ in ps_workers]  # where each server lives (by worker name)
        self.generation = 0  # servers re-created so far
        self._lock = threading.Lock()  # replace() (in the recovery thread) against close()
        self._futures = [self._submit(i, addr) for i, (_, addr) in enumerate(ps_workers)]
        # Every server at once: a future's result() and an attribute read of its actor, one server after
        # another, cost two round trips per server (0.16 s of a start-up with 64 servers).
        wait(self._futures)
        for fut in self._futures:
            if fut.status != "finished":
                fut.result()  # the actor's constructor failed: its error
        found = self.client.run(_channels, [str(fut.key) for fut in self._futures],
                                workers=list(dict.fromkeys(addr for _, addr in ps_workers)))
        channels = [found[addr][str(fut.key)] for (_, addr), fut in zip(ps_workers, self._futures)]
        self.servers = [ServerRef(addr, str(fut.key), i, ch)
                        for i, ((_, addr), fut, ch) in enumerate(zip(ps_workers, self._futures, channels))]
        _GROUPS[self.token] = self
        weakref.finalize(self, CHANNELS.forget, self.servers)  # the list: servers re-created too

    def _submit(self, task_id: int, address: str) -> Any:
        return self.client.submit(DaskParameterServer, task_id, actor=True, workers=[address],
                                  allow_other_workers=False, pure=False,
                                  key=server_key(task_id, self.token, self.generation))

    def replace(self, task_id: int, worker: tuple[str, str], timeout: float,
                before_release: Any = None) -> tuple[ServerRef, ServerRef]:
        """Start an empty server ``task_id`` on ``worker`` (name, address) in place of a lost one.

        Returns ``(old, new)``. ``before_release(old, new)`` is called before
        the old actor's future is released (the scheduler forgets it then).
        """
        self.check_open("the parameter servers")
        old = self.servers[task_id]
        self.generation += 1
        future = self._submit(task_id, worker[1])
        try:
            with self.client.as_current():
                channel = future.result(timeout=timeout).channel
        except Exception as exc:
            future.release()
            raise PSUnavailableError(f"parameter server ps:{task_id} was lost, and starting it again on "
                                     f"{worker[0]} ({worker[1]}) failed: {type(exc).__name__}: {exc}") from exc
        new = ServerRef(worker[1], str(future.key), task_id, channel)
        if before_release is not None:
            before_release(old, new)
        with self._lock:
            if self.closed:  # strategy.close() meanwhile: the new server must not outlive its group
                future.release()
                self.check_open("the parameter servers")
            previous, self._futures[task_id] = self._futures[task_id], future
            self.servers[task_id] = new
            self.worker_names[task_id] = worker[0]
        CHANNELS.forget([old])
        previous.release()
        return old, new

    @property
    def futures(self) -> list[Any]:
        return list(self._futures)

    def check_open(self, what: str = "it") -> None:
        """Raise :class:`~daskps.errors.ClosedError` if the servers were released."""
        if self.closed:
            raise ClosedError(
                f"cannot use {what}: the ParameterServerStrategy it belongs to was closed "
                "(strategy.close()), which released its parameter servers and everything on them"
            )

    def close(self) -> None:
        """Release the actors now (their variables go with them); later calls raise ``ClosedError``."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            futures, self._futures = self._futures, []
        CHANNELS.forget(self.servers)
        for fut in futures:
            try:
                fut.release()
            except Exception:  # the client is gone: so are its actors
                pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.servers)} servers"
        return f"<ServerGroup {self.token[:8]} {state}>"
