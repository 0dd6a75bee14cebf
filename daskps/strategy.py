"""``ParameterServerStrategy``: variables on parameter servers, steps on workers.

The strategy owns one ``ParameterServer`` actor per ps-tagged worker, pinned
to that worker by address (Dask releases an actor's resources once its
constructor returns, so resources alone would not pin it). Variables made in
``strategy.scope()`` go to the servers round robin.

A strategy pickles to a small worker-side view (server addresses and keys),
so scheduled functions may capture it and call ``strategy.run`` on a worker.
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from distributed import Client, default_client

from daskps import context, placement
from daskps.cluster import DaskClusterResolver
from daskps.context import InputContext, ReduceOp, ReplicaContext, ValueContext, _Mode
from daskps.server import ParameterServer
from daskps.transport import PSRef
from daskps.variables import Variable, check_variable_args

__all__ = ["ParameterServerStrategy", "default_strategy"]

# Set while a worker runs a function given to ClusterCoordinator.schedule.
_SCHEDULED: contextvars.ContextVar[bool] = contextvars.ContextVar("daskps_scheduled", default=False)
# Set while a worker runs a dataset function, to its InputContext.
_DATASET_CONTEXT: contextvars.ContextVar[InputContext | None] = contextvars.ContextVar(
    "daskps_dataset_context", default=None
)


def in_scheduled_function() -> bool:
    """True while a worker runs a function scheduled by a ``ClusterCoordinator``."""
    return _SCHEDULED.get()


class _SingleReplicaExtended:
    """``strategy.extended`` for one replica and no parameter servers."""

    def __init__(self, strategy: _SingleReplicaStrategy):
        self._strategy = strategy

    @contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        yield

    def variable_created_in_scope(self, v: Any) -> bool:
        return isinstance(v, Variable) and v._strategy_token is None

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return ("/job:chief/replica:0/task:0/device:CPU:0",)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return ("/job:chief/replica:0/task:0/device:CPU:0",)


class _SingleReplicaStrategy:
    """What every daskps strategy does with exactly one replica per step."""

    _extended_cls: type = _SingleReplicaExtended
    _variable_creator: Callable[..., Any] | None = None

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
    def scope(self) -> Iterator[_SingleReplicaStrategy]:
        """Make this strategy current, in cross-replica context."""
        current = context._MODE.get()
        if current is not None and current.strategy is not self and not isinstance(current.strategy, _DefaultStrategy):
            raise RuntimeError(
                "cannot enter the scope of one strategy inside the scope of another "
                f"({current.strategy!r} is current)"
            )
        with context._enter_mode(_Mode(self, None)):
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
        if context.get_replica_context() is not None and context.has_strategy():
            raise RuntimeError("reduce must be called in cross-replica context, not inside strategy.run")
        arr = np.asarray(value)
        if axis is None:
            return arr
        if not isinstance(axis, (int, np.integer)) or not -arr.ndim <= axis < max(arr.ndim, 1) or arr.ndim == 0:
            raise ValueError(f"axis must be None or in [-{arr.ndim}, {arr.ndim}) for value of rank {arr.ndim}, got {axis!r}")
        return arr.sum(axis=axis) if op is ReduceOp.SUM else arr.mean(axis=axis)

    def gather(self, value: Any, axis: int) -> np.ndarray:
        """Concatenate ``value`` across replicas (one here) along ``axis``."""
        if context.get_replica_context() is not None and context.has_strategy():
            raise RuntimeError(
                "gather needs cross-replica context; inside strategy.run use "
                "get_replica_context().all_gather()"
            )
        return context._check_gather_axis(np.asarray(value), axis)

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
        return dataset_fn(_DATASET_CONTEXT.get() or InputContext())


class _DefaultStrategy(_SingleReplicaStrategy):
    """The strategy that is current when no scope is entered."""

    def __repr__(self) -> str:
        return "<daskps default strategy>"


_DEFAULT = _DefaultStrategy()


def default_strategy() -> _DefaultStrategy:
    return _DEFAULT


class ParameterServerExtended(_SingleReplicaExtended):
    """``strategy.extended`` of a :class:`ParameterServerStrategy`."""

    _strategy: ParameterServerStrategy

    def __init__(self, strategy: ParameterServerStrategy):
        super().__init__(strategy)
        self._colocate_with: contextvars.ContextVar[Variable | None] = contextvars.ContextVar(
            "daskps_colocate", default=None
        )

    @contextmanager
    def colocate_vars_with(self, colocate_with_variable: Variable) -> Iterator[None]:
        """Create variables on the same parameter server as ``colocate_with_variable``.

        Such variables are never partitioned.
        """
        if not self.variable_created_in_scope(colocate_with_variable) or not isinstance(colocate_with_variable, Variable):
            raise ValueError(
                "colocate_with_variable must be a Variable created in this strategy's scope, "
                f"got {colocate_with_variable!r}"
            )
        token = self._colocate_with.set(colocate_with_variable)
        try:
            yield
        finally:
            self._colocate_with.reset(token)

    def variable_created_in_scope(self, v: Any) -> bool:
        shards = getattr(v, "_shard_variables", None)
        if shards is not None:
            return all(self.variable_created_in_scope(s) for s in shards)
        return isinstance(v, Variable) and v._strategy_token == self._strategy._token

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return tuple(ps.device for ps in self._strategy._ps)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        n = len(self._strategy._worker_names)
        return tuple(f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(n))


class ParameterServerStrategy(_SingleReplicaStrategy):
    """Asynchronous training with variables on Dask parameter-server workers.

    Parameters
    ----------
    cluster_resolver : Client, str, DaskClusterResolver or None
        The cluster: a ``distributed.Client``, a scheduler address, a
        resolver, or ``None`` for the current default client.
    variable_partitioner : callable, optional
        ``partitioner(shape, dtype) -> [num_shards, 1, ...]`` (see
        ``dps.partitioners``). ``None`` keeps every variable whole.

    Raises
    ------
    ValueError
        If the cluster has no ps-tagged worker or no worker-tagged worker.

    Examples
    --------
    >>> import daskps as dps
    >>> with dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster:  # doctest: +SKIP
    ...     strategy = dps.ParameterServerStrategy(cluster.get_client())
    ...     with strategy.scope():
    ...         w = dps.Variable(np.zeros(3), name="w")
    ...     w.device
    '/job:ps/replica:0/task:0/device:CPU:0'
    """

    _extended_cls = ParameterServerExtended

    def __init__(self, cluster_resolver: Any = None, variable_partitioner: Any = None):
        super().__init__()
        self._resolver: DaskClusterResolver | None
        self._resolver, self._owns_client = _resolve(cluster_resolver)
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(
                "variable_partitioner must be a callable (shape, dtype) -> list of ints, such as "
                f"dps.partitioners.MinSizePartitioner(...), or None; got {type(variable_partitioner).__name__}"
            )
        self._variable_partitioner = variable_partitioner
        self._client: Client | None = self._resolver.client
        self._token = uuid.uuid4().hex
        ps_workers = self._resolver.ps_workers()
        trainers = self._resolver.training_workers()
        if not ps_workers:
            raise ValueError(
                f"the cluster has no parameter server: no worker has resource "
                f"{self._resolver.ps_resource!r} (start one with "
                f"`dask worker ADDRESS --resources {self._resolver.ps_resource}=1`)"
            )
        if not trainers:
            raise ValueError(
                f"the cluster has no training worker: no worker has resource "
                f"{self._resolver.worker_resource!r} (start one with "
                f"`dask worker ADDRESS --resources {self._resolver.worker_resource}=1`)"
            )
        self._worker_names = [name for name, _ in trainers]
        from daskps.dashboard import install_plugin

        install_plugin(self._client)  # feeds the dashboard page
        self._ps_futures = [
            self._client.submit(
                ParameterServer,
                i,
                actor=True,
                workers=[addr],
                allow_other_workers=False,
                pure=False,
                key=f"daskps-ps-{i}-{self._token}",
            )
            for i, (_, addr) in enumerate(ps_workers)
        ]
        for fut in self._ps_futures:
            fut.result()
        self._ps = [
            PSRef(address=addr, actor_key=str(fut.key), task_id=i)
            for i, ((_, addr), fut) in enumerate(zip(ps_workers, self._ps_futures))
        ]
        self._variable_count = 0
        self._coordinator: Any = None

    # -- pickling: a worker-side view ------------------------------------------
    def __reduce__(self):
        return (_worker_view, (self._token, tuple(self._ps), tuple(self._worker_names), self._variable_partitioner))

    @property
    def cluster_resolver(self) -> DaskClusterResolver | None:
        return self._resolver

    @property
    def client(self) -> Client | None:
        """The coordinator's ``distributed.Client`` (``None`` in a worker's copy)."""
        return self._client

    def _check_can_run(self) -> None:
        if not in_scheduled_function():
            raise NotImplementedError(
                "ParameterServerStrategy.run and reduce work only inside a function "
                "passed to ClusterCoordinator.schedule"
            )

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Return ``dataset``; call it inside the dataset_fn of ``create_per_worker_dataset``."""
        self._check_in_dataset_fn("experimental_distribute_dataset")
        return dataset

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any], options: Any = None) -> Any:
        """Call ``dataset_fn(input_context)``; only inside the dataset_fn of ``create_per_worker_dataset``."""
        self._check_in_dataset_fn("distribute_datasets_from_function")
        return super().distribute_datasets_from_function(dataset_fn, options)

    def _check_in_dataset_fn(self, method: str) -> None:
        if _DATASET_CONTEXT.get() is None:
            raise ValueError(
                f"{method} must be called inside the dataset_fn passed to "
                "ClusterCoordinator.create_per_worker_dataset"
            )

    # -- variable creation -------------------------------------------------
    def _variable_creator(
        self,
        initial_value: Any = None,
        trainable: bool = True,
        name: str | None = None,
        dtype: Any = None,
        shape: Any = None,
    ) -> Any:
        if self._client is None:
            raise RuntimeError(
                "variables can only be created on the coordinator, not inside a scheduled function"
            )
        if initial_value is None and self._variable_partitioner is not None:
            raise ValueError(
                "initial_value must be given (an array-like or a callable) when the strategy has a "
                "variable_partitioner"
            )
        name, dtype, shape = check_variable_args(initial_value, name, dtype, shape)
        colocate = self._extended._colocate_with.get()
        if colocate is not None:  # never partitioned
            return placement.create(self, [placement.Part(colocate._store.ps, name, initial_value, shape, dtype)], trainable)[0]
        if self._variable_partitioner is not None:
            return placement.create_partitioned(self, initial_value, trainable, name, dtype, shape)
        return placement.create(self, [placement.Part(self._next_ps(), name, initial_value, shape, dtype)], trainable)[0]

    def _next_ps(self) -> PSRef:
        ps = self._ps[self._variable_count % len(self._ps)]
        self._variable_count += 1
        return ps

    def ps_stats(self) -> list[dict[str, Any]]:
        """Counters and sizes of every parameter server, one call per server."""
        from daskps.transport import Call, transport_for

        return transport_for(self._client).call_many([Call(ps, "stats") for ps in self._ps])

    def _repr_html_(self) -> str:
        from daskps.display import strategy_html

        return strategy_html(self)

    def summary(self) -> str:
        """Servers (variables, bytes, reads, updates) and trainers, as text; never blocks long."""
        from daskps.display import strategy_text

        return strategy_text(self)

    def __repr__(self) -> str:
        where = "worker view" if self._client is None else self._client.scheduler.address
        return (
            f"<ParameterServerStrategy {where} num_ps={len(self._ps)} "
            f"num_workers={len(self._worker_names)}>"
        )


_WORKER_VIEWS: dict[str, ParameterServerStrategy] = {}


def _worker_view(token: str, ps: tuple, worker_names: tuple, partitioner: Any) -> ParameterServerStrategy:
    """Rebuild (once per process) the strategy a scheduled function captured."""
    view = _WORKER_VIEWS.get(token)
    if view is None:
        view = object.__new__(ParameterServerStrategy)
        _SingleReplicaStrategy.__init__(view)
        view._resolver = None
        view._owns_client = False
        view._client = None
        view._token = token
        view._ps = list(ps)
        view._worker_names = list(worker_names)
        view._variable_partitioner = partitioner
        view._variable_count = 0
        view._coordinator = None
        view._ps_futures = []
        _WORKER_VIEWS[token] = view
    return view


def _resolve(cluster_resolver: Any) -> tuple[DaskClusterResolver, bool]:
    if isinstance(cluster_resolver, DaskClusterResolver):
        return cluster_resolver, False
    if isinstance(cluster_resolver, Client):
        return DaskClusterResolver(cluster_resolver), False
    if isinstance(cluster_resolver, str):
        return DaskClusterResolver(Client(cluster_resolver)), True
    if cluster_resolver is None:
        try:
            return DaskClusterResolver(default_client()), False
        except ValueError:
            raise ValueError(
                "cluster_resolver is None and there is no default Dask client: pass a "
                "distributed.Client, a scheduler address or a DaskClusterResolver"
            ) from None
    raise TypeError(
        "cluster_resolver must be a distributed.Client, a scheduler address (str), a "
        f"DaskClusterResolver or None, got {type(cluster_resolver).__name__}"
    )
