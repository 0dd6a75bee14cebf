"""``embedding_lookup``: rows of a (sharded) table, fetched where they live."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from daskps._core.updates import check_indices
from daskps.variables import rows
from daskps.variables.hashed import EmbeddingTable
from daskps.variables.rows import clip_rows
from daskps.variables.variable import ShardedVariable, Variable

__all__ = ["embedding_lookup"]


def embedding_lookup(params: Any, ids: Any, max_norm: float | None = None, name: str | None = None) -> np.ndarray:
    """The rows of ``params`` named by ``ids``: shape ``ids.shape + params.shape[1:]``.

    Parameters
    ----------
    params : Variable, ShardedVariable, list of Variable, EmbeddingTable, or numpy array
        A list is taken as the shards of one table in row order (for a "div"
        split this is TensorFlow's ``partition_strategy="div"``).
    ids : array-like of int, any shape
        Row numbers in ``[0, rows)``; ``IndexError`` otherwise. For an
        :class:`~daskps.EmbeddingTable`, any int64 keys (rows are made on first sight).
    max_norm : float, optional
        Rows whose L2 norm exceeds it are scaled down to it: a positive
        number (``inf`` clips nothing); anything else is refused before any
        row is read (``TypeError`` for a non-number, ``ValueError`` for zero,
        a negative number or NaN).

    Only the distinct rows requested are read, from every shard at once, one
    call per parameter server; the table never moves.

    Examples
    --------
    >>> import daskps as dps
    >>> table = dps.ShardedVariable([dps.Variable([[0.0, 0.0], [1.0, 1.0]]), dps.Variable([[2.0, 2.0]])])
    >>> dps.embedding_lookup(table, [[2, 0], [2, 2]]).shape
    (2, 2, 2)
    """
    check_max_norm(max_norm)
    if isinstance(params, (list, tuple)):
        params = params[0] if len(params) == 1 else ShardedVariable(list(params), name="embedding")
    if isinstance(params, EmbeddingTable):
        found = params.lookup(ids)
    elif isinstance(params, ShardedVariable):
        found = rows.read_plan(*params.row_plan(ids, "ids"))
    elif isinstance(params, Variable):
        found = rows.gather_rows([params], (0, params.shape[0] if params.shape else 0), ids, params.name, arg="ids")
    else:
        table = np.asarray(params)
        found = table[check_indices(ids, len(table), "params", "ids", one_d=False)]
    if max_norm is not None:
        found = clip_rows(found, np.ndim(ids), max_norm)
    return found


def check_max_norm(max_norm: Any) -> None:
    """Refuse a ``max_norm`` TensorFlow's ``clip_by_norm`` could not use: it must be a number > 0."""
    if max_norm is None:
        return
    if isinstance(max_norm, (bool, np.bool_)) or not isinstance(max_norm, numbers.Real):
        raise TypeError(f"max_norm must be a positive number or None, got {type(max_norm).__name__} {max_norm!r}")
    if not float(max_norm) > 0:  # NaN fails this too
        raise ValueError(f"max_norm must be a positive number or None, got {max_norm!r}")
