"""``ClusterCoordinator``: schedule functions on training workers, asynchronously.

``schedule`` pickles the function's arguments, and the function itself the
first time it is scheduled (as Dask does with functions it submits: what a
function captures is read then, so pass values that change as arguments).
That checks they can travel and refuses variables that live only in this
process. It queues the function and returns a :class:`RemoteValue` at once. A pump on
the client's event loop packs queued functions into batches, each one Dask
task restricted to ``worker``-tagged workers, sized to the backlog (a share
of the queue per trainer, about a fifth of a second of work, at most
``daskps.max-batch``) with one batch in flight per trainer, and a second one
when the backlog is deep, so every trainer stays busy and the last batches
are short. The scheduler sees one task per batch, not per function.

Each function reports as soon as it finishes, through an event (see
:mod:`daskps.trainer.batches`): its RemoteValue is ready then, and a
batch that Dask runs again after its trainer died skips the functions that
already reported. When a batch's task finishes its future is released (its
result, the values too big for an event, is fetched first if it has any),
so nothing finished is ever recomputed.

Errors follow TensorFlow's coordinator: the first error a function raises is
kept and raised once, by whichever of ``join``, ``done`` or ``schedule`` comes
next. When it is raised, every function still pending is cancelled (its
RemoteValue raises :class:`~daskps.errors.CancelledError`; queued ones never
start) and the coordinator is ready for new work. A function may run more
than once if its trainer dies before its result reached the coordinator
(at-least-once, as in TensorFlow), never after.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import functools
import itertools
import pickle
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle
from distributed import Client, as_completed

from daskps._core import views
from daskps._core.arrays import is_int
from daskps._core.pickling import dumps_or_explain, located
from daskps.client import refs
from daskps.client.routing import ROUTES
from daskps.coordinator import recovery
from daskps.coordinator.batching import BatchPolicy
from daskps.coordinator.counts import Counts, RateLimited
from daskps.coordinator.dask_input import dask_dataset
from daskps.coordinator.recovery import RecoveryControl, RecoveryState
from daskps.coordinator.remote import FAILED, PENDING, Outcome, RemoteValue, to_numpy
from daskps.distribute.dask_data import DaskInput
from daskps.distribute.strategy import ParameterServerStrategy
from daskps.errors import CancelledError, PSUnavailableError, RollbackWarning
from daskps.scheduler.messages import BATCH_TOPIC_PREFIX, BIG, ERROR, LOST, FunctionReport, load_error
from daskps.trainer.datasets import PerWorkerDataset
from daskps.trainer.messages import run_batch
from daskps.training.checkpoint_manager import CheckpointManager

__all__ = ["ClusterCoordinator", "RemoteValue"]

# While there is work to dispatch, trainers are counted again this often (seconds).
TRAINERS_REFRESH = 1.0


# How many times one function is run again after losses of parameter servers before its error stands.
MAX_RERUNS = 3


class _Closure:
    """One scheduled function: its pickle, what it keeps alive, what became of it (its RemoteValue's outcome)."""

    __slots__ = ("id", "blob", "kept", "outcome", "reruns", "batch", "generation", "staleness", "trainer")

    def __init__(self, cid: int, blob: tuple[bytes, bytes], kept: list[Any], outcome: Outcome, staleness: int = 0):
        self.id, self.blob, self.kept, self.outcome, self.staleness = cid, blob, kept, outcome, staleness
        self.reruns = 0
        self.batch: str | None = None  # the key of the batch it is in; None while queued
        self.generation = 0  # of the servers its trainer knew as it started (see generation_known)
        self.trainer = ""  # the name of the trainer whose report settled it last ("" before any)


def _checked_staleness(k: Any) -> int:
    if not is_int(k) or k < 0:
        raise ValueError(f"staleness must be a whole number of steps >= 0 (0: none), got {k!r}")
    return int(k)


def _refuse_bad_arguments(structure: Any, arg: str) -> None:
    """One walk over ``args`` or ``kwargs`` (nested lists, tuples and dicts): a ``RemoteValue`` is refused
    (fetch it first), and so is a ``PerWorkerDataset`` (pass ``iter(dataset)``: a dataset does not pickle)."""
    def walk(value: Any, where: str) -> None:
        if isinstance(value, RemoteValue):
            raise ValueError(
                f"{arg} contains a RemoteValue; using the output of one scheduled "
                "function as input of another is not supported: fetch() it first"
            )
        if isinstance(value, PerWorkerDataset):
            raise TypeError(
                f"{where} is a PerWorkerDataset; pass iter(dataset) instead: a scheduled function takes "
                "its iterator, and next(iterator) inside the function gives that trainer's next element"
            )
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
        for key, item in items:
            walk(item, f"{where}[{key!r}]")

    walk(structure, arg)


# Functions are pickled once, at their first schedule (as Dask does with the functions it
# submits): pickling a closure scans sys.modules for every module it uses, per call.
_PICKLED_FUNCTIONS: weakref.WeakKeyDictionary[Any, tuple[bytes, list[Any]]] = weakref.WeakKeyDictionary()


def _pickle(obj: Any, what: str) -> tuple[bytes, list[Any]]:
    """``obj`` pickled, and what it refers to that must stay alive until it has run."""
    with refs.collecting() as kept:
        try:
            return cloudpickle.dumps(obj), kept
        except ValueError:
            raise  # a variable of this process only: its message says what to do
        except Exception:
            if what.startswith("the arguments of "):  # name the argument as the call would: args[1], kwargs['k']
                for label, part in zip(("args", "kwargs"), obj):
                    try:
                        dumps_or_explain(part, label)
                    except TypeError as exc:
                        raise TypeError(f"{exc.args[0]} (in {what})") from exc.__cause__
            dumps_or_explain(obj, what)
            raise


def _pickle_closure(fn: Callable[..., Any], args: tuple, kwargs: dict, name: str) -> tuple[tuple[bytes, bytes], list]:
    """``(pickled fn, pickled (args, kwargs))`` and what must stay alive until the function has run."""
    cached = None
    with contextlib.suppress(TypeError):  # not weak-referenceable: then not cached
        cached = _PICKLED_FUNCTIONS.get(fn)
    if cached is not None:
        fn_blob, fn_kept = cached
    else:  # not seen yet (pickled outside any handler: an error it raises carries no lookup's KeyError)
        fn_blob, fn_kept = _pickle(located(fn), f"the function {name!r}")  # tracebacks name its file
        with contextlib.suppress(TypeError):
            _PICKLED_FUNCTIONS[fn] = (fn_blob, fn_kept)
    if not args and not kwargs:  # the common step without arguments: nothing to pickle
        return (fn_blob, _NO_ARGUMENTS), fn_kept
    args_blob, args_kept = _pickle((args, kwargs), f"the arguments of {name!r}")
    return (fn_blob, args_blob), fn_kept + args_kept


_NO_ARGUMENTS = cloudpickle.dumps(((), {}))


class ClusterCoordinator:
    """Dispatches training functions to workers and tracks their results.

    There is one coordinator per strategy: ``ClusterCoordinator(strategy)``
    called again returns the same object.

    Parameters
    ----------
    strategy : ParameterServerStrategy
    checkpoint_manager : CheckpointManager, optional
        With one, a parameter server lost during training is re-created and
        restored from the manager's latest checkpoint, and the functions that
        failed because of the loss run again: ``join()`` does not raise (see
        :mod:`daskps.coordinator.recovery`; a :class:`~daskps.errors.RollbackWarning`
        says what was rolled back). Given to an existing coordinator (calling
        ``ClusterCoordinator(strategy, checkpoint_manager=...)`` again), it
        replaces the one it had. Without one, the loss raises
        :class:`~daskps.errors.PSUnavailableError`.

    Examples
    --------
    >>> coordinator = dps.ClusterCoordinator(strategy)            # doctest: +SKIP
    >>> with strategy.scope():                                     # doctest: +SKIP
    ...     v = dps.Variable(0.0)
    >>> def step():                                                # doctest: +SKIP
    ...     v.assign_add(1.0)
    >>> for _ in range(10):                                        # doctest: +SKIP
    ...     coordinator.schedule(step)
    >>> coordinator.join()                                         # doctest: +SKIP
    >>> v.numpy()                                                  # doctest: +SKIP
    array(10., dtype=float32)
    """

    def __new__(cls, strategy: ParameterServerStrategy, checkpoint_manager: Any = None, *,
                staleness: int | None = None) -> ClusterCoordinator:
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(f"strategy must be a ParameterServerStrategy, got {type(strategy).__name__}")
        if checkpoint_manager is not None and not isinstance(checkpoint_manager, CheckpointManager):
            raise TypeError(f"checkpoint_manager must be a dps.CheckpointManager or None, "
                            f"got {type(checkpoint_manager).__name__}")
        if strategy.client is None:
            raise RuntimeError("a ClusterCoordinator can only be made on the coordinator, not on a worker")
        strategy.check_open("ClusterCoordinator(strategy)")
        if staleness is not None:
            _checked_staleness(staleness)
        coordinator = strategy.coordinator
        if coordinator is None:
            coordinator = super().__new__(cls)
            coordinator._setup(strategy)
            strategy.adopt_coordinator(coordinator)
            strategy.on_close(coordinator._cancel_all)  # before the servers go
        if checkpoint_manager is not None:
            coordinator._set_manager(checkpoint_manager)
        if staleness is not None:
            coordinator.staleness = staleness
        return coordinator

    def __init__(self, strategy: ParameterServerStrategy, checkpoint_manager: Any = None, *,
                 staleness: int | None = None):
        pass  # all done in __new__ (a second call returns the same coordinator)

    def _set_manager(self, manager: CheckpointManager) -> None:
        self._manager: CheckpointManager | None = manager
        manager.count_finished_with(self._finished_by_generation)

    @property
    def checkpoint_manager(self) -> CheckpointManager | None:
        """The manager lost parameter servers are restored from, if any."""
        return self._manager

    def _setup(self, strategy: ParameterServerStrategy) -> None:
        self._strategy = strategy
        client = strategy.client
        assert client is not None  # checked in __new__
        self._client: Client = client
        self._loop: Any = client.loop
        self._strategy_blob = dumps_or_explain(strategy, "strategy")
        self._cond = threading.Condition()
        self._queue: collections.deque[_Closure] = collections.deque()  # scheduled, not yet in a batch
        self._pending: dict[int, _Closure] = {}  # scheduled, not finished (queued or in a batch)
        self._batches: dict[str, tuple[Any, list[_Closure]]] = {}  # in flight: key -> (future, closures)
        self._error: BaseException | None = None
        self._pump_queued = False
        self._fetching = 0  # threads waiting in RemoteValue.fetch(): wake them on every result
        self._batching = BatchPolicy()  # how many queued functions the next batch takes
        self._ids = itertools.count()
        self._batch_ids = itertools.count()
        self._topic = f"{BATCH_TOPIC_PREFIX}{strategy.token}"
        # The client keeps its handlers: give it one that does not keep this coordinator alive.
        client.subscribe_topic(self._topic, functools.partial(self._deliver, weakref.ref(self)))
        weakref.finalize(self, _unsubscribe, client, self._topic)
        self._counts = Counts()  # in all and per trainer: what summary(), the dashboard and /metrics show
        self.stats = self._counts.totals
        self._publisher = RateLimited(self._loop, self._send_counts)  # to the scheduler, twice a second at most
        # Functions finished, by the generation of servers their trainer knew (see _finished_by_generation).
        self._done_by_generation: collections.Counter[int] = collections.Counter()
        self.last_error: BaseException | None = None
        self._created = time.monotonic()
        self._joined_at = 0  # functions scheduled before the last join() that found nothing pending
        self._trainers = len(strategy.trainer_names)  # live trainers, counted again as work is dispatched
        self._trainers_at = time.monotonic()
        self._manager = None
        self._staleness = 0
        self._recovery = RecoveryControl()  # lost servers: the state, and the functions to run again
        self.recoveries: list[Any] = []  # what each recovery did (daskps.coordinator.recovery.Recovered)

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    @property
    def staleness(self) -> int:
        """The bounded staleness of functions scheduled without their own (0: none, the default).

        With ``k > 0`` a function may read whole values its trainer read up to
        ``k`` of its own steps before, and is reported without waiting for its
        pushes (see the README's "Bounded staleness"); ``join()`` still waits
        for every push.
        """
        return self._staleness

    @staleness.setter
    def staleness(self, k: int) -> None:
        self._staleness = _checked_staleness(k)

    @property
    def recovery_state(self) -> RecoveryState:
        """Whether dispatch goes on, waits for lost servers to be recovered, or halted on a failed recovery."""
        return self._recovery.state

    # -- scheduling ------------------------------------------------------------
    def schedule(self, fn: Callable[..., Any], args: Any = None, kwargs: Any = None, *,
                 staleness: int | None = None) -> RemoteValue:
        """Run ``fn(*args, **kwargs)`` on some training worker; return at once.

        ``staleness`` (default: the coordinator's :attr:`staleness`, 0) lets
        this function read values up to that many of its trainer's steps old
        and report before its pushes are applied.

        Raises
        ------
        TypeError
            If ``fn`` is not callable, ``args``/``kwargs`` have the wrong type,
            or something in them cannot be pickled (the message names it); a
            ``PerWorkerDataset`` argument (pass ``iter(dataset)``).
        ValueError
            If ``args`` or ``kwargs`` contain a :class:`RemoteValue`, or the
            function uses a variable made outside ``strategy.scope()``.
        Exception
            The first error of an earlier scheduled function, if not yet raised.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        args = _checked(args, (list, tuple), "args", "a tuple or list", ())
        kwargs = _checked(kwargs, dict, "kwargs", "a dict", {})
        _refuse_bad_arguments(args, "args")
        _refuse_bad_arguments(kwargs, "kwargs")
        k = self._staleness if staleness is None else _checked_staleness(staleness)
        self._strategy.check_open("coordinator.schedule")
        self._raise_pending_error()
        blob, kept = _pickle_closure(fn, tuple(args), kwargs, getattr(fn, "__name__", type(fn).__name__))
        closure = _Closure(next(self._ids), blob, kept, Outcome(self._wait_for), k)
        with self._cond:
            self._queue.append(closure)
            self._pending[closure.id] = closure
            self._counts.add("scheduled")
            wake = not self._pump_queued
            self._pump_queued = True
        if wake:  # one loop wake-up serves every schedule call made meanwhile
            self._loop.add_callback(self._pump)
        return RemoteValue(closure.outcome)

    def _next_batch(self, trainers: int, in_flight: int) -> list[_Closure]:
        """The next batch (see :mod:`daskps.coordinator.batching`), or none."""
        size = self._batching.next_size(len(self._queue), len(self._pending), trainers, in_flight)
        return [self._queue.popleft() for _ in range(size)]

    def _pump(self) -> None:
        """On the client's event loop: put queued functions into batches while trainers need work."""
        if self._client.status in ("closing", "closed"):
            return  # the script is ending (Ctrl-C, a closed cluster): what is queued stays queued
        trainers = max(1, self._trainers)
        if time.monotonic() - self._trainers_at > TRAINERS_REFRESH and self._queue:
            self._trainers_at = time.monotonic()
            asyncio.ensure_future(self._count_trainers())
        with self._cond:
            self._pump_queued = False
            if not self._recovery.dispatching:
                return  # resumed when the lost server is back; after a failed recovery, join() raises
            batches: list[list[_Closure]] = []
            while self._queue:
                batch = self._next_batch(trainers, len(self._batches) + len(batches))
                if not batch:
                    break
                batches.append(batch)
            for closures in batches:
                key = f"daskps-batch-{next(self._batch_ids)}-{self._strategy.token[:8]}"
                # One bytes object: Dask walks every nested list and tuple of a task's arguments.
                payload = pickle.dumps([(c.id, c.blob, c.staleness) for c in closures], protocol=5)
                future = self._client.submit(
                    run_batch, self._strategy_blob, self._topic, key, payload,
                    key=key, resources={"worker": 1}, pure=False,
                )
                self._batches[key] = (future, closures)
                for c in closures:
                    c.batch = key
                asyncio.ensure_future(self._watch(key, future))
        self._publish()

    def _publish(self) -> None:
        """On the client's event loop: the counts to the scheduler (see :mod:`daskps.coordinator.counts`)."""
        self._publisher.call()

    def _send_counts(self) -> None:
        with self._cond:
            stats = self._counts.snapshot(recoveries=len(self.recoveries), in_flight=len(self._pending))
        asyncio.ensure_future(self._send_stats(stats))

    async def _send_stats(self, stats: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # an older scheduler plugin, or the client closing: nothing lost
            await self._client.scheduler.daskps_coordinator_stats(token=self._strategy.token, stats=stats)

    async def _count_trainers(self) -> None:
        """Ask the scheduler how many trainers there are now (workers come and go); pump if it changed."""
        resolver = self._strategy.cluster_resolver
        resource = resolver.worker_resource if resolver is not None else "worker"
        with contextlib.suppress(Exception):  # an older scheduler plugin, or the client closing: keep the count
            count = await self._client.scheduler.daskps_trainers(resource=resource)
            if count and count != self._trainers:
                self._trainers = count
                self._pump()

    @staticmethod
    def _deliver(coordinator: weakref.ref, event: Any) -> None:
        """A topic's event, for the coordinator if it is still alive (the subscription holds it weakly)."""
        alive = coordinator()
        if alive is not None:
            alive._on_event(event)

    def _on_event(self, event: tuple[float, Any]) -> None:
        """On the client's event loop: functions finished on a trainer."""
        _, (batch_key, finished, *by) = event
        if batch_key == LOST:
            self._on_lost(finished)
            return
        trainer = str(by[0]) if by else ""
        with self._cond:
            reports = [FunctionReport(*row) for row in finished]
            self._batching.observe([r.seconds for r in reports])
            for cid, status, payload, _, generation in reports:
                closure = self._pending.get(cid)
                if closure is None or closure.outcome.state != PENDING or closure.batch != batch_key:
                    continue  # cancelled or queued again meanwhile
                closure.generation = generation
                closure.trainer = trainer
                if status == BIG:
                    continue  # its result comes with the batch
                if status == ERROR:
                    assert payload is not None  # an error always carries itself
                    error = load_error(payload)  # one that cannot be rebuilt here: a RuntimeError with its text
                    if self._run_again(closure, error):
                        self._recovery.lossy.add(batch_key)
                    else:
                        ROUTES.name_what_was_held(error)
                        self._fail(closure, error)
                else:
                    closure.outcome.finish(payload)
                    self._done(closure)
        self._publish()

    def _done(self, closure: _Closure) -> None:
        self._pending.pop(closure.id, None)
        ok = closure.outcome.state != "error"
        self._counts.add("done" if ok else "failed", closure.trainer)
        if ok:
            self._done_by_generation[closure.generation] += 1
        if self._fetching or not self._pending or self._error is not None:
            self._cond.notify_all()  # join() needs waking only when all is done, or on an error

    def _fail(self, closure: _Closure, error: BaseException) -> None:
        closure.outcome.fail(error)
        self.last_error = error
        if self._error is None:
            self._error = error
        self._done(closure)

    async def _watch(self, key: str, future: Any) -> None:
        """A batch's task finished: take its big results, settle the rest, release the future."""
        async for _ in as_completed([future], loop=self._client.loop):  # Dask's own wait, on this loop
            pass
        results, error = {}, None
        with self._cond:  # every function reported (none too big for its event): nothing to fetch
            _, closures = self._batches.get(key, (None, []))
            unsettled = any(c.outcome.state == PENDING and c.id in self._pending for c in closures)
        if future.status == "finished" and unsettled:
            try:
                results = await future
            except Exception as exc:  # its result was lost with its worker
                error = exc
        elif future.status == "error":
            try:
                await future  # raises the task's exception
            except Exception as exc:
                error = exc
        elif future.status == "cancelled":  # not by us (we forget what we cancel): client.restart(), say
            error = CancelledError(f"the Dask task of batch {key!r} was cancelled outside the coordinator "
                                   "(client.restart() or client.cancel()); its functions did not all run")
        future.release()
        with self._cond:
            _, closures = self._batches.pop(key, (None, []))
            failed = any(c.outcome.state == FAILED for c in closures)
            lossy = key in self._recovery.lossy
            self._recovery.lossy.discard(key)
            for c in closures:
                if c.outcome.state != PENDING or c.id not in self._pending or c.batch != key:
                    continue  # settled, or queued again (a lost server)
                if c.id in results:
                    c.outcome.finish(None, results[c.id])
                    self._done(c)
                elif error is not None:
                    if not self._run_again(c, error):
                        self._fail(c, error)
                elif failed:  # not run: an earlier function of its batch failed (the batch stops there)
                    self._pending.pop(c.id, None)
                    self._counts.add("cancelled")
                    c.outcome.cancel()
                    self._cond.notify_all()
                elif lossy:  # not run: an earlier one failed because a parameter server was lost
                    self._requeue(c)
                else:  # never reported, yet the batch ended: say so rather than wait forever
                    self._fail(c, RuntimeError(f"scheduled function {c.id} of batch {key!r} ended without "
                                               "reporting its result"))
        self._pump()

    # -- lost parameter servers --------------------------------------------------------
    def _run_again(self, closure: _Closure, error: BaseException) -> bool:
        """Whether ``closure``, failed with ``error``, is queued again because a parameter server was lost.

        Only with a checkpoint manager; recovery starts unless it is under way
        or the server was replaced already (a handle that had not heard).
        """
        if (self._manager is None or not isinstance(error, PSUnavailableError) or self._strategy.closed
                or closure.reruns >= MAX_RERUNS):
            return False
        closure.reruns += 1
        key = getattr(error, "server_key", None)
        if self._recovery.recovering:
            if key is not None:
                self._recovery.lost_meanwhile.add(key)  # looked at when this recovery ends
        elif key not in ROUTES.moved:
            self._start_recovery()
        self._requeue(closure)
        return True

    def _finished_by_generation(self) -> collections.Counter[int]:
        """How many functions finished, by the generation of re-created servers their trainer knew.

        A checkpoint manager keeps a copy at each save; a recovery tells from
        them how many finished since then on the lost server.
        """
        with self._cond:
            return collections.Counter(self._done_by_generation)

    def _on_lost(self, keys: list[str]) -> None:
        """The scheduler saw the worker of servers ``keys`` leave: recover now, even with nothing running.

        During a recovery, they are looked at again when it ends (a second
        ps killed just after the first may not have looked lost yet).
        """
        with self._cond:
            if self._recovery.recovering:
                self._recovery.lost_meanwhile.update(keys)
            elif self._should_recover(keys):
                self._start_recovery()

    def _should_recover(self, keys: Any) -> bool:
        return (self._manager is not None and not self._strategy.closed and self._client.status == "running"
                and any(k not in ROUTES.moved for k in keys))

    def _start_recovery(self) -> None:
        """Pause dispatch and recover in a thread (under the lock, which the thread needs to finish)."""
        threading.Thread(target=self._recover, name="daskps-recover", daemon=True).start()
        self._recovery.begin()

    def _requeue(self, closure: _Closure) -> None:
        """Queue ``closure`` again, before the functions scheduled after it (under the lock)."""
        self._recovery.requeued()
        # where it failed (one never run, behind a failed one in its batch, has no trainer)
        self._counts.add("rerun", closure.trainer)
        closure.batch, closure.trainer = None, ""
        index = bisect.bisect_left([c.id for c in self._queue], closure.id)
        self._queue.insert(index, closure)

    def _recover(self) -> None:
        """In a thread: re-create the lost servers, restore them, then let dispatch go on."""
        report, error = None, None
        try:
            report = recovery.recover(self._strategy, self._manager, self._finished_by_generation)
            if report is not None:
                self._strategy_blob = dumps_or_explain(self._strategy, "strategy")  # new server addresses
        except BaseException as exc:  # no worker came, or the checkpoint does not restore: raised by join()
            error = exc
        try:
            if report is not None:  # before join() can return: a caller catching warnings around it sees it
                with self._cond:
                    rerun = self._recovery.rerun
                warnings.warn(report.describe(rerun), RollbackWarning, stacklevel=1)
        finally:  # even where warnings are errors (they would end this thread, not reach the user)
            self._finish_recovery(report, error)

    def _finish_recovery(self, report: Any, error: BaseException | None) -> None:
        """Record the recovery, let join() return (or raise ``error``), and dispatch what waited."""
        with self._cond:
            lost = self._recovery.end(failed=error is not None)
            if report is not None:
                self.recoveries.append(report)
            if error is not None:  # what is queued waits for join() to raise it (and cancel them)
                self.last_error = error
                self._error = self._error or error
            elif self._should_recover(lost):  # servers seen leaving meanwhile that this one did not replace
                self._start_recovery()
            pump = error is None and not self._recovery.recovering
            self._cond.notify_all()
        if pump:
            with contextlib.suppress(Exception):  # the client is closing: nothing to dispatch
                self._loop.add_callback(self._pump)

    # -- errors and waiting ----------------------------------------------------------
    def _raise_pending_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is None:
            return
        self._cancel_all()
        raise error

    def _cancel_all(self) -> int:
        """Cancel every pending function (return how many): queued ones never start; a running batch stops
        after its current one.

        A function already running may finish; what it refers to is no longer
        kept alive for it, so objects the user has dropped may vanish under it.
        Its result is discarded either way.
        """
        with self._cond:
            cancelled = list(self._pending.values())
            self._pending.clear()
            self._queue.clear()
            self._recovery.resume()
            futures = [f for f, _ in self._batches.values()]
            self._counts.add("cancelled", n=len(cancelled))
            for c in cancelled:
                c.outcome.cancel()
            self._cond.notify_all()
        if futures and self._client.status == "running":
            self._client.cancel(futures)
        with contextlib.suppress(Exception):  # the loop may be closing
            self._loop.add_callback(self._publish)
        return len(cancelled)

    def _wait_for(self, outcome: Outcome) -> None:
        with self._cond:
            self._fetching += 1
            try:
                while outcome.state == PENDING:
                    self._cond.wait(timeout=1.0)
            finally:
                self._fetching -= 1

    def join(self) -> None:
        """Block until every scheduled function has finished.

        Raises the first error of a scheduled function, once, after cancelling
        the functions still pending. Interrupted (``KeyboardInterrupt``), it
        cancels every pending function before the interrupt goes on (see
        :meth:`cancel`).
        """
        try:
            with self._cond:
                while (self._pending or self._recovery.recovering) and self._error is None:
                    self._cond.wait(timeout=1.0)
                if not self._pending:
                    self._joined_at = self.stats["scheduled"]
        except KeyboardInterrupt:  # Ctrl-C, a notebook's stop button: stop the work too
            self.cancel()
            raise
        self._raise_pending_error()

    def cancel(self) -> int:
        """Cancel every pending function; return how many were pending.

        Queued functions never start; a function already running finishes,
        and the rest of its batch does not start. Their RemoteValues raise
        :class:`~daskps.errors.CancelledError`. The coordinator is ready for
        new work at once. ``join()`` and ``progress()`` call this when
        interrupted (``KeyboardInterrupt``).
        """
        return self._cancel_all()

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a pending error).

        ``False`` while a lost parameter server is being recovered.
        """
        self._raise_pending_error()
        with self._cond:
            return not self._pending and not self._recovery.recovering

    def fetch(self, val: Any) -> Any:
        """Replace RemoteValues and variables in ``val`` by their numpy values.

        ``val`` may be a nested list, tuple or dict; other objects are returned
        unchanged.
        """
        return to_numpy(val)

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any] | DaskInput) -> PerWorkerDataset:
        """Build ``dataset_fn()`` (or ``dataset_fn(input_context)``) on each worker.

        ``dataset_fn`` may also be ``dps.data.from_dask(collection, ...)``:
        each trainer then reads the partitions it holds (see
        :mod:`daskps.trainer.dask_input`), and ``next`` at the end raises
        ``StopIteration`` in the scheduled function.

        Returns a :class:`~daskps.trainer.datasets.PerWorkerDataset`;
        ``iter()`` on it gives a per-worker iterator to pass to scheduled functions.
        """
        if isinstance(dataset_fn, DaskInput):
            self._strategy.check_open("create_per_worker_dataset")
            resolver = self._strategy.cluster_resolver
            assert resolver is not None
            reader, futures = dask_dataset(self._strategy.client, dataset_fn, resolver.training_workers(),
                                           resolver.worker_resource, self._topic)
            return PerWorkerDataset(self, reader, keep=futures, stops=True)
        return PerWorkerDataset(self, dataset_fn)

    def summary(self) -> dict[str, Any]:
        """Counts, throughput and the last error, without waiting on anything."""
        with self._cond:
            in_flight = len(self._pending)
            stats = dict(self.stats)
        elapsed = max(time.monotonic() - self._created, 1e-9)
        return dict(stats, in_flight=in_flight, per_second=stats["done"] / elapsed,
                    since_join=stats["scheduled"] - self._joined_at,
                    last_error=None if self.last_error is None else repr(self.last_error))

    def _repr_html_(self) -> str:
        return views.html(views.CoordinatorView(self.summary()))

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"<ClusterCoordinator scheduled={s['scheduled']} pending={s['in_flight']} "
            f"done={s['done']} failed={s['failed']} cancelled={s['cancelled']}>"
        )


def _unsubscribe(client: Client, topic: str) -> None:
    try:
        client.unsubscribe_topic(topic)
    except Exception:  # the client is closed already
        pass


def _checked(value: Any, kinds: Any, arg: str, expected: str, default: Any) -> Any:
    if value is None:
        return default
    if not isinstance(value, kinds):
        raise TypeError(f"{arg} must be {expected}, got {type(value).__name__}")
    return value
