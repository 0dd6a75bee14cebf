"""Per-worker datasets: built on each training worker, read where they live.

``create_per_worker_dataset(dataset_fn)`` pickles ``dataset_fn`` once and
stores it on a parameter server. Nothing is built until a scheduled function
first calls ``next`` on an iterator on a trainer: that trainer fetches the
function (once), builds its dataset and keeps it. Only trainers that use the
dataset ever hold it, so parameter servers, the scheduler and idle workers
pay nothing, and a trainer that joins or restarts builds its own on first
use. The iterator handle that travels with each scheduled function is small:
ids and where the function is stored.

When the ``PerWorkerDataset`` is dropped (or the strategy closed), the
stored function is released and every worker forgets the dataset.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import pickle
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from distributed.protocol.pickle import dumps
from distributed.utils import sync
from distributed.worker import get_worker

from daskps._core.pickling import dumps_or_explain
from daskps.client import protocol, refs
from daskps.client.routing import ServerRef
from daskps.client.worker_state import existing_part, part_on
from daskps.distribute.context import DATASET_CONTEXT
from daskps.distribute.values import InputContext
from daskps.errors import NotScheduledError, OutOfRangeError
from daskps.scheduler.messages import AddCleanup, ask

__all__ = ["PerWorkerDataset", "PerWorkerIterator", "PerWorkerValues"]

# Iterators kept per dataset on one worker; older ones are dropped.
MAX_ITERATORS_PER_DATASET = 8


class PerWorkerValues:
    """One value per training worker; a scheduled function gets its worker's.

    Parameters
    ----------
    values : list or tuple
        ``values[i]`` goes to the worker with index ``i`` (the order of
        ``strategy.extended.worker_devices``). As in TensorFlow there must be
        one value for every training worker: an empty sequence is refused
        here, and a function run on a trainer whose index has no value fails
        (``ValueError`` from ``join``) before it starts.

    Examples
    --------
    >>> PerWorkerValues(["shard-a", "shard-b"]).on_worker(1)
    'shard-b'
    """

    def __init__(self, values: Any):
        if isinstance(values, (str, bytes, bytearray, Mapping, AbstractSet)) or not isinstance(values, Iterable):
            raise TypeError(f"values must be a list or tuple of one value per training worker, "
                            f"got {type(values).__name__}")
        self._values = tuple(values)
        if not self._values:
            raise ValueError("values must hold one value per training worker, got none")

    @property
    def values(self) -> tuple[Any, ...]:
        """One value per worker, by worker index."""
        return self._values

    def on_worker(self, index: int) -> Any:
        """The value of the worker with index ``index``."""
        if not 0 <= index < len(self._values):
            raise ValueError(
                f"values of PerWorkerValues hold {len(self._values)} value(s), one per training worker, but "
                f"this function runs on the trainer with index {index}: give one value per training worker"
            )
        return self._values[index]

    def __repr__(self) -> str:
        return f"PerWorkerValues({len(self._values)} values)"


@dataclasses.dataclass(frozen=True)
class _DatasetSpec:
    """What a trainer needs to build a dataset: its id, where its function is, the trainers."""

    dataset_id: str
    blob: refs.Ref
    worker_names: tuple[str, ...]
    stops: bool = False  # the end raises StopIteration in the function (dps.data), not OutOfRangeError


class PerWorkerIterator(PerWorkerValues):
    """Handle to one iterator per worker over a :class:`PerWorkerDataset`.

    Pass it to a scheduled function; there, ``next(iterator)`` returns the
    next element of the iterator on the worker running that function.
    """

    def __init__(self, spec: _DatasetSpec, iterator_id: int, dataset: Any = None):
        self._spec = spec
        self._iterator_id = iterator_id
        self._dataset = dataset  # on the coordinator: keeps the dataset alive while functions use it
        self._values = ()

    def __reduce__(self) -> Any:
        refs.keep_alive(self._dataset)
        spec, server = self._spec, self._spec.blob.server
        return (_iterator, (spec.dataset_id, self._iterator_id, server.address, server.actor_key,
                            server.task_id, spec.worker_names, spec.stops))

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        try:
            worker = get_worker()
        except ValueError:
            raise NotScheduledError(
                "next() on a per-worker iterator works only inside a function run by "
                "ClusterCoordinator.schedule"
            ) from None
        return _state(worker).next(self._spec, self._iterator_id)

    def get_next(self) -> Any:
        return next(self)

    def __repr__(self) -> str:
        return f"PerWorkerIterator(dataset={self._spec.dataset_id[:8]}, iterator={self._iterator_id})"


def _iterator(dataset_id: str, iterator_id: int, address: str, actor_key: str, task_id: int,
              worker_names: tuple[str, ...], stops: bool = False) -> PerWorkerIterator:
    """An iterator handle that arrived by pickle (compact: it travels with every scheduled function)."""
    server = ServerRef(address, actor_key, task_id)
    blob = refs.borrow(server, f"dataset-{dataset_id}", f"<dataset {dataset_id}>")
    return PerWorkerIterator(_DatasetSpec(dataset_id, blob, worker_names, stops), iterator_id)


class PerWorkerDataset:
    """A dataset built by ``dataset_fn`` on each training worker.

    Made by ``ClusterCoordinator.create_per_worker_dataset``. Each ``iter()``
    gives a fresh iterator on every worker. Dropping it (or closing the
    strategy) frees it everywhere.

    ``keep`` is held as long as the dataset (the partitions of a
    ``dps.data.from_dask`` input); with ``stops`` the end of an iterator
    raises ``StopIteration`` in the scheduled function.
    """

    def __init__(self, coordinator: Any, dataset_fn: Callable[..., Any], *, keep: Any = None,
                 stops: bool = False):
        if not callable(dataset_fn):
            raise TypeError(
                "dataset_fn must be a callable returning an iterable, got "
                f"{type(dataset_fn).__name__} (wrap a dataset as `lambda: dataset`)"
            )
        strategy = coordinator.strategy
        strategy.check_open("create_per_worker_dataset")
        blob = dumps_or_explain(dataset_fn, "dataset_fn")
        dataset_id = uuid.uuid4().hex[:16]
        servers = strategy.servers
        server = servers[int(dataset_id[:8], 16) % len(servers)]
        key = f"dataset-{dataset_id}"
        recipe = protocol.put_blob(server, key, blob, strategy.group)
        held = refs.owned(server, key, f"<dataset {dataset_id}>", strategy.group)
        held.recipe = recipe
        self._spec = _DatasetSpec(dataset_id, held, _trainers_now(strategy), stops)
        self._fn = dataset_fn  # whatever it captured stays alive as long as the dataset
        self._keep = keep
        self._iterators = 0
        self._lock = threading.Lock()
        strategy.on_close(self._release)
        # If the coordinator goes without dropping it, the scheduler has the trainers forget it.
        strategy.client.run_on_scheduler(ask, AddCleanup(server.actor_key, dataset_id, dumps(forget_on_worker),
                                                         dumps((dataset_id,))))
        self._forget = weakref.finalize(self, _forget_later, strategy.client, dataset_id, server.actor_key)

    def __iter__(self) -> PerWorkerIterator:
        with self._lock:
            self._iterators += 1
            return PerWorkerIterator(self._spec, self._iterators, self)

    @property
    def dataset_fn(self) -> Callable[..., Any]:
        """What each trainer builds its dataset with (for ``dps.data.from_dask`` input, its reader)."""
        return self._fn

    @property
    def dataset_id(self) -> str:
        """The id the trainers know this dataset by (what they build is kept under it)."""
        return self._spec.dataset_id

    @property
    def blob(self) -> refs.Ref:
        """The handle of the pickled ``dataset_fn`` on the parameter server that stores it (``.server``, ``.key``)."""
        return self._spec.blob

    def _release(self) -> None:
        """Forget the dataset on every worker now (``strategy.close``)."""
        self._keep = None
        pending = self._forget.detach()
        if pending is not None:
            client, dataset_id, _ = pending[2]
            client.run(forget_on_worker, dataset_id, on_error="ignore")

    def __repr__(self) -> str:
        return f"PerWorkerDataset(id={self._spec.dataset_id[:8]}, iterators={self._iterators})"


def _trainers_now(strategy: Any) -> tuple[str, ...]:
    """The strategy's trainers, then those that joined since (``cluster.scale``), in name order.

    A trainer keeps its index; ``num_input_pipelines`` counts those here now.
    """
    names = list(strategy.trainer_names)
    resolver = strategy.cluster_resolver
    if resolver is not None:
        names += [n for n, _ in resolver.training_workers() if n not in names]
    return tuple(names)


def _forget_later(client: Any, dataset_id: str, server_key: str) -> None:
    """After the dataset is dropped: have every worker forget it, without blocking anyone."""
    async def forget() -> None:
        try:  # the cleanup it registered, run now by the scheduler's plugin (and forgotten)
            await client.scheduler.daskps_run_cleanup(server_key=server_key, cleanup_id=dataset_id)
        except Exception:  # the cluster is going away: nothing left to free
            pass

    try:
        client.loop.add_callback(forget)
    except Exception:
        pass


def forget_on_worker(dataset_id: str, dask_worker: Any = None) -> None:
    """On a worker (``client.run``): drop the dataset ``dataset_id`` built there, and its iterators."""
    state = existing_part(dask_worker, "datasets")
    if state is not None:
        state.forget(dataset_id)


def _wants_context(fn: Callable[..., Any]) -> bool:
    try:
        params = [
            p for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 1


class _Built:
    """A dataset on one worker: its function (once fetched), the dataset, its iterators.

    It keeps no handle to the stored function: the coordinator keeps that alive
    while functions that use the dataset run, and a handle kept here would
    have to be counted for this worker.
    """

    def __init__(self, worker_names: tuple[str, ...]):
        self.worker_names = worker_names
        self.fn: Any = None
        self.dataset: Any = None
        self.iterators: OrderedDict[int, Iterator[Any]] = OrderedDict()


class _WorkerState:
    """daskps's state on one worker: the datasets built here and their iterators."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.datasets: dict[str, _Built] = {}
        self.indices: dict[tuple[str, ...], int] = {}
        self.lock = threading.RLock()

    def forget(self, dataset_id: str) -> None:
        # Not under the lock: this runs on the worker's event loop, and the lock is held while a dataset
        # is built or read, which may wait on that loop (fetching the dataset's function): a deadlock.
        self.datasets.pop(dataset_id, None)

    def next(self, spec: _DatasetSpec, iterator_id: int) -> Any:
        with self.lock:
            it = self._iterator(spec, iterator_id)
            try:
                return next(it)
            except StopIteration:
                if spec.stops:
                    raise StopIteration(f"per-worker iterator {iterator_id} is exhausted on worker "
                                        f"{self.worker.name!r}") from None
                raise OutOfRangeError(
                    f"per-worker iterator {iterator_id} is exhausted on worker "
                    f"{self.worker.name!r}; create a new one with iter(dataset)"
                ) from None

    def _iterator(self, spec: _DatasetSpec, iterator_id: int) -> Iterator[Any]:
        built = self.datasets.get(spec.dataset_id)
        if built is None:
            built = self.datasets[spec.dataset_id] = _Built(spec.worker_names)
        it = built.iterators.get(iterator_id)
        if it is None:
            it = built.iterators[iterator_id] = self._new_iterator(built, spec, iterator_id)
            while len(built.iterators) > MAX_ITERATORS_PER_DATASET:
                built.iterators.popitem(last=False)
        return it

    def _new_iterator(self, built: _Built, spec: _DatasetSpec, iterator_id: int) -> Iterator[Any]:
        own = getattr(built.dataset, "daskps_iterator", None)  # a dps.data input: one per iterator id
        if own is not None:
            return own(iterator_id)
        if built.dataset is not None:
            it = iter(built.dataset)
            if it is not built.dataset:  # re-iterable: a fresh pass
                return it
        if built.fn is None:
            built.fn = pickle.loads(protocol.get_blob(spec.blob.server, spec.blob.key))
        built.dataset = self._build(built.fn, built.worker_names)
        own = getattr(built.dataset, "daskps_iterator", None)
        return own(iterator_id) if own is not None else iter(built.dataset)

    def _build(self, fn: Callable[..., Any], worker_names: tuple[str, ...]) -> Any:
        ctx = InputContext(num_input_pipelines=len(worker_names), input_pipeline_id=self.index(worker_names))
        token = DATASET_CONTEXT.set(ctx)
        try:
            dataset = fn(ctx) if _wants_context(fn) else fn()
        finally:
            DATASET_CONTEXT.reset(token)
        try:
            iter(dataset)
        except TypeError:
            raise TypeError(f"dataset_fn must return an iterable, got {type(dataset).__name__}") from None
        return dataset

    def index(self, worker_names: tuple[str, ...]) -> int:
        """This worker's index among the training workers.

        A worker known by name keeps its index across restarts. A new worker
        takes the first index whose worker is no longer alive.
        """
        with self.lock:
            if worker_names not in self.indices:
                self.indices[worker_names] = self._find_index(worker_names)
            return self.indices[worker_names]

    def _find_index(self, worker_names: tuple[str, ...]) -> int:
        name = str(self.worker.name)
        if name in worker_names:
            return worker_names.index(name)
        info = sync(self.worker.loop, self.worker.scheduler.identity)
        kinds = set(self.worker.state.total_resources)  # trainers: workers with this one's resources
        live = sorted(str(w.get("name", a)) for a, w in info["workers"].items()
                      if kinds & set(w.get("resources", {})))
        newcomers = [n for n in live if n not in worker_names]
        free = [i for i, n in enumerate(worker_names) if n not in live]
        rank = newcomers.index(name) if name in newcomers else 0
        return free[rank] if rank < len(free) else len(worker_names) + rank


# On a trainer, the scheduled function running in this thread: its id and the ``next`` calls it made
# so far on each iterator (an exactly-once input hands a function that runs again the same batches).
_RUNNING: contextvars.ContextVar[tuple[int, dict[int, int]] | None] = contextvars.ContextVar(
    "daskps_running_function", default=None)


@contextlib.contextmanager
def running_function(function_id: int) -> Iterator[None]:
    """Mark the scheduled function ``function_id`` as running in this thread (on a trainer)."""
    token = _RUNNING.set((function_id, {}))
    try:
        yield
    finally:
        _RUNNING.reset(token)


def call_position(iterator: object) -> tuple[int | None, int]:
    """``(function id, n)``: this is the ``n``-th ``next`` on ``iterator`` by the running function
    (``(None, 0)`` outside one)."""
    running = _RUNNING.get()
    if running is None:
        return None, 0
    function_id, counts = running
    n = counts.get(id(iterator), 0)
    counts[id(iterator)] = n + 1
    return function_id, n


def _state(worker: Any) -> _WorkerState:
    return part_on(worker, "datasets", _WorkerState)


def local_worker_index(worker_names: tuple[str, ...]) -> int:
    """Index of the worker running the current task (see ``_WorkerState.index``)."""
    return _state(get_worker()).index(tuple(worker_names))
