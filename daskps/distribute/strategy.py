"""``ParameterServerStrategy``: variables on parameter servers, steps on workers.

The strategy owns a :class:`~daskps.client.group.ServerGroup`: one
``ParameterServer`` actor per ps-tagged worker. Variables made in
``strategy.scope()`` go to the servers round robin. Everything made through
the strategy holds the group, so the servers live as long as any of it is
held, and :meth:`ParameterServerStrategy.close` releases them at once.

A strategy pickles to a small worker-side view (server addresses and keys),
so scheduled functions may capture it and call ``strategy.run`` on a worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from distributed import Client, default_client
from distributed.comm import connect, parse_address
from distributed.deploy import Cluster

from daskps._core import views
from daskps._core.arrays import check_trainable_flag, check_variable_args
from daskps._core.config import setting
from daskps.client import protocol
from daskps.client.group import ServerGroup
from daskps.client.routing import ROUTES, ServerRef
from daskps.distribute import placement
from daskps.distribute.cluster import DaskClusterResolver
from daskps.distribute.context import (
    DATASET_CONTEXT,
    SingleReplicaExtended,
    SingleReplicaStrategy,
    in_scheduled_function,
)
from daskps.scheduler.plugin import install_plugin

__all__ = ["ParameterServerStrategy"]

logger = logging.getLogger("daskps")


class ParameterServerExtended(SingleReplicaExtended):
    """``strategy.extended`` of a :class:`ParameterServerStrategy`."""

    _strategy: ParameterServerStrategy

    def __init__(self, strategy: ParameterServerStrategy):
        super().__init__(strategy)
        self._colocate_with: contextvars.ContextVar[Any] = contextvars.ContextVar("daskps_colocate", default=None)

    @property
    def colocation(self) -> ServerRef | None:
        """The server of the innermost ``colocate_vars_with`` block around this code, if any."""
        return self._colocate_with.get()

    @contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Create variables on the same parameter server as ``colocate_with_variable``.

        Such variables are never partitioned.
        """
        plain = hasattr(colocate_with_variable, "handle")
        if not plain or not self.variable_created_in_scope(colocate_with_variable):
            raise ValueError(
                "colocate_with_variable must be a Variable created in this strategy's scope, "
                f"got {colocate_with_variable!r}"
            )
        # Only its server: a context may be copied into callbacks that outlive the block.
        token = self._colocate_with.set(colocate_with_variable.handle.server)
        try:
            yield
        finally:
            self._colocate_with.reset(token)

    def variable_created_in_scope(self, v: Any) -> bool:
        shards = v.variables if hasattr(v, "row_offsets") else None  # a ShardedVariable
        if shards is not None:
            return all(self.variable_created_in_scope(s) for s in shards)
        return hasattr(v, "handle") and getattr(v, "strategy_token", None) == self._strategy.token

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return tuple(ps.device for ps in self._strategy.servers)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        n = len(self._strategy.trainer_names)
        return tuple(f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(n))


class ParameterServerStrategy(SingleReplicaStrategy):
    """Asynchronous training with variables on Dask parameter-server workers.

    Parameters
    ----------
    cluster_resolver : Client, Cluster, str, DaskClusterResolver or None
        The cluster: a ``distributed.Client``, a Dask cluster object (a
        :class:`LocalPSCluster`, a ``dask_jobqueue`` or ``dask_kubernetes``
        cluster: its ``get_client()`` is used), a scheduler address such as
        ``"tcp://scheduler:8786"`` (a client the strategy closes when it
        closes), a resolver, or ``None`` for the current default client.
    variable_partitioner : callable, optional
        ``partitioner(shape, dtype) -> [num_shards, 1, ...]`` (see
        ``dps.partitioners``). ``None`` keeps every variable whole.

    Raises
    ------
    ValueError
        If the cluster has no ps-tagged worker or no worker-tagged worker.

    The parameter servers live as long as the strategy or anything made
    through it (a variable, optimizer, metric, dataset, coordinator,
    checkpoint) is held. :meth:`close` (or leaving a ``with`` block)
    releases them at once.

    Examples
    --------
    >>> import daskps as dps
    >>> with dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster:  # doctest: +SKIP
    ...     with dps.ParameterServerStrategy(cluster.get_client()) as strategy:
    ...         with strategy.scope():
    ...             w = dps.Variable(np.zeros(3), name="w")
    ...         w.device
    '/job:ps/replica:0/task:0/device:CPU:0'
    """

    _extended_cls = ParameterServerExtended

    def __init__(self, cluster_resolver: Any = None, variable_partitioner: Any = None):
        super().__init__()
        self._resolver: DaskClusterResolver | None
        self._resolver, self._owns_client = _resolve(cluster_resolver)
        try:
            self._start(variable_partitioner)
        except BaseException:
            if self._owns_client:
                self._resolver.client.close()
            raise

    def _start(self, variable_partitioner: Any) -> None:
        assert self._resolver is not None
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(
                "variable_partitioner must be a callable (shape, dtype) -> list of ints, such as "
                f"dps.partitioners.MinSizePartitioner(...), or None; got {type(variable_partitioner).__name__}"
            )
        self._variable_partitioner = variable_partitioner
        self._client: Client | None = self._resolver.client
        ps_workers, trainers = self._resolver.wait_for_workers()
        self._worker_names = [name for name, _ in trainers]
        install_plugin(self._client)  # server bookkeeping on the scheduler (and the dashboard page)
        self._group: ServerGroup | None = ServerGroup(self._client, ps_workers)
        self._token = self._group.token
        self._ps: list[ServerRef] = self._group.servers
        self._variable_count = 0
        self._coordinator: Any = None
        self._closers: list[Callable[[], Callable[[], object] | None]] = []
        _MADE_HERE.add(self)

    @staticmethod
    def open_strategies() -> list[ParameterServerStrategy]:
        """The strategies made in this process that are not closed (``dps.keras`` picks one when it is alone)."""
        return [s for s in list(_MADE_HERE) if not s.closed]

    @staticmethod
    def last_scoped() -> ParameterServerStrategy | None:
        """The strategy whose ``scope()`` was entered last in this process, if it is still open.

        A Keras model built and compiled in a strategy's scope is trained
        with that strategy's coordinator by ``dps.keras.fit`` called after the
        scope, as TensorFlow's ``model.fit`` uses the strategy the model was
        made under.
        """
        ref = _LAST_SCOPED[0]
        found = ref() if ref is not None else None
        return None if found is None or found.closed else found

    # -- pickling: a worker-side view ------------------------------------------
    def __reduce__(self) -> Any:
        return (self._worker_view, (self._token, tuple(self._ps), tuple(self._worker_names),
                                    self._variable_partitioner))

    @staticmethod  # (a plain function: cloudpickle sends it by reference, as a module-level one)
    def _worker_view(token: str, ps: tuple, worker_names: tuple, partitioner: Any) -> ParameterServerStrategy:
        """Rebuild (once per process) the strategy a scheduled function captured."""
        view = _WORKER_VIEWS.get(token)
        if view is None:
            view = object.__new__(ParameterServerStrategy)
            SingleReplicaStrategy.__init__(view)
            view._resolver = None
            view._owns_client = False
            view._client = None
            view._token = token
            view._ps = list(ps)
            view._worker_names = list(worker_names)
            view._variable_partitioner = partitioner
            view._variable_count = 0
            view._coordinator = None
            view._group = None
            view._closers = []
            _WORKER_VIEWS[token] = view
        return view

    @property
    def cluster_resolver(self) -> DaskClusterResolver | None:
        return self._resolver

    @property
    def servers(self) -> tuple[ServerRef, ...]:
        """The parameter servers, in task order (their current places, after any recovery)."""
        return tuple(self._ps)

    @property
    def trainer_names(self) -> tuple[str, ...]:
        """The names of the training workers when the strategy was made (their index order)."""
        return tuple(self._worker_names)

    def follow_moved_servers(self) -> None:
        """Point at the servers re-created after losses (on a trainer, for a view made before a move)."""
        self._ps = [ROUTES.current(s) for s in self._ps]

    @property
    def client(self) -> Client | None:
        """The coordinator's ``distributed.Client`` (``None`` in a worker's copy)."""
        return self._client

    @property
    def coordinator(self) -> Any:
        """The ``ClusterCoordinator`` of this strategy, once one is made (there is one per strategy)."""
        return self._coordinator

    def adopt_coordinator(self, coordinator: Any) -> None:
        """Called by ``ClusterCoordinator(strategy)``: the strategy's one coordinator."""
        if self._coordinator is not None and self._coordinator is not coordinator:
            raise ValueError("this strategy has a ClusterCoordinator already")
        self._coordinator = coordinator

    def on_close(self, callback: Callable[[], object]) -> None:
        """Have ``close()`` call ``callback`` before it releases the servers (in the order given).

        A bound method is held weakly: an object that goes away is not kept for this.
        """
        ref: Callable[[], Callable[[], object] | None]
        ref = weakref.WeakMethod(callback) if inspect.ismethod(callback) else (lambda: callback)
        self._closers = [r for r in self._closers if r() is not None] + [ref]

    # -- lifetime -----------------------------------------------------------------
    def close(self) -> None:
        """Release the parameter servers and everything on them.

        Pending scheduled functions are cancelled, per-worker datasets are
        dropped on the workers, and the client is closed if the strategy made
        it from an address. Using the strategy, or anything made through it,
        afterwards raises :class:`~daskps.errors.ClosedError`. Calling it
        again does nothing.
        """
        group = self._group
        if group is None or group.closed:
            return
        try:
            for closer in [r() for r in self._closers]:
                if closer is not None:
                    closer()
        except Exception as exc:  # e.g. the client is closed: the servers must go all the same
            logger.warning("daskps: strategy.close() could not reach the workers: %s", exc)
        finally:
            group.close()
            if self._owns_client and self._client is not None:
                self._client.close()

    @property
    def closed(self) -> bool:
        return self._group is not None and self._group.closed

    def check_open(self, what: str) -> None:
        """Raise ``ClosedError`` naming ``what`` if the strategy was closed."""
        if self._group is not None:
            self._group.check_open(what)

    @property
    def group(self) -> ServerGroup | None:
        """The parameter servers' Dask actors, started and released together (None in a worker's view)."""
        return self._group

    @property
    def token(self) -> str:
        """The strategy's id: its servers' keys, its variables and its coordinator's topic carry it."""
        return self._token

    def __enter__(self) -> ParameterServerStrategy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def scope(self) -> Iterator[ParameterServerStrategy]:
        """Make this strategy current: variables made inside go to its parameter servers."""
        self.check_open("strategy.scope()")
        _LAST_SCOPED[0] = weakref.ref(self)
        with super().scope():
            yield self

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

    def distribute_datasets_from_function(self, dataset_fn: Any, options: Any = None) -> Any:
        """Call ``dataset_fn(input_context)``; only inside the dataset_fn of ``create_per_worker_dataset``."""
        self._check_in_dataset_fn("distribute_datasets_from_function")
        return super().distribute_datasets_from_function(dataset_fn, options)

    def _check_in_dataset_fn(self, method: str) -> None:
        if DATASET_CONTEXT.get() is None:
            raise ValueError(
                f"{method} must be called inside the dataset_fn passed to "
                "ClusterCoordinator.create_per_worker_dataset"
            )

    # -- variable creation -------------------------------------------------
    def variable_creator(self, initial_value: Any = None, trainable: bool = True, name: str | None = None,
                          dtype: Any = None, shape: Any = None) -> placement.Placed:
        """Create a variable on the servers (called by ``Variable(...)`` in this scope)."""
        if self._group is None:
            raise RuntimeError("variables can only be created on the coordinator, not inside a scheduled function")
        self.check_open("a new variable")
        if initial_value is None and self._variable_partitioner is not None:
            raise ValueError(
                "initial_value must be given (an array-like or a callable) when the strategy has a "
                "variable_partitioner"
            )
        trainable = check_trainable_flag(trainable)
        name, dtype, shape = check_variable_args(initial_value, name, dtype, shape)
        colocate = self._extended.colocation
        count = self._variable_count
        try:
            if colocate is not None:  # never partitioned
                part = placement.Part(colocate, name, initial_value, shape, dtype)
                return placement.Placed(name, placement.create(self._group, [part]), False, trainable)
            if self._variable_partitioner is not None:
                return placement.create_partitioned(self, initial_value, trainable, name, dtype, shape)
            part = placement.Part(self.next_server(), name, initial_value, shape, dtype)
            return placement.Placed(name, placement.create(self._group, [part]), False, trainable)
        except BaseException:
            self._variable_count = count  # a failed create takes no place in the rotation
            raise

    def next_server(self) -> ServerRef:
        """The server the next variable (or part) made in this scope goes to: round robin, as TensorFlow places them."""
        ps = self._ps[self._variable_count % len(self._ps)]
        self._variable_count += 1
        return ps

    @property
    def variable_partitioner(self) -> Any:
        """The partitioner variables made in this scope are split by (``None``: not split)."""
        return self._variable_partitioner

    def ps_stats(self) -> list[dict[str, Any]]:
        """Counters and sizes of every parameter server, one call per server."""
        self.check_open("strategy.ps_stats()")
        return [s.as_dict() for s in protocol.stats(self._ps, self._group)]

    def _repr_html_(self) -> str:
        return views.html(self._display())

    def summary(self) -> str:
        """Servers (variables, bytes, reads, updates) and trainers, as text; never blocks long."""
        return views.text(self._display())

    def _server_rows(self) -> list[views.ServerRow]:
        """Each server's numbers, waiting at most ``daskps.display-timeout`` for each."""
        if self.closed:
            return [views.ServerRow(ps.task_id, ps.device, ps.address, "closed", None) for ps in self._ps]
        results = protocol.stats_within(list(self._ps), self._group, setting("display_timeout"))
        rows = []
        for ps, res in zip(self._ps, results):
            if isinstance(res, BaseException):
                rows.append(views.ServerRow(ps.task_id, ps.device, ps.address,
                                            f"unreachable: {type(res).__name__}: {res}", None))
            else:
                rows.append(views.ServerRow(ps.task_id, ps.device, ps.address, "ok", {
                    "variables": res.num_variables, "nbytes": res.nbytes, "slot_nbytes": res.slot_nbytes,
                    "reads": res.reads, "updates": res.updates, "bytes_read": res.bytes_read}))
        return rows

    def _display(self) -> views.StrategyView:
        try:
            current = dict(self._resolver.training_workers()) if self._resolver is not None else {}
        except Exception:  # a display must not fail: show what we know
            current = {}
        trainers = [(name, current.get(name, "gone")) for name in self._worker_names]
        link = self._client.dashboard_link if self._client is not None else ""
        return views.StrategyView(repr(self), self._server_rows(), trainers, link)

    def __repr__(self) -> str:
        if self._client is None:
            where = "worker view"
        elif self.closed:
            where = "closed"
        else:
            where = self._client.scheduler.address
        return (
            f"<ParameterServerStrategy {where} num_ps={len(self._ps)} "
            f"num_workers={len(self._worker_names)}>"
        )


_WORKER_VIEWS: weakref.WeakValueDictionary[str, ParameterServerStrategy] = weakref.WeakValueDictionary()
_MADE_HERE: weakref.WeakSet[ParameterServerStrategy] = weakref.WeakSet()  # on the coordinator
_LAST_SCOPED: list[Any] = [None]  # a weak reference to the strategy whose scope() was entered last


def _resolve(cluster_resolver: Any) -> tuple[DaskClusterResolver, bool]:
    if isinstance(cluster_resolver, DaskClusterResolver):
        return cluster_resolver, False
    if isinstance(cluster_resolver, Client):
        return DaskClusterResolver(cluster_resolver), False
    if isinstance(cluster_resolver, Cluster):  # LocalPSCluster, SLURMCluster, KubeCluster, ...: its client
        return DaskClusterResolver(cluster_resolver.get_client()), False
    if isinstance(cluster_resolver, str):
        return DaskClusterResolver(_connect(cluster_resolver)), True
    if cluster_resolver is None:
        try:
            return DaskClusterResolver(default_client()), False
        except ValueError:
            raise ValueError(
                "cluster_resolver is None and there is no default Dask client: pass a "
                "distributed.Client, a Dask cluster, a scheduler address or a DaskClusterResolver"
            ) from None
    raise TypeError(
        "cluster_resolver must be a distributed.Client, a Dask cluster (LocalPSCluster, ...), a "
        f"scheduler address (str), a DaskClusterResolver or None, got {type(cluster_resolver).__name__}"
    )


def _connect(address: str) -> Client:
    """A client of the scheduler at ``address``, or an error naming it within ``daskps.scheduler-timeout``.

    A tcp address is first tried with a bare connection bounded by that
    timeout; the client is then made with Dask's own timeouts, which it
    keeps for later waits (reconnecting, closing), so the short one does not
    outlive the first contact.
    """
    timeout = setting("scheduler_timeout")
    try:
        scheme, _ = parse_address(address)
        if scheme == "tcp":
            _probe(address, timeout)
        return Client(address)
    except ValueError as exc:  # an address Dask cannot parse
        raise ValueError(f"cluster_resolver {address!r} is not a scheduler address such as "
                         f"'tcp://scheduler:8786': {exc}") from None
    except OSError as exc:  # timed out: nothing answered there
        raise OSError(
            f"cannot reach a Dask scheduler at {address!r} within {timeout:g} s (daskps.scheduler-timeout): "
            f"{exc}. Check the address (`dask scheduler` prints it as 'Scheduler at: ...') and that "
            "the scheduler is running"
        ) from None


def _probe(address: str, timeout: float) -> None:
    """Open and close one connection to ``address`` (OSError within ``timeout`` if nothing answers).

    On a thread of its own, with its own event loop: the caller's thread may be running one (Jupyter).
    """
    async def probe() -> None:
        comm = await connect(address, timeout=timeout)
        await comm.close()

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="daskps-probe") as pool:
        pool.submit(asyncio.run, probe()).result()
