"""``dps.keras.EmbeddingTable``: a hash embedding table on the parameter servers, as a Keras layer.

With ``combiner`` it pools each row of ids (a bag, padded with ids < 0) on
the servers, as :func:`daskps.embedding_lookup_sparse` does, and its
gradient goes back as one vector per bag (:class:`daskps.PooledSlices`).

The layer holds no weights in the model: its rows are a
:class:`daskps.EmbeddingTable` on the servers (any int64 key, rows made on
first sight, eviction and capacity as that class has them), made when the
model is first trained on a strategy. In a ``dps.keras`` step the trainer
first works out the ids each such layer sees (a jitted pass that XLA prunes
to what the ids depend on), reads their rows in the same round trip as the
model's variables, runs Keras' step with those rows as the layer's output,
and sends the rows' gradients back as ``IndexedSlices``: the table is never
pulled whole. Called outside a step (``model.predict`` in your process), the
layer reads the rows from the servers.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from daskps.keras.backend import all_layers

__all__ = ["EmbeddingTable", "no_lookups", "recording_ids", "table_layers", "using_rows"]

_ROWS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("daskps_keras_rows", default=None)
_IDS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("daskps_keras_ids", default=None)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def using_rows(rows: dict[str, Any]) -> Any:
    """Inside: each ``EmbeddingTable`` layer returns the rows given for it by name (traced in a step)."""
    return _setting(_ROWS, rows)


def recording_ids(found: dict[str, Any]) -> Any:
    """Inside: each ``EmbeddingTable`` layer puts the ids it is called with in ``found`` and returns zeros."""
    return _setting(_IDS, found)


def no_lookups() -> Any:
    """Inside: the layers return zeros and read nothing (Keras' build, which only needs shapes)."""
    return recording_ids({})


@keras.saving.register_keras_serializable(package="daskps")
class EmbeddingTable(keras.layers.Layer):
    """Rows of a :class:`daskps.EmbeddingTable` for integer ids: output shape ``ids.shape + (dim,)``.

    Parameters
    ----------
    dim : int
        Row width.
    initializer : callable(shape, dtype), optional
        How a new row is made on its server (zeros by default); pickled to
        the servers, so a module-level function or a numpy-only callable.
    admit_after, evict_after_steps, capacity
        As :class:`daskps.EmbeddingTable`.
    combiner : {"mean", "sum", "sqrtn"}, optional
        Pool each row of ids (its last axis: a bag, padded with ids < 0)
        into one vector, as :func:`daskps.embedding_lookup_sparse` does, on
        the servers: output shape ``ids.shape[:-1] + (dim,)``. The gradient
        goes back as one vector per bag.

    Examples
    --------
    >>> ids = keras.Input((3,), dtype="int64")                       # doctest: +SKIP
    >>> rows = dps.keras.EmbeddingTable(16)(ids)                      # doctest: +SKIP
    >>> bags = keras.Input((20,), dtype="int64")   # -1 pads           # doctest: +SKIP
    >>> pooled = dps.keras.EmbeddingTable(16, combiner="mean")(bags)  # doctest: +SKIP
    """

    def __init__(self, dim: int, *, initializer: Any = None, admit_after: int = 1,
                 evict_after_steps: int | None = None, capacity: int | None = None, combiner: str | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        if combiner not in (None, "mean", "sum", "sqrtn"):
            raise ValueError(f"combiner must be 'mean', 'sum', 'sqrtn' or None, got {combiner!r}")
        self.combiner = combiner
        self.dim = dim
        self.initializer = initializer
        self.admit_after = admit_after
        self.evict_after_steps = evict_after_steps
        self.capacity = capacity
        self.table: Any = None  # the dps.EmbeddingTable, once the model is bound to a strategy

    def table_kwargs(self) -> dict[str, Any]:
        return dict(initializer=self.initializer, admit_after=self.admit_after,
                    evict_after_steps=self.evict_after_steps, capacity=self.capacity)

    def _out_shape(self, shape: Any) -> tuple[Any, ...]:
        shape = tuple(shape)
        if self.combiner is not None:
            if not shape:
                raise ValueError(f"EmbeddingTable layer {self.name!r} pools each row of ids: it takes ids of rank "
                                 ">= 1, got a scalar")
            shape = shape[:-1]
        return shape + (self.dim,)

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return self._out_shape(input_shape)

    def compute_output_spec(self, ids: Any) -> Any:
        return keras.KerasTensor(self._out_shape(ids.shape), dtype=self.compute_dtype)

    def call(self, ids: Any) -> Any:
        rows = _ROWS.get()
        if rows is not None and self.name in rows:
            return rows[self.name]
        found = _IDS.get()
        if found is not None:
            found[self.name] = ids
            return keras.ops.zeros(self._out_shape(ids.shape), dtype=self.compute_dtype)
        return self._lookup(ids)

    def _lookup(self, ids: Any) -> Any:
        """The rows from the servers, outside a ``dps.keras`` step (``model.predict`` in this process)."""
        if self.table is None:
            raise RuntimeError(f"EmbeddingTable layer {self.name!r} has no rows yet: its table is made on the "
                               "parameter servers by the model's first dps.keras.fit, evaluate or predict")
        from daskps.variables.bags import embedding_lookup_sparse
        from daskps.variables.embedding import embedding_lookup

        table, dtype, combiner = self.table, np.dtype(self.compute_dtype), self.combiner

        def read(i: Any) -> np.ndarray:
            i = np.asarray(i).astype(np.int64)
            if combiner is None:
                return np.asarray(embedding_lookup(table, i), dtype)
            width = i.shape[-1]
            pooled = embedding_lookup_sparse(table, (i.reshape(-1), np.full(i.size // max(width, 1), width)),
                                             combiner=combiner)
            return np.asarray(pooled, dtype).reshape(i.shape[:-1] + (-1,))

        if keras.backend.backend() == "jax":
            import jax

            shape = jax.ShapeDtypeStruct(self._out_shape(ids.shape), dtype)
            return jax.pure_callback(read, shape, ids)
        return keras.ops.convert_to_tensor(read(keras.ops.convert_to_numpy(ids)))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        # The initializer stays with the table on the servers: copies of the model never make rows.
        config.update(dim=self.dim, admit_after=self.admit_after, evict_after_steps=self.evict_after_steps,
                      capacity=self.capacity, combiner=self.combiner)
        return config


def table_layers(model: Any) -> list[EmbeddingTable]:
    """The model's ``EmbeddingTable`` layers, nested models included, in a stable order."""
    return [layer for layer in all_layers(model) if isinstance(layer, EmbeddingTable)]
