"""A Dask DataFrame or Array as input: checked, persisted, read a partition at a time, batched.

``dps.data.from_dask(collection, batch_size, ...)`` checks the collection
and the options and returns a :class:`DaskInput`. Two readers take it:
``ClusterCoordinator.create_per_worker_dataset`` (the trainers read it, see
:mod:`daskps.trainer.dask_input`) and ``SidecarEvaluator(data=...)``
(one evaluator reads a whole pass). Both persist the collection where it
will be read unless it was persisted already (then its partitions are used
where they lie), read each partition from the worker's own memory when it
is there and fetch it from the worker holding it otherwise, and cut batches
with a :class:`Batcher`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from distributed import Future, futures_of, wait, worker_client

from daskps._core.arrays import is_int
from daskps._core.config import setting
from daskps.scheduler.messages import ask

__all__ = ["Batcher", "DaskInput", "from_dask", "one_pass", "partition_futures", "read_partition", "rows_per_partition",
           "slice_rows", "take_rows", "unpublish_later"]


@dataclasses.dataclass(frozen=True)
class DaskInput:
    """A Dask collection and how to batch it; made by :func:`from_dask`.

    Pass it to ``ClusterCoordinator.create_per_worker_dataset``.
    """

    parts: tuple[Any, ...]  # the collection's components: one, or those of the tuple/dict
    names: tuple[Any, ...] | None  # the dict's keys; None for one collection or a tuple
    single: bool
    batch_size: int
    shuffle: bool
    seed: int | None
    epochs: int | None
    drop_remainder: bool
    exactly_once: bool = False

    def __repr__(self) -> str:
        return (f"DaskInput({len(self.parts)} collection(s), {self.npartitions} partitions, "
                f"batch_size={self.batch_size}, shuffle={self.shuffle}, epochs={self.epochs}"
                + (", exactly_once=True)" if self.exactly_once else ")"))

    @property
    def npartitions(self) -> int:
        return _npartitions(self.parts[0])


def from_dask(collection: Any, batch_size: int, *, shuffle: bool = False, seed: int | None = None,
              epochs: int | None = 1, drop_remainder: bool = False, exactly_once: bool = False) -> DaskInput:
    """Batches of a Dask DataFrame or Array, read on the trainers holding its partitions.

    Parameters
    ----------
    collection : dask DataFrame, dask Array, or a tuple or dict of them
        A DataFrame gives batches that are dicts of numpy arrays by column;
        an Array (chunked along axis 0 only) gives numpy arrays; a tuple or
        dict of them (with equal partitions) gives the same tuple or dict.
    batch_size : int
        Rows per batch; the last batch of an epoch may be smaller.
    shuffle : bool
        Read the partitions in a new order each epoch and shuffle rows
        within a bounded buffer.
    seed : int, optional
        Makes the shuffled order repeatable.
    epochs : int or None
        Passes over the data; ``None`` repeats forever.
    drop_remainder : bool
        Drop each trainer's last, smaller batch of an epoch (with
        ``exactly_once``, each partition's).
    exactly_once : bool
        Hand the batches out from one queue for the whole cluster, one per
        ``next``: every row is in exactly one batch whose function's result
        reached the coordinator, also when trainers die (a function that
        runs again gets the same batches). Batches are ``batch_size`` rows
        within a partition (a partition's last may be smaller). For
        evaluation; slower than the default, which streams each trainer's
        partitions.

    Examples
    --------
    >>> import dask.array as da
    >>> import daskps as dps
    >>> x = da.ones((1000, 4), chunks=(250, 4))
    >>> dps.data.from_dask((x, x[:, 0]), batch_size=100, shuffle=True, seed=0)
    DaskInput(2 collection(s), 4 partitions, batch_size=100, shuffle=True, epochs=1)
    """
    if isinstance(collection, dict):
        if not collection:
            raise ValueError("collection must not be an empty dict")
        names: tuple[Any, ...] | None = tuple(collection)
        parts = tuple(collection.values())
        labels = [f"collection[{k!r}]" for k in collection]
    elif isinstance(collection, tuple):
        if not collection:
            raise ValueError("collection must not be an empty tuple")
        names, parts, labels = None, collection, [f"collection[{i}]" for i in range(len(collection))]
    else:
        names, parts, labels = None, (collection,), ["collection"]
    for part, label in zip(parts, labels):
        _check_part(part, label)
    _check_aligned(parts, labels)
    if not is_int(batch_size) or batch_size <= 0:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if epochs is not None and (not is_int(epochs) or epochs < 1):
        raise ValueError(f"epochs must be an integer >= 1 or None (repeat forever), got {epochs!r}")
    if seed is not None and (not is_int(seed)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    for arg, flag in (("shuffle", shuffle), ("drop_remainder", drop_remainder), ("exactly_once", exactly_once)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{arg} must be True or False, got {flag!r}")
    return DaskInput(parts, names, not isinstance(collection, (tuple, dict)), int(batch_size), bool(shuffle),
                     None if seed is None else int(seed), None if epochs is None else int(epochs),
                     bool(drop_remainder), bool(exactly_once))


def _is_frame(x: Any) -> bool:
    try:
        import dask.dataframe as dd
    except ImportError:  # dask's dataframe extra is not installed: nothing can be a dask DataFrame
        return False
    return isinstance(x, dd.DataFrame)


def _is_array(x: Any) -> bool:
    import dask.array as da

    return isinstance(x, da.Array)


def _check_part(part: Any, label: str) -> None:
    if _is_frame(part):
        return
    if _is_array(part):
        if part.ndim == 0:
            raise ValueError(f"{label} must have at least one axis, got a 0-d dask Array")
        for axis, chunks in enumerate(part.chunks[1:], start=1):
            if len(chunks) != 1:
                raise ValueError(
                    f"{label} must be chunked along axis 0 only, got {len(chunks)} chunks along axis "
                    f"{axis} (use x.rechunk({{{axis}: -1}}))"
                )
        return
    kind = f"{type(part).__module__.split('.')[0]}.{type(part).__name__}"
    hint = " (make one with dask.dataframe.from_pandas(df, npartitions=...))" if kind.startswith("pandas") else ""
    raise TypeError(f"{label} must be a dask DataFrame or a dask Array, got {kind}{hint}")


def _npartitions(part: Any) -> int:
    return part.npartitions if _is_frame(part) else len(part.chunks[0])


def _check_aligned(parts: tuple[Any, ...], labels: list[str]) -> None:
    """Equal partitions across components (row counts are checked again once persisted)."""
    first = _npartitions(parts[0])
    for part, label in zip(parts[1:], labels[1:]):
        if _npartitions(part) != first:
            raise ValueError(
                f"{label} must have the same partitions as {labels[0]}: got {_npartitions(part)} "
                f"partitions against {first}"
            )
    known = [(p.chunks[0], label) for p, label in zip(parts, labels)
             if _is_array(p) and not any(np.isnan(c) for c in p.chunks[0])]
    for chunks, label in known[1:]:
        if chunks != known[0][0]:
            raise ValueError(f"{label} must have the same rows per partition as {known[0][1]}: "
                             f"got {chunks} against {known[0][0]}")



def partition_futures(client: Any, parts: tuple[Any, ...], workers: list[str] | None) -> list[list[Future]]:
    """Each component's futures in partition order: persisted here (on ``workers``, by name) unless
    they were already.

    By name, not address: a partition lost with its worker is computed again on a worker of that
    name once its Nanny restarts it, or on another of ``workers``. (Restricted strictly: with
    loose restrictions Dask's work stealing spreads the partitions over any idle worker.)
    """
    where = {"workers": workers} if workers else {}
    out = []
    for part in parts:
        held = _held(part)
        if held is None:  # one at a time: Dask warns when frames and arrays are persisted together
            held = _held(client.persist(part, **where))
        assert held is not None
        out.append(held)
    return out


def _held(part: Any) -> list[Future] | None:
    """The futures of a persisted collection, in partition order; None if it is not persisted.

    Persisted means its graph is its partitions, one future each (a collection
    computed from persisted ones is not). A persisted DataFrame's keys are
    aliases of its futures' keys, so they are put in order by partition index.
    """
    futures = futures_of(part)
    n = _npartitions(part)
    if len(futures) != n:
        return None
    keys = {f.key for f in futures}
    if any(k not in keys and not _is_alias(v) for k, v in part.__dask_graph__().items()):
        return None
    if not all(isinstance(f.key, tuple) for f in futures) or len({f.key[0] for f in futures}) != 1:
        return None
    return sorted(futures, key=lambda f: f.key[1:])


def _known_rows(part: Any) -> list[int] | None:
    """Rows per partition when the collection says (an Array with known chunks); counted otherwise."""
    if _is_array(part) and not any(np.isnan(c) for c in part.chunks[0]):
        return [int(c) for c in part.chunks[0]]
    return None


def _is_alias(task: Any) -> bool:
    """Whether a graph entry only renames another key (how a persisted DataFrame points at its futures)."""
    try:
        from dask._task_spec import Alias
    except ImportError:  # older dask: no aliases, a persisted graph holds its futures only
        return False
    return isinstance(task, Alias)


def rows_per_partition(client: Any, spec: DaskInput, futures: list[list[Future]]) -> list[int]:
    """Rows of each partition, the same for every component (refused naming the component otherwise)."""
    lengths = [_known_rows(p) or _count_rows(client, fs) for p, fs in zip(spec.parts, futures)]
    for i, these in enumerate(lengths[1:], start=1):
        if list(these) != list(lengths[0]):
            label = f"collection[{spec.names[i]!r}]" if spec.names else f"collection[{i}]"
            raise ValueError(f"{label} must have the same rows per partition as the first: got "
                             f"{list(these)} against {list(lengths[0])}")
    return [int(n) for n in lengths[0]]


def _count_rows(client: Any, futures: list[Future]) -> list[int]:
    """Rows of each partition, counted on a worker that holds it: counted anywhere, Dask's work stealing
    could copy a partition to a worker it was not persisted on."""
    wait(futures)
    holders = client.who_has(futures)
    return client.gather([client.submit(len, f, workers=list(holders.get(f.key, ())) or None, pure=False)
                          for f in futures])


def read_partition(worker: Any, futures: tuple[Future, ...]) -> tuple[list[Any], bool]:
    """A partition of every component as numpy, read on ``worker``; and whether it was there already.

    Partitions this worker holds are read from its memory, in the task's
    thread (the worker's mappings are thread-safe: a dict, or zict's, locked
    since zict 3), not through a round trip to its event loop (~0.6 ms
    each). Others are fetched straight from the workers holding them, out of
    the worker's thread pool while waiting: a partition lost with its worker
    is computed again, maybe by this very worker.
    """
    try:
        values, local = [worker.data[f.key] for f in futures], True
    except KeyError:
        with worker_client() as client:
            values, local = client.gather(list(futures)), False
    return [to_numpy(v) for v in values], local


def to_numpy(value: Any) -> Any:
    """A partition as numpy: a DataFrame's as a dict of columns."""
    if hasattr(value, "columns"):  # a pandas DataFrame
        return {c: value[c].to_numpy() for c in value.columns}
    return np.asarray(value)


def one_pass(spec: DaskInput, futures: list[tuple[Future, ...]], read: Any) -> Iterator[Any]:
    """The batches of ``spec.epochs`` passes over partitions ``futures``, each read by ``read(futures[i])``.

    One reader reads everything (the sidecar evaluator): partitions in order,
    or in a new order each epoch with ``shuffle`` (repeatable with ``seed``).
    """
    for epoch in range(spec.epochs or 1):
        rng = np.random.default_rng(None if spec.seed is None else [spec.seed, epoch])
        order = list(range(len(futures)))
        if spec.shuffle:
            rng.shuffle(order)
        batcher = Batcher(spec, rng)
        for i in order:
            batcher.add(read(futures[i]))
            while batcher.ready:
                yield batcher.ready.popleft()
        batcher.flush()
        yield from batcher.ready


def unpublish_later(client: Any, name: str, request: Any = None) -> None:
    """Drop the futures published as ``name`` (after the scheduler plugin answers ``request``, if given:
    a :mod:`daskps.scheduler.messages` request), without blocking whoever dropped them: safe in a
    finalizer, in any thread."""
    async def go() -> None:
        with contextlib.suppress(Exception):  # the cluster is going away: nothing left to free
            if request is not None:
                await client.run_on_scheduler(ask, request, asynchronous=True)
            await client.unpublish_dataset(name, asynchronous=True)

    with contextlib.suppress(Exception):
        client.loop.add_callback(go)


class Batcher:
    """Cuts partitions into batches across their ends; shuffles within a bounded buffer if asked.

    ``add(partition)`` then take from ``ready``; ``flush()`` at the end of an
    epoch batches what is left (the last batch smaller, or dropped with
    ``drop_remainder``). Without shuffling the batches are views of the
    partitions, except the one made of a partition's tail and the next's
    head. Shuffling pools at least ``daskps.data.shuffle-buffer-rows`` rows
    (at least a batch) and puts them in a random order with one copy.
    """

    def __init__(self, spec: Any, rng: np.random.Generator | None = None):
        self.spec = spec  # batch_size, shuffle, drop_remainder, single, names
        self.rng = rng if rng is not None else np.random.default_rng()
        self.ready: deque[Any] = deque()  # batches made, not yet taken
        self.pool: list[list[Any]] = []  # rows not yet batched: segments, each a list over components
        self.window = max(setting("data_shuffle_buffer_rows"), spec.batch_size)

    def add(self, part: list[Any]) -> None:
        size, pooled = self.spec.batch_size, sum(_rows(seg[0]) for seg in self.pool)
        if self.spec.shuffle:
            self.pool.append(part)
            if pooled + _rows(part[0]) >= self.window:
                self._emit(keep_tail=True)
            return
        if pooled and pooled + _rows(part[0]) >= size:
            # The rows left over make one batch with this partition's head: copying those rows, not
            # the whole partition (the rest are batched as views).
            need = size - pooled
            self.pool.append([slice_rows(b, 0, need) for b in part])
            self._emit(keep_tail=True)
            part = [slice_rows(b, need, _rows(b)) for b in part]
        self.pool.append(part)
        self._emit(keep_tail=True)

    def flush(self) -> None:
        if self.pool:
            self._emit(keep_tail=False)

    def batch(self, columns: list[Any]) -> Any:
        """A batch in the collection's shape: one array (or dict of columns), a tuple, or a dict."""
        spec = self.spec
        if spec.single:
            return columns[0]
        if spec.names is not None:
            return dict(zip(spec.names, columns))
        return tuple(columns)

    def _emit(self, keep_tail: bool) -> None:
        """Batch the pool (shuffled first if asked): full batches, and the rest unless ``keep_tail``."""
        size = self.spec.batch_size
        if len(self.pool) == 1 and not self.spec.shuffle:
            columns = self.pool[0]
        else:
            columns = _joined(self.pool, self.rng if self.spec.shuffle else None)
        self.pool = []
        n = _rows(columns[0])
        full = n - n % size
        if self.spec.single and not isinstance(columns[0], dict):  # one array: its views are the batches
            a = columns[0]
            self.ready.extend(a[s:s + size] for s in range(0, full, size))
        else:
            self.ready.extend(self.batch([slice_rows(a, s, s + size) for a in columns]) for s in range(0, full, size))
        if full < n:
            rest = [slice_rows(a, full, n) for a in columns]
            if keep_tail:
                self.pool = [rest]
            elif not self.spec.drop_remainder:
                self.ready.append(self.batch(rest))


def _joined(segments: list[list[Any]], rng: np.random.Generator | None) -> list[Any]:
    """The segments' rows as one array per component: in order, or scattered to a random permutation.

    Shuffling scatters each segment straight to its rows' new places: one
    copy of the data, not a concatenation and then a permuted copy.
    """
    n = sum(_rows(seg[0]) for seg in segments)
    perm = rng.permutation(n) if rng is not None else None
    out: list[Any] = []
    for c, first in enumerate(segments[0]):
        if isinstance(first, dict):
            out.append({col: _scatter([seg[c][col] for seg in segments], perm) for col in first})
        else:
            out.append(_scatter([seg[c] for seg in segments], perm))
    return out


def _scatter(arrays: list[np.ndarray], perm: np.ndarray | None) -> np.ndarray:
    if perm is None:
        return np.concatenate(arrays)
    n = len(perm)
    out = np.empty((n, *arrays[0].shape[1:]), dtype=np.result_type(*arrays))
    at = 0
    for a in arrays:
        out[perm[at:at + len(a)]] = a
        at += len(a)
    return out


def _rows(a: Any) -> int:
    return len(next(iter(a.values()))) if isinstance(a, dict) else len(a)


def take_rows(a: Any, index: np.ndarray) -> Any:
    return {c: v[index] for c, v in a.items()} if isinstance(a, dict) else a[index]


def slice_rows(a: Any, start: int, stop: int) -> Any:
    return {c: v[start:stop] for c, v in a.items()} if isinstance(a, dict) else a[start:stop]
