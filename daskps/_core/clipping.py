"""Gradient clipping as Keras 3 does it, on checked gradients, before they are split into shards.

The trainer clips, not the servers: a server sees only its shards' parts of
a gradient, while a norm is over the whole variable (``clipnorm``) or over
every gradient of one ``apply`` call (``global_clipnorm``).

>>> clip_gradients(Clipping(clipnorm=1.0), [("rows", (np.array([0, 0]), np.array([[3.0], [4.0]])))])
[('rows', (array([0, 0]), array([[0.6],
       [0.8]])))]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["Clipping", "clip_gradients"]


class Clipping(NamedTuple):
    """Gradient clipping as Keras 3 does it; at most one field is set."""

    clipnorm: float | None = None
    clipvalue: float | None = None
    global_clipnorm: float | None = None


class Pooled(NamedTuple):
    """A ``"bags"`` gradient: a row of ``values`` per bag; ``squares`` the sum of squared weights of each
    bag's ids, so that its norm is that of the gradient with a row per id."""

    squares: np.ndarray
    values: np.ndarray
    bags: Any


def _values(kind: str, payload: Any) -> np.ndarray:
    return payload[1] if kind in ("rows", "bags") else payload


def _with_values(kind: str, payload: Any, values: np.ndarray) -> Any:
    if kind == "bags":
        return payload._replace(values=values)
    return (payload[0], values) if kind == "rows" else values


def _squared(kind: str, payload: Any) -> Any:
    """The squared L2 norm of a gradient's values as given (a bag's row counted once per id, times its weight)."""
    values = _values(kind, payload)
    if kind == "bags":
        per_bag = np.sum(np.square(values, dtype=np.float64).reshape(len(values), int(np.prod(values.shape[1:]))),
                         axis=1)
        return np.dot(per_bag, payload.squares)
    return np.sum(np.square(values), dtype=np.float64)  # (float32 squares, as Keras' global norm)


def clip_gradients(clipping: Clipping, grads: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Clip checked ``(kind, payload)`` gradients (``"dense"`` arrays or ``"rows"`` ``(indices, values)``).

    Norms are L2 norms of the values as given: for rows, repeated indices are
    not summed first. ``global_clipnorm`` scales every gradient in ``grads``
    by one factor, ``clip / max(global norm, clip)``.

    >>> clip_gradients(Clipping(global_clipnorm=1.0), [("dense", np.array([3.0])), ("dense", np.array([4.0]))])
    [('dense', array([0.6])), ('dense', array([0.8]))]
    """
    if clipping.clipnorm is not None:
        c = clipping.clipnorm
        out = []
        for kind, payload in grads:
            values = _values(kind, payload)
            norm = (np.sqrt(_squared(kind, payload)).astype(values.dtype) if kind == "bags"
                    else np.sqrt(np.sum(np.square(values))))
            out.append((kind, _with_values(kind, payload, values * values.dtype.type(c) / np.maximum(norm, c))))
        return out
    if clipping.clipvalue is not None:
        c = clipping.clipvalue
        return [(kind, _with_values(kind, p, np.clip(_values(kind, p), -c, c))) for kind, p in grads]
    if clipping.global_clipnorm is not None and grads:
        c = clipping.global_clipnorm
        norm = np.sqrt(sum(_squared(kind, p) for kind, p in grads))
        scale = c * min(1.0 / norm, 1.0 / c) if norm > 0 else 1.0
        if not np.isfinite(norm):
            scale = np.nan  # as Keras: an infinite or NaN norm makes every gradient NaN
        return [(kind, _with_values(kind, p, _values(kind, p) * _values(kind, p).dtype.type(scale))) for kind, p in grads]
    return grads
