"""Distribution contexts: which strategy is current, and in which mode.

Code runs either in a *cross-replica* context (inside ``strategy.scope()``, or
inside ``ReplicaContext.merge_call``) or in a *replica* context (inside the
function given to ``strategy.run``, or by default outside every scope). The
current mode is kept in a ``contextvars.ContextVar``, so it follows threads
and asyncio tasks the way Python's own context does.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from daskps.strategy import _SingleReplicaStrategy

__all__ = [
    "InputContext",
    "InputOptions",
    "ReduceOp",
    "ReplicaContext",
    "RunOptions",
    "ValueContext",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


class ReduceOp(enum.Enum):
    """How values are combined across replicas: ``SUM`` or ``MEAN``.

    Anywhere daskps takes a ``reduce_op``, the strings ``"SUM"`` and
    ``"MEAN"`` (in any case) work as well.

    >>> ReduceOp.coerce("mean")
    <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def coerce(cls, value: ReduceOp | str) -> ReduceOp:
        if isinstance(value, ReduceOp):
            return value
        if isinstance(value, str):
            try:
                return cls(value.upper())
            except ValueError:
                pass
        raise ValueError(
            "reduce_op must be ReduceOp.SUM, ReduceOp.MEAN, 'SUM' or 'MEAN', "
            f"got {value!r}"
        )


class InputContext:
    """What a dataset function needs to know about where it runs.

    Parameters
    ----------
    num_input_pipelines : int
        Number of input pipelines (one per training worker).
    input_pipeline_id : int
        This pipeline's index, in ``[0, num_input_pipelines)``.
    num_replicas_in_sync : int
        Replicas whose gradients are combined per step (1 for asynchronous
        parameter-server training).

    Examples
    --------
    >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1)
    >>> ctx.get_per_replica_batch_size(64)
    64
    """

    __slots__ = ("_num_input_pipelines", "_input_pipeline_id", "_num_replicas_in_sync")

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch size each replica should use for ``global_batch_size``."""
        if global_batch_size % self._num_replicas_in_sync:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be divisible by "
                f"num_replicas_in_sync ({self._num_replicas_in_sync})"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(input_pipeline_id={self._input_pipeline_id}, "
            f"num_input_pipelines={self._num_input_pipelines})"
        )


class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` sees.

    >>> ctx = ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)
    >>> ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync
    0.5
    """

    __slots__ = ("_replica_id_in_sync_group", "_num_replicas_in_sync")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        return self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options for ``strategy.run``; accepted for compatibility.

    With one replica per worker and plain Python functions none of these
    change what ``run`` does.
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for distributing datasets; accepted for compatibility.

    Datasets live in worker memory as Python iterables, so there is no
    device prefetching to configure.
    """

    experimental_fetch_to_device: bool | None = None
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1


@dataclasses.dataclass(frozen=True)
class _Mode:
    strategy: _SingleReplicaStrategy
    replica_context: ReplicaContext | None  # None means cross-replica


_MODE: contextvars.ContextVar[_Mode | None] = contextvars.ContextVar(
    "daskps_mode", default=None
)


def _current_mode() -> _Mode:
    mode = _MODE.get()
    if mode is None:
        from daskps.strategy import default_strategy

        strategy = default_strategy()
        mode = _Mode(strategy, ReplicaContext(strategy, 0))
    return mode


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

    def __init__(self, strategy: _SingleReplicaStrategy, replica_id_in_sync_group: int = 0):
        if not isinstance(replica_id_in_sync_group, (int, np.integer)):
            raise ValueError(
                "replica_id_in_sync_group must be an integer, "
                f"got {type(replica_id_in_sync_group).__name__}"
            )
        self._strategy = strategy
        self._replica_id = int(replica_id_in_sync_group)
        self._tokens: list[contextvars.Token] = []

    @property
    def strategy(self) -> _SingleReplicaStrategy:
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
        from daskps._nest import map_structure

        return map_structure(np.asarray, value)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenate ``value`` across replicas along ``axis`` (one replica here)."""
        from daskps._nest import map_structure

        return map_structure(lambda v: _check_gather_axis(np.asarray(v), axis), value)

    def __repr__(self) -> str:
        return f"ReplicaContext(replica_id_in_sync_group={self._replica_id})"


def _check_gather_axis(value: np.ndarray, axis: int) -> np.ndarray:
    if value.ndim == 0:
        raise ValueError("value must have rank >= 1 to be gathered, got a scalar")
    if not -value.ndim <= axis < value.ndim:
        raise ValueError(f"axis must be in [0, {value.ndim}) for value of rank {value.ndim}, got {axis}")
    return value


def get_strategy() -> _SingleReplicaStrategy:
    """The current strategy: the one whose ``scope()`` is entered, else a default."""
    return _current_mode().strategy


def has_strategy() -> bool:
    """Whether a non-default strategy is current."""
    from daskps.strategy import _DefaultStrategy

    return not isinstance(_current_mode().strategy, _DefaultStrategy)


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` (and ``merge_call``), False in a replica."""
    return _current_mode().replica_context is None


def get_replica_context() -> ReplicaContext | None:
    """The current ``ReplicaContext``, or ``None`` in cross-replica context."""
    return _current_mode().replica_context
