"""Partitioners: how many shards a variable is split into, along one axis.

A partitioner is called as ``partitioner(shape, dtype, axis=0)`` and returns
a list with one entry per axis: the number of shards along ``axis`` and 1
everywhere else. ``ParameterServerStrategy(variable_partitioner=...)`` calls
it for every variable created in its scope and splits along axis 0.

The numbers are TensorFlow's: the same formulas, evaluated in the same order,
so every shape and dtype gets the same answer. String dtypes count
``bytes_per_string`` bytes per element.

>>> FixedShardsPartitioner(num_shards=2)((10, 3), np.float32)
[2, 1]
>>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32)
[2, 1]
>>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32)
[6, 1]
>>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32)
[6, 1]
>>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), np.float32)
[2, 1]
>>> MaxSizePartitioner(max_shard_bytes=1024)((6, 1), np.float32)
[1, 1]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from daskps._core.arrays import is_int

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "div_offsets",
    "fixed_size_partitioner",
    "min_max_variable_partitioner",
    "variable_axis_size_partitioner",
]

PartitionFn = Callable[..., list]


def _positive(value: Any, arg: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{arg} must be a positive int, got {value!r}")


def as_shape(shape: Any, arg: str = "shape") -> tuple[int, ...]:
    """``shape`` as a tuple of ints >= 0; as TensorFlow's ``TensorShape``, 2.5 or "3" is no dimension."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(f"{arg} must be a tuple of ints, got {shape!r}") from None
    if any(d is None for d in dims):
        raise ValueError(f"{arg} must be fully defined, got {shape!r}")
    if any(not is_int(d) for d in dims):
        raise ValueError(f"{arg} must be a tuple of ints, got {shape!r}")
    if any(d < 0 for d in dims):
        raise ValueError(f"{arg} must not have negative dimensions, got {shape!r}")
    return tuple(int(d) for d in dims)


def _axis(axis: Any, rank: int, shape: tuple) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -rank <= axis < rank:
        raise ValueError(f"axis must be an int in [-{rank}, {rank}) for shape {shape}, got {axis!r}")
    return int(axis) % rank


def _element_size(dtype: Any, bytes_per_string: int) -> int:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be a numpy dtype, got {dtype!r}") from None
    return bytes_per_string if dt.kind in "OSU" else dt.itemsize


def fixed_size_partitioner(num_shards: int, axis: int = 0) -> PartitionFn:
    """A partition function giving ``min(num_shards, shape[axis])`` shards along ``axis``."""
    _positive(num_shards, "num_shards")

    def partition(shape: Any, dtype: Any = None, **unused: Any) -> list[int]:
        dims = as_shape(shape)
        ax = _axis(axis, len(dims), dims)
        result = [1] * len(dims)
        result[ax] = min(num_shards, dims[ax])
        return result

    return partition


def min_max_variable_partitioner(
    max_partitions: int = 1, axis: int = 0, min_slice_size: int = 256 << 10, bytes_per_string_element: int = 16
) -> PartitionFn:
    """A partition function giving shards of at least ``min_slice_size`` bytes, at most ``max_partitions``.

    >>> min_max_variable_partitioner(max_partitions=16)((1024, 1024), np.float32)
    [16, 1]
    """
    _positive(max_partitions, "max_partitions")
    _positive(min_slice_size, "min_slice_size")
    _positive(bytes_per_string_element, "bytes_per_string_element")

    def partition(shape: Any, dtype: Any, **unused: Any) -> list[int]:
        dims = as_shape(shape)
        ax = _axis(axis, len(dims), dims)
        total_bytes = math.prod(dims) * _element_size(dtype, bytes_per_string_element)
        partitions = total_bytes / min_slice_size
        result = [1] * len(dims)
        result[ax] = max(1, min(dims[ax], max_partitions, int(math.ceil(partitions))))
        return result

    return partition


def variable_axis_size_partitioner(
    max_shard_bytes: int, axis: int = 0, bytes_per_string_element: int = 16, max_shards: int | None = None
) -> PartitionFn:
    """A partition function keeping shards at most ``max_shard_bytes`` (unless ``max_shards`` forbids).

    When one slice along ``axis`` is already larger than ``max_shard_bytes``,
    every slice becomes a shard. An empty variable gets one shard.

    >>> variable_axis_size_partitioner(max_shard_bytes=400)((100, 10), np.float32)
    [10, 1]
    """
    _positive(max_shard_bytes, "max_shard_bytes")
    _positive(bytes_per_string_element, "bytes_per_string_element")
    _positive(max_shards, "max_shards", allow_none=True)

    def partition(shape: Any, dtype: Any, **unused: Any) -> list[int]:
        dims = as_shape(shape)
        ax = _axis(axis, len(dims), dims)
        result = [1] * len(dims)
        if math.prod(dims) == 0:
            return result  # nothing to split (TensorFlow divides by zero here)
        bytes_per_slice = 1.0 * (math.prod(dims) / dims[ax]) * _element_size(dtype, bytes_per_string_element)
        slices_per_shard = max(1, math.floor(max_shard_bytes / bytes_per_slice))
        axis_shards = int(math.ceil(1.0 * dims[ax] / slices_per_shard))
        if max_shards:
            axis_shards = min(max_shards, axis_shards)
        result[ax] = axis_shards
        return result

    return partition


class Partitioner:
    """Base class: subclasses implement ``__call__(shape, dtype, axis=0) -> list[int]``.

    >>> class TwoShards(Partitioner):
    ...     def __call__(self, shape, dtype, axis=0):
    ...         return [2] + [1] * (len(shape) - 1)
    >>> TwoShards()((8, 4), np.float32)
    [2, 1]
    """

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        raise NotImplementedError("Partitioner subclasses must implement __call__(shape, dtype, axis=0)")

    def __repr__(self) -> str:
        args = ", ".join(f"{k.lstrip('_')}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards (fewer when the axis is shorter).

    >>> FixedShardsPartitioner(3)((2, 5), np.float32)
    [2, 1]
    """

    def __init__(self, num_shards: int):
        _positive(num_shards, "num_shards")
        self._num_shards = num_shards

    def __call__(self, shape: Sequence[int], dtype: Any = None, axis: int = 0) -> list[int]:
        return fixed_size_partitioner(self._num_shards, axis)(shape, dtype)


class MinSizePartitioner(Partitioner):
    """As many shards as possible with at least ``min_shard_bytes`` each, at most ``max_shards``.

    ``MinSizePartitioner(256 << 10, max_shards=num_ps)`` is the usual choice:
    shards of at least 256 KiB, at most one per parameter server.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        _positive(min_shard_bytes, "min_shard_bytes")
        _positive(max_shards, "max_shards")
        _positive(bytes_per_string, "bytes_per_string")
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        return min_max_variable_partitioner(
            self._max_shards, axis, self._min_shard_bytes, self._bytes_per_string
        )(shape, dtype)


class MaxSizePartitioner(Partitioner):
    """As few shards as possible with at most ``max_shard_bytes`` each (``max_shards`` takes precedence)."""

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        _positive(max_shard_bytes, "max_shard_bytes")
        _positive(max_shards, "max_shards", allow_none=True)
        _positive(bytes_per_string, "bytes_per_string")
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        return variable_axis_size_partitioner(
            self._max_shard_bytes, axis, self._bytes_per_string, self._max_shards
        )(shape, dtype)


def div_offsets(rows: int, num_shards: int) -> list[int]:
    """Start rows of a "div" split, plus ``rows`` at the end.

    The first ``rows % num_shards`` shards get one extra row:

    >>> div_offsets(13, 5)
    [0, 3, 6, 9, 11, 13]
    """
    if not is_int(rows) or rows < 0:
        raise ValueError(f"rows must be an int >= 0, got {rows!r}")
    _positive(num_shards, "num_shards")
    base, extra = divmod(int(rows), int(num_shards))
    offsets = [0]
    for i in range(num_shards):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    return offsets
