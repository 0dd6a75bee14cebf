"""A lost parameter server, re-created and restored from the latest checkpoint.

A ``ClusterCoordinator`` given a checkpoint manager calls :func:`recover`
when a scheduled function fails because a parameter server is gone. It:

1. asks every server of the strategy whether it answers; those that do not
   are lost;
2. starts an empty server for each lost one, on its worker once the Nanny
   has restarted it (same worker name), or else on another ps worker;
3. makes there again every object the coordinator holds on the lost server,
   from the recipe kept with its handle: variables and shards (their
   initial value), optimizer settings, stored dataset functions;
4. points every handle at the new server (trainers learn it with their next
   batch, and handles inside functions pickled earlier follow it too);
5. restores, from the manager's latest checkpoint, the variables, shards
   and optimizer slots that lived on the lost server, and only those.

What was on the lost server since that checkpoint is lost: the updates of
the functions that finished after it was saved, for the variables that
lived there (their other variables keep every update). Variables the
checkpoint does not hold start again from their initial value, with fresh
optimizer slots. The coordinator then runs again the functions that failed
or were cancelled because of the loss.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

from distributed import wait

from daskps._core.config import setting
from daskps.client import protocol, refs
from daskps.client.group import key_generation
from daskps.client.routing import ROUTES, ServerRef, connect_timeout, quoted, recovery_timeout
from daskps.distribute.cluster import cluster_workers
from daskps.errors import PSUnavailableError, RollbackWarning
from daskps.scheduler.messages import MoveCleanups, RecordMoves, ask
from daskps.server import ops


class RecoveryState(enum.Enum):
    """Where a coordinator stands with lost parameter servers."""

    DISPATCHING = "dispatching"  # all servers there: queued functions go out
    RECOVERING = "recovering"  # lost servers are being re-created and restored: dispatch waits
    HALTED = "halted"  # a recovery failed: nothing goes out until join() has raised its error


# How many times one function is run again after losses of parameter servers before its error stands.
MAX_RERUNS = 3


class Recovery:
    """A coordinator's lost parameter servers: where it stands with them, and every change of that.

    The coordinator's parts tell it what they see: settling, a function that
    failed because a server was gone (:meth:`run_again`) or a batch stopped by
    one (:meth:`stopped_batch`); the scheduler, a server's worker leaving
    (:meth:`on_lost`); ``join``, that everything pending was cancelled
    (:meth:`resume`). It decides: whether to recover (only with a checkpoint
    manager), when dispatch waits (:attr:`dispatching`), what runs again. A
    recovery runs in a thread of its own; once the servers run at new
    addresses the callbacks given to :meth:`on_moved` run, and at its end
    those given to :meth:`on_recovered` (dispatch goes on). Methods that take no lock
    run under the book's.
    """

    def __init__(self, book: Any, strategy: Any, client: Any) -> None:
        self._book, self._strategy, self._client = book, strategy, client
        self.state = RecoveryState.DISPATCHING
        self.manager: Any = None  # the CheckpointManager lost servers are restored from, if any
        self.lost_meanwhile: set[str] = set()  # servers seen leaving while a recovery ran: looked at at its end
        self._lossy: set[str] = set()  # batches stopped by a lost server: their unrun functions run again
        self.rerun = 0  # functions run again since the current recovery began
        self._moved: list[Callable[[], None]] = []
        self._recovered: list[Callable[[], None]] = []

    @property
    def recovering(self) -> bool:
        return self.state is RecoveryState.RECOVERING

    @property
    def dispatching(self) -> bool:
        return self.state is RecoveryState.DISPATCHING

    def on_moved(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` in the recovery's thread once lost servers run at new addresses, before the
        recovery ends (an error it raises fails the recovery, as a restore that fails does)."""
        self._moved.append(callback)

    def on_recovered(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (no lock held) when a recovery has brought every server back."""
        self._recovered.append(callback)

    def run_again(self, closure: Any, error: BaseException) -> bool:
        """Whether ``closure``, failed with ``error``, is queued again because a parameter server was lost.

        Only with a checkpoint manager, at most ``MAX_RERUNS`` times; recovery
        starts unless it is under way or the server was replaced already (a
        handle that had not heard).
        """
        if (self.manager is None or not isinstance(error, PSUnavailableError) or self._strategy.closed
                or closure.reruns >= MAX_RERUNS):
            return False
        closure.reruns += 1
        key = getattr(error, "server_key", None)
        if self.recovering:
            if key is not None:
                self.lost_meanwhile.add(key)  # looked at when this recovery ends
        elif key not in ROUTES.moved:
            self._begin()
        self.requeue(closure)
        return True

    def requeue(self, closure: Any) -> None:
        """Queue ``closure`` again (counted while a recovery runs)."""
        if self.recovering:
            self.rerun += 1
        self._book.requeue(closure)

    def stopped_batch(self, key: str) -> None:
        """Batch ``key`` stopped at a function that failed because a server was lost: the rest run again."""
        self._lossy.add(key)

    def batch_ended(self, key: str) -> bool:
        """Batch ``key`` ended: whether a lost server stopped it (its functions not run then run again)."""
        lossy = key in self._lossy
        self._lossy.discard(key)
        return lossy

    def on_lost(self, keys: list[str]) -> None:
        """The scheduler saw the worker of servers ``keys`` leave: recover now, even with nothing running.

        During a recovery, they are looked at again when it ends (a second
        ps killed just after the first may not have looked lost yet). Takes the lock.
        """
        with self._book.lock:
            if self.recovering:
                self.lost_meanwhile.update(keys)
            elif self._should_recover(keys):
                self._begin()

    def resume(self) -> None:
        """Everything pending was cancelled (the failed recovery's error raised): dispatch may go on."""
        if self.state is RecoveryState.HALTED:
            self.state = RecoveryState.DISPATCHING

    def _should_recover(self, keys: Any) -> bool:
        return (self.manager is not None and not self._strategy.closed and self._client.status == "running"
                and any(k not in ROUTES.moved for k in keys))

    def _begin(self) -> None:
        """Pause dispatch and recover in a thread (under the lock, which the thread needs to finish)."""
        threading.Thread(target=self._recover, name="daskps-recover", daemon=True).start()
        self.state, self.rerun = RecoveryState.RECOVERING, 0

    def _recover(self) -> None:
        """In a thread: re-create the lost servers, restore them, then let dispatch go on."""
        report, error = None, None
        try:
            report = recover(self._strategy, self.manager, self._book.finished_by_generation)
            if report is not None:
                for callback in self._moved:
                    callback()
        except BaseException as exc:  # no worker came, or the checkpoint does not restore: raised by join()
            error = exc
        try:
            if report is not None:  # before join() can return: a caller catching warnings around it sees it
                with self._book.lock:
                    rerun = self.rerun
                warnings.warn(report.describe(rerun), RollbackWarning, stacklevel=1)
        finally:  # even where warnings are errors (they would end this thread, not reach the user)
            self.end(report, error)

    def end(self, report: Recovered | None, error: BaseException | None) -> None:
        """Record the recovery, let join() return (or raise ``error``), and dispatch what waited."""
        with self._book.lock:
            lost, self.lost_meanwhile = self.lost_meanwhile, set()
            self.state = RecoveryState.HALTED if error is not None else RecoveryState.DISPATCHING
            if report is not None:
                self._book.recoveries.append(report)
            if error is not None:  # what is queued waits for join() to raise it (and cancel them)
                self._book.record_error(error)
            elif self._should_recover(lost):  # servers seen leaving meanwhile that this one did not replace
                self._begin()
            back = error is None and not self.recovering
            self._book.lock.notify_all()
        if back:
            for callback in self._recovered:
                callback()


@dataclasses.dataclass
class Recovered:
    """What one recovery did, for the warning it gives."""

    servers: list[tuple[ServerRef, ServerRef]]  # (lost, new)
    checkpoint: str | None
    rolled_back: list[str]  # tensors restored from the checkpoint
    reset: list[str]  # variables the checkpoint lacks: back to their initial value
    functions_since: int | None  # finished after the checkpoint was saved, on the lost servers (None: unknown)
    seconds: float = 0.0  # from noticing the loss to the servers restored

    def describe(self, rerun: int) -> str:
        where = "; ".join(f"ps:{old.task_id} (was at {old.address}) now runs at {new.address}"
                          for old, new in self.servers)
        text = f"daskps: lost parameter server re-created in {self.seconds:.1f}s: {where}."
        if self.checkpoint is None:
            text += " No checkpoint had been saved yet."
        else:
            since = ("an unknown number of scheduled functions (it was not saved by this coordinator)"
                     if self.functions_since is None else f"{self.functions_since} scheduled function(s)")
            text += (f" Rolled back to checkpoint {self.checkpoint}: {_names(self.rolled_back)}; every update "
                     f"made to them after it is lost ({since} that reached the lost server finished since it "
                     "was saved).")
        if self.reset:
            text += f" Back to their initial value (in no checkpoint): {_names(self.reset)}."
        text += f" {rerun} function(s) that failed or were cancelled by the loss run again."
        return text


def _names(names: list[str]) -> str:
    return quoted(names, 12) or "nothing"


def lost_servers(group: Any) -> list[ServerRef]:
    """The servers of ``group`` that are gone: their worker left the scheduler, or they say so.

    A server whose worker is still there but does not answer in time (busy
    writing a large checkpoint, say) is not lost: only an answer that it
    cannot be reached or its actor is gone counts.
    """
    live = set(cluster_workers(group.client))
    servers = list(group.servers)
    gone = [s for s in servers if s.address not in live]
    rest = [s for s in servers if s.address in live]
    answers = protocol.stats_within(rest, group, connect_timeout())
    return gone + [s for s, a in zip(rest, answers) if isinstance(a, PSUnavailableError)]


def recover(strategy: Any, manager: Any, done: Callable[[], Counter[int]]) -> Recovered | None:
    """Re-create and restore the lost servers of ``strategy`` (``None`` if none was lost).

    ``done()`` counts the functions the coordinator has finished, by the
    generation of servers their trainer knew as they started
    (:func:`~daskps.client.group.generation_known`); the manager kept the same
    count at each save. Those that reached the lost servers (not their
    replacements) and finished after the save are the ones whose updates
    are lost. It is asked at the end, when the reports of functions that
    finished before the loss have all come in. Raises
    :class:`~daskps.errors.PSUnavailableError` if no ps worker takes a lost
    server's place in time (config ``daskps.recovery-timeout``), or the
    checkpoint cannot be restored.
    """
    started = time.monotonic()
    group = strategy.group
    lost = lost_servers(group)
    if not lost:
        return None
    deadline = time.monotonic() + recovery_timeout()
    pairs = []
    for old in lost:
        assert old.task_id is not None
        host = _host(strategy, group, old, deadline)
        pairs.append(group.replace(old.task_id, host, max(30.0, deadline - time.monotonic()),
                                   functools.partial(_move_cleanups, group.client)))
    made = [_remake(group, old, new) for old, new in pairs]
    news = [new for _, new in pairs]
    ROUTES.hold(news)  # calls from other threads here wait until the new servers are restored
    try:
        ROUTES.move({old.actor_key: new for old, new in pairs})
        variables = {r.key: r.name for keys in made for r in keys}
        latest = manager.latest_checkpoint
        rolled_back: list[str] = []
        if latest is not None:
            try:
                with ROUTES.past_holds():
                    manifest = manager.checkpoint.restore_on(latest, servers=set(news))
            except Exception as exc:
                raise PSUnavailableError(
                    f"parameter server(s) {', '.join(f'ps:{o.task_id}' for o, _ in pairs)} were lost and "
                    f"re-created, but restoring them from {latest} failed ({type(exc).__name__}: {exc}); "
                    "their variables hold their initial values"
                ) from exc
            restored = manifest["restored"]
            rolled_back = sorted(restored)
            for keys in restored.values():
                for key in keys:
                    variables.pop(key, None)
        # Only now do trainers learn the new routes: batches as they start, and every worker at once.
        group.client.run_on_scheduler(ask, RecordMoves({old.actor_key: tuple(new) for old, new in pairs}))
        _tell_workers(group.client, dict(ROUTES.moved))
    finally:
        ROUTES.release_holds(news)
    at_save = manager.finished_at(latest) if latest is not None else None
    return Recovered(pairs, latest, rolled_back, sorted(set(variables.values())),
                     None if at_save is None else _finished_on(pairs, done(), at_save), time.monotonic() - started)


def _finished_on(pairs: list[tuple[ServerRef, ServerRef]], now: Counter[int], at_save: Counter[int]) -> int:
    """How many functions that reached the lost servers of ``pairs`` finished after the save."""
    low = min(key_generation(old.actor_key) for old, _ in pairs)  # knew of the oldest lost one
    high = min(key_generation(new.actor_key) for _, new in pairs)  # did not know of its replacement yet
    return sum(now[g] - at_save[g] for g in range(low, high))


def _host(strategy: Any, group: Any, old: ServerRef, deadline: float) -> tuple[str, str]:
    """(name, address) of the ps worker to host the new server: the lost one's restarted, else another.

    Its own worker, restarted by its Nanny, is waited for a few seconds
    (config ``daskps.recovery-same-worker-wait``); then any other live ps
    worker will do, the one holding fewest of this strategy's servers first.
    """
    resource = strategy.cluster_resolver.ps_resource
    name = str(group.worker_names[old.task_id])
    prefer_until = time.monotonic() + setting("recovery_same_worker_wait")
    while True:
        workers = [(str(info.get("name", addr)), addr) for addr, info in cluster_workers(strategy.client).items()
                   if info.get("resources", {}).get(resource, 0) > 0 and addr != old.address]
        same = [w for w in workers if w[0] == name]
        if same:
            return same[0]
        if workers and time.monotonic() >= prefer_until:
            busy = [s.address for s in group.servers]
            return min(workers, key=lambda w: (busy.count(w[1]), w[0]))
        if time.monotonic() >= deadline:
            raise PSUnavailableError(
                f"parameter server ps:{old.task_id} was lost and no worker with resource {resource!r} "
                f"came to take its place within daskps.recovery-timeout; start one "
                f"(`dask worker ADDRESS --resources {resource}=1`) and train again"
            )
        time.sleep(0.1)


# Seconds the recovery waits for every worker to point its handles at the new servers.
FOLLOW_WAIT = 2.0


def _tell_workers(client: Any, moves: dict[str, ServerRef]) -> None:
    """Have every worker point its handles at the new servers now, not with its next batch.

    Until a trainer has counted the handles it keeps (a cache) on the new
    server, that server counts only the coordinator's: one the coordinator
    dropped meanwhile would go while the trainer still holds it. One task
    per worker, in its thread like a batch; a worker too busy to answer in
    time follows with its next batch.
    """
    token = uuid.uuid4().hex[:8]
    futures = [client.submit(refs.follow, moves, workers=[address], allow_other_workers=False, pure=False,
                             key=f"daskps-follow-{token}-{i}")
               for i, address in enumerate(cluster_workers(client))]
    try:
        wait(futures, timeout=FOLLOW_WAIT)
    except Exception:
        pass
    finally:
        for future in futures:
            future.release()


def _move_cleanups(client: Any, old: ServerRef, new: ServerRef) -> None:
    """What the scheduler was to do once ``old`` went (have trainers forget datasets) waits for ``new``."""
    client.run_on_scheduler(ask, MoveCleanups(old.actor_key, new.actor_key))


def _remake(group: Any, old: ServerRef, new: ServerRef) -> list[Any]:
    """Make on ``new`` every object this process holds on ``old``; return the variables' handles."""
    held = [r for r in ROUTES.on(old) if r.recipe is not None]
    try:
        protocol.remake(new, [r.recipe for r in held], group)
    except PSUnavailableError:
        raise
    except Exception as exc:
        raise PSUnavailableError(f"parameter server ps:{old.task_id} was lost, and making its variables "
                                 f"again failed: {type(exc).__name__}: {exc}") from exc
    return [r for r in held if isinstance(r.recipe, ops.Create)]
