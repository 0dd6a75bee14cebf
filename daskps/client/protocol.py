"""The parameter-server operations: the only code that builds messages to servers.

Everything daskps does to a parameter server (variables, shards, optimizers,
metrics, checkpoints, datasets, reprs, the dashboard) is a function here.
Each takes *targets* (anything with ``server``, ``key``, ``name`` and
``owner``, as the handles of :mod:`daskps.client.refs`), groups the work by
server, and sends **one message per server, all servers at once**: a list
of typed operations (:mod:`daskps.server.ops`) that the server runs in order.

Routing (where a server is now, holds while one is restored) is
:mod:`daskps.client.routing`'s; getting a message there and its answer back is
:mod:`daskps.client.transport`'s; pushes held back between steps are
:mod:`daskps.client.pipeline`'s. The server of local variables takes the same
path, called directly.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Protocol, cast

import numpy as np

from daskps._core.ckpt_io import RestoreSpec, Written
from daskps._core.transforms import Transform
from daskps.client import pipeline
from daskps.client.group import key_generation
from daskps.client.routing import HOLDER, LOCAL, ROUTES, ServerRef
from daskps.client.transport import CHANNELS, LOCAL_SERVER, Answers, pool_transport, transport_here
from daskps.errors import PartlyAppliedError
from daskps.server import ops
from daskps.server.ops import TableSpec

__all__ = [
    "Call", "Target", "acquire", "add_optimizer", "apply_gradients", "call", "create", "flush", "forget_place_async",
    "get_blob", "put_blob", "read", "reconfigure_optimizer", "release", "remake", "restore", "save", "stats",
    "stats_async", "stats_within", "update",
]

Call = tuple[ServerRef, ops.Op]
Result = object  # what one operation answers: see each operation in daskps.server.ops


class Owner(Protocol):
    """What the servers of a call belong to (a :class:`daskps.client.group.ServerGroup`)."""

    @property
    def closed(self) -> bool: ...

    @property
    def client(self) -> object: ...

    def check_open(self, what: str) -> None: ...


class Target(Protocol):
    """What an operation is about: a handle (see :class:`daskps.client.refs.Ref`)."""

    server: ServerRef
    key: str
    name: str
    owner: Owner | None


def _owner(targets: Iterable[Target | None]) -> Owner | None:
    """The first owner among ``targets``, after checking that none is closed."""
    found = None
    for t in targets:
        if t is not None and t.owner is not None:
            if t.owner.closed:
                t.owner.check_open(t.name)
            found = found or t.owner
    return found


def route(server: ServerRef, known: int | None) -> ServerRef:
    """Where a call to ``server`` goes: the server that replaced it, if any, unless that one is newer than
    the generation ``known`` to the scheduled function running here.

    A function runs against the servers it knew as it began (the coordinator counts its updates as made
    there: lost with a lost server, or kept by its replacement). Where several trainers share a process
    (thread workers) one of them may learn of a re-created server while another's function runs; that
    function keeps to the old server, and fails and runs again if it was lost.
    """
    new = ROUTES.current(server)
    if new is server or known is None or key_generation(new.actor_key) <= known:
        return new
    return server


def _send(calls: Sequence[Call], owner: Owner | None, held: dict[ServerRef, list[ops.Op]]) -> list[Result]:
    """One message per server: its ``held`` pushes first, then its calls; results of ``calls`` in order."""
    if ROUTES.moved:
        pipe = pipeline.current()
        calls = [(route(s, None if pipe is None else pipe.generation), op) for s, op in calls]
    if ROUTES.holds:
        ROUTES.wait_for_holds({s for s, _ in calls})
    batches = dict(held)
    where = []
    for server, op in calls:
        message = batches.setdefault(server, [])
        where.append((server, len(message)))
        message.append(op)
    local = batches.pop(LOCAL, None)
    answers: Answers = {}
    try:
        results = CHANNELS.run({s: m for s, m in batches.items() if s.channel}, owner, answers)
        rest = {s: m for s, m in batches.items() if not s.channel}
        if rest:
            results.update(transport_here(owner).run(rest, answers))
    except BaseException as exc:
        pipe = pipeline.current()
        if held and pipe is not None:
            pipe.acknowledge(answers, exc)
        if isinstance(exc, PartlyAppliedError):
            raise exc.error from None
        raise
    if held:
        pipeline.current().acknowledge(results)  # type: ignore[union-attr]
    if local is not None:
        results[LOCAL] = LOCAL_SERVER.run(local)
    return [results[s][i] for s, i in where]


def call(calls: Sequence[Call], owner: Owner | None = None) -> list[Result]:
    """Run ``(server, operation)`` calls: one message per server, all at once; their results in order.

    Pushes a pipeline holds back for these servers go first in their messages.
    """
    pipe = pipeline.current()
    held = pipe.take({s for s, _ in calls}) if pipe is not None and pipe.pending else {}
    return _send(calls, owner, held)


def _push(calls: list[Call], owner: Owner | None, merge: bool = False) -> None:
    """Updates: held back in a pipeline if one runs here (and none goes to this process), else sent now.

    ``merge``: gradients whose sum may replace them (see :meth:`pipeline.Pipeline.defer`).
    """
    pipe = pipeline.current()
    if pipe is None or pipe.function is None or any(s.is_local for s, _ in calls):
        call(calls, owner)
        return
    for server, op in calls:
        pipe.defer(server, op, merge)


def flush() -> None:
    """Send every push a pipeline holds back here (one message per server) and wait for them."""
    pipe = pipeline.current()
    if pipe is not None and pipe.pending:
        _send([], None, pipe.take(list(pipe.pending)))


def _by_server(targets: Sequence[Target], extra: Target | None = None) -> dict[ServerRef, list[int]]:
    """Positions of ``targets`` by server (``extra``'s server too, with none)."""
    groups: dict[ServerRef, list[int]] = {}
    for i, t in enumerate(targets):
        groups.setdefault(t.server, []).append(i)
    if extra is not None:
        groups.setdefault(extra.server, [])
    return groups


# -- operations -------------------------------------------------------------------------
def read(items: Sequence[tuple[Target, ops.Index | None]]) -> list[np.ndarray]:
    """``value[index]`` (the whole value for ``None``) of each ``(target, index)``: one read per server.

    Inside a function scheduled with bounded staleness, whole values this
    trainer read recently enough in the same batch come from ``pipeline.current().reads``.
    """
    pipe = pipeline.current()
    if pipe is not None and pipe.staleness:
        return _read_stale(items, pipe.reads, pipe.staleness)
    return _read(items)


def _read_stale(items: Sequence[tuple[Target, ops.Index | None]], cache: pipeline.StaleReads,
                staleness: int) -> list[np.ndarray]:
    out: list[np.ndarray | None] = [None if index is not None else cache.get(t.key, staleness) for t, index in items]
    missing = [i for i, value in enumerate(out) if value is None]
    if missing:
        for i, value in zip(missing, _read([items[i] for i in missing])):
            out[i] = value
            if items[i][1] is None:
                cache.keep(items[i][0].key, value)
    return cast(list[np.ndarray], out)


def _read(items: Sequence[tuple[Target, ops.Index | None]]) -> list[np.ndarray]:
    targets = [t for t, _ in items]
    groups = _by_server(targets)
    calls: list[Call] = []
    for server, idx in groups.items():
        keys, indices = [items[i][0].key for i in idx], [items[i][1] for i in idx]
        whole = all(x is None for x in indices)
        calls.append((server, ops.Read(keys) if whole else ops.Read(keys, [... if x is None else x for x in indices])))
    out: list[np.ndarray] = [None] * len(items)  # type: ignore[list-item]  # each filled below
    for idx, values in zip(groups.values(), cast(list[list[np.ndarray]], call(calls, _owner(targets)))):
        for i, value in zip(idx, values):
            out[i] = value
    return out


def table_command(items: Sequence[tuple[Target, str]]) -> list[np.ndarray]:
    """Each ``(target, command)``'s answer (see :class:`ops.TableCommand`): one message per server."""
    targets = [t for t, _ in items]
    calls: list[Call] = []
    where: list[int] = []
    for server, idx in _by_server(targets).items():
        for i in idx:  # a command each: they may differ
            calls.append((server, ops.TableCommand([items[i][0].key], items[i][1])))
            where.append(i)
    out: list[np.ndarray] = [None] * len(items)  # type: ignore[list-item]  # each filled below
    for i, (value,) in zip(where, cast(list[list[np.ndarray]], call(calls, _owner(targets)))):
        out[i] = value
    return out


def update(items: Sequence[tuple[Target, str, ops.Payload]]) -> None:
    """Apply checked ``(target, op, payload)`` updates: one call per server, all at once."""
    targets = [t for t, _, _ in items]
    pipe = pipeline.current()
    if pipe is not None and pipe.reads.values:
        pipe.reads.forget(t.key for t in targets)  # this trainer's own updates are seen at once
    calls: list[Call] = [(server, ops.Update([(items[i][0].key, items[i][1], items[i][2]) for i in idx]))
                         for server, idx in _by_server(targets).items()]
    _push(calls, _owner(targets))


def apply_gradients(opt_key: str, items: Sequence[tuple[Target, str, ops.Payload]],
                    counter: Target | None = None, additive: bool = False) -> None:
    """Apply checked ``(target, kind, gradient)`` items with optimizer ``opt_key``, one call per server.

    ``counter`` (the optimizer's ``iterations``) is bumped by 1 inside the call to its server.
    ``additive``: the optimizer's steps add up (:func:`daskps._core.transforms.additive`), so a
    pipeline under bounded staleness may merge these pushes with held ones.
    """
    targets = [t for t, _, _ in items]
    calls: list[Call] = []
    for server, idx in _by_server(targets, counter).items():
        bump = counter.key if counter is not None and server == counter.server else None
        calls.append((server, ops.ApplyGradients(opt_key, [(items[i][0].key, items[i][1], items[i][2]) for i in idx],
                                                 bump)))
    _push(calls, _owner([*targets, counter]), merge=additive)


def create(made: Sequence[tuple[ServerRef, ops.Create]], owner: Owner | None = None) -> list[ops.Created | Exception]:
    """Make each table, all at once; each result is a :class:`ops.Created` or the exception it raised.

    A message holds one create, so one failing initializer does not stop the others.
    """
    if owner is not None:
        owner.check_open("a new variable")
    out: list[ops.Created | Exception] = [None] * len(made)  # type: ignore[list-item]  # each filled below
    remote = [i for i, (s, _) in enumerate(made) if not s.is_local]
    if remote:
        answers = transport_here(owner).run_apart([(made[i][0], [made[i][1]]) for i in remote])
        for i, answer in zip(remote, answers):
            out[i] = cast(ops.Created | Exception, _first(answer))
    for i, (s, op) in enumerate(made):
        if s.is_local:
            try:
                out[i] = cast(ops.Created, LOCAL_SERVER.run([op])[0])
            except Exception as exc:
                out[i] = exc
    return out


def table(server: ServerRef, key: str, name: str, spec: TableSpec) -> tuple[ServerRef, ops.Create]:
    """What :func:`create` takes to make one table held by this process."""
    return server, ops.Create(key, name, spec, HOLDER)


def add_optimizer(servers: Sequence[ServerRef], key: str, transform: Transform, lazy_sparse: bool, name: str,
                  owner: Owner | None = None) -> ops.AddOptimizer:
    """Configure a new optimizer on ``servers``, held by this process; returns the recipe to do it again."""
    op = ops.AddOptimizer(key, transform, bool(lazy_sparse), name, HOLDER)
    call([(s, op) for s in servers], owner)
    return op


def reconfigure_optimizer(servers: Sequence[ServerRef], key: str, transform: Transform, lazy_sparse: bool,
                          name: str, owner: Owner | None = None) -> ops.AddOptimizer:
    """Change the settings of optimizer ``key`` on ``servers`` (its slots are kept); returns the recipe
    to make it anew with them."""
    call([(s, ops.AddOptimizer(key, transform, bool(lazy_sparse), name, None)) for s in servers], owner)
    return ops.AddOptimizer(key, transform, bool(lazy_sparse), name, HOLDER)


def put_blob(server: ServerRef, key: str, blob: bytes, owner: Owner | None = None) -> ops.PutBlob:
    """Keep ``blob`` on ``server``, held by this process; returns the recipe to do it again."""
    op = ops.PutBlob(key, blob, HOLDER)
    call([(server, op)], owner)
    return op


def get_blob(server: ServerRef, key: str) -> bytes:
    return cast(bytes, call([(server, ops.GetBlob(key))])[0])


def remake(server: ServerRef, recipes: Sequence[ops.Op], owner: Owner | None) -> None:
    """Make again on ``server`` (re-created after a loss) the objects of ``recipes``: tables first."""
    tables = [(server, r) for r in recipes if isinstance(r, ops.Create)]
    for result in create(tables, owner):
        if isinstance(result, BaseException):
            raise result
    rest = [(server, r) for r in recipes if not isinstance(r, ops.Create)]
    if rest:
        call(rest, owner)


def acquire(pairs: Sequence[tuple[ServerRef, str]], holder: str,
            owner: Owner | None = None) -> dict[ServerRef, Exception | None]:
    """Count one more handle of ``holder`` for each ``(server, key)``.

    Each server's acquire succeeds or fails whole; returns ``{server: None or the exception}``.
    """
    keys = _keys_by_server(pairs)
    gone = {s: ROUTES.unavailable(s, "was found gone earlier") for s in keys if s.actor_key in ROUTES.gone}
    remote = {s: [ops.Acquire(ks, holder)] for s, ks in keys.items() if not s.is_local and s not in gone}
    found = transport_here(owner).run_each(remote, 60.0) if remote else {}
    out: dict[ServerRef, Exception | None] = {s: (r if isinstance(r, Exception) else None) for s, r in found.items()}
    out.update(gone)  # (asking again would wait out Dask's connect retries)
    for s, ks in keys.items():
        if s.is_local:
            try:
                LOCAL_SERVER.run([ops.Acquire(ks, holder)])
                out[s] = None
            except Exception as exc:
                out[s] = exc
    return out


def release(pairs: Sequence[tuple[ServerRef, str]], owner: Owner | None = None, holder: str = HOLDER) -> None:
    """Count one handle of ``holder`` less for each ``(server, key)``, now."""
    call([(s, ops.Release(ks, holder)) for s, ks in _keys_by_server(pairs).items()], owner)


def _keys_by_server(pairs: Sequence[tuple[ServerRef, str]]) -> dict[ServerRef, list[str]]:
    keys: dict[ServerRef, list[str]] = {}
    for server, key in pairs:
        keys.setdefault(server, []).append(key)
    return keys


def save(path: str, items: Sequence[tuple[Target, str, int, list[tuple[str, str]]]]) -> list[Written]:
    """Each server writes its ``(target, tensor, offset, [(optimizer_path, opt_key)])`` pieces to ``path``."""
    targets = [t for t, *_ in items]
    calls: list[Call] = [(server, ops.Save(path, [ops.SavePiece(items[i][0].key, *items[i][1:]) for i in idx]))
                         for server, idx in _by_server(targets).items()]
    return [rec for records in cast(list[list[Written]], call(calls, _owner(targets))) for rec in records]


def restore(path: str, items: Sequence[tuple[Target, RestoreSpec]]) -> None:
    """Every server reads its ``(target, spec)`` parts; only when all succeeded do they swap them in."""
    targets = [t for t, _ in items]
    owner, groups = _owner(targets), _by_server(targets)
    token = uuid.uuid4().hex
    try:
        call([(s, ops.StageRestore(token, path, [(targets[i].key, items[i][1]) for i in idx]))
              for s, idx in groups.items()], owner)
    except BaseException:
        call([(s, ops.AbortRestore(token)) for s in groups], owner)
        raise
    call([(s, ops.CommitRestore(token)) for s in groups], owner)


def stats(servers: Sequence[ServerRef], owner: Owner | None = None) -> list[ops.ServerStats]:
    """Each server's :class:`ops.ServerStats`."""
    return cast(list[ops.ServerStats], call([(s, ops.Stats()) for s in servers], owner))


def stats_within(servers: Sequence[ServerRef], owner: Owner | None,
                 timeout: float) -> list[ops.ServerStats | Exception]:
    """:func:`stats`, with an exception in place of a server that did not answer within ``timeout`` seconds."""
    found = transport_here(owner).run_each({s: [ops.Stats()] for s in servers if not s.is_local}, timeout)
    return [cast(ops.ServerStats | Exception, LOCAL_SERVER.run([ops.Stats()])[0] if s.is_local else _first(found[s]))
            for s in servers]


async def forget_place_async(pool: object, servers: Sequence[ServerRef], address: str, timeout: float = 5.0) -> None:
    """Tell ``servers`` (from inside an event loop) that the worker at ``address`` is gone."""
    await pool_transport(pool).each({s: [ops.ForgetPlace(address)] for s in servers}, timeout)


async def stats_async(pool: object, servers: Sequence[ServerRef], timeout: float) -> list[ops.ServerStats | Exception]:
    """:func:`stats` from inside an event loop (the scheduler's dashboard), over ``pool``."""
    found = await pool_transport(pool).each({s: [ops.Stats()] for s in servers}, timeout)
    return [cast(ops.ServerStats | Exception, _first(found[s])) for s in servers]


def _first(result: object) -> object:
    """The only operation's result of a message's answer (or the exception it raised)."""
    return result if isinstance(result, BaseException) else cast(list, result)[0]
