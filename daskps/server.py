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

from daskps import ckpt_io
from daskps.updates import apply_update, check_update


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


def build_part(
    value: Any,
    init_fn: Callable[..., Any] | None,
    shape: Sequence[int] | None,
    dtype: np.dtype | None,
    partition_shape: Sequence[int] | None = None,
    partition_offset: Sequence[int] | None = None,
) -> tuple[Any, bool]:
    """The initial value of one part of a variable of ``shape``.

    ``init_fn`` (if given) is offered the part's shape and offset; when it
    (or ``value``) has the whole ``shape`` instead, the part is cut out of it.
    Returns the value and whether the whole variable had to be built.
    """
    full = None if shape is None else tuple(shape)
    part = None if partition_shape is None else tuple(partition_shape)
    offset = None if partition_offset is None else tuple(partition_offset)
    if init_fn is not None:
        value = call_initializer(init_fn, full, dtype, part, offset)
    if part is None or offset is None or part == full or np.shape(value) != full:
        return value, False
    return np.asarray(value)[tuple(slice(o, o + n) for o, n in zip(offset, part))], True


_PYTHON_DEFAULTS = {np.dtype("float64"): np.dtype("float32"), np.dtype("int64"): np.dtype("int32")}


def _materialize(value: Any, dtype: np.dtype | None, shape: tuple | None, name: str, fresh: bool = False) -> np.ndarray:
    # Updates write in place: take a private, writable copy unless the value
    # is an initializer's new array (a large one need not exist twice).
    private = fresh and isinstance(value, np.ndarray) and value.flags.owndata and value.flags.writeable
    arr = np.array(value, dtype=dtype, copy=None if private else True)
    if dtype is None and not isinstance(value, (np.ndarray, np.generic)):
        # Python numbers follow TensorFlow's defaults, not numpy's 64-bit ones.
        arr = arr.astype(_PYTHON_DEFAULTS.get(arr.dtype, arr.dtype), copy=False)
    if shape is not None and arr.shape != tuple(shape):
        raise ValueError(
            f"initial value of variable {name!r} has shape {arr.shape}, "
            f"expected shape {tuple(shape)}"
        )
    return arr


class ParameterServer(ckpt_io.Holder):
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
    ((2,), '<f4', False)
    >>> ps.update([("k1", "add", np.ones(2, "float32"))])
    >>> ps.read(["k1"])
    [array([2., 3.], dtype=float32)]
    """

    def __init__(self, task_id: int):
        self.task_id = task_id
        self._values: dict[str, np.ndarray] = {}
        self._names: dict[str, str] = {}
        self._slots: dict[str, dict[str, dict[str, np.ndarray]]] = {}  # optimizer -> variable key -> slots
        self._staged: dict[str, list] = {}  # restores read but not yet committed
        self.reads = 0
        self.bytes_read = 0
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
    ) -> tuple[tuple[int, ...], str, bool]:
        """Create variable ``key``; return its shape, dtype string, and whether
        the initializer built the whole variable to cut this part out of it.

        With ``partition_shape``/``partition_offset`` this server holds one
        part of a variable of ``shape``: ``init_fn`` is offered the part's
        shape and offset, and a result of the full ``shape`` is sliced.
        """
        if key in self._values:
            raise ValueError(f"variable key {key!r} already exists on ps task {self.task_id}")
        np_dtype = None if dtype is None else np.dtype(dtype)
        value, sliced = build_part(value, init_fn, shape, np_dtype, partition_shape, partition_offset)
        part = partition_shape if partition_shape is not None else shape
        fresh = init_fn is not None and not sliced
        arr = _materialize(value, np_dtype, None if part is None else tuple(part), name, fresh)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"variable {name!r} must hold numbers, got dtype {arr.dtype}")
        self._values[key] = arr
        self._names[key] = name
        self.calls["create"] += 1
        return arr.shape, arr.dtype.str, sliced

    def drop(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._values.pop(key, None)
            self._names.pop(key, None)
            for slots in self._slots.values():
                slots.pop(key, None)

    # -- reads --------------------------------------------------------------
    def _get(self, key: str) -> np.ndarray:
        try:
            return self._values[key]
        except KeyError:
            raise LookupError(
                f"no variable with key {key!r} on ps task {self.task_id}"
            ) from None

    def read(self, keys: Sequence[str], indices: Sequence[Any] | None = None) -> list[np.ndarray]:
        """Copies of the values of ``keys`` (or of ``value[index]`` for each).

        Updates write in place, so what is returned must be a copy: Dask
        sends it after this method returns, while later calls may run.
        """
        arrays = [self._get(k) for k in keys]
        if indices is None:
            out = [a.copy() for a in arrays]
        else:
            out = [np.array(a[index]) for a, index in zip(arrays, indices, strict=True)]
        self.calls["read"] += 1
        self.reads += len(out)
        self.bytes_read += sum(a.nbytes for a in out)
        return out

    # -- updates ------------------------------------------------------------
    def update(self, updates: Sequence[tuple[str, str, Any]]) -> None:
        """Apply ``(key, op, payload)`` updates (see :mod:`daskps.updates`).

        All updates are checked before any is applied.
        """
        checked = []
        for key, op, payload in updates:
            arr = self._get(key)
            checked.append((arr, op, check_update(arr.shape, arr.dtype, self._names[key], op, payload)))
        self.calls["update"] += 1
        for arr, op, payload in checked:
            apply_update(arr, op, payload)
        self.updates += len(checked)

    # -- optimizers -------------------------------------------------------------
    def apply_gradients(self, optimizer: Any, items: Sequence[tuple[str, str, Any]], bump: str | None = None) -> None:
        """Apply ``(key, kind, gradient)`` with ``optimizer``; slots stay here.

        ``kind`` is ``"dense"`` or ``"rows"`` (``(indices, values)``). Every
        gradient is checked first; ``bump`` names a counter to add 1 to.
        """
        from daskps.optimizers import check_gradient_of_kind

        checked = []
        for key, kind, grad in items:
            arr = self._get(key)
            checked.append((key, arr, *check_gradient_of_kind(arr.shape, arr.dtype, self._names[key], kind, grad)))
        if bump is not None:
            self._get(bump)
        slots = self._slots.setdefault(optimizer.slot_key, {})
        for key, arr, kind, payload in checked:
            slots[key] = optimizer.apply(arr, slots.get(key), kind, payload)
        if bump is not None:
            self._values[bump] += 1
        self.calls["apply_gradients"] += 1
        self.updates += len(checked)

    # -- checkpoints ------------------------------------------------------------
    def array(self, key: str) -> np.ndarray:
        return self._get(key)

    def slot_state(self, slot_key: str, key: str) -> dict | None:
        return self._slots.get(slot_key, {}).get(key)

    def set_slot_state(self, slot_key: str, key: str, state: dict | None) -> None:
        per_var = self._slots.setdefault(slot_key, {})
        if state is None:
            per_var.pop(key, None)
        else:
            per_var[key] = state

    def replace(self, key: str, value: np.ndarray) -> None:
        self._values[key] = value

    def save(self, base: str, specs: list) -> list[dict]:
        """Write this server's checkpoint pieces straight to ``base`` (an fsspec URL)."""
        self.calls["save"] += 1
        return ckpt_io.save_specs(self, base, specs)

    def stage_restore(self, token: str, base: str, specs: list) -> None:
        """Read the pieces of a restore; nothing changes until :meth:`commit_restore`."""
        self._staged[token] = ckpt_io.stage_specs(self, base, specs)

    def commit_restore(self, token: str) -> None:
        ckpt_io.commit_staged(self, self._staged.pop(token))
        self.calls["restore"] += 1

    def abort_restore(self, token: str) -> None:
        self._staged.pop(token, None)

    # -- introspection ------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and sizes, for reprs and the dashboard."""
        return {
            "task_id": self.task_id,
            "num_variables": len(self._values),
            "nbytes": int(sum(v.nbytes for v in self._values.values())),
            "reads": self.reads,
            "bytes_read": self.bytes_read,
            "updates": self.updates,
            "uptime": time.time() - self.started,
            "calls": dict(self.calls),
            "variables": {k: (self._names[k], v.shape, v.dtype.str) for k, v in self._values.items()},
        }
