"""Dask DataFrames and Arrays as per-worker input, read where their partitions live.

``from_dask(collection, batch_size, ...)`` checks the collection and the
options and returns a :class:`DaskInput`; ``create_per_worker_dataset`` turns
it into a :class:`~daskps.coordinator.datasets.PerWorkerDataset` by
:func:`dask_dataset`:

1. the collection is persisted on the trainers, unless it was persisted
   already (then its partitions are used where they lie);
2. ``client.who_has`` says where each partition lives; partitions go to the
   trainers holding them, balanced by rows (a trainer short of rows takes
   partitions held elsewhere, or by no trainer);
3. each trainer reads the partitions it was given: from its own worker's
   memory when it holds them, fetched directly from the worker holding them
   otherwise (once: kept for later epochs). Nothing passes through the
   coordinator: only partition keys and row counts travel.

Batches span partition boundaries. With ``shuffle=True`` each epoch reads
the partitions in a new order and shuffles rows within a bounded buffer
(``daskps.data.shuffle-buffer-rows`` rows, at least one partition);
``seed`` makes the order repeatable. At the end of the last epoch ``next``
raises ``StopIteration`` in the scheduled function.

The coordinator keeps the persisted partitions (futures) alive as long as
the dataset; dropping it releases them, and the trainers forget what they
fetched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import uuid
import weakref
from collections.abc import Generator, Iterator
from typing import Any

import dask.config
import numpy as np
from distributed import Future, futures_of, get_client, get_worker, wait

__all__ = ["DaskInput", "dask_dataset", "from_dask"]


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

    def __repr__(self) -> str:
        return (f"DaskInput({len(self.parts)} collection(s), {self.npartitions} partitions, "
                f"batch_size={self.batch_size}, shuffle={self.shuffle}, epochs={self.epochs})")

    @property
    def npartitions(self) -> int:
        return _npartitions(self.parts[0])


def from_dask(collection: Any, batch_size: int, *, shuffle: bool = False, seed: int | None = None,
              epochs: int | None = 1, drop_remainder: bool = False) -> DaskInput:
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
        Drop each trainer's last, smaller batch of an epoch.

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
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, numbers.Integral) or epochs < 1):
        raise ValueError(f"epochs must be an integer >= 1 or None (repeat forever), got {epochs!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    return DaskInput(parts, names, not isinstance(collection, (tuple, dict)), int(batch_size), bool(shuffle),
                     None if seed is None else int(seed), None if epochs is None else int(epochs),
                     bool(drop_remainder))


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


# -- on the coordinator: persist, locate, assign --------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where each partition is read: ``assignment[trainer name]`` lists partition indices."""

    rows: tuple[int, ...]
    assignment: dict[str, tuple[int, ...]]
    moved: int  # partitions given to a trainer that does not hold them


def _partition_futures(client: Any, parts: tuple[Any, ...], trainers: list[str]) -> list[list[Future]]:
    """Each component's futures in partition order: persisted here unless they were already."""
    out = []
    for part in parts:
        held = _held(part)
        if held is None:  # one at a time: Dask warns when frames and arrays are persisted together
            held = _held(client.persist(part, workers=trainers))
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


def make_plan(client: Any, spec: DaskInput, trainers: list[tuple[str, str]]) -> tuple[Plan, list[Future]]:
    """Persist (or find) the partitions, count their rows, and give each trainer its share."""
    addresses = [addr for _, addr in trainers]
    futures = _partition_futures(client, spec.parts, addresses)
    wait([f for fs in futures for f in fs])  # who_has knows only what is computed
    lengths = [_known_rows(p) or client.gather(client.map(len, fs, pure=False)) for p, fs in zip(spec.parts, futures)]
    for i, these in enumerate(lengths[1:], start=1):
        if list(these) != list(lengths[0]):
            label = f"collection[{spec.names[i]!r}]" if spec.names else f"collection[{i}]"
            raise ValueError(f"{label} must have the same rows per partition as the first: got "
                             f"{list(these)} against {list(lengths[0])}")
    who_has = client.who_has([f for fs in futures for f in fs])
    holders = []
    for i in range(len(lengths[0])):
        counts: dict[str, int] = {}
        for fs in futures:
            for addr in who_has.get(fs[i].key, ()):
                counts[addr] = counts.get(addr, 0) + 1
        top = max(counts.values(), default=0)
        holders.append({a for a, c in counts.items() if c == top})
    by_addr, moved = assign([int(n) for n in lengths[0]], holders, addresses)
    names = {addr: name for name, addr in trainers}
    plan = Plan(tuple(int(n) for n in lengths[0]), {names[a]: tuple(sorted(by_addr[a])) for a in addresses}, moved)
    return plan, [f for fs in futures for f in fs]


def assign(rows: list[int], holders: list[set[str]], trainers: list[str]) -> tuple[dict[str, list[int]], int]:
    """Partitions to trainers: to one holding it, unless that trainer has its share of rows already.

    Biggest partitions first; each goes to its least-loaded holder among the
    trainers, or to the least-loaded trainer when every holder has reached
    ``total / len(trainers)`` rows and that trainer has not.
    """
    target = sum(rows) / len(trainers)
    load = {t: 0 for t in trainers}
    out: dict[str, list[int]] = {t: [] for t in trainers}
    moved = 0
    for i in sorted(range(len(rows)), key=lambda i: (-rows[i], i)):
        lightest = min(trainers, key=lambda t: (load[t], trainers.index(t)))
        mine = [t for t in trainers if t in holders[i]]
        pick = min(mine, key=lambda t: (load[t], trainers.index(t))) if mine else lightest
        if load[pick] >= target and load[lightest] < target and pick != lightest:
            pick = lightest
        moved += pick not in holders[i]
        out[pick].append(i)
        load[pick] += rows[i]
    return out, moved


# -- on each trainer: read and batch ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reader:
    """The dataset function stored for the trainers: the plan and the batching options (a few KB)."""

    plan: Plan
    names: tuple[Any, ...] | None
    single: bool
    batch_size: int
    shuffle: bool
    seed: int | None
    epochs: int | None
    drop_remainder: bool
    published: str  # the partitions' futures, published on the scheduler under this name

    def __call__(self, ctx: Any) -> Stream:
        name = str(get_worker().name)
        return Stream(self, self.plan.assignment.get(name, ()), ctx.input_pipeline_id)


class Stream:
    """One trainer's share of the data: each ``iter()`` is a fresh pass over all epochs."""

    def __init__(self, reader: Reader, partitions: tuple[int, ...], index: int):
        self.reader, self.partitions, self.index = reader, partitions, index
        self.fetched: dict[int, list[Any]] = {}  # partitions fetched from other workers, kept for later epochs
        self.futures: list[tuple[Future, ...]] | None = None

    def __iter__(self) -> Iterator[Any]:
        r = self.reader
        epoch = 0
        while r.epochs is None or epoch < r.epochs:
            empty = True
            for batch in self._epoch(epoch):
                empty = False
                yield batch
            if empty:  # no rows here (none assigned, or fewer than a batch dropped): repeating gives none
                return
            epoch += 1

    def _epoch(self, epoch: int) -> Iterator[Any]:
        r = self.reader
        rng = np.random.default_rng(None if r.seed is None else [r.seed, epoch, self.index])
        order = list(self.partitions)
        if r.shuffle:
            rng.shuffle(order)
        window = max(int(dask.config.get("daskps.data.shuffle-buffer-rows", 10_000)), r.batch_size) \
            if r.shuffle else r.batch_size
        pool: list[Any] | None = None
        for i in order:
            part = self._load(i)
            if pool is None or not _rows(pool[0]):
                pool = part
            elif not r.shuffle and _rows(pool[0]) + _rows(part[0]) >= r.batch_size:
                # The rows left over make one batch with this partition's head: copying those
                # rows, not the whole partition (the rest are batched as views).
                need = r.batch_size - _rows(pool[0])
                yield self._batch([_concat(a, _slice(b, 0, need)) for a, b in zip(pool, part)])
                pool = [_slice(b, need, _rows(b)) for b in part]
            else:
                pool = [_concat(a, b) for a, b in zip(pool, part)]
            if _rows(pool[0]) >= window:
                pool = yield from self._emit(pool, rng, keep_tail=True)
        if pool is not None and _rows(pool[0]):
            yield from self._emit(pool, rng, keep_tail=False)

    def _emit(self, pool: list[Any], rng: np.random.Generator, keep_tail: bool) -> Generator[Any, None, list[Any]]:
        """Yield the pool's full batches (shuffled first if asked); return the rows left over."""
        r, n = self.reader, _rows(pool[0])
        if r.shuffle:
            perm = rng.permutation(n)
            pool = [_take(a, perm) for a in pool]
        full = n - n % r.batch_size
        for start in range(0, full, r.batch_size):
            yield self._batch([_slice(a, start, start + r.batch_size) for a in pool])
        rest = [_slice(a, full, n) for a in pool]
        if not keep_tail and full < n and not r.drop_remainder:
            yield self._batch(rest)
        return rest

    def _batch(self, columns: list[Any]) -> Any:
        r = self.reader
        if r.single:
            return columns[0]
        if r.names is not None:
            return dict(zip(r.names, columns))
        return tuple(columns)

    def _load(self, i: int) -> list[Any]:
        """Partition ``i`` of every component, as numpy (a dict of columns for a DataFrame)."""
        if i in self.fetched:
            return self.fetched[i]
        if self.futures is None:
            # Futures from the scheduler, not made from keys here: with them the worker's client
            # hears of a partition Dask recomputes after its worker died.
            self.futures = get_client().get_dataset(self.reader.published)
        futures = self.futures[i]
        data = get_worker().data
        try:
            # Partitions this worker holds are read from its memory here, in the task's thread
            # (the worker's mappings are thread-safe: a dict, or zict's, locked since zict 3),
            # not through a round trip to the worker's event loop (~0.6 ms each).
            values, local = [data[f.key] for f in futures], True
        except KeyError:
            # The worker's client reads the keys this worker holds from its own memory, the
            # others straight from the workers holding them.
            values, local = get_client().gather(list(futures)), False
        out = [_to_numpy(v) for v in values]
        if not local:
            self.fetched[i] = out
        return out


def _to_numpy(value: Any) -> Any:
    if hasattr(value, "columns"):  # a pandas DataFrame
        return {c: value[c].to_numpy() for c in value.columns}
    return np.asarray(value)


def _rows(a: Any) -> int:
    return len(next(iter(a.values()))) if isinstance(a, dict) else len(a)


def _concat(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        return {c: np.concatenate([a[c], b[c]]) for c in a}
    return np.concatenate([a, b])


def _take(a: Any, index: np.ndarray) -> Any:
    return {c: v[index] for c, v in a.items()} if isinstance(a, dict) else a[index]


def _slice(a: Any, start: int, stop: int) -> Any:
    return {c: v[start:stop] for c, v in a.items()} if isinstance(a, dict) else a[start:stop]


class Held:
    """The coordinator's hold on a dataset's partitions: released (and unpublished) when it dies."""

    def __init__(self, client: Any, name: str, futures: list[Future]):
        self.futures = futures
        self._finalizer = weakref.finalize(self, _unpublish, client, name)

    def __repr__(self) -> str:
        return f"<Held {len(self.futures)} partitions>"


def _unpublish(client: Any, name: str) -> None:
    """Drop the published futures without blocking whoever dropped the dataset."""
    async def go() -> None:
        with contextlib.suppress(Exception):  # the cluster is going away: nothing left to free
            await client.unpublish_dataset(name, asynchronous=True)

    with contextlib.suppress(Exception):
        client.loop.add_callback(go)


def dask_dataset(client: Any, spec: DaskInput, trainers: list[tuple[str, str]]) -> tuple[Reader, Held]:
    """The dataset function for the trainers and what the coordinator must hold while it lives."""
    plan, futures = make_plan(client, spec, trainers)
    name = f"daskps-data-{uuid.uuid4().hex}"
    per_partition = [tuple(futures[c * len(plan.rows) + i] for c in range(len(spec.parts)))
                     for i in range(len(plan.rows))]
    client.publish_dataset(per_partition, name=name)
    reader = Reader(plan, spec.names, spec.single, spec.batch_size, spec.shuffle, spec.seed, spec.epochs,
                    spec.drop_remainder, name)
    return reader, Held(client, name, futures)
