"""``EmbeddingTable``: embedding rows keyed by any int64, spread over every parameter server.

Recommendation models look up ids with no upper bound (user ids, item ids,
hashed feature crosses). An ``EmbeddingTable`` has one part on each
parameter server; key ``k`` lives on server ``splitmix64(k) % num_servers``
(:mod:`daskps._core.hashing`), where its row is made the first time a lookup
admits it. The rules for admission, eviction and capacity are written out
in :mod:`daskps.server.hash_table`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from daskps._core import views
from daskps._core.hashing import server_of
from daskps._core.updates import check_keys
from daskps.client import protocol, refs
from daskps.client.refs import Ref
from daskps.client.routing import LOCAL
from daskps.distribute import context
from daskps.server.ops import EVICT, KEYS, ROWS, STAT_FIELDS, STATS, HashSpec
from daskps.variables.variable import new_key

__all__ = ["EmbeddingTable"]


def _count(value: Any, arg: str, low: int, optional: bool = True) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{arg} must be an int >= {low}{' or None' if optional else ''}, got {value!r}")
    return int(value)


class EmbeddingTable:
    """Rows of ``dim`` numbers for any int64 key, made on first sight, on every parameter server.

    Parameters
    ----------
    dim : int
        The length of each row.
    initializer : callable, optional
        ``initializer(shape, dtype)`` makes new rows (``shape`` is ``(n, dim)``);
        it runs on the parameter servers. Zeros by default.
    dtype : numpy dtype
        Of the rows (a float type).
    key_dtype : numpy dtype
        ``np.int64`` (any integer ids are taken) or ``np.int32`` (ids must fit).
    admit_after : int
        A key gets a row at its ``admit_after``-th sighting in lookups; until
        then it reads zeros and its gradients are dropped.
    evict_after_steps : int, optional
        :meth:`evict` removes rows not updated in that many gradient steps.
    capacity : int, optional
        The most rows the table holds: each server keeps at most its share,
        dropping the least recently used rows first.
    name : str, optional

    Made inside ``strategy.scope()`` it has a part on every parameter server;
    outside any scope it lives in this process. Look rows up with
    :func:`daskps.embedding_lookup` and train it with ``IndexedSlices(values,
    keys)`` gradients through any optimizer (rows and their slots are updated
    row by row).
    """

    def __init__(self, dim: int, *, initializer: Callable[..., Any] | None = None, dtype: Any = np.float32,
                 key_dtype: Any = np.int64, admit_after: int = 1, evict_after_steps: int | None = None,
                 capacity: int | None = None, name: str | None = None):
        dim = _count(dim, "dim", 1, optional=False)  # type: ignore[assignment]
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype must be a numpy float dtype, got {dtype!r}") from None
        if dtype.kind != "f":
            raise TypeError(f"dtype must be a float dtype, got {dtype}")
        try:
            key_ok = np.dtype(key_dtype) in (np.dtype("int64"), np.dtype("int32"))
        except (TypeError, ValueError):
            key_ok = False
        if not key_ok:
            raise TypeError(f"key_dtype must be np.int64 or np.int32, got {key_dtype!r}")
        if initializer is not None and not callable(initializer):
            raise TypeError(f"initializer must be callable(shape, dtype), got {type(initializer).__name__}")
        admit_after = _count(admit_after, "admit_after", 1, optional=False)  # type: ignore[assignment]
        evict_after_steps = _count(evict_after_steps, "evict_after_steps", 1)
        capacity = _count(capacity, "capacity", 1)
        name = "embedding_table" if name is None else name
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        mode = context.current_mode()
        strategy: Any = mode.strategy
        in_scope = strategy.variable_creator is not None and mode.replica_context is None
        if in_scope and strategy.group is None:
            raise RuntimeError("create embedding tables on the coordinator, not inside a scheduled function")
        servers = list(strategy.servers) if in_scope else [LOCAL]
        if capacity is not None and capacity < len(servers):
            raise ValueError(f"capacity must be at least the number of parameter servers ({len(servers)}), "
                             f"got {capacity}")
        owner = strategy.group if in_scope else None
        key = new_key(name)
        n = len(servers)
        made = [protocol.table(s, f"{key}/part_{i}", name, HashSpec(
            dim, dtype.str, initializer, admit_after, evict_after_steps,
            None if capacity is None else capacity // n + (i < capacity % n), i, n, np.dtype(key_dtype).str))
            for i, s in enumerate(servers)]
        answers = protocol.create(made, owner)
        failed = [a for a in answers if isinstance(a, BaseException)]
        if failed:
            with contextlib.suppress(Exception):
                protocol.release([(s, op.key) for (s, op), a in zip(made, answers)
                                  if not isinstance(a, BaseException)], owner)
            raise failed[0]
        parts = []
        for server, op in made:
            ref = refs.owned(server, op.key, name, owner)
            ref.recipe = op  # to make it again (empty) should its server be lost
            parts.append(ref)
        self._setup(parts, dim, dtype, np.dtype(key_dtype), name,
                     (admit_after, evict_after_steps, capacity), strategy.token if in_scope else None)

    def _setup(self, parts: list[Ref], dim: int, dtype: np.dtype, key_dtype: np.dtype, name: str,
               rules: tuple, token: str | None) -> None:
        self._parts, self._dim, self._dtype, self._key_dtype = parts, dim, dtype, key_dtype
        self._name, self._rules, self._strategy_token = name, rules, token

    def __reduce__(self) -> Any:
        if self._parts[0].server.is_local and refs.scheduling():
            raise ValueError(f"embedding table {self._name!r} was created outside strategy.scope(), so it lives "
                             "in this process only; create it inside `with strategy.scope():`")
        return (EmbeddingTable._rebuilt, (self._parts, self._dim, self._dtype.str, self._key_dtype.str, self._name, self._rules,
                           self._strategy_token))

    @staticmethod
    def _rebuilt(parts: list[Ref], dim: int, dtype: str, key_dtype: str, name: str, rules: tuple,
                 token: str | None) -> EmbeddingTable:
        table = object.__new__(EmbeddingTable)
        table._setup(parts, dim, np.dtype(dtype), np.dtype(key_dtype), name, rules, token)
        return table

    # -- properties ----------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def key_dtype(self) -> np.dtype:
        return self._key_dtype

    @property
    def trainable(self) -> bool:
        return True

    @property
    def handles(self) -> tuple[Ref, ...]:
        """One handle per part, in server order."""
        return tuple(self._parts)

    @property
    def admit_after(self) -> int:
        return self._rules[0]

    @property
    def evict_after_steps(self) -> int | None:
        return self._rules[1]

    @property
    def capacity(self) -> int | None:
        return self._rules[2]

    @property
    def strategy_token(self) -> str | None:
        return self._strategy_token

    # -- keys ----------------------------------------------------------------------
    def keys_of(self, ids: Any, arg: str = "ids", one_d: bool = False) -> np.ndarray:
        """``ids`` checked as keys of this table (int64)."""
        keys = check_keys(ids, self._name, arg, one_d)
        if self._key_dtype == np.int32 and keys.size:
            lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
            bad = keys[(keys < lo) | (keys > hi)]
            if bad.size:
                raise ValueError(f"{arg} for embedding table {self._name!r} must fit key_dtype int32, got {bad[0]}")
        return keys

    def split(self, keys: np.ndarray) -> list[np.ndarray]:
        """For each part, the positions in ``keys`` of the keys it holds."""
        owner = server_of(keys, len(self._parts))
        return [np.flatnonzero(owner == p) for p in range(len(self._parts))]

    def lookup(self, ids: Any) -> np.ndarray:
        """Rows of ``ids`` (any shape): ``ids.shape + (dim,)``; one call per server, all at once."""
        items, assemble = self.row_plan(ids)
        return assemble(protocol.read([(part.handle, keys) for part, keys in items]))

    def row_plan(self, ids: Any) -> tuple[list[tuple[_Part, np.ndarray]], Callable[[list], np.ndarray]]:
        """What to read for rows ``ids`` (each distinct key once, from its part), and how to assemble
        them: as :func:`daskps.variables.rows.plan_rows` does for tables of fixed rows (used by
        :func:`daskps.read_values`)."""
        keys = self.keys_of(ids)
        uniq, inverse = np.unique(keys.ravel(), return_inverse=True)
        touched = [(p, w) for p, w in enumerate(self.split(uniq)) if len(w)]

        def assemble(values: list) -> np.ndarray:
            found = np.zeros((len(uniq), self._dim), self._dtype)
            for (_, w), rows in zip(touched, values):
                found[w] = rows
            return found[inverse.ravel()].reshape(keys.shape + (self._dim,))

        return [(_Part(self._parts[p]), uniq[w]) for p, w in touched], assemble

    # -- whole-table operations ----------------------------------------------------
    def _each(self, what: str) -> list[np.ndarray]:
        return protocol.table_command([(p, what) for p in self._parts])

    def size(self) -> int:
        """Rows held, on all servers."""
        return int(sum(s[0] for s in self._each(STATS)))

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, rows)`` of every row held, by key."""
        got = protocol.table_command([(p, what) for p in self._parts for what in (KEYS, ROWS)])
        keys = np.concatenate(got[0::2])
        rows = np.concatenate(got[1::2]).reshape(-1, self._dim)
        order = np.argsort(keys, kind="stable")
        return keys[order], rows[order]

    def evict(self) -> int:
        """Remove the rows not updated in the last ``evict_after_steps`` steps; how many went."""
        return int(sum(self._each(EVICT)))

    def stats(self) -> list[dict[str, int]]:
        """Per server: ``rows`` held, ``admitted`` and ``evicted`` so far, gradient rows ``dropped``,
        keys ``pending`` admission, and gradient ``steps``."""
        return [dict(zip(STAT_FIELDS, (int(x) for x in s))) for s in self._each(STATS)]

    def _repr_html_(self) -> str:
        parts = [(ref.server.device, "this process" if ref.server.is_local else ref.server.address, counts)
                 for ref, counts in zip(self._parts, self.stats())]
        rules = f"admit_after={self.admit_after} evict_after_steps={self.evict_after_steps} capacity={self.capacity}"
        return views.html(views.EmbeddingTableView(self._name, self._dim, self._dtype, rules, parts))

    def __repr__(self) -> str:
        where = "this process" if self._parts[0].server.is_local else f"{len(self._parts)} parameter servers"
        return f"<daskps.EmbeddingTable {self._name!r} dim={self._dim} dtype={self._dtype} on {where}>"


class _Part(NamedTuple):
    handle: Ref
