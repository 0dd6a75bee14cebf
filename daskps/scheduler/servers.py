"""The scheduler plugin's placement job: where each parameter server is, and what follows when one goes.

It notes where each server's actor lives (from the scheduler's task
transitions), which servers were re-created after a loss and where
(``moves``: batches that start later follow them), and the *cleanups* code
above left with it: a function to run on every worker once a given server is
gone, however it went (``strategy.close()``, everything dropped, or the
coordinator's process ending). When a worker leaves it tells every server to
forget the handles that worker's process held, and tells the coordinators of
the servers that lived there.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from distributed.core import Status
from distributed.protocol.pickle import dumps

from daskps.client import protocol
from daskps.client.group import parse_server_key
from daskps.client.routing import ServerRef
from daskps.scheduler.messages import BATCH_TOPIC_PREFIX, LOST, AddCleanup, MoveCleanups, RecordMoves


class ServerPlaces:
    """Servers by actor key: where they live, how they were replaced, what waits for them to go."""

    def __init__(self) -> None:
        self.servers: dict[str, str] = {}  # actor key -> worker address, while the actor is in memory
        self.hosts: dict[str, str] = {}  # actor key -> worker address, until the key is forgotten
        self.replaced: dict[str, str] = {}  # actor key of a lost server -> the server that took its place
        self.moves: dict[str, tuple] = {}  # actor key of a lost server -> the new server (a ServerRef's fields)
        self.cleanups: dict[str, dict[str, tuple[bytes, bytes]]] = {}  # server key -> id -> (function, args)

    def found(self, scheduler: Any) -> None:
        """Servers made before the plugin started."""
        for key, ts in scheduler.tasks.items():
            if parse_server_key(key) and ts.who_has:
                self.servers[key] = next(iter(ts.who_has)).address

    def transition(self, scheduler: Any, key: str, finish: str, where: str | None) -> bool:
        """A server's task changed state; True once its key is forgotten for good."""
        if finish == "memory" and where:
            self.servers[key] = self.hosts[key] = where
        elif finish in ("forgotten", "released", "erred"):
            self.servers.pop(key, None)
            if finish == "forgotten":
                self.hosts.pop(key, None)
                todo = self.cleanups.pop(key, {})
                if todo and scheduler is not None:
                    asyncio.ensure_future(_run_on_workers(scheduler, list(todo.values())))
                return True
        return False

    def strategy_gone(self, token: str) -> bool:
        """Whether no server of strategy ``token`` is left."""
        return not any(parse_server_key(k)[1] == token for k in self.hosts)  # type: ignore[index]

    def worker_left(self, scheduler: Any, worker: str) -> None:
        """Servers forget what ``worker``'s process held; coordinators hear of their servers that lived there."""
        servers = [s for s in self.refs() if s.address != worker]
        if servers:
            asyncio.ensure_future(protocol.forget_place_async(scheduler.rpc, servers, worker))
        lost: dict[str, list[str]] = {}  # servers that lived there, by strategy
        for key in [k for k, address in self.hosts.items() if address == worker]:
            del self.hosts[key]
            lost.setdefault(parse_server_key(key)[1], []).append(key)  # type: ignore[index]
        for token, keys in lost.items():
            scheduler.log_event(f"{BATCH_TOPIC_PREFIX}{token}", [LOST, keys])

    def add_cleanup(self, request: AddCleanup) -> None:
        self.cleanups.setdefault(request.server_key, {})[request.cleanup_id] = (request.function, request.args)

    def move_cleanups(self, request: MoveCleanups) -> None:
        self.replaced[request.old_key] = request.new_key
        moved = self.cleanups.pop(request.old_key, None)
        if moved:
            self.cleanups.setdefault(request.new_key, {}).update(moved)

    def record_moves(self, request: RecordMoves) -> None:
        self.moves.update(request.moves)

    async def run_cleanup(self, scheduler: Any, server_key: str, cleanup_id: str) -> None:
        """Run a cleanup on every worker now, and forget it: its object was dropped."""
        while server_key in self.replaced:
            server_key = self.replaced[server_key]
        todo = self.cleanups.get(server_key, {}).pop(cleanup_id, None)
        if todo is not None:
            await _run_on_workers(scheduler, [todo])

    def refs(self) -> list[ServerRef]:
        return [ServerRef(address, key, parse_server_key(key)[0])  # type: ignore[index]
                for key, address in sorted(self.servers.items())]

    async def stats(self, rpc: Any, timeout: float) -> list[dict[str, Any]]:
        """``stats()`` of every server, asked directly: a row each (``"error"`` where one did not answer)."""
        servers = self.refs()
        rows = []
        for server, result in zip(servers, await protocol.stats_async(rpc, servers, timeout)):
            row: dict[str, Any] = {"key": server.actor_key, "address": server.address, "task": server.task_id}
            if isinstance(result, BaseException):
                row["error"] = f"{type(result).__name__}: {result}"
            else:
                row.update(result.as_dict())
            rows.append(row)
        return rows


async def _run_on_workers(scheduler: Any, calls: list[tuple[bytes, bytes]]) -> None:
    """Run each pickled ``(function, args)`` on every running worker, all at once, ignoring failures.

    Not ``scheduler.broadcast``: that logs an error for each worker it cannot
    reach, and a worker closing with its cluster has nothing left to clean.
    """
    async def one(address: str, function: bytes, args: bytes) -> None:
        with contextlib.suppress(Exception):  # a worker that is gone has nothing to clean
            await scheduler.rpc(address).run(function=function, args=args, kwargs=dumps({}), wait=True)

    for function, args in calls:
        running = [a for a, ws in scheduler.workers.items() if ws.status == Status.running]
        await asyncio.gather(*(one(a, function, args) for a in running))
