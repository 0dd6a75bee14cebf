"""The parameter-server protocol: the only code that talks to servers.

Everything daskps does to a parameter server (variables, shards, optimizers,
metrics, checkpoints, datasets, reprs, the dashboard) is a function here.
Each takes *targets* (anything with ``server``, ``key``, ``name`` and
``owner``, as the handles of :mod:`daskps.ps.refs`), groups the work by
server, and sends **one message per server, all servers at once**: a list
of ``(operation, args)`` that the server's ``execute`` runs in order.

Messages go straight to the worker that hosts the actor, as Dask's own
``actor_execute``, from whatever process is running: a trainer inside a
scheduled function (worker to worker), the coordinator (without the
scheduler's proxy), or the scheduler for the dashboard. The server of local
variables is :data:`LOCAL`, a ``ParameterServer`` in this process reached by
a direct call, so local and remote variables share one code path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import dask.config
from dask.utils import parse_timedelta
from distributed import default_client
from distributed.core import send_recv
from distributed.protocol.serialize import Serialized, deserialize
from distributed.utils import sync
from distributed.worker import get_worker

from daskps._core import wire
from daskps.errors import ClosedError, PSUnavailableError
from daskps.ps import channel, pipeline
from daskps.ps.local import LocalTransport
from daskps.ps.server import ParameterServer

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
    return parse_timedelta(dask.config.get("daskps.connect-timeout"))


def recovery_timeout() -> float:
    """Seconds a lost server's recovery may take (config ``daskps.recovery-timeout``)."""
    return parse_timedelta(dask.config.get("daskps.recovery-timeout"))


class ServerRef(NamedTuple):
    """Where one parameter server lives: worker address, actor key, task index, channel.

    A tuple: it is a dictionary key on every call, and travels with every handle.
    ``channel`` is the ``host:port`` of its direct channel (:mod:`daskps.ps.channel`), if any.
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

Ops = list[tuple[str, tuple]]

# Every live handle in this process, by (server, key): at most one each (see daskps.ps.refs).
HANDLES: weakref.WeakValueDictionary[tuple[ServerRef, str], Any] = weakref.WeakValueDictionary()


def held_names(server: ServerRef) -> list[str]:
    """Names of the variables on ``server`` that this process holds handles to."""
    return sorted({h.name for (s, _), h in list(HANDLES.items()) if s == server and not h.name.startswith("<")})


def _unavailable(server: ServerRef, what: str, exc: BaseException | None = None, gone: bool = True) -> PSUnavailableError:
    cause = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    happened = f"parameter server {server.label} {what}{cause}."
    error = PSUnavailableError(_unavailable_text(happened, server))
    error.server_key = server.actor_key  # type: ignore[attr-defined]  # which server (travels by pickle)
    error.daskps_what = happened  # type: ignore[attr-defined]  # named again where the handles are known
    if gone:  # unreachable or its actor gone, not just a broken channel
        GONE.add(server.actor_key)
    return error


def quoted(names: Sequence[str], most: int = 8) -> str:
    """``'a', 'b' and 3 more``."""
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _unavailable_text(what: str, server: ServerRef) -> str:
    names = held_names(server)
    held = f" It held {quoted(names)}: their values are lost." if names else ""
    return (f"{what}{held} Give the ClusterCoordinator a checkpoint manager "
            "(dps.ClusterCoordinator(strategy, checkpoint_manager=manager)) to have lost servers re-created "
            "and restored during training; otherwise restore them from a checkpoint "
            "(dps.CheckpointManager.restore_or_initialize) or re-create them.")


def name_what_was_held(error: BaseException) -> None:
    """Rewrite a :class:`PSUnavailableError` raised elsewhere (on a trainer) to name what this process holds there."""
    key, what = getattr(error, "server_key", None), getattr(error, "daskps_what", None)
    server = next((s for s, _ in list(HANDLES) if s.actor_key == key), None) if key and what else None
    if server is not None and held_names(server):
        error.args = (_unavailable_text(what, server),)  # type: ignore[arg-type]


# Actor keys of the servers this process found unreachable or gone (a re-created server has a new key).
GONE: set[str] = set()


# -- servers re-created after a loss ---------------------------------------------------
# Old actor key -> the server that replaced it (see daskps.coordinator.recovery). Handles that
# still name an old server (inside pickled functions, on trainers) find the new one through it.
MOVED: dict[str, ServerRef] = {}


# Servers just re-created and not yet restored: other threads' calls to them wait (see hold()).
_HOLDS: dict[str, threading.Event] = {}
_PAST_HOLDS = threading.local()


def hold(servers: Sequence[ServerRef]) -> None:
    """Make calls to ``servers`` from other threads wait until :func:`release_holds` (a restore runs)."""
    for server in servers:
        _HOLDS[server.actor_key] = threading.Event()


def release_holds(servers: Sequence[ServerRef]) -> None:
    for server in servers:
        event = _HOLDS.pop(server.actor_key, None)
        if event is not None:
            event.set()


@contextlib.contextmanager
def past_holds() -> Iterator[None]:
    """The recovery's own calls go to the servers it holds."""
    _PAST_HOLDS.active = True
    try:
        yield
    finally:
        _PAST_HOLDS.active = False


def _wait_for_holds(servers: Iterable[ServerRef]) -> None:
    if getattr(_PAST_HOLDS, "active", False):
        return
    for server in servers:
        event = _HOLDS.get(server.actor_key)
        if event is not None:
            event.wait(recovery_timeout())


def current(server: ServerRef) -> ServerRef:
    """Where ``server`` is now: itself, unless it was re-created after a loss."""
    return MOVED.get(server.actor_key, server) if MOVED else server


def move(moves: dict[str, ServerRef]) -> list[Any]:
    """Servers were re-created (``{old actor key: new server}``): point this process's handles at them.

    Returns the handles that moved.
    """
    changed = {old: new for old, new in moves.items() if MOVED.get(old) != new}
    if not changed:
        return []
    MOVED.update(changed)
    for old, new in list(MOVED.items()):  # a server re-created twice: follow the chain
        while new.actor_key in MOVED and MOVED[new.actor_key] != new:
            new = MOVED[new.actor_key]
        MOVED[old] = new
    moved = []
    for (server, key), ref in list(HANDLES.items()):
        to = MOVED.get(server.actor_key)
        if to is not None and to != server:
            ref.server = to
            HANDLES.pop((server, key), None)
            HANDLES[(to, key)] = ref
            moved.append(ref)
    return moved


def _result(value: Any) -> Any:
    return deserialize(value.header, value.frames) if isinstance(value, Serialized) else value


# Operations whose arguments may hold functions (initializers, optimizer transforms): pickled by value.
_CARRY_CODE = frozenset({"create", "add_optimizer"})


def carries_code(ops: Ops) -> bool:
    return any(op in _CARRY_CODE for op, _ in ops)


def serialized(obj: Any, by_value: bool = False) -> Serialized:
    """``obj`` ready for Dask's comms: our wire format is Dask's "pickle" layout, so Dask only frames it."""
    frames = wire.pack(obj, by_value)
    return Serialized({"serializer": "pickle", "writeable": (True,) * (len(frames) - 1)}, frames)


class DaskParameterServer(ParameterServer):
    """The actor Dask hosts: a ParameterServer whose answers are ready for Dask's comms.

    On a worker that talks plain TCP it also opens a direct channel (``.channel``).
    """

    channel: str | None = None  # (on the class too: Dask's actor handles look there first)

    def __init__(self, task_id: int | None):
        super().__init__(task_id)
        worker = get_worker()
        scheme, _, rest = worker.address.partition("://")
        if scheme == "tcp":
            host = rest.rsplit(":", 1)[0].strip("[]")
            self.channel, close = channel.open_channel(self, host, worker.loop.asyncio_loop)  # type: ignore[attr-defined]
            weakref.finalize(self, close)

    def handle(self, ops: Ops) -> Serialized:
        return serialized(self.execute(ops))


# -- transports -------------------------------------------------------------------------
class _DaskTransport:
    """Sends messages over one process's Dask connection pool."""

    def __init__(self, loop: Any, pool: Any, client: Any = None):
        self.loop = loop
        self.pool = pool
        self._client = None if client is None else weakref.ref(client)  # never keep a client alive
        # Releases come from finalizers, maybe inside a garbage collection on any thread:
        # a SimpleQueue takes them without a lock that such a thread could already hold.
        self._releases: queue.SimpleQueue[tuple[ServerRef, str, str]] = queue.SimpleQueue()
        self._flush_queued = False

    @property
    def client(self) -> Any:
        return None if self._client is None else self._client()

    def call(self, coroutine_fn: Any, *args: Any) -> Any:
        """Run ``coroutine_fn(*args)`` on this transport's loop and wait for it."""
        client = self.client
        if self._client is not None and (client is None or client.status in ("closing", "closed")):
            raise ClosedError(
                f"the Dask client {client!r} was closed (client.close()); daskps reaches the "
                "parameter servers through it, so make a new client and strategy"
            )
        return sync(self.loop, coroutine_fn, *args)

    def run(self, batches: dict[ServerRef, Ops]) -> dict[ServerRef, list]:
        """Send every batch at once; return each server's results, or raise the first error."""
        return self.call(self._gather, batches)

    async def _gather(self, batches: dict[ServerRef, Ops]) -> dict[ServerRef, list]:
        servers = list(batches)
        results = await asyncio.gather(*(self.send(s, batches[s]) for s in servers), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return dict(zip(servers, results))  # type: ignore[arg-type]  # no exceptions left

    def run_each(self, batches: dict[ServerRef, Ops], timeout: float) -> dict[ServerRef, Any]:
        """Like :meth:`run`, but each server's results or exception, within ``timeout`` seconds."""
        return self.call(_each, self, batches, timeout)

    async def send(self, server: ServerRef, ops: Ops) -> list:
        try:
            # Dask retries refused connections until its (30 s) connect timeout;
            # a parameter server that is gone should be reported sooner.
            comm = await self.pool.connect(server.address, timeout=connect_timeout())
            try:
                # Run on the worker's event loop (no thread hop): every operation goes this way,
                # so they still run one at a time.
                response = await send_recv(comm=comm, op="actor_execute", actor=server.actor_key,
                                           function="handle", args=[serialized(ops, carries_code(ops))],
                                           kwargs={"separate_thread": False})
            finally:
                self.pool.reuse(server.address, comm)
        except OSError as exc:
            raise _unavailable(server, "cannot be reached: its worker died or is cut off", exc) from exc
        except KeyError as exc:
            if server.actor_key in str(exc):
                raise _unavailable(server, "is up but its actor is gone: the worker restarted, or "
                                           "the strategy's servers were released") from exc
            raise
        if response["status"] == "OK":
            return _result(response["result"])
        raise _result(response["exception"])

    def release_later(self, server: ServerRef, key: str, holder: str) -> None:
        """Queue one release of ``key``; a callback on the loop sends the queue (one message per server)."""
        self._releases.put((server, holder, key))
        if self._flush_queued:
            return
        self._flush_queued = True
        try:
            self.loop.add_callback(self._flush)
        except Exception:  # the loop is closed: the servers are going away too
            pass

    async def _flush(self) -> None:
        self._flush_queued = False  # before draining: a release queued from now on schedules another flush
        by_server: dict[ServerRef, dict[str, list[str]]] = {}
        while True:
            try:
                server, holder, key = self._releases.get_nowait()
            except queue.Empty:
                break
            by_server.setdefault(server, {}).setdefault(holder, []).append(key)
        client = self.client
        if self._client is not None and (client is None or client.status != "running"):
            return  # the client went, and the scheduler released its servers with it
        sends = [self.send(s, [("release", (keys, h)) for h, keys in per.items()]) for s, per in by_server.items()]
        await asyncio.gather(*sends, return_exceptions=True)


async def _each(transport: Any, batches: dict[ServerRef, Ops], timeout: float) -> dict[ServerRef, Any]:
    async def one(server: ServerRef) -> Any:
        try:
            return await asyncio.wait_for(transport.send(server, batches[server]), timeout)
        except asyncio.TimeoutError:
            return TimeoutError(f"parameter server {server.label} did not answer within {timeout}s")
        except Exception as exc:
            return exc

    servers = list(batches)
    return dict(zip(servers, await asyncio.gather(*(one(s) for s in servers))))


_LOCAL = LocalTransport()
_CLIENT_TRANSPORTS: weakref.WeakKeyDictionary[Any, _DaskTransport] = weakref.WeakKeyDictionary()


def transport_here(owner: Any = None) -> _DaskTransport:
    """The Dask transport of this process: the worker's inside a task, else ``owner``'s client's."""
    try:
        worker = get_worker()
    except ValueError:
        worker = None
    if worker is not None:
        cached = getattr(worker, "_daskps_transport", None)
        if cached is None:
            cached = worker._daskps_transport = _DaskTransport(worker.loop, worker.rpc)  # type: ignore[attr-defined]
        return cached
    client = getattr(owner, "client", None) or default_client()
    transport = _CLIENT_TRANSPORTS.get(client)
    if transport is None or transport.pool is not client.rpc:
        transport = _CLIENT_TRANSPORTS[client] = _DaskTransport(client.loop, client.rpc, client)
    return transport


def sender_for(server: ServerRef, owner: Any = None) -> Any:
    """What later releases of ``server``'s objects go through, from this process."""
    return _LOCAL if server.is_local else transport_here(owner)


def _owner(targets: Iterable[Any]) -> Any:
    """The first owner among ``targets``, after checking that none is closed."""
    found = None
    for t in targets:
        owner = t.owner
        if owner is not None:
            if owner.closed:
                owner.check_open(t.name)
            found = found or owner
    return found


def _run(calls: Sequence[tuple[ServerRef, str, tuple]], owner: Any = None, flush: bool = False) -> list:
    """Run ``(server, operation, args)`` calls: one message per server, all at once; results in order.

    Pushes held back by a pipeline for these servers (for every server, with
    ``flush``) go first in their messages.
    """
    if MOVED:
        calls = [(current(s), op, args) for s, op, args in calls]
    if _HOLDS:
        _wait_for_holds({s for s, _, _ in calls})
    pipe = pipeline.current()
    held = {}
    if pipe is not None and pipe.pending:
        held = pipe.take(list(pipe.pending) if flush else {s for s, _, _ in calls})
    # Held pushes run each on its own ("isolate"): one the server refuses fails only its function.
    batches: dict[ServerRef, Ops] = {s: [("isolate", (len(ops),)), *ops] for s, ops in held.items()}
    where = []
    for server, op, args in calls:
        ops = batches.setdefault(server, [])
        where.append((server, len(ops)))
        ops.append((op, args))
    local = batches.pop(LOCAL, None)
    answers: dict = {}
    try:
        results = _over_channels({s: ops for s, ops in batches.items() if s.channel}, owner, answers)
        rest = {s: ops for s, ops in batches.items() if not s.channel}
        if rest:
            results.update(transport_here(owner).run(rest))
    except BaseException as exc:
        for server in held:
            got = answers.get(server)
            if isinstance(got, list):  # this server answered
                pipe.acknowledged(server, got[1 : 1 + len(held[server])])  # type: ignore[union-attr]
            else:
                isolated = getattr(got, "daskps_isolated", None)  # how its pushes went, if it said
                pipe.acknowledged(server, isolated, exc if got is None else got)  # type: ignore[union-attr]
        raise
    for server in held:
        pipe.acknowledged(server, results[server][1 : 1 + len(held[server])])  # type: ignore[union-attr]
    if local is not None:
        results[LOCAL] = _LOCAL.run(local)
    return [results[s][i] for s, i in where]


_CHANNELS: dict[str, channel.Channel] = {}


def _over_channels(batches: dict[ServerRef, Ops], owner: Any, answers: dict | None = None) -> dict[ServerRef, list]:
    """Send every batch on its server's channel, then read every answer (so all servers work at once).

    ``answers`` gets each server's results or error, also when one of them is raised.
    """
    if not batches:
        return {}
    if owner is not None:
        _check_client(owner)
    servers = sorted(batches, key=lambda s: s.channel or "")
    chans = [_channel(s.channel) for s in servers if s.channel]
    for ch in chans:
        ch.lock.acquire()
    awaiting: list[channel.Channel] = []  # sent to, answer not read yet
    try:
        results, errors = {}, {}
        for server, ch in zip(servers, chans):
            try:
                ch.send(batches[server], carries_code(batches[server]))
                awaiting.append(ch)
            except OSError as exc:
                errors[server] = _lost(server, owner, exc)
        for server, ch in zip(servers, chans):
            if server in errors:
                continue
            try:
                awaiting.remove(ch)
                results[server] = ch.receive()  # every answer is read, so each channel stays in step
            except OSError as exc:  # the server's own OSError (a full disk, say) is its answer
                errors[server] = exc if getattr(exc, "daskps_from_server", False) else _lost(server, owner, exc)
            except Exception as exc:
                errors[server] = exc
        if answers is not None:
            answers.update(results)
            answers.update(errors)
        if errors:
            raise next(iter(errors.values()))
        return results
    except BaseException:  # interrupted, or a message that would not pack: unread answers would
        for ch in awaiting:  # come back as the answers to later requests
            ch.close()
        raise
    finally:
        for ch in chans:
            ch.lock.release()


def _channel(address: str) -> channel.Channel:
    found = _CHANNELS.get(address)
    if found is None:
        channel.prune(_CHANNELS)  # a new server: a good moment to drop channels to servers gone
        found = _CHANNELS.setdefault(address, channel.Channel(address, connect_timeout()))
    return found


def forget_channels(servers: Sequence[ServerRef]) -> None:
    """Close this process's channels to ``servers`` (their group was released)."""
    for server in servers:
        found = _CHANNELS.pop(server.channel, None) if server.channel else None
        if found is not None:
            with found.lock:
                found.close()


def _check_client(owner: Any) -> None:
    client = getattr(owner, "client", None)
    if client is not None and client.status in ("closing", "closed"):
        raise ClosedError(
            f"the Dask client {client!r} was closed (client.close()); daskps reaches the "
            "parameter servers through it, so make a new client and strategy"
        )


def _lost(server: ServerRef, owner: Any, exc: OSError) -> BaseException:
    """The channel failed: ask through Dask what happened to the server, for an accurate error.

    Briefly (``LOST_PROBE`` seconds): Dask retries a refused connection
    until its connect timeout, and a dead server should be reported at once.
    """
    try:
        reason = transport_here(owner).run_each({server: [("stats", ())]}, LOST_PROBE)[server]
    except Exception:
        reason = None
    if isinstance(reason, PSUnavailableError):
        return reason
    if isinstance(reason, list):  # it answers Dask: only the channel broke
        return _unavailable(server, "dropped its channel", exc, gone=False)
    return _unavailable(server, "cannot be reached: its worker died or is cut off", exc)


# Seconds to wait for Dask's account of a server whose channel failed.
LOST_PROBE = 1.0


def _push(calls: list[tuple[ServerRef, str, tuple]], owner: Any) -> None:
    """Updates: held back in a pipeline if one runs here (and none goes to this process), else sent now."""
    pipe = pipeline.current()
    if pipe is None or pipe.function is None or any(s.is_local for s, _, _ in calls):
        _run(calls, owner)
        return
    for server, op, args in calls:
        pipe.defer(server, op, args)


def flush() -> None:
    """Send every push a pipeline holds back here (one message per server) and wait for them."""
    pipe = pipeline.current()
    if pipe is not None and pipe.pending:
        _run([], flush=True)


def _by_server(targets: Sequence[Any]) -> dict[ServerRef, list[int]]:
    groups: dict[ServerRef, list[int]] = {}
    for i, t in enumerate(targets):
        groups.setdefault(t.server, []).append(i)
    return groups


def _each_server(op: str, targets: list[Any], args_of: Any, extra: Any = None, push: bool = False) -> tuple[dict, list]:
    """One ``op`` per server among ``targets`` (and ``extra``'s), its args from the positions there.

    A ``push`` (an update with no result) may be held back by a pipeline (:mod:`daskps.ps.pipeline`).
    """
    owner = _owner(targets + ([extra] if extra is not None else []))
    groups = _by_server(targets)
    if extra is not None:
        groups.setdefault(extra.server, [])
    calls = [(server, op, args_of(server, idx)) for server, idx in groups.items()]
    if push:
        _push(calls, owner)
        return groups, []
    return groups, _run(calls, owner)


# -- operations -------------------------------------------------------------------------
def read(items: Sequence[tuple[Any, Any]]) -> list:
    """``value[index]`` (the whole value for ``None``) of each ``(target, index)``: one read per server."""
    def args(server: ServerRef, idx: list[int]) -> tuple:
        keys, indices = [items[i][0].key for i in idx], [items[i][1] for i in idx]
        return (keys,) if all(x is None for x in indices) else (keys, [... if x is None else x for x in indices])

    groups, results = _each_server("read", [t for t, _ in items], args)
    out: list[Any] = [None] * len(items)
    for idx, values in zip(groups.values(), results):
        for i, value in zip(idx, values):
            out[i] = value
    return out


def update(items: Sequence[tuple[Any, str, Any]]) -> None:
    """Apply checked ``(target, op, payload)`` updates: one call per server, all at once."""
    _each_server("update", [t for t, _, _ in items],
                 lambda server, idx: ([(items[i][0].key, items[i][1], items[i][2]) for i in idx],), push=True)


@dataclasses.dataclass
class CreateSpec:
    """One variable (or part of one) to create on ``server``."""

    server: ServerRef
    key: str
    name: str
    value: Any = None
    init_fn: Any = None
    shape: tuple | None = None
    dtype: str | None = None
    partition_shape: tuple | None = None
    partition_offset: tuple | None = None


def create(specs: Sequence[CreateSpec], owner: Any = None) -> list:
    """Create every spec, all at once; each result is ``(shape, dtype, sliced)`` or the exception it raised.

    A message holds one create, so one failing initializer does not stop the others.
    """
    if owner is not None:
        owner.check_open("a new variable")
    remote = [s for s in specs if not s.server.is_local]
    results: dict[int, Any] = {}
    if remote:
        transport = transport_here(owner)
        outcome = transport.call(_create_each, transport, remote)
        results.update({id(s): r for s, r in zip(remote, outcome)})
    for s in specs:
        if s.server.is_local:
            try:
                results[id(s)] = _LOCAL.run([("create", _create_args(s))])[0]
            except Exception as exc:
                results[id(s)] = exc
    return [results[id(s)] for s in specs]


def _create_args(s: CreateSpec) -> tuple:
    return (s.key, s.name, s.value, s.init_fn, s.shape, s.dtype, s.partition_shape, s.partition_offset, HOLDER)


async def _create_each(transport: _DaskTransport, specs: list[CreateSpec]) -> list:
    async def one(s: CreateSpec) -> Any:
        return (await transport.send(s.server, [("create", _create_args(s))]))[0]

    return list(await asyncio.gather(*(one(s) for s in specs), return_exceptions=True))


def add_optimizer(servers: Sequence[ServerRef], key: str, transform: Any, lazy_sparse: bool, name: str,
                  owner: Any = None, new: bool = True) -> None:
    """Configure an optimizer on ``servers`` (``new``: as an object this process holds)."""
    holder = HOLDER if new else None
    _run([(s, "add_optimizer", (key, transform, lazy_sparse, name, holder)) for s in servers], owner)


def apply_gradients(opt_key: str, items: Sequence[tuple[Any, str, Any]], counter: Any = None) -> None:
    """Apply checked ``(target, kind, gradient)`` items with optimizer ``opt_key``, one call per server.

    ``counter`` (the optimizer's ``iterations``) is bumped by 1 inside the call to its server.
    """
    def args(server: ServerRef, idx: list[int]) -> tuple:
        bump = counter.key if counter is not None and server == counter.server else None
        return (opt_key, [(items[i][0].key, items[i][1], items[i][2]) for i in idx], bump)

    _each_server("apply_gradients", [t for t, _, _ in items], args, counter, push=True)


def put_blob(server: ServerRef, key: str, blob: bytes, owner: Any = None) -> None:
    _run([(server, "put_blob", (key, blob, HOLDER))], owner)


def get_blob(server: ServerRef, key: str) -> bytes:
    return _run([(server, "get_blob", (key,))])[0]


def acquire(pairs: Sequence[tuple[ServerRef, str]], holder: str, owner: Any = None) -> dict[ServerRef, Any]:
    """Count one more handle of ``holder`` for each ``(server, key)``.

    Each server's acquire succeeds or fails whole; returns ``{server: None or the exception}``.
    """
    calls = _keyed_calls("acquire", pairs, holder)
    gone = {s: _unavailable(s, "was found gone earlier") for s, _, _ in calls if s.actor_key in GONE}
    remote = {s: [(op, args)] for s, op, args in calls if not s.is_local and s not in gone}
    transport = transport_here(owner)
    found = transport.call(_each, transport, remote, 60.0) if remote else {}
    out: dict[ServerRef, Any] = {s: (r if isinstance(r, BaseException) else None) for s, r in found.items()}
    out.update(gone)  # (asking again would wait out Dask's connect retries)
    for s, op, args in calls:
        if s.is_local:
            try:
                _LOCAL.run([(op, args)])
                out[s] = None
            except Exception as exc:
                out[s] = exc
    return out


def release(pairs: Sequence[tuple[ServerRef, str]], owner: Any = None, holder: str = HOLDER) -> None:
    """Count one handle of ``holder`` less for each ``(server, key)``, now."""
    _run(_keyed_calls("release", pairs, holder), owner)


def _keyed_calls(op: str, pairs: Sequence[tuple[ServerRef, str]], holder: str) -> list:
    keys: dict[ServerRef, list[str]] = {}
    for server, key in pairs:
        keys.setdefault(server, []).append(key)
    return [(server, op, (ks, holder)) for server, ks in keys.items()]


def save(path: str, items: Sequence[tuple[Any, tuple]]) -> list[dict]:
    """Each server writes its ``(target, (tensor, offset, [(optimizer_path, opt_key)]))`` pieces to ``path``."""
    _, results = _each_server("save", [t for t, _ in items],
                              lambda server, idx: (path, [(items[i][0].key, *items[i][1]) for i in idx]))
    return [rec for records in results for rec in records]


def restore(path: str, items: Sequence[tuple[Any, dict]]) -> None:
    """Every server reads its ``(target, spec)`` parts; only when all succeeded do they swap them in."""
    targets = [t for t, _ in items]
    owner, servers = _owner(targets), list(_by_server(targets))
    token = uuid.uuid4().hex
    try:
        _each_server("stage_restore", targets, lambda server, idx: (token, path, [(targets[i].key, items[i][1]) for i in idx]))
    except BaseException:
        _run([(s, "abort_restore", (token,)) for s in servers], owner)
        raise
    _run([(s, "commit_restore", (token,)) for s in servers], owner)


def stats(servers: Sequence[ServerRef], owner: Any = None, timeout: float | None = None) -> list:
    """Counters of each server; with ``timeout``, an exception in place of a server that did not answer."""
    if timeout is None:
        return _run([(s, "stats", ()) for s in servers], owner)
    found = transport_here(owner).run_each({s: [("stats", ())] for s in servers if not s.is_local}, timeout)
    return [_LOCAL.run([("stats", ())])[0] if s.is_local else _first(found[s]) for s in servers]


async def forget_place_async(pool: Any, servers: Sequence[ServerRef], address: str, timeout: float = 5.0) -> None:
    """Tell ``servers`` (from inside an event loop) that the worker at ``address`` is gone."""
    await _each(_DaskTransport(None, pool), {s: [("forget_place", (address,))] for s in servers}, timeout)


async def stats_async(pool: Any, servers: Sequence[ServerRef], timeout: float) -> list:
    """:func:`stats` from inside an event loop (the scheduler's dashboard), over ``pool``."""
    found = await _each(_DaskTransport(None, pool), {s: [("stats", ())] for s in servers}, timeout)
    return [_first(found[s]) for s in servers]


def _first(result: Any) -> Any:
    return result if isinstance(result, BaseException) else result[0]
