"""Making arrays for variables: dtype defaults, argument checks, initializers.

The same rules apply wherever a variable's value is built: on a parameter
server, in this process for a local variable, or on the coordinator when an
initializer needs no shape.

>>> default_array(1.5).dtype, default_array([1, 2]).dtype, default_array(np.float64(1)).dtype
(dtype('float32'), dtype('int32'), dtype('float64'))
>>> call_initializer(lambda shape, dtype: np.zeros(shape, dtype), (2,), np.dtype("int8"))
array([0, 0], dtype=int8)
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# Python numbers follow TensorFlow's defaults, not numpy's 64-bit ones.
PYTHON_DEFAULTS = {np.dtype("float64"): np.dtype("float32"), np.dtype("int64"): np.dtype("int32")}


def _typed(value: Any) -> bool:
    """Whether ``value`` carries its own dtype (numpy values and variables do; Python numbers do not)."""
    return isinstance(value, (np.ndarray, np.generic)) or (hasattr(value, "__array__") and hasattr(value, "dtype"))


def default_array(value: Any, arg: str = "value") -> np.ndarray:
    """``value`` as a numeric array; Python numbers default to float32/int32."""
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # ragged nested lists
        raise ValueError(f"{arg} must be an array-like of one shape: {exc}") from None
    if not _typed(value):
        arr = arr.astype(PYTHON_DEFAULTS.get(arr.dtype, arr.dtype), copy=False)
    if arr.dtype.kind not in "biufc":
        raise TypeError(f"{arg} must be numeric, got dtype {arr.dtype} from {type(value).__name__}")
    return arr


def is_int(value: Any) -> bool:
    """Whether ``value`` is a whole number: a Python or numpy integer, not a bool (nor numpy's).

    >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
    (True, True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_trainable_flag(trainable: Any) -> bool:
    """``trainable`` as a bool: True, False (numpy's too), or None for the default, True (as TensorFlow)."""
    if trainable is None:
        return True
    if not isinstance(trainable, (bool, np.bool_)):
        raise TypeError(f"trainable must be True or False, got {trainable!r}")
    return bool(trainable)


def check_variable_args(initial_value: Any, name: Any, dtype: Any, shape: Any) -> tuple[str, np.dtype | None, tuple | None]:
    """Validate a variable's constructor arguments; return ``(name, dtype, shape)``."""
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
    kwargs = {k: v for k, v in offered.items() if v is not None and (takes_all or k in params)}
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


def materialize(value: Any, dtype: np.dtype | None, shape: tuple | None, name: str, fresh: bool = False) -> np.ndarray:
    """A private, writable, numeric array for variable ``name``.

    Updates write in place, so the array is a copy unless ``fresh`` says the
    value is an initializer's new array (a large one need not exist twice).
    """
    private = fresh and isinstance(value, np.ndarray) and value.flags.owndata and value.flags.writeable
    try:
        arr = np.array(value, dtype=dtype, copy=None if private else True)
    except (TypeError, ValueError) as exc:  # strings into a float variable, ragged lists, ...
        raise TypeError(f"initial_value of variable {name!r} cannot be an array of dtype "
                        f"{np.dtype(dtype) if dtype is not None else 'numbers'}: {exc}") from None
    if dtype is None and not _typed(value):
        arr = arr.astype(PYTHON_DEFAULTS.get(arr.dtype, arr.dtype), copy=False)
    if shape is not None and arr.shape != tuple(shape):
        raise ValueError(f"initial_value of variable {name!r} has shape {arr.shape}, expected shape {tuple(shape)}")
    if arr.dtype.kind not in "biufc":
        raise TypeError(f"initial_value of variable {name!r} must hold numbers, got dtype {arr.dtype}")
    return arr
