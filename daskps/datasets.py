"""Per-worker datasets: built on each training worker, read where they live.

``create_per_worker_dataset(dataset_fn)`` ships ``dataset_fn`` to every worker
once, as a Dask ``WorkerPlugin`` (Dask also sends it to workers that join or
restart later). Nothing is built until a scheduled function first calls
``next`` on an iterator on that worker. The iterator handle that travels with
each scheduled function is a few bytes: a dataset id and an iterator id.
"""

from __future__ import annotations

import inspect
import pickle
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from distributed import WorkerPlugin
from distributed.utils import sync
from distributed.worker import get_worker

from daskps._pickling import dumps_or_explain
from daskps.context import InputContext
from daskps.errors import DaskPSError, NotScheduledError, OutOfRangeError

__all__ = ["PerWorkerDataset", "PerWorkerIterator", "PerWorkerValues"]

# Iterators kept per dataset on one worker; older ones are dropped.
MAX_ITERATORS_PER_DATASET = 8


class PerWorkerValues:
    """One value per training worker; a scheduled function gets its worker's.

    Parameters
    ----------
    values : sequence
        ``values[i]`` goes to the worker with index ``i`` (the order of
        ``strategy.extended.worker_devices``).
    """

    def __init__(self, values: Any):
        self._values = tuple(values)

    def _local(self, index: int) -> Any:
        return self._values[index % len(self._values)]

    def __repr__(self) -> str:
        return f"PerWorkerValues({len(self._values)} values)"


class PerWorkerIterator(PerWorkerValues):
    """Handle to one iterator per worker over a :class:`PerWorkerDataset`.

    Pass it to a scheduled function; there, ``next(iterator)`` returns the
    next element of the iterator on the worker running that function.
    """

    def __init__(self, dataset_id: str, iterator_id: int):
        self._dataset_id = dataset_id
        self._iterator_id = iterator_id
        self._values = ()

    def __reduce__(self):
        return (PerWorkerIterator, (self._dataset_id, self._iterator_id))

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
        return _state(worker).next(self._dataset_id, self._iterator_id)

    def get_next(self) -> Any:
        return next(self)

    def __repr__(self) -> str:
        return f"PerWorkerIterator(dataset={self._dataset_id[:8]}, iterator={self._iterator_id})"


class PerWorkerDataset:
    """A dataset built by ``dataset_fn`` on each training worker.

    Made by ``ClusterCoordinator.create_per_worker_dataset``. Each ``iter()``
    gives a fresh iterator on every worker.
    """

    def __init__(self, coordinator: Any, dataset_fn: Callable[..., Any]):
        if not callable(dataset_fn):
            raise TypeError(
                "dataset_fn must be a callable returning an iterable, got "
                f"{type(dataset_fn).__name__} (wrap a dataset as `lambda: dataset`)"
            )
        strategy = coordinator.strategy
        self._id = uuid.uuid4().hex
        blob = dumps_or_explain(dataset_fn, "dataset_fn")
        self._plugin_name = f"daskps-dataset-{self._id}"
        plugin = _DatasetPlugin(self._id, blob, tuple(strategy._worker_names))
        strategy.client.register_plugin(plugin, name=self._plugin_name)
        self._iterators = 0
        self._lock = threading.Lock()

    def __iter__(self) -> PerWorkerIterator:
        with self._lock:
            self._iterators += 1
            return PerWorkerIterator(self._id, self._iterators)

    def __repr__(self) -> str:
        return f"PerWorkerDataset(id={self._id[:8]}, iterators={self._iterators})"


class _DatasetPlugin(WorkerPlugin):
    """Stores a pickled dataset function on each worker, built on first use."""

    def __init__(self, dataset_id: str, blob: bytes, worker_names: tuple[str, ...]):
        self.dataset_id = dataset_id
        self.blob = blob
        self.worker_names = worker_names

    def setup(self, worker: Any) -> None:
        _state(worker).datasets[self.dataset_id] = _DatasetSpec(self.blob, self.worker_names)

    def teardown(self, worker: Any) -> None:
        _state(worker).forget(self.dataset_id)


class _DatasetSpec:
    def __init__(self, blob: bytes, worker_names: tuple[str, ...]):
        self.blob = blob
        self.worker_names = worker_names
        self.dataset: Any = None
        self.built = False


def _wants_context(fn: Callable[..., Any]) -> bool:
    try:
        params = [
            p for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    return len(params) >= 1


class _WorkerState:
    """daskps's state on one worker: dataset functions and live iterators."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.datasets: dict[str, _DatasetSpec] = {}
        self.iterators: dict[str, OrderedDict[int, Iterator[Any]]] = {}
        self.indices: dict[tuple[str, ...], int] = {}
        self.lock = threading.RLock()

    def forget(self, dataset_id: str) -> None:
        with self.lock:
            self.datasets.pop(dataset_id, None)
            self.iterators.pop(dataset_id, None)

    def next(self, dataset_id: str, iterator_id: int) -> Any:
        with self.lock:
            it = self._iterator(dataset_id, iterator_id)
            try:
                return next(it)
            except StopIteration:
                raise OutOfRangeError(
                    f"per-worker iterator {iterator_id} is exhausted on worker "
                    f"{self.worker.name!r}; create a new one with iter(dataset)"
                ) from None

    def _iterator(self, dataset_id: str, iterator_id: int) -> Iterator[Any]:
        its = self.iterators.setdefault(dataset_id, OrderedDict())
        it = its.get(iterator_id)
        if it is None:
            spec = self.datasets.get(dataset_id)
            if spec is None:
                raise DaskPSError(
                    f"dataset {dataset_id[:8]} is not registered on worker {self.worker.name!r}"
                )
            it = self._new_iterator(spec)
            its[iterator_id] = it
            while len(its) > MAX_ITERATORS_PER_DATASET:
                its.popitem(last=False)
        return it

    def _new_iterator(self, spec: _DatasetSpec) -> Iterator[Any]:
        if spec.built:
            it = iter(spec.dataset)
            if it is not spec.dataset:  # re-iterable: a fresh pass
                return it
        spec.dataset = self._build(spec)
        spec.built = True
        return iter(spec.dataset)

    def _build(self, spec: _DatasetSpec) -> Any:
        from daskps.strategy import _DATASET_CONTEXT

        fn = pickle.loads(spec.blob)
        ctx = InputContext(
            num_input_pipelines=len(spec.worker_names),
            input_pipeline_id=self.index(spec.worker_names),
        )
        token = _DATASET_CONTEXT.set(ctx)
        try:
            dataset = fn(ctx) if _wants_context(fn) else fn()
        finally:
            _DATASET_CONTEXT.reset(token)
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
        live = sorted(str(w.get("name", a)) for a, w in info["workers"].items())
        newcomers = [n for n in live if n not in worker_names]
        free = [i for i, n in enumerate(worker_names) if n not in live]
        rank = newcomers.index(name) if name in newcomers else 0
        return free[rank] if rank < len(free) else len(worker_names) + rank


def _state(worker: Any) -> _WorkerState:
    state = getattr(worker, "_daskps_state", None)
    if state is None:
        state = worker._daskps_state = _WorkerState(worker)
    return state


def local_worker_index(worker_names: tuple[str, ...]) -> int:
    """Index of the worker running the current task (see ``_WorkerState.index``)."""
    return _state(get_worker()).index(tuple(worker_names))
