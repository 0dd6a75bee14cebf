"""``ShardedVariable``: one logical variable split by rows over several variables.

Shard *i* holds rows ``offsets[i]:offsets[i + 1]`` of the whole. Every
operation works out which shards and rows it touches from those offsets, so
it works for any row layout (not only the "div" one the strategy makes), and
sends one call to each parameter server involved, all at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from daskps._arraylike import ArrayLike
from daskps.updates import BATCH_SCATTER, check_indices, check_update
from daskps.variables import Variable, apply_updates, fetch

__all__ = ["ShardedVariable", "embedding_lookup", "gather_rows"]


class ShardedVariable(ArrayLike):
    """Variables that together make one larger variable, split along axis 0.

    Parameters
    ----------
    variables : list of Variable
        The shards, in row order: same dtype, same shape past axis 0.
    name : str
        The name of the whole (``ParameterServerStrategy`` uses the
        variable's name and names the shards ``name/part_i``).

    Examples
    --------
    >>> import daskps as dps
    >>> sv = dps.ShardedVariable([dps.Variable([[0.0], [1.0]]), dps.Variable([[2.0]])])
    >>> sv.shape, [v.shape for v in sv]
    ((3, 1), [(2, 1), (1, 1)])
    >>> sv[::-1, 0]
    array([2., 1., 0.], dtype=float32)
    >>> sv.scatter_add(dps.IndexedSlices([[5.0], [5.0]], [2, 2])).numpy()[:, 0]
    array([ 0.,  1., 12.], dtype=float32)
    """

    def __init__(self, variables: Sequence[Variable], name: str = "ShardedVariable"):
        if (
            not isinstance(variables, Sequence)
            or isinstance(variables, (str, bytes))
            or not variables
            or any(not isinstance(v, Variable) for v in variables)
        ):
            raise TypeError(f"variables must be a non-empty list of daskps.Variable, got {variables!r}")
        dtypes = [v.dtype for v in variables]
        if len(set(dtypes)) > 1:
            raise ValueError(f"all variables must have the same dtype, got {[str(d) for d in dtypes]}")
        shapes = [v.shape for v in variables]
        if any(not s for s in shapes) or len({s[1:] for s in shapes}) > 1:
            raise ValueError(f"all variables must have rank >= 1 and equal shapes past axis 0, got {shapes}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        self._variables = list(variables)
        self._name = name
        self._offsets = [0]
        for s in shapes:
            self._offsets.append(self._offsets[-1] + s[0])
        self._shape = (self._offsets[-1],) + shapes[0][1:]

    def __reduce__(self):
        return (ShardedVariable, (self._variables, self._name))

    @property
    def variables(self) -> list[Variable]:
        """The shards, in row order."""
        return list(self._variables)

    @property
    def _shard_variables(self) -> list[Variable]:
        return self._variables

    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._variables[0].dtype

    @property
    def trainable(self) -> bool:
        return all(v.trainable for v in self._variables)

    def __iter__(self) -> Iterator[Variable]:
        """Iterate over the shards (as TensorFlow does)."""
        return iter(self._variables)

    def numpy(self) -> np.ndarray:
        """The whole value: every shard read, one call per parameter server."""
        return np.concatenate(fetch([(v, None) for v in self._variables]), axis=0)

    def __getitem__(self, index: Any) -> np.ndarray:
        """``value[index]`` with numpy's semantics, reading only the rows touched."""
        return _getitem(self, index)

    # -- updates ------------------------------------------------------------
    def _dense(self, op: str, value: Any, arg: str) -> ShardedVariable:
        payload = check_update(self._shape, self.dtype, self._name, op, value, arg)
        apply_updates([(v, op, payload[a:b]) for v, a, b in self._spans()])
        return self

    def _scatter(self, op: str, payload: tuple) -> ShardedVariable:
        idx, vals = check_update(self._shape, self.dtype, self._name, op, payload)
        if op == BATCH_SCATTER and idx.ndim > 1:  # batch axis 0 is the sharded axis
            items = [(v, op, (idx[a:b], vals[a:b])) for v, a, b in self._spans()]
        else:
            items = [(v, op, part) for v, part in self._split_rows(idx, vals) if len(part[0])]
        apply_updates(items)
        return self

    def _split_rows(self, idx: np.ndarray, values: np.ndarray) -> list[tuple[Variable, tuple]]:
        """``(shard, (local indices, values))`` for every shard, in order (some may be empty)."""
        owner = np.searchsorted(self._offsets, idx, side="right") - 1
        return [(v, (idx[owner == s] - a, values[owner == s])) for s, (v, a, _) in enumerate(self._spans())]

    def _gather(self, indices: Any, one_d: bool = False) -> np.ndarray:
        return gather_rows(self._variables, self._offsets, indices, self._name, one_d)

    def _spans(self) -> list[tuple[Variable, int, int]]:
        return [(v, self._offsets[i], self._offsets[i + 1]) for i, v in enumerate(self._variables)]

    def _repr_html_(self) -> str:
        from daskps.display import sharded_html

        return sharded_html(self)

    def __repr__(self) -> str:
        return (
            f"<daskps.ShardedVariable {self._name!r} shape={self._shape} dtype={self.dtype} "
            f"shards={len(self._variables)}>"
        )


# -- reading rows ---------------------------------------------------------------
def _unique_rows(variables: Sequence[Variable], offsets: Sequence[int], rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` (sorted, unique, in range) of the whole, one call per server."""
    owner = np.searchsorted(offsets, rows, side="right") - 1
    bounds = np.searchsorted(owner, np.arange(len(variables) + 1))
    items = [
        (v, rows[bounds[s] : bounds[s + 1]] - offsets[s])
        for s, v in enumerate(variables)
        if bounds[s + 1] > bounds[s]
    ]
    if not items:
        return np.empty((0,) + variables[0].shape[1:], variables[0].dtype)
    return np.concatenate(fetch(items), axis=0)


def gather_rows(
    variables: Sequence[Variable], offsets: Sequence[int], ids: Any, name: str, one_d: bool = False
) -> np.ndarray:
    """Rows ``ids`` (any shape) of the variable made of ``variables``.

    Each distinct row travels once, whatever the number of repeats.
    """
    idx = check_indices(ids, offsets[-1], name, "indices", one_d=one_d)
    uniq, inverse = np.unique(idx.ravel(), return_inverse=True)
    rows = _unique_rows(variables, offsets, uniq)
    return rows[inverse.ravel()].reshape(idx.shape + rows.shape[1:])


def embedding_lookup(params: Any, ids: Any, max_norm: float | None = None, name: str | None = None) -> np.ndarray:
    """The rows of ``params`` named by ``ids``: shape ``ids.shape + params.shape[1:]``.

    Parameters
    ----------
    params : Variable, ShardedVariable, list of Variable, or numpy array
        A list is taken as the shards of one table in row order (for a "div"
        split this is TensorFlow's ``partition_strategy="div"``).
    ids : array-like of int, any shape
        Row numbers in ``[0, rows)``; ``IndexError`` otherwise.
    max_norm : float, optional
        Rows whose L2 norm exceeds it are scaled down to it.

    Only the distinct rows requested are read, from every shard at once, one
    call per parameter server; the table never moves.

    Examples
    --------
    >>> import daskps as dps
    >>> table = dps.ShardedVariable([dps.Variable([[0.0, 0.0], [1.0, 1.0]]), dps.Variable([[2.0, 2.0]])])
    >>> dps.embedding_lookup(table, [[2, 0], [2, 2]]).shape
    (2, 2, 2)
    """
    if isinstance(params, (list, tuple)):
        params = params[0] if len(params) == 1 else ShardedVariable(list(params), name="embedding")
    if isinstance(params, ShardedVariable):
        rows = params._gather(ids)
    elif isinstance(params, Variable):
        rows = params._gather(ids)
    else:
        table = np.asarray(params)
        rows = table[check_indices(ids, len(table), "params", "ids", one_d=False)]
    if max_norm is not None:
        rows = _clip_rows(rows, np.ndim(ids), max_norm)
    return rows


def _clip_rows(rows: np.ndarray, id_rank: int, max_norm: float) -> np.ndarray:
    axes = tuple(range(id_rank, rows.ndim))
    norms = np.sqrt(np.sum(np.square(rows, dtype=np.float64), axis=axes, keepdims=True)) if axes else np.abs(rows)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(norms > max_norm, max_norm / norms, 1.0)
    return (rows * scale).astype(rows.dtype, copy=False)


# -- slicing --------------------------------------------------------------------
def _as_index(x: Any) -> Any:
    if isinstance(x, ArrayLike):
        x = x.numpy()
    if isinstance(x, list):
        arr = np.asarray(x)
        return arr.astype(np.intp) if arr.size == 0 and arr.dtype.kind == "f" else arr
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iu":
        return int(x)  # numpy treats 0-d integer arrays as integers
    return x


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _dims_used(x: Any) -> int:
    if x is None or x is Ellipsis or isinstance(x, (bool, np.bool_)):
        return 0
    if isinstance(x, np.ndarray) and x.dtype == np.bool_:
        return x.ndim
    return 1


def _getitem(sv: ShardedVariable, index: Any) -> np.ndarray:
    parts = [_as_index(x) for x in (index if isinstance(index, tuple) else (index,))]
    # numpy validates the index (and gives its own errors) on a free stand-in.
    probe = np.broadcast_to(np.zeros((), np.bool_), sv.shape)[tuple(parts)]
    if probe.size == 0:
        return np.zeros(probe.shape, sv.dtype)
    used = sum(_dims_used(x) for x in parts)
    pos = len(parts)  # where the index for axis 0 is (or an Ellipsis covering it)
    for i, x in enumerate(parts):
        if (x is Ellipsis and sv.ndim > used) or (x is not Ellipsis and _dims_used(x) > 0):
            pos = i
            break
    first: Any = parts[pos] if pos < len(parts) and parts[pos] is not Ellipsis else slice(None)
    n, offsets, shards = sv.shape[0], sv._offsets, sv._variables
    if _is_int(first):
        row = int(first) % n
        s = int(np.searchsorted(offsets, row, side="right")) - 1
        parts[pos] = row - offsets[s]
        return fetch([(shards[s], tuple(parts))])[0]
    if isinstance(first, slice):
        return _get_slice(sv, parts, pos, first)
    if first.dtype == np.bool_:
        rows = np.flatnonzero(first.reshape(n, -1).any(axis=1))
        parts[pos] = first[rows]
    else:
        rows, inverse = np.unique(np.where(first < 0, first + n, first).ravel(), return_inverse=True)
        parts[pos] = inverse.reshape(first.shape)
    return _unique_rows(shards, offsets, rows)[tuple(parts)]


def _get_slice(sv: ShardedVariable, parts: list, pos: int, first: slice) -> np.ndarray:
    """``sv[parts]`` where axis 0 is indexed by the slice ``first`` at ``parts[pos]``."""
    pieces = _split_range(range(*first.indices(sv.shape[0])), sv._offsets)
    named = pos < len(parts) and parts[pos] is not Ellipsis
    if all(x is None or x is Ellipsis or isinstance(x, slice) or _is_int(x) for x in parts):
        # Basic indexing: each shard applies the whole index; only the result travels.
        items = []
        for s, local in pieces:
            if named:
                parts[pos] = local
            items.append((sv._variables[s], tuple(parts)))
        return np.concatenate(fetch(items), axis=sum(x is None for x in parts[:pos]))
    rows = np.concatenate(fetch([(sv._variables[s], local) for s, local in pieces]), axis=0)
    if named:
        parts[pos] = slice(None)
    return rows[tuple(parts)]


def _split_range(r: range, offsets: Sequence[int]) -> list[tuple[int, slice]]:
    """The rows of ``r`` in each shard, as ``(shard, local slice)`` in ``r``'s order."""
    out = []
    shards = range(len(offsets) - 1)
    for s in shards if r.step > 0 else reversed(shards):
        lo, hi = offsets[s], offsets[s + 1]
        if r.step > 0:
            k0 = max(0, -(-(lo - r.start) // r.step))
            k1 = min(len(r), -(-(hi - r.start) // r.step))
        else:
            k0 = max(0, -(-(r.start - (hi - 1)) // -r.step))
            k1 = min(len(r), (r.start - lo) // -r.step + 1)
        if k1 > k0:
            first, last = r[k0] - lo, r[k1 - 1] - lo
            stop = last + (1 if r.step > 0 else -1)
            out.append((s, slice(first, stop if stop >= 0 else None, r.step)))
    return out
