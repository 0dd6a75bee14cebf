"""``ClusterCoordinator``: schedule functions on training workers, asynchronously.

``schedule`` pickles the function's arguments, and the function itself the
first time it is scheduled (as Dask does with functions it submits: what a
function captures is read then, so pass values that change as arguments).
That checks they can travel and refuses variables that live only in this
process. It queues the function and returns a :class:`RemoteValue` at once.

The coordinator is four parts around one book of what is scheduled
(:mod:`daskps.coordinator.book`, one lock): this class, the API and the
queue; dispatch (:mod:`~daskps.coordinator.dispatch`: batches, each one Dask
task on a trainer); settling (:mod:`~daskps.coordinator.settling`: each
function's report, each batch's end); and recovery
(:mod:`~daskps.coordinator.recovery`: lost parameter servers).

Errors follow TensorFlow's coordinator: the first error a function raises is
kept and raised once, by whichever of ``join``, ``done`` or ``schedule`` comes
next. When it is raised, every function still pending is cancelled (its
RemoteValue raises :class:`~daskps.errors.CancelledError`; queued ones never
start) and the coordinator is ready for new work. A function may run more
than once if its trainer dies before its result reached the coordinator
(at-least-once, as in TensorFlow), never after.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from distributed import Client

from daskps._core import views
from daskps.coordinator.batching import BatchPolicy
from daskps.coordinator.book import Book
from daskps.coordinator.closures import checked, checked_staleness, pickle_closure, refuse_bad_arguments
from daskps.coordinator.counts import Publisher
from daskps.coordinator.dask_input import dask_dataset
from daskps.coordinator.dispatch import Dispatcher
from daskps.coordinator.recovery import Recovery, RecoveryState
from daskps.coordinator.remote import RemoteValue, to_numpy
from daskps.coordinator.settling import Settler
from daskps.distribute.dask_data import DaskInput
from daskps.distribute.strategy import ParameterServerStrategy
from daskps.scheduler.messages import BATCH_TOPIC_PREFIX
from daskps.trainer.datasets import PerWorkerDataset
from daskps.training.checkpoint_manager import CheckpointManager

__all__ = ["ClusterCoordinator", "RemoteValue"]


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
            checked_staleness(staleness)
        existing = strategy.coordinator  # one per strategy: __init__ finds it set up
        return existing if existing is not None else super().__new__(cls)

    def __init__(self, strategy: ParameterServerStrategy, checkpoint_manager: Any = None, *,
                 staleness: int | None = None):
        if strategy.coordinator is not self:  # new: set up (__new__ returned the strategy's own otherwise)
            self._setup(strategy)
        if checkpoint_manager is not None:
            self._recovery.manager = checkpoint_manager
            checkpoint_manager.count_finished_with(self._book.finished_by_generation)
        if staleness is not None:
            self.staleness = staleness

    def _setup(self, strategy: ParameterServerStrategy) -> None:
        client = strategy.client
        assert client is not None  # checked in __new__
        self._strategy, self._client = strategy, client
        self._loop: Any = client.loop
        self._topic = f"{BATCH_TOPIC_PREFIX}{strategy.token}"
        self._book = book = Book()
        self._recovery = Recovery(book, strategy, client)
        self._publisher = Publisher(book, client, strategy.token)
        policy = BatchPolicy()  # settling measures how long functions take; dispatch sizes batches by it
        self._settler = Settler(book, self._recovery, policy, self._publisher, client)
        self._dispatch = Dispatcher(book, strategy, client, self._topic, self._recovery, self._settler, policy,
                                    self._publisher)
        # The client keeps its handlers: give it one that does not keep the settler (and this) alive.
        client.subscribe_topic(self._topic, functools.partial(Settler.deliver, weakref.ref(self._settler)))
        weakref.finalize(self, _unsubscribe, client, self._topic)
        self.stats = book.counts.totals
        self.recoveries = book.recoveries  # what each recovery did (daskps.coordinator.recovery.Recovered)
        self._created = time.monotonic()
        self._joined_at = 0  # functions scheduled before the last join() that found nothing pending
        self._staleness = 0
        strategy.adopt_coordinator(self)
        strategy.on_close(self._cancel_all)  # before the servers go

    @property
    def checkpoint_manager(self) -> CheckpointManager | None:
        """The manager lost parameter servers are restored from, if any."""
        return self._recovery.manager

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
        self._staleness = checked_staleness(k)

    @property
    def recovery_state(self) -> RecoveryState:
        """Whether dispatch goes on, waits for lost servers to be recovered, or halted on a failed recovery."""
        return self._recovery.state

    @property
    def last_error(self) -> BaseException | None:
        """The latest error a scheduled function failed with for good (kept after it was raised)."""
        return self._book.last_error

    @property
    def trainers(self) -> int:
        """How many trainers the coordinator counts on (asked of the scheduler again while work is queued)."""
        return self._dispatch.trainers

    @property
    def fetching(self) -> int:
        """How many threads are waiting in a ``RemoteValue``'s ``fetch()`` now."""
        return self._book.fetching

    def finished_by_generation(self) -> Any:
        """How many functions finished, by the generation of servers their trainer knew (see the book)."""
        return self._book.finished_by_generation()

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
        args = checked(args, (list, tuple), "args", "a tuple or list", ())
        kwargs = checked(kwargs, dict, "kwargs", "a dict", {})
        refuse_bad_arguments(args, "args")
        refuse_bad_arguments(kwargs, "kwargs")
        k = self._staleness if staleness is None else checked_staleness(staleness)
        self._strategy.check_open("coordinator.schedule")
        self._raise_pending_error()
        blob, kept = pickle_closure(fn, tuple(args), kwargs, getattr(fn, "__name__", type(fn).__name__))
        with self._book.lock:
            closure = self._book.add(blob, kept, k)
            self._dispatch.wake()
        return RemoteValue(closure.outcome)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Functions scheduled inside the block wait in the queue, and are dispatched together as it ends.

        Batches are made from what is queued when dispatch looks: held, a
        burst of ``schedule`` calls is batched as one, whatever the timing of
        the calls (without it, the first calls may go out before the later
        ones are made). Blocks may nest; the outermost releases them. While
        any block is open, in any thread, nothing goes out (functions queued
        before it, or run again after a lost server, wait too): do not wait
        for results (``join``, ``fetch``) inside one.

        >>> with coordinator.hold():                                   # doctest: +SKIP
        ...     values = [coordinator.schedule(step) for _ in range(100)]
        """
        self._dispatch.hold()
        try:
            yield
        finally:
            self._dispatch.release()

    # -- errors and waiting ----------------------------------------------------------
    def _raise_pending_error(self) -> None:
        error = self._book.take_error()
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
        with self._book.lock:
            cancelled, futures = self._book.cancel_all()
            self._recovery.resume()
        if futures and self._client.status == "running":
            self._client.cancel(futures)
        with contextlib.suppress(Exception):  # the loop may be closing
            self._loop.add_callback(self._publisher.publish)
        return cancelled

    def join(self) -> None:
        """Block until every scheduled function has finished.

        Raises the first error of a scheduled function, once, after cancelling
        the functions still pending. Interrupted (``KeyboardInterrupt``), it
        cancels every pending function before the interrupt goes on (see
        :meth:`cancel`).
        """
        book = self._book
        try:
            with book.lock:
                while (book.pending or self._recovery.recovering) and book.error is None:
                    book.lock.wait(timeout=1.0)
                if not book.pending:
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
        with self._book.lock:
            return not self._book.pending and not self._recovery.recovering

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
        with self._book.lock:
            in_flight = len(self._book.pending)
            stats = dict(self.stats)
        elapsed = max(time.monotonic() - self._created, 1e-9)
        last_error = self._book.last_error
        return dict(stats, in_flight=in_flight, per_second=stats["done"] / elapsed,
                    since_join=stats["scheduled"] - self._joined_at,
                    last_error=None if last_error is None else repr(last_error))

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
