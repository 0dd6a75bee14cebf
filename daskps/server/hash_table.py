"""A table keyed by any int64: one server's part of an :class:`daskps.EmbeddingTable`.

Rows live in one growing numpy array (the *arena*), found through a
:class:`daskps._core.hashing.KeyIndex`; each optimizer's slots are arrays of
the arena's shape, so the dense optimizers' row-local update runs unchanged
on the rows a gradient names. A freed row's place is reused, its slots
reset as the optimizer's ``init`` makes them.

The rules, exactly (``tests/embeddings/test_hash_table.py`` checks them against a
reference written from this text):

- **Clock.** Every lookup and every gradient this part receives advances
  its *use clock* by one; every gradient advances its *step* by one (the
  client sends every gradient to every part, so all parts count the same
  steps). A row records the use clock of the last lookup or gradient that
  named it, and the step of the last gradient that updated it (its creation
  counts as an update).
- **Admission.** A lookup counts one *sighting* of each distinct key it
  names that has no row. At its ``admit_after``-th sighting the key gets a
  row, made by the initializer; before that a lookup reads zeros for it and
  gradients for it are dropped (``dropped`` counts, per gradient, the
  distinct keys dropped: a gradient's repeated keys are summed first).
- **Capacity.** After a lookup makes rows, while the part holds more than
  its share of ``capacity``, it removes the row with the oldest use clock,
  the smallest key first among equals.
- **Age.** ``evict()`` removes every row whose last update is
  ``evict_after_steps`` or more steps old.
- A removed row takes its optimizer slots with it; a key seen again starts
  afresh (sightings, initializer, slots).
- **Restore** (into any number of parts): each part takes the saved rows
  whose keys are now its own, with their slots and step of last update; a
  row's use clock keeps its age (its old part's lookups and gradients since
  it was used), counted back from the newest saved clock; pending sightings
  start afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import numpy as np
from fsspec import AbstractFileSystem

from daskps._core import bags, ckpt_io, transforms
from daskps._core.arrays import call_initializer
from daskps._core.hashing import KeyIndex, mix, server_of
from daskps._core.transforms import Transform
from daskps._core.updates import check_keys
from daskps.server.ops import (
    CLOCKS_TENSOR,
    EVICT,
    KEYS,
    KEYS_TENSOR,
    ROWS,
    STAT_FIELDS,
    STATS,
    UPDATED_TENSOR,
    USED_TENSOR,
    HashSpec,
)
from daskps.server.tables import Staged, Table

_RECENT = 4  # lookups whose rows a part keeps for the gradients that follow
_NEVER = np.iinfo(np.int64).max  # the use clock of an arena row that holds no key: never the least recent


def _kth_smallest(a: np.ndarray, k: int, chunk: int = 1 << 16) -> Any:
    """The ``k``-th smallest of ``a`` (1-based), sorting no copy of more than ``chunk`` + ``k`` values at a time.

    ``np.partition`` copies the whole array; for a part's use clocks that is a
    temporary as large as a column of the table, at every lookup that evicts.
    """
    best = a[:0]
    for start in range(0, len(a), chunk):
        part = np.concatenate([best, a[start:start + chunk]])
        best = np.partition(part, k - 1)[:k] if len(part) > k else part
    return np.partition(best, k - 1)[k - 1]


class HashTable(Table):
    """Rows by int64 key, made on first sight (see the module's rules)."""

    def __init__(self, name: str, spec: HashSpec):
        self.name = name
        self.spec = spec
        self.dtype = np.dtype(spec.dtype)
        self._reset()

    def _reset(self) -> None:
        """Empty: no rows, slots, sightings or counts."""
        self.slots = {}
        self._transforms: dict[str, Transform] = {}
        self._index = KeyIndex(self._keys_at)
        self._values = np.zeros((0, self.spec.dim), self.dtype)
        self._key = np.zeros(0, np.int64)  # by arena row
        self._used = np.zeros(0, np.int64)  # use clock of the last lookup or gradient
        self._updated = np.zeros(0, np.int64)  # step of the last update
        self._live = np.zeros(0, bool)
        self._n_live = 0
        self._free = np.zeros(0, np.int64)  # arena rows to reuse, used last first
        self._top = 0  # arena rows ever handed out
        self._sightings: dict[int, int] = {}
        self._recent: list[tuple[np.ndarray, np.ndarray]] = []  # the last lookups' (keys, rows)
        self.clock = self.steps = 0
        self.admitted = self.evicted = self.dropped = 0

    def _keys_at(self, rows: np.ndarray) -> np.ndarray:
        return self._key[rows]

    # -- reads ---------------------------------------------------------------------
    def read(self, index: object, shared: bool) -> np.ndarray:
        keys = check_keys(index, self.name, "ids", one_d=True)
        return self.lookup(keys)

    def pool(self, ids: np.ndarray, lengths: np.ndarray, weights: np.ndarray | None,
             max_norm: float | None) -> np.ndarray:
        """As a lookup of the distinct keys (one sighting each), then pooled bag by bag."""
        keys = check_keys(ids, self.name, "ids", one_d=True)
        uniq, inverse = np.unique(keys, return_inverse=True)
        return bags.pool(self.lookup(uniq)[inverse.ravel()], lengths, weights, max_norm)

    def peek(self, ids: np.ndarray) -> np.ndarray:
        """Rows of keys ``ids`` (zeros for keys without one), changing nothing."""
        keys = check_keys(ids, self.name, "ids", one_d=True)
        rows = self._index.find(keys, mix(keys))
        out = np.zeros((len(keys), self.spec.dim), self.dtype)
        held = rows >= 0
        out[held] = self._values[rows[held]]
        return out

    def command(self, what: str) -> np.ndarray:
        """A :class:`~daskps.server.ops.TableCommand`: the keys or rows held (by key), the counts, or an eviction."""
        if what in (KEYS, ROWS):
            live = np.flatnonzero(self._live)
            order = live[np.argsort(self._key[live], kind="stable")]  # by key: the same on every call
            return self._key[order] if what == KEYS else self._values[order]
        if what == STATS:
            return np.array(list(self.counts().values()), np.int64)
        if what == EVICT:
            return np.array(self.evict(), np.int64)
        raise ValueError(f"embedding table {self.name!r} has no command {what!r}")

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Rows of distinct ``keys``: made on first (admitted) sight; zeros for keys not admitted."""
        rows = self._index.find(keys, self._mine(keys))
        held = rows >= 0
        if held.all():  # the usual case once a model warms up
            self.clock += 1
            self._used[rows] = self.clock
            self._remember(keys, rows)
            return self._values[rows]
        new = np.flatnonzero(~held)
        if len(np.unique(keys[new])) != len(new):
            raise ValueError(f"ids sent to a part of embedding table {self.name!r} must be distinct")
        admit = self._admissions(keys[new])
        made_keys = keys[new[admit]]
        made = self._initial(len(made_keys))  # may raise: nothing has changed yet
        self.clock += 1
        self._used[rows[held]] = self.clock
        out = np.zeros((len(keys), self.spec.dim), self.dtype)
        out[held] = self._values[rows[held]]
        out[new[admit]] = made
        self._count_sightings(keys[new], admit)
        if len(made_keys):
            if self._n_live - int(np.count_nonzero(held)) >= len(made_keys):
                # The rows to go are certain to be ones this lookup did not touch (theirs are the
                # newest): remove them first, so that a full part never holds more than its share.
                self._fit_capacity(room=len(made_keys))
            self._add(made_keys, made)
            self._fit_capacity()
        return out

    def _remember(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Keep the rows of a lookup whose keys all have rows: its gradient usually names the same keys."""
        self._recent = [(keys.copy(), rows), *self._recent[:_RECENT - 1]]

    def _find(self, keys: np.ndarray, mixed: np.ndarray) -> np.ndarray:
        for seen, rows in self._recent:
            if len(seen) == len(keys) and np.array_equal(seen, keys):
                return rows
        return self._index.find(keys, mixed)

    def _mine(self, keys: np.ndarray) -> np.ndarray:
        """``mix(keys)``, having checked that every key belongs to this part."""
        mixed = mix(keys)
        if self.spec.parts > 1 and len(keys):
            wrong = (mixed % np.uint64(self.spec.parts)).astype(np.int64) != self.spec.part
            if wrong.any():
                raise ValueError(f"key {keys[wrong][0]} does not belong to part {self.spec.part} of "
                                 f"embedding table {self.name!r}")
        return mixed

    def _admissions(self, keys: np.ndarray) -> np.ndarray:
        """Which of the row-less ``keys`` this sighting admits (nothing changes here)."""
        need = self.spec.admit_after
        if need <= 1:
            return np.ones(len(keys), bool)
        seen = self._sightings
        return np.array([seen.get(k, 0) + 1 >= need for k in keys.tolist()], bool)

    def _count_sightings(self, keys: np.ndarray, admitted: np.ndarray) -> None:
        if self.spec.admit_after <= 1:
            return
        seen = self._sightings
        for k, a in zip(keys.tolist(), admitted.tolist()):
            if a:
                seen.pop(k, None)
            else:
                seen[k] = seen.get(k, 0) + 1

    def _initial(self, n: int) -> np.ndarray:
        shape = (n, self.spec.dim)
        if self.spec.initializer is None or n == 0:
            return np.zeros(shape, self.dtype)
        made = np.asarray(call_initializer(self.spec.initializer, shape, self.dtype))
        if made.shape != shape:
            raise ValueError(f"the initializer of embedding table {self.name!r} returned shape {made.shape} "
                             f"for shape {shape}")
        if made.dtype.kind not in "biuf":
            raise TypeError(f"the initializer of embedding table {self.name!r} returned dtype {made.dtype}")
        return made.astype(self.dtype, copy=False)

    # -- rows in and out -----------------------------------------------------------
    def _add(self, keys: np.ndarray, values: np.ndarray) -> None:
        self._recent = []  # rows are about to move
        rows = self._allocate(len(keys))
        self._values[rows] = values
        self._key[rows], self._used[rows], self._updated[rows] = keys, self.clock, self.steps
        self._live[rows] = True
        self._n_live += len(rows)
        for opt_key, state in list(self.slots.items()):
            fresh = self._transforms[opt_key].init(self._values[rows])
            for field, value in transforms.slot_arrays(fresh).items():
                getattr(state, field)[rows] = value
        self._index.insert(keys, rows)
        self.admitted += len(keys)

    def _allocate(self, n: int) -> np.ndarray:
        reuse = self._free[len(self._free) - min(n, len(self._free)):]
        self._free = self._free[: len(self._free) - len(reuse)]
        fresh = np.arange(self._top, self._top + n - len(reuse))
        self._top += len(fresh)
        if self._top > len(self._values):
            share = self.spec.capacity
            if share is None:  # unbounded: double
                self._grow(max(self._top, 2 * len(self._values), 64))
            else:  # bounded: the share; more only when one lookup makes more rows than others held
                self._grow(share if self._top <= share else max(self._top, share + max(1024, share // 32)))
                self._index.reserve(len(self._values))  # and its index, once
        return np.concatenate([reuse, fresh]).astype(np.int64)

    def _grow(self, size: int) -> None:
        def grown(a: np.ndarray, fill: Any = 0) -> np.ndarray:
            out = np.full((size,) + a.shape[1:], fill, a.dtype)
            out[: len(a)] = a
            return out

        self._values, self._key, self._used = grown(self._values), grown(self._key), grown(self._used, _NEVER)
        self._updated, self._live = grown(self._updated), grown(self._live)
        self.slots = {k: s._replace(**{f: grown(a) for f, a in transforms.slot_arrays(s).items()})
                      for k, s in self.slots.items()}

    def _remove(self, rows: np.ndarray) -> int:
        if len(rows):
            self._recent = []
            self._index.delete(self._key[rows])
            self._live[rows] = False
            self._used[rows] = _NEVER
            self._n_live -= len(rows)
            self._free = np.concatenate([self._free, rows])
            self.evicted += len(rows)
        return len(rows)

    def _fit_capacity(self, room: int = 0) -> None:
        """Remove the least recently used rows (smallest key first among equals) down to the share less ``room``."""
        share = self.spec.capacity
        over = self._n_live + room - share if share is not None else 0
        if over <= 0:
            return
        used = self._used[: self._top]  # rows holding no key have _NEVER
        cut = _kth_smallest(used, over)  # the use clock of the last row to go
        older = np.flatnonzero(used < cut)
        ties = np.flatnonzero(used == cut)
        ties = ties[np.argsort(self._key[ties], kind="stable")][: over - len(older)]
        self._remove(np.concatenate([older, ties]))

    def evict(self) -> int:
        """Remove rows not updated in the last ``evict_after_steps`` steps; how many went."""
        k = self.spec.evict_after_steps
        if k is None:
            return 0
        live = np.flatnonzero(self._live)
        return self._remove(live[self._updated[live] <= self.steps - k])

    # -- updates and gradients -----------------------------------------------------
    def check_update(self, op: str, payload: object) -> object:
        raise TypeError(f"embedding table {self.name!r} changes through gradients and evict(), not {op!r}")

    def apply_update(self, op: str, checked: object) -> None:  # pragma: no cover - check_update refuses all
        raise TypeError(op)

    def check_gradient(self, kind: str, gradient: object, optimizer: str) -> tuple[str, object]:
        transforms.check_trainable(self.dtype, self.name, optimizer)
        if kind != "rows" or not isinstance(gradient, tuple) or len(gradient) != 2:
            raise TypeError(f"gradients for embedding table {self.name!r} must be IndexedSlices(values, keys)")
        keys = check_keys(gradient[0], self.name, "gradient keys", one_d=True)
        mixed = self._mine(keys)
        values = np.asarray(gradient[1])
        if values.dtype.kind not in "biuf" or not np.can_cast(values.dtype, self.dtype, "same_kind"):
            raise TypeError(f"gradient values for embedding table {self.name!r} must be castable to "
                            f"{self.dtype}, got {values.dtype}")
        if values.shape != (len(keys), self.spec.dim):
            raise ValueError(f"gradient values for embedding table {self.name!r} must have shape "
                             f"{(len(keys), self.spec.dim)}, got {values.shape}")
        return "rows", (keys, values.astype(self.dtype, copy=False), mixed)

    def apply_gradient(self, opt_key: str, transform: Transform, checked: tuple[str, object], lazy_sparse: bool,
                       times: int = 1) -> None:
        keys, values, mixed = cast(tuple[np.ndarray, np.ndarray, np.ndarray], checked[1])
        self.steps += times
        self.clock += times
        rows = self._find(keys, mixed)
        held = rows >= 0
        if not held.all():
            self.dropped += int(np.count_nonzero(~held))
            rows, values = rows[held], values[held]
        self._transforms[opt_key] = transform
        state = self.slots.get(opt_key)
        if state is None:
            state = transform.init(self._values)
        # Always row-local: a hash table has no dense form to scatter into.
        self.slots[opt_key] = transforms.apply_gradient(transform, self._values, state, "rows", (rows, values), True,
                                                        times)
        self._updated[rows] = self.steps
        self._used[rows] = self.clock

    # -- sizes ---------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """``STAT_FIELDS``: rows held, admitted and evicted so far, gradient rows dropped, keys pending, steps."""
        values = (self._n_live, self.admitted, self.evicted, self.dropped,
                  len(self._sightings), self.steps)
        return dict(zip(STAT_FIELDS, values))

    def info(self) -> tuple[str, tuple[int, ...], str]:
        return self.name, (self._n_live, self.spec.dim), self.dtype.str

    def nbytes(self) -> int:
        arrays = (self._values, self._key, self._used, self._updated, self._live, self._free)
        return int(sum(a.nbytes for a in arrays) + self._index.nbytes())

    # -- checkpoints ---------------------------------------------------------------
    def save(self, fs: AbstractFileSystem, root: str, tensor: str, offset: int,
             optimizers: Sequence[tuple[str, str]]) -> list[ckpt_io.Written]:
        """Evict by age, then write keys, rows, their clocks and slots as pieces at ``offset``.

        ``offset`` only names this part's files: the coordinator numbers the
        parts' rows one after another in the manifest.
        """
        self.evict()
        live = np.flatnonzero(self._live)
        live = live[np.argsort(self._key[live], kind="stable")]
        states = []
        for opt_path, opt_key in optimizers:
            state = self.slots.get(opt_key)
            if state is not None:
                slots = {f: a[live] for f, a in transforms.slot_arrays(state).items()}
                states.append((opt_path, state.count, slots))
        records = ckpt_io.write_with_slots(fs, root, tensor, offset, self._values[live], states)
        for suffix, array in ((KEYS_TENSOR, self._key[live]), (UPDATED_TENSOR, self._updated[live]),
                              (USED_TENSOR, self._used[live]),
                              (CLOCKS_TENSOR, np.array([[self.steps, self.clock]], np.int64))):
            records.append(ckpt_io.write_piece(fs, root, tensor + suffix, offset, array))
        return records

    def stage(self, fs: AbstractFileSystem, root: str, spec: Any) -> Staged:
        """Read the rows of a saved table (any number of parts) whose keys belong to this part."""
        def whole(name: str, row_shape: tuple, dtype: Any) -> np.ndarray:
            pieces = spec.pieces[name]
            rows = sum(p["rows"] for p in pieces)
            return ckpt_io.read_rows(fs, root, 0, rows, pieces, row_shape, np.dtype(dtype))

        keys = whole(KEYS_TENSOR, (), np.int64)
        if np.dtype(self.spec.key_dtype) == np.int32 and len(keys):
            info = np.iinfo(np.int32)
            outside = keys[(keys < info.min) | (keys > info.max)]
            if len(outside):
                raise ValueError(f"embedding table {self.name!r} has key_dtype int32; the checkpoint holds "
                                 f"key {outside[0]}, which does not fit")
        mine = server_of(keys, self.spec.parts) == self.spec.part if self.spec.parts > 1 else np.ones(len(keys), bool)
        dim = (self.spec.dim,)
        values = whole("", dim, self.dtype)[mine]
        clocks = whole(CLOCKS_TENSOR, (2,), np.int64)
        slots: dict[str, tuple[int, dict[str, np.ndarray]] | None] = {}
        for opt_key, saved in spec.slots.items():
            if saved is None:
                slots[opt_key] = None
                continue
            arrays = {}
            for slot, pieces in saved.pieces.items():
                total = sum(p["rows"] for p in pieces)
                arrays[slot] = ckpt_io.read_rows(fs, root, 0, total, pieces, dim, self.dtype)[mine]
            slots[opt_key] = (int(saved.step), arrays)
        # Use clocks are each old part's own: keep each row's age (its old part's lookups and
        # gradients since it was used), counted back from the newest of those clocks.
        saved_part = np.repeat(np.arange(len(clocks)), [p["rows"] for p in spec.pieces[KEYS_TENSOR]])
        clock = int(clocks[:, 1].max(initial=0))
        age = clocks[saved_part, 1] - whole(USED_TENSOR, (), np.int64)
        rows = _Restored(keys[mine], values, whole(UPDATED_TENSOR, (), np.int64)[mine], (clock - age)[mine],
                         int(clocks[:, 0].max(initial=0)), clock)
        return Staged(rows, slots)

    def commit(self, staged: Staged, optimizers: dict[str, Transform]) -> None:
        """Replace everything with the staged rows (pending sightings start afresh)."""
        got: _Restored = staged.value
        self._reset()
        n = len(got.keys)
        self._grow(max(n, 64))
        rows = np.arange(n)
        self._values[rows], self._key[rows] = got.values, got.keys
        self._updated[rows], self._used[rows], self._live[rows] = got.updated, got.used, True
        self._top, self._n_live, self.admitted = n, n, n
        self._index.insert(got.keys, rows)
        self.steps, self.clock = got.steps, got.clock
        for opt_key, saved in staged.slots.items():
            if saved is None:
                continue
            count, arrays = saved
            padded = {k: np.concatenate([a, np.zeros((len(self._values) - n,) + a.shape[1:], a.dtype)])
                      for k, a in arrays.items()}
            self.slots[opt_key] = transforms.state_from_slots(optimizers[opt_key], self._values, count, padded)
            self._transforms[opt_key] = optimizers[opt_key]
        self._fit_capacity()  # restored into fewer servers, or a smaller capacity: the share holds


class _Restored(NamedTuple):
    keys: np.ndarray
    values: np.ndarray
    updated: np.ndarray
    used: np.ndarray
    steps: int
    clock: int
