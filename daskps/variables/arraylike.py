"""Numpy behaviour shared by ``Variable`` and ``ShardedVariable``.

A subclass provides ``numpy()``, ``shape``, ``dtype``, ``_dense(op, value,
arg)``, ``_scatter(op, sparse_delta)`` and ``_gather(indices)``; this base
turns them into operators, ufuncs, conversions and TensorFlow's sparse API.
Every operator and ufunc gives exactly what the same operation on
``np.asarray(v)`` gives, dtype included.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from daskps._core.slices import IndexedSlices


class ArrayLike:
    __array_priority__ = 100
    __hash__ = None  # type: ignore[assignment]  # == is elementwise, as in TF2

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def dtype(self) -> np.dtype:
        raise NotImplementedError

    def numpy(self) -> np.ndarray:
        raise NotImplementedError

    def read_value(self) -> np.ndarray:
        """The current value (same as :meth:`numpy`)."""
        return self.numpy()

    def value(self) -> np.ndarray:
        return self.numpy()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def ref(self) -> Ref:
        """A hashable reference to this object, for use as a dict key."""
        return Ref(self)

    # -- numpy protocol -----------------------------------------------------
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if any(isinstance(x, ArrayLike) for x in kwargs.get("out", ())):
            raise TypeError(
                f"out= cannot be a variable: {ufunc.__name__} would write into a copy of its value; "
                "compute the result and pass it to assign()"
            )
        return getattr(ufunc, method)(*(_operand(x) for x in inputs), **kwargs)

    def __bool__(self) -> bool:
        return bool(self.numpy())

    def __float__(self) -> float:
        return float(self.numpy())

    def __int__(self) -> int:
        return int(self.numpy())

    # -- dense updates --------------------------------------------------------
    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Any:
        """Set the value (same shape); returns ``self``."""
        return self._dense("assign", value, "value")

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Any:
        """Add ``delta`` (same shape); returns ``self``."""
        return self._dense("add", delta, "delta")

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Any:
        """Subtract ``delta`` (same shape); returns ``self``."""
        return self._dense("sub", delta, "delta")

    # -- sparse API ---------------------------------------------------------
    def scatter_add(self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None) -> Any:
        """Add ``sparse_delta.values`` to the rows ``sparse_delta.indices`` (duplicates accumulate)."""
        return self._sparse("scatter_add", sparse_delta)

    def scatter_sub(self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None) -> Any:
        """Subtract ``sparse_delta.values`` from the rows it names."""
        return self._sparse("scatter_sub", sparse_delta)

    def scatter_mul(self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None) -> Any:
        """Multiply the rows ``sparse_delta`` names by its values."""
        return self._sparse("scatter_mul", sparse_delta)

    def scatter_div(self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None) -> Any:
        """Divide the rows ``sparse_delta`` names by its values (integers truncate)."""
        return self._sparse("scatter_div", sparse_delta)

    def scatter_min(self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None) -> Any:
        """Elementwise minimum of the rows ``sparse_delta`` names and its values."""
        return self._sparse("scatter_min", sparse_delta)

    def scatter_max(self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None) -> Any:
        """Elementwise maximum of the rows ``sparse_delta`` names and its values."""
        return self._sparse("scatter_max", sparse_delta)

    def scatter_update(self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None) -> Any:
        """Set the rows ``sparse_delta`` names (for duplicates the last wins)."""
        return self._sparse("scatter_update", sparse_delta)

    def batch_scatter_update(self, sparse_delta: IndexedSlices, use_locking: bool = False, name: str | None = None) -> Any:
        """``self[b..., indices[b..., j]] = values[b..., j]`` for batch indices of shape ``shape[:k] + (n,)``."""
        return self._sparse("batch_scatter_update", sparse_delta)

    def sparse_read(self, indices: Any, name: str | None = None) -> np.ndarray:
        """The rows named by 1-D ``indices``, fetched without reading the rest."""
        return self._gather(indices, one_d=True)

    def _sparse(self, op: str, sparse_delta: Any) -> Any:
        if not isinstance(sparse_delta, IndexedSlices):
            raise TypeError(f"sparse_delta must be a daskps.IndexedSlices, got {type(sparse_delta).__name__}")
        return self._scatter(op, (sparse_delta.indices, sparse_delta.values))

    def _dense(self, op: str, value: Any, arg: str) -> Any:
        raise NotImplementedError

    def _scatter(self, op: str, payload: tuple) -> Any:
        raise NotImplementedError

    def _gather(self, indices: Any, one_d: bool = False, arg: str = "indices") -> np.ndarray:
        raise NotImplementedError


class Ref:
    """Hashable stand-in for a variable (``v.ref()``); ``deref()`` gives it back."""

    __slots__ = ("_var",)

    def __init__(self, var: Any):
        self._var = var

    def deref(self) -> Any:
        return self._var

    def __hash__(self) -> int:
        return id(self._var)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and other._var is self._var


def _operand(x: Any) -> Any:
    # Everything but variables goes to numpy as it is: wrapping a Python
    # scalar in an array would defeat numpy's rules for them (float32 * 0.5
    # stays float32).
    return x.numpy() if isinstance(x, ArrayLike) else x


def _binary(op: Any, reflected: bool = False):
    if reflected:
        return lambda self, other: op(_operand(other), self.numpy())
    return lambda self, other: op(self.numpy(), _operand(other))


def _unary(op: Any):
    return lambda self: op(self.numpy())


for _name, _op in [
    ("add", operator.add), ("sub", operator.sub), ("mul", operator.mul),
    ("truediv", operator.truediv), ("floordiv", operator.floordiv), ("mod", operator.mod),
    ("pow", operator.pow), ("matmul", operator.matmul), ("and", operator.and_),
    ("or", operator.or_), ("xor", operator.xor), ("lshift", operator.lshift),
    ("rshift", operator.rshift), ("divmod", divmod),
]:
    setattr(ArrayLike, f"__{_name}__", _binary(_op))
    setattr(ArrayLike, f"__r{_name}__", _binary(_op, reflected=True))
for _name, _op in [
    ("lt", operator.lt), ("le", operator.le), ("gt", operator.gt),
    ("ge", operator.ge), ("eq", operator.eq), ("ne", operator.ne),
]:
    setattr(ArrayLike, f"__{_name}__", _binary(_op))
for _name, _unary_op in [("neg", operator.neg), ("pos", operator.pos), ("abs", operator.abs), ("invert", operator.invert)]:
    setattr(ArrayLike, f"__{_name}__", _unary(_unary_op))
