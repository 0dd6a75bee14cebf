"""``IndexedSlices``: some rows of a larger array, as a sparse update or gradient."""

from __future__ import annotations

from typing import Any

import numpy as np

from daskps._core.trees import to_numpy


class IndexedSlices:
    """Rows ``indices`` of an array of ``dense_shape``, with values ``values``.

    ``values.shape`` starts with ``indices.shape``: for 1-D indices,
    ``values[i]`` is row ``indices[i]``. Indices may repeat; converting to a
    dense array sums the repeats (as a gradient would).

    Parameters
    ----------
    values : array-like (numpy, JAX, torch, ...)
    indices : array-like of int
    dense_shape : tuple of int, optional

    Examples
    --------
    >>> s = IndexedSlices(np.ones((3, 2)), [0, 2, 0], dense_shape=(4, 2))
    >>> np.asarray(s)
    array([[2., 2.],
           [0., 0.],
           [1., 1.],
           [0., 0.]])
    """

    __slots__ = ("values", "indices", "dense_shape")

    def __init__(self, values: Any, indices: Any, dense_shape: Any = None):
        # As dense gradients are: a torch tensor that requires grad is detached, a GPU one copied over.
        values = to_numpy(values)
        indices = to_numpy(indices)
        if indices.size == 0 and indices.dtype.kind == "f":
            indices = indices.astype(np.intp)  # [] parses as float64
        if indices.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers, got dtype {indices.dtype}")
        if values.shape[: indices.ndim] != indices.shape:
            raise ValueError(
                f"values must have shape indices.shape + row shape; got values {values.shape} "
                f"for indices {indices.shape}"
            )
        if dense_shape is not None:
            dense_shape = tuple(int(d) for d in dense_shape)
            if indices.ndim == 1 and (not dense_shape or values.shape[1:] != dense_shape[1:]):
                raise ValueError(f"values rows have shape {values.shape[1:]}, which does not fit dense_shape {dense_shape}")
        self.values = values
        self.indices = indices
        self.dense_shape = dense_shape

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def shape(self) -> tuple[int, ...] | None:
        return self.dense_shape

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self.dense_shape is None or self.indices.ndim != 1:
            raise ValueError("only IndexedSlices with 1-D indices and a dense_shape convert to a dense array")
        dense = np.zeros(self.dense_shape, dtype=dtype or self.values.dtype)
        np.add.at(dense, self.indices, self.values)
        return dense

    def __reduce__(self):
        return (IndexedSlices, (self.values, self.indices, self.dense_shape))

    def __repr__(self) -> str:
        return (
            f"IndexedSlices(indices={self.indices.shape}, values={self.values.shape} "
            f"{self.values.dtype}, dense_shape={self.dense_shape})"
        )
