"""Checking and applying updates to one array: dense and sparse (scatter).

The same functions run in two places: where the update is made, before
anything is sent (so errors name the whole variable), and on the parameter
server before anything is applied (so a batch with one bad item changes
nothing).

Operations, with ``payload``:

- ``assign``, ``add``, ``sub``: an array of the variable's shape.
- ``scatter_add``, ``scatter_sub``, ``scatter_mul``, ``scatter_div``,
  ``scatter_min``, ``scatter_max``, ``scatter_update``: ``(indices, values)``
  with 1-D integer ``indices`` into axis 0 and
  ``values.shape == indices.shape + shape[1:]``. Duplicate indices apply one
  after another (``scatter_add`` accumulates); for ``scatter_update`` the last
  one wins.
- ``batch_scatter_update``: ``(indices, values)`` where ``indices`` has shape
  ``shape[:k] + (n,)`` and indexes axis ``k``;
  ``values.shape == indices.shape + shape[k + 1:]``.

>>> a = np.zeros((3, 2), np.float32)
>>> p = check_update(a.shape, a.dtype, "w", "scatter_add", ([0, 0, 2], np.ones((3, 2))))
>>> apply_update(a, "scatter_add", p)
>>> a
array([[2., 2.],
       [0., 0.],
       [1., 1.]], dtype=float32)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from daskps._core.slices import IndexedSlices

DENSE_OPS = ("assign", "add", "sub")
SCATTER_OPS = (
    "scatter_add",
    "scatter_sub",
    "scatter_mul",
    "scatter_div",
    "scatter_min",
    "scatter_max",
    "scatter_update",
)
BATCH_SCATTER = "batch_scatter_update"
_UFUNCS = {
    "scatter_add": np.add,
    "scatter_sub": np.subtract,
    "scatter_mul": np.multiply,
    "scatter_min": np.minimum,
    "scatter_max": np.maximum,
}


def coerce_values(value: Any, dtype: np.dtype, name: str, arg: str) -> np.ndarray:
    """``value`` as an array of ``dtype``; refuse non-numbers and unsafe casts.

    numpy arrays must cast with ``same_kind``; Python numbers must not lose
    their fractional part when the variable holds integers.
    """
    if not isinstance(value, (np.ndarray, np.generic)) and hasattr(value, "__array__"):
        value = np.asarray(value)  # a Variable or ShardedVariable: its current value
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{arg} for variable {name!r} must be array-like, got {type(value).__name__}") from exc
    if arr.dtype.kind not in "biufc":
        raise TypeError(
            f"{arg} for variable {name!r} must be numeric, got dtype {arr.dtype} "
            f"from {type(value).__name__}"
        )
    typed = isinstance(value, (np.ndarray, np.generic))
    if typed and not np.can_cast(arr.dtype, dtype, casting="same_kind"):
        raise TypeError(f"{arg} for variable {name!r} must have a dtype castable to {dtype}, got {arr.dtype}")
    if not typed and arr.dtype.kind in "fc" and dtype.kind in "biu" and not np.all(np.mod(arr, 1) == 0):
        raise TypeError(f"{arg} for variable {name!r} has dtype {dtype}; got non-integer values")
    return arr.astype(dtype, copy=False)


def integer_array(values: Any, of: str, arg: str, one_d: bool) -> np.ndarray:
    """``values`` as an array of integers (1-D unless ``one_d`` is false), or the error naming ``arg`` and
    what it is ``of`` (``"variable 'w'"``, ``"embedding table 't'"``): the one check of ids and indices."""
    idx = np.asarray(values)
    if idx.size == 0 and idx.dtype.kind == "f":
        idx = idx.astype(np.intp)  # [] parses as float64
    if idx.dtype.kind not in "iu":
        raise TypeError(f"{arg} for {of} must be integers, got dtype {idx.dtype}")
    if one_d and idx.ndim != 1:
        raise ValueError(f"{arg} for {of} must be 1-D, got shape {idx.shape}")
    return idx


def check_indices(indices: Any, size: int, name: str, arg: str = "indices", one_d: bool = True) -> np.ndarray:
    """Integer ``indices`` in ``[0, size)`` (1-D unless ``one_d`` is false)."""
    idx = integer_array(indices, f"variable {name!r}", arg, one_d)
    if idx.size:
        lo, hi = idx.min(), idx.max()
        if lo < 0 or hi >= size:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{arg} for variable {name!r}: index {bad} is out of range [0, {size})")
    return idx.astype(np.intp, copy=False)


def _check_shape(values: np.ndarray, want: tuple, name: str, arg: str) -> None:
    if values.shape != want:
        raise ValueError(f"{arg} for variable {name!r} must have shape {want}, got {values.shape}")


def check_update(shape: tuple, dtype: np.dtype, name: str, op: str, payload: Any, arg: str = "value") -> Any:
    """Validate one update of a variable of ``shape``/``dtype``; return it normalised.

    Raises ``ValueError`` (shapes, unknown op), ``TypeError`` (dtypes) or
    ``IndexError`` (indices out of range).
    """
    shape, dtype = tuple(shape), np.dtype(dtype)
    if op in DENSE_OPS:
        arr = coerce_values(payload, dtype, name, arg)
        _check_shape(arr, shape, name, arg)
        return arr
    if op not in SCATTER_OPS and op != BATCH_SCATTER:
        raise ValueError(f"op must be one of {DENSE_OPS + SCATTER_OPS + (BATCH_SCATTER,)}, got {op!r}")
    indices, values = payload
    if not shape:
        raise ValueError(f"{op} needs a variable of rank >= 1; {name!r} is a scalar")
    if op == BATCH_SCATTER:
        return _check_batch(shape, dtype, name, indices, values)
    idx = check_indices(indices, shape[0], name, "sparse_delta.indices")
    vals = coerce_values(values, dtype, name, "sparse_delta.values")
    _check_shape(vals, idx.shape + shape[1:], name, "sparse_delta.values")
    if op == "scatter_div" and dtype.kind in "biu" and np.any(vals == 0):
        raise ValueError(f"scatter_div of integer variable {name!r} by zero")
    return idx, vals


def _check_batch(shape: tuple, dtype: np.dtype, name: str, indices: Any, values: Any) -> tuple:
    idx = np.asarray(indices)
    k = idx.ndim - 1
    if idx.ndim < 1 or k >= len(shape) or idx.shape[:k] != shape[:k]:
        raise ValueError(
            f"sparse_delta.indices for batch_scatter_update of {name!r} must have shape "
            f"{shape[:max(k, 0)]} + (n,) with fewer than {len(shape)} dimensions, got {idx.shape}"
        )
    idx = check_indices(idx, shape[k], name, "sparse_delta.indices", one_d=False)
    vals = coerce_values(values, dtype, name, "sparse_delta.values")
    _check_shape(vals, idx.shape + shape[k + 1 :], name, "sparse_delta.values")
    return idx, vals


def apply_update(arr: np.ndarray, op: str, payload: Any) -> None:
    """Apply a checked update to ``arr`` in place."""
    if op == "assign":
        arr[...] = payload
    elif op == "add":
        arr += payload
    elif op == "sub":
        arr -= payload
    elif op == "scatter_update":
        arr[payload[0]] = payload[1]
    elif op == BATCH_SCATTER:
        idx, vals = payload
        k = idx.ndim - 1
        grid = np.indices(idx.shape[:k] + (1,), sparse=True)[:k]
        arr[tuple(grid) + (idx,)] = vals
    elif op == "scatter_div":
        _scatter_div(arr, *payload)
    else:
        with np.errstate(all="ignore"):
            _UFUNCS[op].at(arr, payload[0], payload[1])


def _scatter_div(arr: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
    if arr.dtype.kind not in "biu":
        with np.errstate(all="ignore"):
            np.divide.at(arr, idx, vals)
        return
    # Integer division truncates toward zero (as TensorFlow's), one duplicate at a time.
    for sel in occurrence_rounds(idx):
        rows, by = arr[idx[sel]], vals[sel]
        quotient = np.abs(rows) // np.abs(by)
        arr[idx[sel]] = np.where((rows < 0) != (by < 0), -quotient, quotient)


def occurrence_rounds(idx: np.ndarray) -> list[np.ndarray]:
    """Masks over ``idx``: the first occurrence of each index, then the second, ..."""
    order = np.argsort(idx, kind="stable")
    ordered = idx[order]
    rank = np.empty(len(idx), np.intp)
    rank[order] = np.arange(len(idx)) - np.searchsorted(ordered, ordered, side="left")
    return [rank == r for r in range(int(rank.max(initial=-1)) + 1)]


def check_gradient(shape: tuple, dtype: np.dtype, name: str, grad: Any) -> tuple[str, Any]:
    """``("dense", array)`` or ``("rows", (indices, values))``, checked against the variable."""
    if isinstance(grad, IndexedSlices):
        return check_gradient_of_kind(shape, dtype, name, "rows", (grad.indices, grad.values))
    return check_gradient_of_kind(shape, dtype, name, "dense", grad)


def check_gradient_of_kind(shape: tuple, dtype: np.dtype, name: str, kind: str, grad: Any) -> tuple[str, Any]:
    """As :func:`check_gradient`, for a gradient already split into ``kind`` and payload."""
    if kind == "rows":
        if not shape:
            raise ValueError(f"gradient for scalar variable {name!r} cannot be IndexedSlices")
        idx = check_indices(grad[0], shape[0], name, "gradient indices")
        values = coerce_values(grad[1], dtype, name, "gradient values")
        if values.shape != idx.shape + tuple(shape[1:]):
            raise ValueError(
                f"gradient values for variable {name!r} must have shape {idx.shape + tuple(shape[1:])}, "
                f"got {values.shape}"
            )
        return "rows", (idx, values)
    if kind != "dense":
        raise ValueError(f"gradient kind must be 'dense' or 'rows', got {kind!r}")
    arr = coerce_values(grad, dtype, name, "gradient")
    if arr.shape != tuple(shape):
        raise ValueError(f"gradient for variable {name!r} must have shape {tuple(shape)}, got {arr.shape}")
    return "dense", arr


class Refused(NamedTuple):
    """In place of a result: an operation run on its own (``isolate``) that raised ``error``."""

    error: BaseException


def check_keys(keys: Any, name: str, arg: str, one_d: bool) -> np.ndarray:
    """An embedding table's ``keys`` as int64; refuse anything but integers that fit."""
    k = integer_array(keys, f"embedding table {name!r}", arg, one_d)
    if k.dtype == np.uint64 and k.size and k.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{arg} for embedding table {name!r} must fit in int64, got {k.max()}")
    return k.astype(np.int64, copy=False)
