"""Pooled lookups: bags of ids combined into one vector each, on the parameter servers.

``embedding_lookup_sparse`` has TensorFlow's ``safe_embedding_lookup_sparse``
meaning. Each server pools the rows it holds for each bag and answers one
partial sum per bag; the trainer adds them up and divides as the combiner
says. A :class:`PooledSlices` gradient goes back the same way, one vector
per bag, and each server spreads it over its rows (see :mod:`daskps._core.bags`).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, NamedTuple

import numpy as np

from daskps._core.bags import REMEMBERED, BagGrad, BagRead, pool, spread
from daskps._core.trees import to_numpy
from daskps._core.updates import coerce_values
from daskps.client import protocol
from daskps.client.routing import holder_here
from daskps.variables.embedding import check_max_norm
from daskps.variables.hashed import EmbeddingTable
from daskps.variables.variable import ShardedVariable, Variable

__all__ = ["Bags", "PooledSlices", "embedding_lookup_sparse"]

COMBINERS = ("sum", "mean", "sqrtn")
_TOKENS = itertools.count(1)  # names this process's lookups on the servers
_LATEST: dict[tuple[str, str], int] = {}  # by (lane, table part key): the highest token sent there
_HOLDER: list[str] = []


def lookup_lane() -> str:
    """Who looks up, for the servers: this process and thread (a thread's messages to a server stay in order)."""
    if not _HOLDER:
        _HOLDER.append(holder_here())
    holder, thread = _HOLDER[0], threading.get_ident()
    return holder.replace("@", f".{thread}@", 1) if "@" in holder else f"{holder}.{thread}"


def _ints(x: Any, arg: str) -> np.ndarray:
    a = to_numpy(x) if not isinstance(x, np.ndarray) else x
    a = np.asarray(a)
    if a.size == 0 and a.dtype.kind == "f":
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise TypeError(f"{arg} must be a 1-D array of integers, got {a.dtype} of shape {a.shape}")
    if a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{arg} must fit in int64, got {a.max()}")
    return a.astype(np.int64, copy=False)


def _ragged(x: Any, arg: str) -> tuple[Any, np.ndarray] | None:
    """``(values, row_lengths)`` of a ragged pair or a RaggedTensor-like object; ``None`` if ``x`` is neither."""
    if isinstance(x, (tuple, list)) and len(x) == 2:
        lengths = _ints(x[1], f"{arg}[1] (row_lengths)")
        if len(lengths) and lengths.min() < 0:
            raise ValueError(f"{arg}[1] (row_lengths) must be >= 0, got {lengths.min()}")
        return x[0], lengths
    if callable(getattr(x, "row_lengths", None)) and hasattr(x, "values"):  # a tf.RaggedTensor
        return x.values, _ints(np.asarray(x.row_lengths()), f"{arg}.row_lengths()")
    return None


def _is_sparse_matrix(x: Any) -> bool:
    return callable(getattr(x, "tocsr", None)) and hasattr(x, "shape") and hasattr(x, "nnz")


class Bags:
    """Bags of ids to pool into one vector each, with TensorFlow's ``safe_embedding_lookup_sparse`` rules.

    Parameters
    ----------
    ids : ``(values, row_lengths)``, a ``scipy.sparse`` matrix, or a ``tf.RaggedTensor``
        Bag ``i`` holds ``values[sum(row_lengths[:i]):][:row_lengths[i]]``,
        as a RaggedTensor of rank 2 does. A sparse matrix (any scipy format,
        read as CSR) has a bag per row: column ``j`` of row ``i`` puts id
        ``j`` in bag ``i`` with its stored value as weight (explicitly
        stored entries only; a CSR matrix's repeated entries count once
        each, other formats go through scipy's ``tocsr()``, which adds
        repeated entries up).
    weights : array of float, or ``(values, row_lengths)``, optional
        One weight per id (with a ragged ``ids``); ``None`` for ones. Not
        with a sparse matrix, whose data are the weights.
    combiner : {"mean", "sum", "sqrtn"}
        ``sum(w * row)``, divided by ``sum(w)`` ("mean") or by
        ``sqrt(sum(w ** 2))`` ("sqrtn"); a zero divisor gives zeros.
    max_norm : float, optional
        Rows are scaled down to this L2 norm before they are combined.
    default_id : int, optional
        The id whose row an empty bag gets; zeros without it.

    As TensorFlow does, ids < 0 are dropped, and with a combiner other than
    "sum" so are ids of weight <= 0; a bag left with no ids is empty.
    Repeated ids in a bag count once each.

    A ``Bags`` remembers the lookups made with it, so that the gradient of
    the pooled vectors (:class:`PooledSlices`) reaches each server as one
    vector per bag, without the ids.

    Examples
    --------
    >>> import numpy as np, daskps as dps
    >>> bags = dps.Bags((np.array([3, 1, 1, 7]), np.array([2, 0, 2])), combiner="sum")
    >>> bags.num_bags, bags.row_lengths.tolist()
    (3, [2, 0, 2])
    """

    def __init__(self, ids: Any, weights: Any = None, *, combiner: str = "mean", max_norm: float | None = None,
                 default_id: int | None = None):
        if combiner not in COMBINERS:
            raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
        check_max_norm(max_norm)
        if default_id is not None and (isinstance(default_id, (bool, np.bool_))
                                       or not isinstance(default_id, (int, np.integer))):
            raise TypeError(f"default_id must be an int or None, got {default_id!r}")
        if _is_sparse_matrix(ids):
            if weights is not None:
                raise TypeError("weights must be None when ids is a scipy.sparse matrix: its stored values are "
                                "the weights")
            csr = ids.tocsr()
            values = np.asarray(csr.indices, np.int64)
            lengths = np.diff(np.asarray(csr.indptr)).astype(np.int64)
            data = np.asarray(csr.data)
            if data.dtype.kind not in "biuf":
                raise TypeError(f"the stored values of ids (a sparse matrix) are its weights and must be numbers, "
                                f"got {data.dtype}")
            if data.dtype.kind == "f" and not np.all(np.isfinite(data)):
                raise ValueError("the stored values of ids (a sparse matrix) are its weights and must be finite")
            w = None if data.size == 0 or bool(np.all(data == 1)) else data.astype(np.float64)
        else:
            pair = _ragged(ids, "ids")
            if pair is None:
                raise TypeError("ids must be a (values, row_lengths) pair, a scipy.sparse matrix or a RaggedTensor, "
                                f"got {type(ids).__name__}")
            values, lengths = _ints(pair[0], "ids values"), pair[1]
            if int(lengths.sum()) != len(values):
                raise ValueError(f"ids: row_lengths add up to {int(lengths.sum())}, but there are {len(values)} ids")
            w = _weights(weights, lengths, len(values))
        self._raw = (values, lengths, w)
        self.combiner, self.max_norm, self.default_id = combiner, max_norm, default_id
        keep = values >= 0
        if w is not None and combiner != "sum":
            keep &= w > 0
        bag = None  # each id's bag number, made when needed
        if not keep.all():
            bag = np.repeat(np.arange(len(lengths)), lengths)
            values, bag, w = values[keep], bag[keep], None if w is None else w[keep]
            lengths = np.bincount(bag, minlength=len(lengths)).astype(np.int64)
        self._empty = lengths == 0
        self._any_empty = bool(self._empty.any())
        if default_id is not None and self._any_empty:
            if bag is None:
                bag = np.repeat(np.arange(len(lengths)), lengths)
            values, lengths, w, bag = _fill(values, lengths, w, bag, self._empty, int(default_id))
        self._values, self._lengths, self._weights, self._bag_of = values, lengths, w, bag
        self._splits: dict[tuple, list[_PartBags]] = {}  # by the table's part keys
        self._looked: dict[str, tuple[str, int]] = {}  # part key -> (lane, token) of the last lookup here
        self._divisor: dict[np.dtype, np.ndarray | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_looked"] = {}  # lookups are this process's: elsewhere the gradient carries the bags
        state["_splits"] = {}  # (made again where needed: they may hold this process's own variables)
        return state

    # -- what the bags hold --------------------------------------------------------------
    @property
    def num_bags(self) -> int:
        return len(self._lengths)

    @property
    def values(self) -> np.ndarray:
        """The ids as given (before ids < 0 and weights <= 0 are dropped)."""
        return self._raw[0]

    @property
    def row_lengths(self) -> np.ndarray:
        return self._raw[1]

    @property
    def weights(self) -> np.ndarray | None:
        return self._raw[2]

    def __repr__(self) -> str:
        return (f"<daskps.Bags {self.num_bags} bags of {len(self._raw[0])} ids combiner={self.combiner!r}"
                f"{'' if self._raw[2] is None else ' weighted'}>")

    # -- the trainer's side of a pooled lookup ---------------------------------------------
    @property
    def _bag(self) -> np.ndarray:
        """Each id's bag number."""
        if self._bag_of is None:
            self._bag_of = np.repeat(np.arange(len(self._lengths)), self._lengths)
        return self._bag_of

    def divisor(self, dtype: np.dtype) -> np.ndarray | None:
        """What each bag's sum is divided by (``None`` for "sum"; 0 for an empty bag)."""
        if dtype not in self._divisor:
            if self.combiner == "sum":
                self._divisor[dtype] = None
            elif self._weights is None:  # the number of ids (or its square root)
                count = self._lengths.astype(dtype)
                self._divisor[dtype] = np.sqrt(count) if self.combiner == "sqrtn" else count
            else:
                w = (np.ones(len(self._values), dtype) if self._weights is None
                     else self._weights.astype(dtype))
                if self.combiner == "sqrtn":
                    w = w * w
                starts = np.zeros(len(self._lengths), np.intp)
                np.cumsum(self._lengths[:-1], out=starts[1:])
                sums = np.zeros(len(self._lengths), dtype)
                full = self._lengths > 0
                if len(w):
                    sums[full] = np.add.reduceat(w, starts[full])
                self._divisor[dtype] = np.sqrt(sums) if self.combiner == "sqrtn" else sums
        return self._divisor[dtype]

    def finish(self, sums: np.ndarray) -> np.ndarray:
        """Each bag's sum divided as the combiner says (``div_no_nan``: zeros where the divisor is 0)."""
        div = self.divisor(sums.dtype)
        if div is None:
            return sums
        shaped = div.reshape((-1,) + (1,) * (sums.ndim - 1))
        if not self._any_empty or self.default_id is not None:  # every divisor > 0
            return sums / shaped
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(shaped > 0, sums / np.where(shaped > 0, shaped, 1), 0).astype(sums.dtype, copy=False)

    def split(self, table: Any) -> list[_PartBags]:
        """The bags' ids on each part of ``table`` that holds some (cached per table)."""
        handles = _handles(table)
        key = tuple(h.key for h in handles)
        found = self._splits.get(key)
        if found is None:
            found = self._splits[key] = self._split(table, handles)
        return found

    def local(self, table: np.ndarray) -> np.ndarray:
        """The pooled vectors of a table held here as an array."""
        rows = table[_check_range(self._values, len(table), "params")]
        sums = np.zeros((self.num_bags,) + table.shape[1:], table.dtype)
        full = np.flatnonzero(self._lengths > 0)
        if len(full):
            sums[full] = pool(rows, self._lengths[full], self._weights, self.max_norm)
        return self.finish(sums)

    def _split(self, table: Any, handles: list[Any]) -> list[_PartBags]:
        """Each part's ids (its own row numbers, narrowed; or keys), bags and weights, in bag order."""
        ids, w = self._values, self._weights
        if isinstance(table, EmbeddingTable):
            keys = table.keys_of(ids, "ids", one_d=True)
            owner = None if len(handles) == 1 else _owner_of_keys(table, keys)
            local, limit = keys, None
        else:
            if table.dtype.kind != "f":
                raise TypeError(f"params {table.name!r} must hold floats to be pooled, got {table.dtype}")
            if not table.shape:
                raise ValueError(f"params {table.name!r} is a scalar: it has no rows to look up")
            n = table.shape[0]
            if self.default_id is not None and not 0 <= self.default_id < n:
                raise IndexError(f"default_id for {table.name!r}: id {self.default_id} is out of range [0, {n})")
            _check_range(ids, n, table.name)
            if isinstance(table, ShardedVariable):
                phys = table.physical(ids)
                offsets = np.asarray(table.row_offsets)
                owner = np.searchsorted(offsets, phys, side="right") - 1
                local, limit = phys - offsets[owner], n
            else:
                owner, local, limit = None, ids, n
        parts = []
        if owner is None:  # one part holds every row: every non-empty bag goes to it whole
            full = np.flatnonzero(self._lengths > 0)
            w_part = None if w is None else w.astype(table.dtype)
            narrowed = local if limit is None else _narrow(local, limit)
            return [_PartBags(handles[0], full, narrowed, _lengths_type(self._lengths[full]), w_part)]
        order = np.argsort(owner, kind="stable")  # each part's ids stay in bag order
        bounds = np.searchsorted(owner[order], np.arange(len(handles) + 1))
        for p, h in enumerate(handles):
            mine = order[bounds[p]:bounds[p + 1]]
            if not len(mine):
                continue
            touched, counts = np.unique(self._bag[mine], return_counts=True)
            part_ids = local[mine] if limit is None else _narrow(local[mine], limit)
            parts.append(_PartBags(h, touched, part_ids, _lengths_type(counts),
                                   None if w is None else w[mine].astype(table.dtype)))
        return parts

    def plan(self, table: Any) -> tuple[list[tuple[_PartBags, BagRead]], Any]:
        """What to read to pool these bags over ``table`` (one ``(part, read)`` per part holding some of their
        ids; ``part.handle`` is where), and how to assemble the answers: as
        :func:`daskps.variables.rows.plan_rows` does for rows."""
        parts = self.split(table)
        token = next(_TOKENS)
        lane = lookup_lane()
        items = []
        for part in parts:
            key = part.handle.key
            _LATEST[lane, key] = max(_LATEST.get((lane, key), 0), token)
            items.append((part, BagRead(part.ids, part.lengths, part.weights, self.max_norm, lane, token)))
        row_shape = (table.dim,) if isinstance(table, EmbeddingTable) else tuple(table.shape[1:])

        def assemble(values: list) -> np.ndarray:
            for part in parts:
                self._looked[part.handle.key] = (lane, token)
            if len(parts) == 1 and len(parts[0].bags) == self.num_bags:
                return self.finish(np.asarray(values[0]))
            sums = np.zeros((self.num_bags,) + row_shape, table.dtype)
            for part, partial in zip(parts, values):
                sums[part.bags] += partial
            return self.finish(sums)

        return items, assemble

    def per_id(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, rows)``: each bag's row of ``values`` for each of its ids, times the id's weight."""
        full = self._lengths > 0
        w = None if self._weights is None else self._weights.astype(values.dtype)
        return self._values.copy(), spread(values[full], self._lengths[full], w)

    def squares(self) -> np.ndarray:
        """Each bag's sum of squared weights (its number of ids when unweighted)."""
        if self._weights is None:
            return self._lengths.astype(np.float64)
        sq = np.zeros(self.num_bags)
        np.add.at(sq, self._bag, self._weights ** 2)
        return sq

    def gradient_parts(self, table: Any, values: np.ndarray) -> list[tuple[Any, str, BagGrad]]:
        """``(handle, "bags", BagGrad)`` for each part of ``table`` (``values``: a row per bag, divided
        already); a part that still holds this lookup's bags gets no ids, one holding none of them an
        empty gradient (every part counts the same steps, as for ``IndexedSlices``)."""
        lane = lookup_lane()
        out = []
        parts = {part.handle.key: part for part in self.split(table)}
        for handle in _handles(table):
            part = parts.get(handle.key)
            if part is None:  # no id here: an empty gradient all the same, so that every part counts the step
                empty = BagGrad(values[:0], np.zeros(0, np.int32), np.zeros(0, np.uint8))
                out.append((handle, "bags", empty))
                continue
            key = part.handle.key
            lane_token = self._looked.pop(key, None)
            token = lane_token[1] if lane_token is not None and lane_token[0] == lane else None  # this process's
            if token is not None and _LATEST.get((lane, key), 0) - token < REMEMBERED:
                grad = BagGrad(values[part.bags], lane=lane, token=token, max_norm=self.max_norm)
            else:
                grad = BagGrad(values[part.bags], part.ids, part.lengths, part.weights, max_norm=self.max_norm)
            out.append((part.handle, "bags", grad))
        return out


class _PartBags(NamedTuple):
    """The bags' ids on one part of a table: which bags (``bags``) and, per bag, its ids there."""

    handle: Any
    bags: np.ndarray  # bag numbers, ascending
    ids: np.ndarray  # the part's own row numbers (or keys), bag after bag
    lengths: np.ndarray
    weights: np.ndarray | None


def _weights(weights: Any, lengths: np.ndarray, n: int) -> np.ndarray | None:
    if weights is None:
        return None
    pair = _ragged(weights, "weights")
    if pair is not None:
        if not np.array_equal(pair[1], lengths):
            raise ValueError("weights must have the same row_lengths as ids")
        weights = pair[0]
    w = np.asarray(to_numpy(weights) if not isinstance(weights, np.ndarray) else weights)
    if w.dtype.kind not in "biuf" or w.shape != (n,):
        raise ValueError(f"weights must be {n} numbers, one per id, got {w.dtype} of shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("weights must be finite numbers")
    return w.astype(np.float64)


def _fill(values: np.ndarray, lengths: np.ndarray, w: np.ndarray | None, bag: np.ndarray, empty: np.ndarray,
          default_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """Put ``default_id`` (weight 1) in each empty bag, keeping the ids in bag order."""
    filled = np.where(empty, 1, lengths)
    starts_old = np.cumsum(lengths) - lengths
    starts_new = np.cumsum(filled) - filled
    at = starts_new[bag] + (np.arange(len(values)) - starts_old[bag])
    out = np.empty(int(filled.sum()), np.int64)
    out[at] = values
    out[starts_new[empty]] = default_id
    new_w = None
    if w is not None:
        new_w = np.empty(len(out), np.float64)
        new_w[at] = w
        new_w[starts_new[empty]] = 1.0
    return out, filled, new_w, np.repeat(np.arange(len(filled)), filled)


def _check_range(ids: np.ndarray, n: int, name: str) -> np.ndarray:
    if len(ids) and (ids.min() < 0 or ids.max() >= n):
        bad = ids.max() if ids.max() >= n else ids.min()
        raise IndexError(f"ids for {name!r}: id {bad} is out of range [0, {n})")
    return ids


def _handles(table: Any) -> list[Any]:
    if isinstance(table, EmbeddingTable):
        return list(table.handles)
    if isinstance(table, ShardedVariable):
        return [v.handle for v in table.variables]
    return [table.handle]


_INT32_MAX = int(np.iinfo(np.int32).max)


def _narrow(ids: np.ndarray, limit: int) -> np.ndarray:
    """Row numbers below ``limit`` in the smallest integer type that holds them (4 bytes for most tables)."""
    return ids.astype(np.int32) if limit <= _INT32_MAX else ids


def _lengths_type(lengths: np.ndarray) -> np.ndarray:
    top = int(lengths.max()) if len(lengths) else 0
    return lengths.astype(np.uint8 if top < 256 else np.uint16 if top < 65536 else np.int64)


def _owner_of_keys(table: EmbeddingTable, keys: np.ndarray) -> np.ndarray:
    from daskps._core.hashing import server_of

    return server_of(keys, len(table.handles)).astype(np.int64)


def _as_params(params: Any) -> Any:
    if isinstance(params, (list, tuple)) and params and all(isinstance(p, Variable) for p in params):
        return params[0] if len(params) == 1 else ShardedVariable(list(params), name="embedding")
    if isinstance(params, (Variable, ShardedVariable, EmbeddingTable)):
        return params
    table = np.asarray(params)
    if table.ndim < 1 or table.dtype.kind != "f":
        raise TypeError(f"params must be a Variable, ShardedVariable, list of Variables, EmbeddingTable or a float "
                        f"array of rank >= 1, got {type(params).__name__}")
    return table


def embedding_lookup_sparse(params: Any, ids: Any, weights: Any = None, *, combiner: str = "mean",
                            max_norm: float | None = None, default_id: int | None = None) -> np.ndarray:
    """One vector per bag of ids: the bag's rows of ``params``, weighted and combined, pooled on the servers.

    TensorFlow's ``tf.nn.safe_embedding_lookup_sparse``: ids < 0 are
    dropped (and, unless ``combiner="sum"``, ids of weight <= 0), an empty
    bag gives zeros or the row of ``default_id``, and each bag gives
    ``sum(w * row)``, divided by ``sum(w)`` for "mean" or by
    ``sqrt(sum(w ** 2))`` for "sqrtn".

    Parameters
    ----------
    params : Variable, ShardedVariable (any layout), list of Variable, EmbeddingTable, or numpy array
    ids : ``(values, row_lengths)``, a ``scipy.sparse`` matrix (column = id, data = weight), or :class:`Bags`
        See :class:`Bags`. Given a ``Bags``, leave ``weights``,
        ``max_norm`` and ``default_id`` unset: the bags carry their own.
    weights : array of float, optional
        One per id, for a ragged ``ids``.
    combiner : {"mean", "sum", "sqrtn"}
    max_norm : float, optional
        Rows are clipped to this L2 norm before they are combined.
    default_id : int, optional

    Returns
    -------
    numpy array of shape ``(number of bags,) + params.shape[1:]``.

    Each parameter server adds up the weighted rows it holds of each bag and
    sends one vector per bag; only those cross the network, never the rows.
    Train the table with ``dps.PooledSlices(grad, bags)``, ``grad`` the
    gradient with respect to the returned vectors.

    Examples
    --------
    >>> import numpy as np, daskps as dps
    >>> table = dps.Variable(np.arange(8, dtype=np.float32).reshape(4, 2))
    >>> dps.embedding_lookup_sparse(table, (np.array([0, 2, 3]), np.array([2, 1])))
    array([[2., 3.],
           [6., 7.]], dtype=float32)
    """
    bags = as_bags(ids, weights, combiner, max_norm, default_id)
    table = _as_params(params)
    if isinstance(table, np.ndarray):
        return bags.local(table)
    items, assemble = bags.plan(table)
    return assemble(protocol.read([(part.handle, read) for part, read in items]))


def as_bags(ids: Any, weights: Any = None, combiner: str = "mean", max_norm: float | None = None,
            default_id: int | None = None) -> Bags:
    if isinstance(ids, Bags):
        if weights is not None or max_norm is not None or default_id is not None or combiner not in (
                "mean", ids.combiner):
            raise ValueError("ids is a dps.Bags, which carries its own weights, combiner, max_norm and default_id: "
                             "leave those arguments unset")
        return ids
    return Bags(ids, weights, combiner=combiner, max_norm=max_norm, default_id=default_id)


class PooledSlices:
    """The gradient of pooled vectors: a row of ``values`` per bag of ``bags``, for the table they were pooled from.

    Parameters
    ----------
    values : array-like (numpy, JAX, torch), shape ``(bags.num_bags,) + row shape``
        The gradient with respect to what :func:`embedding_lookup_sparse` returned.
    bags : Bags
        The bags that lookup pooled.

    ``optimizer.apply_gradients([(dps.PooledSlices(g, bags), table)])``
    sends each server one vector per bag (without the ids when the server
    still holds the lookup's bags: it keeps the last few of each process);
    the server multiplies it by each id's weight and the combiner's factor
    (and, with ``max_norm``, runs it through the clipping of each row it
    clipped) and updates those rows, as the gradient TensorFlow computes for
    ``safe_embedding_lookup_sparse`` (an ``IndexedSlices`` with a row per
    id, :meth:`to_indexed_slices`) would.
    """

    __slots__ = ("values", "bags")

    def __init__(self, values: Any, bags: Bags):
        if not isinstance(bags, Bags):
            raise TypeError(f"bags must be a dps.Bags, got {type(bags).__name__}")
        values = np.asarray(to_numpy(values) if not isinstance(values, np.ndarray) else values)
        if values.ndim < 2 or values.shape[0] != bags.num_bags:
            raise ValueError(f"values must have a row per bag, shape ({bags.num_bags}, ...), got {values.shape}")
        self.values, self.bags = values, bags

    def to_indexed_slices(self) -> Any:
        """The same gradient as TensorFlow gives it: a row per id (weighted, divided by the combiner's
        divisor); without ``max_norm`` (the clipping's part needs the rows, which only the servers have)."""
        if self.bags.max_norm is not None:
            raise ValueError("to_indexed_slices needs the rows to take the gradient through max_norm's clipping: "
                             "apply the PooledSlices itself, whose servers do")
        from daskps._core.slices import IndexedSlices

        ids, rows = self.bags.per_id(self.bags.finish(self.values))
        return IndexedSlices(rows, ids)

    def __repr__(self) -> str:
        return f"<daskps.PooledSlices values={self.values.shape} bags={self.bags!r}>"


def check_pooled(table: Any, grad: PooledSlices) -> tuple[np.ndarray, np.ndarray]:
    """``(values divided by the divisor, per bag sum of squared weights)`` of a table's pooled gradient, checked."""
    row_shape = (table.dim,) if isinstance(table, EmbeddingTable) else tuple(table.shape[1:])
    if grad.values.shape[1:] != row_shape:
        raise ValueError(f"gradient values for {table.name!r} must have shape {(grad.bags.num_bags,) + row_shape}, "
                         f"got {grad.values.shape}")
    values = coerce_values(grad.values, table.dtype, table.name, "gradient values")
    return grad.bags.finish(values), grad.bags.squares()
