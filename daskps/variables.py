"""``Variable``: a numpy array that lives on a parameter server (or locally).

A variable made inside ``strategy.scope()`` is a small picklable handle:
worker address, actor key, variable key, shape, dtype and name. Reading or
updating it is one call to the parameter server that holds it, made from
whichever process uses it. Outside any scope a variable keeps its array in
the current process, as TensorFlow keeps such variables on the coordinator.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from daskps import context
from daskps._arraylike import ArrayLike
from daskps.server import _PYTHON_DEFAULTS
from daskps.transport import Call, PSRef, transport_for
from daskps.updates import apply_update, check_update

__all__ = ["Variable", "apply_updates", "fetch", "read_values"]

LOCAL_DEVICE = "/job:chief/replica:0/task:0/device:CPU:0"


def default_array(value: Any, arg: str = "value") -> np.ndarray:
    """``value`` as a numeric array; Python numbers default to float32/int32."""
    if isinstance(value, Variable):
        return value.numpy()
    arr = np.asarray(value)
    if not isinstance(value, (np.ndarray, np.generic)):
        arr = arr.astype(_PYTHON_DEFAULTS.get(arr.dtype, arr.dtype), copy=False)
    if arr.dtype.kind not in "biufc":
        raise TypeError(f"{arg} must be numeric, got dtype {arr.dtype} from {type(value).__name__}")
    return arr


class _LocalStore:
    """Keeps the value in this process."""

    device = LOCAL_DEVICE

    def __init__(self, value: np.ndarray):
        self.value = value


class _RemoteStore:
    """Names the value on a parameter server."""

    __slots__ = ("ps", "key", "client")

    def __init__(self, ps: PSRef, key: str, client: Any = None):
        self.ps = ps
        self.key = key
        self.client = client  # the coordinator's client; never pickled

    def __reduce__(self):
        return (_RemoteStore, (self.ps, self.key))

    @property
    def device(self) -> str:
        return self.ps.device


class _VariableMeta(type):
    """Routes ``Variable(...)`` to the current strategy inside its scope."""

    def __call__(cls, *args: Any, **kwargs: Any):
        if cls is Variable:
            mode = context._current_mode()
            creator = getattr(mode.strategy, "_variable_creator", None)
            if creator is not None and mode.replica_context is None:
                return creator(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class Variable(ArrayLike, metaclass=_VariableMeta):
    """A mutable numpy array, on a parameter server inside ``strategy.scope()``.

    Parameters
    ----------
    initial_value : array-like or callable
        The starting value. A callable is called with whichever of ``shape``,
        ``dtype``, ``partition_shape`` and ``partition_offset`` it accepts;
        inside a strategy scope it runs on the parameter server, so a large
        value is never built on the coordinator.
    trainable : bool
        Recorded for optimizers and checkpoints.
    name : str, optional
        Defaults to ``"Variable"``.
    dtype : numpy dtype, optional
        Python floats default to float32 and ints to int32, as in TensorFlow.
    shape : tuple of int, optional
        Checked against the initial value; required by callables that need it.

    Examples
    --------
    >>> import daskps as dps
    >>> v = dps.Variable([1.0, 2.0], name="w")   # outside any scope: local
    >>> v.assign_add([0.5, 0.5]).numpy()
    array([1.5, 2.5], dtype=float32)
    >>> v.device
    '/job:chief/replica:0/task:0/device:CPU:0'
    """

    def __init__(
        self,
        initial_value: Any = None,
        trainable: bool = True,
        name: str | None = None,
        dtype: Any = None,
        shape: Any = None,
    ):
        name, dtype, shape = check_variable_args(initial_value, name, dtype, shape)
        if callable(initial_value):
            from daskps.server import call_initializer

            initial_value = call_initializer(initial_value, shape, dtype)
        value = default_array(initial_value, "initial_value") if dtype is None else initial_value
        value = np.array(value, dtype=dtype, copy=True)
        if shape is not None and value.shape != shape:
            raise ValueError(f"initial_value has shape {value.shape}, expected shape {shape}")
        self._setup(_LocalStore(value), name, value.shape, value.dtype, trainable)

    def _setup(self, store: Any, name: str, shape: tuple, dtype: np.dtype, trainable: bool) -> None:
        self._store = store
        self._name = name
        self._shape = tuple(int(d) for d in shape)
        self._dtype = np.dtype(dtype)
        self._trainable = bool(trainable)
        self._strategy_token: str | None = None

    @classmethod
    def _from_store(cls, store: Any, name: str, shape: tuple, dtype: Any, trainable: bool, token: str | None = None) -> Variable:
        var = object.__new__(Variable)
        var._setup(store, name, shape, dtype, trainable)
        var._strategy_token = token
        return var

    def __reduce__(self):
        return (
            _rebuild_variable,
            (self._store, self._name, self._shape, self._dtype.str, self._trainable, self._strategy_token),
        )

    # -- properties ---------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def device(self) -> str:
        return self._store.device

    @property
    def trainable(self) -> bool:
        return self._trainable

    # -- reads and updates -------------------------------------------------
    def numpy(self) -> np.ndarray:
        """The current value, as a numpy array (a copy)."""
        return fetch([(self, None)])[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        """``value[index]`` with numpy semantics, computed where the value lives."""
        if isinstance(index, ArrayLike):
            index = index.numpy()
        elif isinstance(index, tuple):
            index = tuple(x.numpy() if isinstance(x, ArrayLike) else x for x in index)
        return fetch([(self, index)])[0]

    def _dense(self, op: str, value: Any, arg: str) -> Variable:
        payload = check_update(self._shape, self._dtype, self._name, op, value, arg)
        apply_updates([(self, op, payload)])
        return self

    def _scatter(self, op: str, payload: tuple) -> Variable:
        payload = check_update(self._shape, self._dtype, self._name, op, payload)
        apply_updates([(self, op, payload)])
        return self

    def _gather(self, indices: Any, one_d: bool = False) -> np.ndarray:
        from daskps.sharding import gather_rows

        return gather_rows([self], [0, self._shape[0] if self._shape else 0], indices, self._name, one_d)

    # -- Python protocol ----------------------------------------------------
    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a scalar variable")
        return self._shape[0]

    def __iter__(self) -> Iterator[np.ndarray]:
        if not self._shape:
            raise TypeError("iteration over a scalar variable")
        return iter(self.numpy())

    def _repr_html_(self) -> str:
        from daskps.display import variable_html

        return variable_html(self)

    def __repr__(self) -> str:
        return (
            f"<daskps.Variable {self._name!r} shape={self._shape} dtype={self._dtype} "
            f"device={self.device!r}>"
        )


def _rebuild_variable(store: Any, name: str, shape: tuple, dtype: str, trainable: bool, token: str | None) -> Variable:
    return Variable._from_store(store, name, shape, dtype, trainable, token)


def check_variable_args(initial_value: Any, name: Any, dtype: Any, shape: Any) -> tuple[str, np.dtype | None, tuple | None]:
    """Validate the constructor's arguments; return (name, dtype, shape)."""
    if initial_value is None:
        raise ValueError("initial_value must be given (an array-like or a callable), got None")
    if name is None:
        name = "Variable"
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if dtype is not None:
        try:
            dtype = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"dtype must be a numpy dtype, got {dtype!r}") from exc
        if dtype.kind not in "biufc":
            raise TypeError(f"dtype must be numeric, got {dtype}")
    if shape is not None:
        try:
            shape = tuple(int(d) for d in shape)
        except TypeError:
            raise TypeError(f"shape must be a tuple of ints, got {shape!r}") from None
        if any(d < 0 for d in shape):
            raise ValueError(f"shape must not have negative dimensions, got {shape}")
    return name, dtype, shape


def read_values(variables: Iterable[Variable]) -> list[np.ndarray]:
    """Read many variables with one round trip per parameter server.

    Parameters
    ----------
    variables : iterable of Variable (or ShardedVariable)

    Returns
    -------
    list of numpy.ndarray, in the order given.

    Examples
    --------
    >>> import daskps as dps
    >>> a, b = dps.Variable(1.0), dps.Variable([2, 3])
    >>> dps.read_values([a, b])
    [array(1., dtype=float32), array([2, 3], dtype=int32)]
    """
    variables = list(variables)
    leaves: list[list[Variable]] = []
    for v in variables:
        parts = getattr(v, "_shard_variables", None)
        if parts is None and not isinstance(v, Variable):
            raise TypeError(f"variables must contain Variables, got {type(v).__name__}")
        leaves.append(list(parts) if parts is not None else [v])
    values = fetch([(leaf, None) for group in leaves for leaf in group])
    out, i = [], 0
    for v, group in zip(variables, leaves):
        part_values = values[i : i + len(group)]
        i += len(group)
        out.append(part_values[0] if group[0] is v else np.concatenate(part_values, axis=0))
    return out


def _by_server(variables: Sequence[Variable]) -> tuple[dict[PSRef, list[int]], list[int], Any]:
    """Positions of remote variables grouped by server, positions of local ones, a client."""
    by_ps: dict[PSRef, list[int]] = {}
    local, client = [], None
    for i, v in enumerate(variables):
        store = v._store
        if isinstance(store, _RemoteStore):
            by_ps.setdefault(store.ps, []).append(i)
            client = client or store.client
        else:
            local.append(i)
    return by_ps, local, client


def fetch(items: Sequence[tuple[Variable, Any]]) -> list[np.ndarray]:
    """``variable[index]`` (or the whole value for ``None``) for each item.

    One ``read`` call per parameter server, all servers at once; only the
    selected elements travel.
    """
    by_ps, local, client = _by_server([v for v, _ in items])
    results: list[Any] = [None] * len(items)
    for i in local:
        value, index = items[i][0]._store.value, items[i][1]
        results[i] = value.copy() if index is None else np.array(value[index])
    calls = []
    for ps, idx in by_ps.items():
        keys = [items[i][0]._store.key for i in idx]
        indices = [items[i][1] for i in idx]
        args = (keys,) if all(x is None for x in indices) else (keys, [... if x is None else x for x in indices])
        calls.append(Call(ps, "read", args))
    if calls:
        for idx, values in zip(by_ps.values(), transport_for(client).call_many(calls)):
            for i, val in zip(idx, values):
                results[i] = val
    return results


def apply_updates(items: Sequence[tuple[Variable, str, Any]]) -> None:
    """Apply checked ``(variable, op, payload)`` updates: one call per server, all at once."""
    by_ps, local, client = _by_server([v for v, _, _ in items])
    calls = [
        Call(ps, "update", ([(items[i][0]._store.key, items[i][1], items[i][2]) for i in idx],))
        for ps, idx in by_ps.items()
    ]
    for i in local:
        var, op, payload = items[i]
        apply_update(var._store.value, op, payload)
    if calls:
        transport_for(client).call_many(calls)
