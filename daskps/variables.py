"""``Variable``: a numpy array that lives on a parameter server (or locally).

A variable made inside ``strategy.scope()`` is a small picklable handle:
worker address, actor key, variable key, shape, dtype and name. Reading or
updating it is one call to the parameter server that holds it, made from
whichever process uses it. Outside any scope a variable keeps its array in
the current process, as TensorFlow keeps such variables on the coordinator.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from daskps import context
from daskps.server import _PYTHON_DEFAULTS
from daskps.transport import Call, PSRef, transport_for

__all__ = ["Variable", "read_values"]

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


def coerce_update(value: Any, dtype: np.dtype, shape: tuple, name: str, arg: str = "value") -> np.ndarray:
    """Check an update against a variable: same shape, numeric, castable dtype."""
    if isinstance(value, Variable):
        value = value.numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{arg} for variable {name!r} must be array-like, got {type(value).__name__}") from exc
    if arr.dtype.kind not in "biufc":
        raise TypeError(
            f"{arg} for variable {name!r} must be numeric, got dtype {arr.dtype} "
            f"from {type(value).__name__}"
        )
    if arr.shape != shape:
        raise ValueError(f"{arg} for variable {name!r} must have shape {shape}, got {arr.shape}")
    typed = isinstance(value, (np.ndarray, np.generic))
    if typed and not np.can_cast(arr.dtype, dtype, casting="same_kind"):
        raise TypeError(f"{arg} for variable {name!r} must have a dtype castable to {dtype}, got {arr.dtype}")
    if not typed and arr.dtype.kind == "f" and dtype.kind in "biu":
        raise TypeError(f"{arg} for variable {name!r} has dtype {dtype}; got non-integer {value!r}")
    return arr.astype(dtype, copy=False)


class _LocalStore:
    """Keeps the value in this process."""

    device = LOCAL_DEVICE

    def __init__(self, value: np.ndarray):
        self.value = value

    def read(self) -> np.ndarray:
        return self.value.copy()  # callers may write to what they get

    def read_index(self, index: Any) -> np.ndarray:
        return np.array(self.value[index])

    def update(self, op: str, value: np.ndarray) -> None:
        if op == "assign":
            self.value = np.array(value, dtype=self.value.dtype)
        elif op == "add":
            self.value = np.asarray(self.value + value).astype(self.value.dtype, copy=False)
        else:
            self.value = np.asarray(self.value - value).astype(self.value.dtype, copy=False)


class _RemoteStore:
    """Reaches the value on a parameter server."""

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

    def transport(self):
        return transport_for(self.client)

    def read(self) -> np.ndarray:
        return self.transport().call(self.ps, "read", [self.key])[0]

    def read_index(self, index: Any) -> np.ndarray:
        return self.transport().call(self.ps, "read_index", self.key, index)

    def update(self, op: str, value: np.ndarray) -> None:
        self.transport().call(self.ps, "update", [(self.key, op, value)])


class _VariableMeta(type):
    """Routes ``Variable(...)`` to the current strategy inside its scope."""

    def __call__(cls, *args: Any, **kwargs: Any):
        if cls is Variable:
            mode = context._current_mode()
            creator = getattr(mode.strategy, "_variable_creator", None)
            if creator is not None and mode.replica_context is None:
                return creator(*args, **kwargs)
        return super().__call__(*args, **kwargs)


class Variable(metaclass=_VariableMeta):
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

    __array_priority__ = 100

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

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self._dtype.itemsize

    # -- reads --------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """The current value, as a numpy array."""
        return self._store.read()

    def read_value(self) -> np.ndarray:
        """The current value (same as :meth:`numpy`)."""
        return self._store.read()

    def value(self) -> np.ndarray:
        return self._store.read()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self._store.read()
        if dtype is not None:
            arr = arr.astype(dtype, copy=False)
        return np.array(arr, copy=True) if copy else arr

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        inputs = tuple(np.asarray(x) if isinstance(x, Variable) else x for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(x) if isinstance(x, Variable) else x for x in kwargs["out"])
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getitem__(self, index: Any) -> np.ndarray:
        """``value[index]`` with numpy semantics, sliced on the server."""
        if isinstance(index, Variable):
            index = index.numpy()
        return self._store.read_index(index)

    # -- updates ------------------------------------------------------------
    def _update(self, op: str, value: Any, arg: str) -> Variable:
        arr = coerce_update(value, self._dtype, self._shape, self._name, arg)
        self._store.update(op, arr)
        return self

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Variable:
        """Set the value; returns the variable."""
        return self._update("assign", value, "value")

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Variable:
        """Add ``delta`` (same shape) to the value; returns the variable."""
        return self._update("add", delta, "delta")

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Variable:
        """Subtract ``delta`` (same shape) from the value; returns the variable."""
        return self._update("sub", delta, "delta")

    # -- Python protocol ----------------------------------------------------
    __hash__ = None  # type: ignore[assignment]  # == is elementwise, as in TF2

    def ref(self) -> _VariableRef:
        """A hashable reference to this variable, for use as a dict key."""
        return _VariableRef(self)

    def __bool__(self) -> bool:
        return bool(self.numpy())

    def __float__(self) -> float:
        return float(self.numpy())

    def __int__(self) -> int:
        return int(self.numpy())

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a scalar variable")
        return self._shape[0]

    def __iter__(self) -> Iterator[np.ndarray]:
        if not self._shape:
            raise TypeError("iteration over a scalar variable")
        return iter(self.numpy())

    def __repr__(self) -> str:
        return (
            f"<daskps.Variable {self._name!r} shape={self._shape} dtype={self._dtype} "
            f"device={self.device!r}>"
        )


class _VariableRef:
    __slots__ = ("_var",)

    def __init__(self, var: Variable):
        self._var = var

    def deref(self) -> Variable:
        return self._var

    def __hash__(self) -> int:
        return id(self._var)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _VariableRef) and other._var is self._var


def _binary(op: Any, reflected: bool = False):
    if reflected:
        return lambda self, other: op(np.asarray(other), self.numpy())
    return lambda self, other: op(self.numpy(), np.asarray(other))


for _name, _op in [
    ("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
    ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
    ("pow", operator.pow), ("matmul", operator.matmul), ("and", operator.and_),
    ("or", operator.or_), ("xor", operator.xor),
]:
    setattr(Variable, f"__{_name}__", _binary(_op))
    setattr(Variable, f"__r{_name}__", _binary(_op, reflected=True))
for _name, _op in [
    ("lt", operator.lt), ("le", operator.le), ("gt", operator.gt),
    ("ge", operator.ge), ("eq", operator.eq), ("ne", operator.ne),
]:
    setattr(Variable, f"__{_name}__", _binary(_op))
for _name, _op in [("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs), ("invert", operator.invert)]:
    setattr(Variable, f"__{_name}__", (lambda op: lambda self: op(self.numpy()))(_op))


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
    flat = [leaf for group in leaves for leaf in group]
    values = _read_flat(flat)
    out, i = [], 0
    for v, group in zip(variables, leaves):
        part_values = values[i : i + len(group)]
        i += len(group)
        out.append(part_values[0] if len(group) == 1 and group[0] is v else np.concatenate(part_values, axis=0))
    return out


def _read_flat(flat: list[Variable]) -> list[np.ndarray]:
    results: list[Any] = [None] * len(flat)
    by_ps: dict[PSRef, list[int]] = {}
    client = None
    for i, v in enumerate(flat):
        store = v._store
        if isinstance(store, _RemoteStore):
            by_ps.setdefault(store.ps, []).append(i)
            client = client or store.client
        else:
            results[i] = store.read()
    if by_ps:
        calls = [Call(ps, "read", ([flat[i]._store.key for i in idx],)) for ps, idx in by_ps.items()]
        for idx, values in zip(by_ps.values(), transport_for(client).call_many(calls)):
            for i, val in zip(idx, values):
                results[i] = val
    return results
