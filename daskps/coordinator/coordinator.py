"""``ClusterCoordinator``: schedule functions on training workers, asynchronously.

Each ``schedule`` call becomes one Dask task restricted to ``worker``-tagged
workers and returns a :class:`RemoteValue` at once. The function, its
arguments and kwargs are pickled here, once: that both checks that they can
travel and is the only serialization they get. Whatever server-side objects
they refer to (variables, optimizers, datasets) are kept alive until the
function has run, and a variable that lives only in this process is
refused.

Errors follow TensorFlow's coordinator: the first error a function raises is
kept and raised once, by whichever of ``join``, ``done`` or ``schedule`` comes
next. When it is raised, every function still pending is cancelled (its
RemoteValue raises :class:`~daskps.errors.CancelledError`) and the
coordinator is ready for new work. A function may run more than once if the
worker running it dies (at-least-once, as in TensorFlow).
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import cloudpickle
from distributed import Client
from distributed.client import FutureCancelledError
from distributed.utils import CancelledError as _DaskCancelled

from daskps._core.nest import map_structure
from daskps._core.pickling import dumps_or_explain
from daskps.coordinator.datasets import PerWorkerDataset, PerWorkerValues, local_worker_index
from daskps.distribute.context import scheduled_function
from daskps.distribute.strategy import ParameterServerStrategy
from daskps.errors import CancelledError
from daskps.ps import refs
from daskps.ui.display import coordinator_html
from daskps.variables.variable import ShardedVariable, Variable

__all__ = ["ClusterCoordinator", "RemoteValue"]

_MISSING = object()


class RemoteValue:
    """The result of a scheduled function, available once it has run.

    ``fetch()`` (or ``get()``) waits for it and returns it, with variables
    replaced by their numpy values.
    """

    __slots__ = ("_future", "_cancelled", "_value", "__weakref__")

    def __init__(self, future: Any):
        self._future = future
        self._cancelled = False
        self._value: Any = _MISSING

    def _cancel(self) -> None:
        self._cancelled = True

    def _raise_if_cancelled(self) -> None:
        if self._cancelled or self._future.status == "cancelled":
            raise CancelledError(
                "the scheduled function was cancelled because another scheduled "
                "function failed; schedule it again"
            )

    def fetch(self) -> Any:
        """Wait for the value and return it; re-raises the function's error."""
        if self._value is _MISSING:
            self._raise_if_cancelled()
            try:
                result = self._future.result()
            except (FutureCancelledError, _DaskCancelled):
                self._cancelled = True
                self._raise_if_cancelled()
            self._value = _to_numpy(result)
        return self._value

    def get(self) -> Any:
        """Same as :meth:`fetch`."""
        return self.fetch()

    def __reduce__(self):
        raise TypeError("a RemoteValue cannot be sent to a worker; fetch() it first")

    def __repr__(self) -> str:
        state = "cancelled" if self._cancelled else self._future.status
        return f"<RemoteValue {state}>"


def _to_numpy(structure: Any) -> Any:
    def convert(x: Any) -> Any:
        if isinstance(x, RemoteValue):
            return x.fetch()
        if isinstance(x, (Variable, ShardedVariable)):
            return x.numpy()
        return x

    return map_structure(convert, structure)


def _refuse_remote_values(structure: Any, arg: str) -> None:
    def check(x: Any) -> None:
        if isinstance(x, RemoteValue):
            raise ValueError(
                f"{arg} contains a RemoteValue; using the output of one scheduled "
                "function as input of another is not supported: fetch() it first"
            )

    map_structure(check, structure)


def _execute_closure(strategy_blob: bytes, closure_blob: bytes) -> Any:
    """Runs on a training worker: one scheduled function."""
    strategy = pickle.loads(strategy_blob)
    with refs.borrowing():  # handles the function leaves behind are acquired for this worker
        fn, args, kwargs = pickle.loads(closure_blob)
        # Iterators resolve themselves on the worker; plain PerWorkerValues need its index.
        if any(type(x) is PerWorkerValues for x in (*args, *kwargs.values())):
            index = local_worker_index(tuple(strategy._worker_names))
            local = lambda x: x._local(index) if type(x) is PerWorkerValues else x
            args = map_structure(local, args)
            kwargs = map_structure(local, kwargs)
        try:
            with scheduled_function(), strategy.scope():
                return fn(*args, **kwargs)
        finally:
            del fn, args, kwargs


def _pickle_closure(fn: Callable[..., Any], args: tuple, kwargs: dict, name: str) -> tuple[bytes, list[Any]]:
    """The pickled ``(fn, args, kwargs)`` and what must stay alive until it has run."""
    with refs.collecting() as kept:
        try:
            return cloudpickle.dumps((fn, args, kwargs)), kept
        except ValueError:
            raise  # a variable of this process only: its message says what to do
        except Exception:
            dumps_or_explain((fn, args, kwargs), f"the function {name!r} or its arguments")
            raise


class ClusterCoordinator:
    """Dispatches training functions to workers and tracks their results.

    There is one coordinator per strategy: ``ClusterCoordinator(strategy)``
    called again returns the same object.

    Parameters
    ----------
    strategy : ParameterServerStrategy

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

    def __new__(cls, strategy: ParameterServerStrategy) -> ClusterCoordinator:
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(f"strategy must be a ParameterServerStrategy, got {type(strategy).__name__}")
        if strategy.client is None:
            raise RuntimeError("a ClusterCoordinator can only be made on the coordinator, not on a worker")
        strategy._check_open("ClusterCoordinator(strategy)")
        if strategy._coordinator is None:
            self = super().__new__(cls)
            self._setup(strategy)
            strategy._coordinator = self
        return strategy._coordinator

    def _setup(self, strategy: ParameterServerStrategy) -> None:
        self._strategy = strategy
        client = strategy.client
        assert client is not None  # checked in __new__
        self._client: Client = client
        self._loop: Any = client.loop
        self._strategy_blob = dumps_or_explain(strategy, "strategy")
        self._cond = threading.Condition()
        self._pending: dict[str, RemoteValue] = {}
        self._kept: dict[str, list[Any]] = {}  # what each pending function refers to, kept alive
        self._error: BaseException | None = None
        self._unwatched: list[Any] = []
        self._watch_queued = False
        self._counter = itertools.count()
        self.stats = {"scheduled": 0, "done": 0, "failed": 0, "cancelled": 0}
        self.last_error: BaseException | None = None
        self._created = time.monotonic()
        self._joined_at = 0  # functions scheduled before the last join() that found nothing pending

    @property
    def strategy(self) -> ParameterServerStrategy:
        return self._strategy

    # -- scheduling ------------------------------------------------------------
    def schedule(self, fn: Callable[..., Any], args: Any = None, kwargs: Any = None) -> RemoteValue:
        """Run ``fn(*args, **kwargs)`` on some training worker; return at once.

        Raises
        ------
        TypeError
            If ``fn`` is not callable, ``args``/``kwargs`` have the wrong type,
            or something in them cannot be pickled (the message names it).
        ValueError
            If ``args`` or ``kwargs`` contain a :class:`RemoteValue`.
        Exception
            The first error of an earlier scheduled function, if not yet raised.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if args is None:
            args = ()
        elif not isinstance(args, (list, tuple)):
            raise TypeError(f"args must be a tuple or list, got {type(args).__name__}")
        if kwargs is None:
            kwargs = {}
        elif not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict, got {type(kwargs).__name__}")
        _refuse_remote_values(args, "args")
        _refuse_remote_values(kwargs, "kwargs")
        self._strategy._check_open("coordinator.schedule")
        self._raise_pending_error()
        name = getattr(fn, "__name__", type(fn).__name__)
        key = f"daskps-{name}-{next(self._counter)}-{self._strategy._token[:8]}"
        blob, kept = _pickle_closure(fn, tuple(args), kwargs, name)
        future = self._client.submit(
            _execute_closure, self._strategy_blob, blob, key=key, resources={"worker": 1}, pure=False,
        )
        remote = RemoteValue(future)
        with self._cond:
            self._pending[key] = remote
            self._kept[key] = kept
            self.stats["scheduled"] += 1
            self._unwatched.append(future)
            wake = not self._watch_queued
            self._watch_queued = True
        if wake:  # one loop wake-up serves every schedule call made meanwhile
            self._loop.add_callback(self._watch_batch)
        return remote

    def _watch_batch(self) -> None:
        """On the client's event loop: start watching newly scheduled futures."""
        with self._cond:
            batch, self._unwatched = self._unwatched, []
            self._watch_queued = False
        for future in batch:
            asyncio.ensure_future(self._watch(future))

    async def _watch(self, future: Any) -> None:
        await future._state.wait()
        status = future.status
        error = None
        if status == "error":
            error = future._state.exception
            if future._state.traceback is not None:
                error = error.with_traceback(future._state.traceback)
        with self._cond:
            remote = self._pending.pop(future.key, None)
            self._kept.pop(future.key, None)
            if remote is not None:
                if error is not None:
                    self.stats["failed"] += 1
                    self.last_error = error
                    if self._error is None:
                        self._error = error
                elif status == "finished":
                    self.stats["done"] += 1
            self._cond.notify_all()

    def _raise_pending_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
            if error is None:
                return
        self._cancel_all()
        raise error

    def _cancel_all(self) -> None:
        """Cancel every pending function (their RemoteValues raise CancelledError).

        One that is already running on a worker may go on; what it refers to is
        no longer kept alive for it, so objects the user has dropped may vanish
        under it. Its result is discarded either way.
        """
        with self._cond:
            cancelled = list(self._pending.values())
            self._pending.clear()
            self._kept.clear()
            self.stats["cancelled"] += len(cancelled)
            self._cond.notify_all()
        for remote in cancelled:
            remote._cancel()
        if cancelled and self._client.status == "running":
            self._client.cancel([r._future for r in cancelled])

    def join(self) -> None:
        """Block until every scheduled function has finished.

        Raises the first error of a scheduled function, once, after cancelling
        the functions still pending.
        """
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait(timeout=1.0)
            if not self._pending:
                self._joined_at = self.stats["scheduled"]
        self._raise_pending_error()

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a pending error)."""
        self._raise_pending_error()
        with self._cond:
            return not self._pending

    def fetch(self, val: Any) -> Any:
        """Replace RemoteValues and variables in ``val`` by their numpy values.

        ``val`` may be a nested list, tuple or dict; other objects are returned
        unchanged. Results of many RemoteValues come back in one round trip.
        """
        remotes = [x for x in _flat_remote_values(val) if x._value is _MISSING and not x._cancelled]
        live = [r for r in remotes if r._future.status != "cancelled"]
        if live:
            try:
                results = self._client.gather([r._future for r in live], errors="skip")
            except Exception:
                results = None
            if results is not None and len(results) == len(live):
                for r, value in zip(live, results):
                    r._value = _to_numpy(value)
        return _to_numpy(val)

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerDataset:
        """Build ``dataset_fn()`` (or ``dataset_fn(input_context)``) on each worker.

        Returns a :class:`~daskps.datasets.PerWorkerDataset`; ``iter()`` on it
        gives a per-worker iterator to pass to scheduled functions.
        """
        return PerWorkerDataset(self, dataset_fn)

    def summary(self) -> dict[str, Any]:
        """Counts, throughput and the last error, without waiting on anything."""
        with self._cond:
            in_flight = len(self._pending)
        elapsed = max(time.monotonic() - self._created, 1e-9)
        return dict(self.stats, in_flight=in_flight, per_second=self.stats["done"] / elapsed,
                    since_join=self.stats["scheduled"] - self._joined_at,
                    last_error=None if self.last_error is None else repr(self.last_error))

    def _repr_html_(self) -> str:
        return coordinator_html(self)

    def __repr__(self) -> str:
        with self._cond:
            pending = len(self._pending)
        s = self.stats
        return (
            f"<ClusterCoordinator scheduled={s['scheduled']} pending={pending} "
            f"done={s['done']} failed={s['failed']} cancelled={s['cancelled']}>"
        )


def _flat_remote_values(val: Any) -> list[RemoteValue]:
    found: list[RemoteValue] = []
    map_structure(lambda x: found.append(x) if isinstance(x, RemoteValue) else None, val)
    return found
