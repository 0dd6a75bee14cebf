"""Which shards and rows an index touches, and reading just those.

A variable split by rows is a list of shards plus ``offsets``: shard *i*
holds rows ``offsets[i]:offsets[i + 1]`` of the whole (a plain variable is
one shard). These functions work out, for an index, the shards and local
rows it needs, and read them with one call per parameter server, all at
once, so they work for any row layout. Shards are anything with ``_ref``,
``shape`` and ``dtype``.

>>> split_range(range(0, 10, 3), [0, 4, 10])
[(0, slice(0, 4, 3)), (1, slice(2, 6, 3))]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from daskps._core.arrays import is_int
from daskps._core.updates import check_indices
from daskps.client import protocol
from daskps.variables.arraylike import ArrayLike

__all__ = ["clip_rows", "gather_rows", "getitem", "getitem_by_rows", "plan_rows", "read_plan", "split_rows"]


def _fetch(items: list[tuple[Any, Any]]) -> list[np.ndarray]:
    return protocol.read([(shard.handle, index) for shard, index in items])


def split_rows(offsets: Sequence[int], idx: np.ndarray, values: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(local indices, values)`` of every shard, in order (some may be empty)."""
    owner = np.searchsorted(offsets, idx, side="right") - 1
    return [(idx[owner == s] - offsets[s], values[owner == s]) for s in range(len(offsets) - 1)]


def plan_rows(
    variables: Sequence[Any], offsets: Sequence[int], ids: Any, name: str, one_d: bool = False,
    arg: str = "indices",
) -> tuple[list[tuple[Any, Any]], Callable[[list], np.ndarray]]:
    """What to read for rows ``ids`` (any shape) of the variable made of ``variables``, and how to assemble it.

    Returns ``(items, assemble)``: ``items`` are ``(shard, local rows)`` to
    read (each distinct row once), and ``assemble(values)`` turns what was
    read into the rows, shaped ``ids.shape + row shape``.
    """
    idx = check_indices(ids, offsets[-1], name, arg, one_d=one_d)
    uniq, inverse = np.unique(idx.ravel(), return_inverse=True)
    owner = np.searchsorted(offsets, uniq, side="right") - 1
    bounds = np.searchsorted(owner, np.arange(len(variables) + 1))
    items = [(v, uniq[bounds[s] : bounds[s + 1]] - offsets[s]) for s, v in enumerate(variables)
             if bounds[s + 1] > bounds[s]]

    def assemble(values: list) -> np.ndarray:
        found = np.concatenate(values, axis=0) if values else np.empty((0,) + variables[0].shape[1:],
                                                                        variables[0].dtype)
        return found[inverse.ravel()].reshape(idx.shape + found.shape[1:])

    return items, assemble


def read_plan(items: list[tuple[Any, Any]], assemble: Callable[[list], np.ndarray]) -> np.ndarray:
    """Read what :func:`plan_rows` (or a table's ``row_plan``) planned, and assemble it."""
    return assemble(_fetch(items))


def gather_rows(
    variables: Sequence[Any], offsets: Sequence[int], ids: Any, name: str, one_d: bool = False,
    arg: str = "indices",
) -> np.ndarray:
    """Rows ``ids`` (any shape) of the variable made of ``variables``; each distinct row travels once.

    ``arg`` is the caller's name for ``ids``, for error messages.
    """
    items, assemble = plan_rows(variables, offsets, ids, name, one_d, arg)
    return assemble(_fetch(items))


def _unique_rows(variables: Sequence[Any], offsets: Sequence[int], rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` (sorted, unique, in range) of the whole, one call per server."""
    items, assemble = plan_rows(variables, offsets, rows, "variable")
    return assemble(_fetch(items))


def clip_rows(rows: np.ndarray, id_rank: int, max_norm: float) -> np.ndarray:
    """Scale down rows (the trailing axes past ``id_rank``) whose L2 norm exceeds ``max_norm``."""
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


def _dims_used(x: Any) -> int:
    if x is None or x is Ellipsis or isinstance(x, (bool, np.bool_)):
        return 0
    if isinstance(x, np.ndarray) and x.dtype == np.bool_:
        return x.ndim
    return 1


def getitem(sv: Any, index: Any) -> np.ndarray:
    """``sv[index]`` with numpy's semantics, reading only the shards and rows it touches."""
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
    n, offsets, shards = sv.shape[0], sv.row_offsets, sv.variables
    if is_int(first):
        row = int(first) % n
        s = int(np.searchsorted(offsets, row, side="right")) - 1
        parts[pos] = row - offsets[s]
        return _fetch([(shards[s], tuple(parts))])[0]
    if isinstance(first, slice):
        return _get_slice(sv, parts, pos, first)
    if first.dtype == np.bool_:
        rows = np.flatnonzero(first.reshape(n, -1).any(axis=1))
        parts[pos] = first[rows]
    else:
        rows, inverse = np.unique(np.where(first < 0, first + n, first).ravel(), return_inverse=True)
        parts[pos] = inverse.reshape(first.shape)
    return _unique_rows(shards, offsets, rows)[tuple(parts)]


def getitem_by_rows(sv: Any, index: Any) -> np.ndarray:
    """``sv[index]`` for a layout whose shards hold scattered rows ("mod"): axis 0's index (an int,
    a slice, an integer or boolean array) becomes row numbers, and those rows are read; the other
    axes' ints and slices are applied to the rows read. Any other index reads the whole value."""
    parts = [_as_index(x) for x in (index if isinstance(index, tuple) else (index,))]
    if not parts or (isinstance(parts[0], np.ndarray) and parts[0].dtype == np.bool_ and parts[0].ndim != 1):
        return sv.numpy()[index]  # x[()], or a mask over several axes
    first, rest = parts[0], tuple(parts[1:])
    basic_rest = all(is_int(x) or isinstance(x, slice) for x in rest)
    n = sv.shape[0]
    if is_int(first) and basic_rest:
        row = np.arange(n)[first]  # numpy's bounds check and message
        return read_plan(*sv.row_plan(np.array([row]), "index"))[0][rest]
    if basic_rest and (isinstance(first, slice) or (isinstance(first, np.ndarray) and first.dtype.kind in "iub")):
        wanted = np.arange(n)[first]
        if wanted.size == 0:
            return np.zeros(wanted.shape + sv.shape[1:], sv.dtype)[(slice(None),) * wanted.ndim + rest]
        found = read_plan(*sv.row_plan(wanted, "index"))
        return found[(slice(None),) * wanted.ndim + rest]
    return sv.numpy()[index]


def _get_slice(sv: Any, parts: list, pos: int, first: slice) -> np.ndarray:
    """``sv[parts]`` where axis 0 is indexed by the slice ``first`` at ``parts[pos]``."""
    pieces, shards = split_range(range(*first.indices(sv.shape[0])), sv.row_offsets), sv.variables
    named = pos < len(parts) and parts[pos] is not Ellipsis
    if all(x is None or x is Ellipsis or isinstance(x, slice) or is_int(x) for x in parts):
        # Basic indexing: each shard applies the whole index; only the result travels.
        items = []
        for s, local in pieces:
            if named:
                parts[pos] = local
            items.append((shards[s], tuple(parts)))
        return np.concatenate(_fetch(items), axis=sum(x is None for x in parts[:pos]))
    rows = np.concatenate(_fetch([(shards[s], local) for s, local in pieces]), axis=0)
    if named:
        parts[pos] = slice(None)
    return rows[tuple(parts)]


def split_range(r: range, offsets: Sequence[int]) -> list[tuple[int, slice]]:
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
