"""Distribution contexts: which strategy is current, and in which mode.

Code runs either in a *cross-replica* context (inside ``strategy.scope()``, or
inside ``ReplicaContext.merge_call``) or in a *replica* context (inside the
function given to ``strategy.run``, or by default outside every scope). The
current mode is kept in a ``contextvars.ContextVar``, so it follows threads
and asyncio tasks the way Python's own context does.
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from daskps._core.nest import map_structure
from daskps.distribute.values import InputContext, ReduceOp, ValueContext

__all__ = [
    "ReplicaContext",
    "current_mode",
    "default_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


class _Mode:
    """The current strategy and replica context (``None`` means cross-replica).

    Held weakly: asyncio copies the current context into callbacks and
    connections made inside a scope, which may outlive it by far, and must
    not keep a strategy (and its parameter servers) alive.
    """

    __slots__ = ("_strategy", "_replica")

    def __init__(self, strategy: SingleReplicaStrategy, replica_context: ReplicaContext | None):
        self._strategy = weakref.ref(strategy)
        self._replica = None if replica_context is None else weakref.ref(replica_context)

    @property
    def strategy(self) -> SingleReplicaStrategy:
        return self._strategy() or _DEFAULT

    @property
    def replica_context(self) -> ReplicaContext | None:
        return None if self._replica is None else self._replica()


_MODE: contextvars.ContextVar[_Mode | None] = contextvars.ContextVar(
    "daskps_mode", default=None
)


# Set while a worker runs a function given to ClusterCoordinator.schedule.
_SCHEDULED: contextvars.ContextVar[bool] = contextvars.ContextVar("daskps_scheduled", default=False)
# Set while a worker runs a dataset function, to its InputContext.
DATASET_CONTEXT: contextvars.ContextVar[InputContext | None] = contextvars.ContextVar(
    "daskps_dataset_context", default=None
)


def in_scheduled_function() -> bool:
    """True while a worker runs a function scheduled by a ``ClusterCoordinator``."""
    return _SCHEDULED.get()


@contextmanager
def scheduled_function() -> Iterator[None]:
    """Mark the code inside as a scheduled function (on a worker)."""
    token = _SCHEDULED.set(True)
    try:
        yield
    finally:
        _SCHEDULED.reset(token)


def current_mode() -> _Mode:
    """The current strategy and replica context (the default strategy's outside any scope)."""
    mode = _MODE.get()
    return _DEFAULT_MODE if mode is None else mode


@contextmanager
def _enter_mode(mode: _Mode) -> Iterator[None]:
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


class ReplicaContext:
    """The context a function sees while ``strategy.run`` runs it.

    Get it with ``dps.get_replica_context()``. Asynchronous parameter-server
    training has one replica per step, so ``replica_id_in_sync_group`` is 0
    and reductions across replicas return their input.

    Examples
    --------
    >>> import daskps as dps
    >>> ctx = dps.get_replica_context()   # the default context
    >>> ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
    (0, 1)
    >>> ctx.all_reduce("sum", [1.0, 2.0])
    [array(1.), array(2.)]
    """

    def __init__(self, strategy: SingleReplicaStrategy, replica_id_in_sync_group: int = 0):
        if not isinstance(replica_id_in_sync_group, (int, np.integer)):
            raise ValueError(
                "replica_id_in_sync_group must be an integer, "
                f"got {type(replica_id_in_sync_group).__name__}"
            )
        self._strategy = strategy
        self._replica_id = int(replica_id_in_sync_group)
        self._tokens: list[contextvars.Token] = []

    @property
    def strategy(self) -> SingleReplicaStrategy:
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    def __enter__(self) -> ReplicaContext:
        self._tokens.append(_MODE.set(_Mode(self._strategy, self)))
        return self

    def __exit__(self, *exc: object) -> None:
        _MODE.reset(self._tokens.pop())

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` in cross-replica context."""
        if not callable(merge_fn):
            raise TypeError(f"merge_fn must be callable, got {type(merge_fn).__name__}")
        with _enter_mode(_Mode(self._strategy, None)):
            return merge_fn(self._strategy, *args, **(kwargs or {}))

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        """Combine ``value`` across replicas; with one replica it comes back as arrays.

        ``value`` may be a nested list, tuple or dict of array-likes; the
        structure is kept.
        """
        ReduceOp.coerce(reduce_op)
        return map_structure(np.asarray, value)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenate ``value`` across replicas along ``axis`` (one replica here)."""
        return map_structure(lambda v: _check_gather_axis(np.asarray(v), axis), value)

    def __repr__(self) -> str:
        return f"ReplicaContext(replica_id_in_sync_group={self._replica_id})"


def _check_gather_axis(value: np.ndarray, axis: int) -> np.ndarray:
    if value.ndim == 0:
        raise ValueError("value must have rank >= 1 to be gathered, got a scalar")
    if not -value.ndim <= axis < value.ndim:
        raise ValueError(f"axis must be in [0, {value.ndim}) for value of rank {value.ndim}, got {axis}")
    return value


def get_strategy() -> SingleReplicaStrategy:
    """The current strategy: the one whose ``scope()`` is entered, else a default."""
    return current_mode().strategy


def has_strategy() -> bool:
    """Whether a non-default strategy is current."""
    return current_mode().strategy is not _DEFAULT


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` (and ``merge_call``), False in a replica."""
    return current_mode().replica_context is None


def get_replica_context() -> ReplicaContext | None:
    """The current ``ReplicaContext``, or ``None`` in cross-replica context."""
    return current_mode().replica_context


# -- strategies with one replica per step ------------------------------------------------
class SingleReplicaExtended:
    """``strategy.extended`` for one replica and no parameter servers."""

    def __init__(self, strategy: SingleReplicaStrategy):
        self._strategy = strategy

    @contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        yield

    def variable_created_in_scope(self, v: Any) -> bool:
        return hasattr(v, "handle") and getattr(v, "strategy_token", "") is None

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return ("/job:chief/replica:0/task:0/device:CPU:0",)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return ("/job:chief/replica:0/task:0/device:CPU:0",)


class SingleReplicaStrategy:
    """What every daskps strategy does with exactly one replica per step."""

    _extended_cls: type = SingleReplicaExtended
    # Makes a Variable(...) called in this strategy's scope (None: variables are local).
    variable_creator: Callable[..., Any] | None = None
    group: Any = None  # the parameter servers, on a strategy that has them (on its coordinator)

    def __init__(self) -> None:
        self._extended = self._extended_cls(self)

    @property
    def extended(self) -> Any:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def cluster_resolver(self) -> Any:
        return None

    @contextmanager
    def scope(self) -> Iterator[SingleReplicaStrategy]:
        """Make this strategy current, in cross-replica context."""
        current = _MODE.get()
        if current is not None and current.strategy is not self and not isinstance(current.strategy, _DefaultStrategy):
            raise RuntimeError(
                "cannot enter the scope of one strategy inside the scope of another "
                f"({current.strategy!r} is current)"
            )
        with _enter_mode(_Mode(self, None)):
            yield self

    def _check_can_run(self) -> None:
        pass

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, options: Any = None) -> Any:
        """Call ``fn(*args, **kwargs)`` once, in a replica context with replica id 0."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._check_can_run()
        with ReplicaContext(self, 0):
            return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> np.ndarray:
        """Reduce ``value`` across replicas (one here), and along ``axis`` if given."""
        op = ReduceOp.coerce(reduce_op)
        self._check_can_run()
        if get_replica_context() is not None and has_strategy():
            raise RuntimeError("reduce must be called in cross-replica context, not inside strategy.run")
        arr = np.asarray(value)
        if axis is None:
            return arr
        if not isinstance(axis, (int, np.integer)) or not -arr.ndim <= axis < max(arr.ndim, 1) or arr.ndim == 0:
            raise ValueError(f"axis must be None or in [-{arr.ndim}, {arr.ndim}) for value of rank {arr.ndim}, got {axis!r}")
        return arr.sum(axis=axis) if op is ReduceOp.SUM else arr.mean(axis=axis)

    def gather(self, value: Any, axis: int) -> np.ndarray:
        """Concatenate ``value`` across replicas (one here) along ``axis``."""
        if get_replica_context() is not None and has_strategy():
            raise RuntimeError(
                "gather needs cross-replica context; inside strategy.run use "
                "get_replica_context().all_gather()"
            )
        return _check_gather_axis(np.asarray(value), axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The per-replica values of ``value``: here always ``(value,)``."""
        return (value,)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Call ``value_fn(ValueContext())`` for the single replica."""
        if not callable(value_fn):
            raise TypeError(f"value_fn must be callable, got {type(value_fn).__name__}")
        return value_fn(ValueContext(0, self.num_replicas_in_sync))

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any], options: Any = None) -> Any:
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        return dataset_fn(DATASET_CONTEXT.get() or InputContext())


class _DefaultStrategy(SingleReplicaStrategy):
    """The strategy that is current when no scope is entered."""

    def __repr__(self) -> str:
        return "<daskps default strategy>"


_DEFAULT = _DefaultStrategy()


def default_strategy() -> _DefaultStrategy:
    return _DEFAULT


_DEFAULT_REPLICA = ReplicaContext(_DEFAULT, 0)
_DEFAULT_MODE = _Mode(_DEFAULT, _DEFAULT_REPLICA)
