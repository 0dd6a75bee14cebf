"""The parameter server: a Dask actor holding many variables and shards.

One ``ParameterServer`` lives on each ps-tagged worker. Dask runs the
synchronous methods of all actors on a worker one at a time on a single actor
thread, so each method sees and leaves a consistent state without locks.

Every method validates all of its input before it changes anything: a call
that raises leaves the server as it was.
"""

from __future__ import annotations

import inspect
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_INIT_ARGS = ("shape", "dtype", "partition_shape", "partition_offset")
_DENSE_OPS = ("assign", "add", "sub")


def call_initializer(
    fn: Callable[..., Any],
    shape: tuple[int, ...] | None,
    dtype: np.dtype | None,
    partition_shape: tuple[int, ...] | None = None,
    partition_offset: tuple[int, ...] | None = None,
) -> Any:
    """Call an initializer with the keyword arguments it accepts.

    A callable may accept any of ``shape``, ``dtype``, ``partition_shape`` and
    ``partition_offset`` (or ``**kwargs``); it gets those it names and that are
    known. A callable taking none of them is called with no arguments.
    """
    offered = {
        "shape": shape,
        "dtype": dtype,
        "partition_shape": partition_shape if partition_shape is not None else shape,
        "partition_offset": partition_offset
        if partition_offset is not None
        else (None if shape is None else (0,) * len(shape)),
    }
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn()
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {
        k: v for k, v in offered.items() if v is not None and (takes_all or k in params)
    }
    return fn(**kwargs)


_PYTHON_DEFAULTS = {np.dtype("float64"): np.dtype("float32"), np.dtype("int64"): np.dtype("int32")}


def _materialize(value: Any, dtype: np.dtype | None, shape: tuple | None, name: str) -> np.ndarray:
    arr = np.array(value, dtype=dtype, copy=True)
    if dtype is None and not isinstance(value, (np.ndarray, np.generic)):
        # Python numbers follow TensorFlow's defaults, not numpy's 64-bit ones.
        arr = arr.astype(_PYTHON_DEFAULTS.get(arr.dtype, arr.dtype), copy=False)
    if shape is not None and arr.shape != tuple(shape):
        raise ValueError(
            f"initial value of variable {name!r} has shape {arr.shape}, "
            f"expected shape {tuple(shape)}"
        )
    return arr


class ParameterServer:
    """Holds variables (and variable shards) of one parameter-server task.

    Parameters
    ----------
    task_id : int
        This server's index among the parameter servers (``/job:ps/task:K``).

    Examples
    --------
    The class is plain Python; Dask hosts it as an actor, but it runs
    in-process just as well:

    >>> ps = ParameterServer(0)
    >>> ps.create("k1", "w", value=[1.0, 2.0], dtype="float32")
    ((2,), '<f4')
    >>> ps.update([("k1", "add", np.ones(2, "float32"))])
    >>> ps.read(["k1"])
    [array([2., 3.], dtype=float32)]
    """

    def __init__(self, task_id: int):
        self.task_id = task_id
        self._values: dict[str, np.ndarray] = {}
        self._names: dict[str, str] = {}
        self.reads = 0
        self.updates = 0
        self.calls: Counter[str] = Counter()
        self.started = time.time()

    # -- creation -----------------------------------------------------------
    def create(
        self,
        key: str,
        name: str,
        value: Any = None,
        init_fn: Callable[..., Any] | None = None,
        shape: Sequence[int] | None = None,
        dtype: str | None = None,
        partition_shape: Sequence[int] | None = None,
        partition_offset: Sequence[int] | None = None,
    ) -> tuple[tuple[int, ...], str]:
        """Create variable ``key``; return its shape and dtype string."""
        if key in self._values:
            raise ValueError(f"variable key {key!r} already exists on ps task {self.task_id}")
        np_dtype = None if dtype is None else np.dtype(dtype)
        want = tuple(partition_shape) if partition_shape is not None else shape
        if init_fn is not None:
            value = call_initializer(
                init_fn,
                None if shape is None else tuple(shape),
                np_dtype,
                None if partition_shape is None else tuple(partition_shape),
                None if partition_offset is None else tuple(partition_offset),
            )
        arr = _materialize(value, np_dtype, want, name)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"variable {name!r} must hold numbers, got dtype {arr.dtype}")
        self._values[key] = arr
        self._names[key] = name
        self.calls["create"] += 1
        return arr.shape, arr.dtype.str

    def drop(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._values.pop(key, None)
            self._names.pop(key, None)

    # -- reads --------------------------------------------------------------
    def _get(self, key: str) -> np.ndarray:
        try:
            return self._values[key]
        except KeyError:
            raise LookupError(
                f"no variable with key {key!r} on ps task {self.task_id}"
            ) from None

    def read(self, keys: Sequence[str]) -> list[np.ndarray]:
        """Current values of ``keys``, in order.

        Dense updates replace arrays instead of writing into them, so the
        arrays returned here stay a consistent snapshot while they are sent.
        """
        out = [self._get(k) for k in keys]
        self.calls["read"] += 1
        self.reads += len(out)
        return out

    def read_index(self, key: str, index: Any) -> np.ndarray:
        """``value[index]`` computed here, so only the selection travels."""
        value = self._get(key)
        self.calls["read_index"] += 1
        self.reads += 1
        return np.array(value[index])

    # -- updates ------------------------------------------------------------
    def update(self, updates: Sequence[tuple[str, str, Any]]) -> None:
        """Apply ``(key, op, value)`` updates, op one of assign/add/sub.

        All updates are checked before any is applied.
        """
        checked = [self._check_dense(key, op, value) for key, op, value in updates]
        self.calls["update"] += 1
        for key, op, value in checked:
            old = self._values[key]
            if op == "assign":
                new = np.array(value, dtype=old.dtype, copy=True)
            elif op == "add":
                new = np.asarray(old + value).astype(old.dtype, copy=False)
            else:
                new = np.asarray(old - value).astype(old.dtype, copy=False)
            self._values[key] = new
        self.updates += len(checked)

    def _check_dense(self, key: str, op: str, value: Any) -> tuple[str, str, np.ndarray]:
        old = self._get(key)
        if op not in _DENSE_OPS:
            raise ValueError(f"op must be one of {_DENSE_OPS}, got {op!r}")
        arr = np.asarray(value)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"value for {self._names[key]!r} must be numeric, got dtype {arr.dtype}")
        if arr.shape != old.shape:
            raise ValueError(
                f"value for {self._names[key]!r} must have shape {old.shape}, got {arr.shape}"
            )
        if not np.can_cast(arr.dtype, old.dtype, casting="same_kind"):
            raise TypeError(
                f"value for {self._names[key]!r} must be castable to {old.dtype}, got {arr.dtype}"
            )
        return key, op, arr

    # -- introspection ------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and sizes, for reprs and the dashboard."""
        return {
            "task_id": self.task_id,
            "num_variables": len(self._values),
            "nbytes": int(sum(v.nbytes for v in self._values.values())),
            "reads": self.reads,
            "updates": self.updates,
            "uptime": time.time() - self.started,
            "calls": dict(self.calls),
            "variables": {k: (self._names[k], v.shape, v.dtype.str) for k, v in self._values.items()},
        }
