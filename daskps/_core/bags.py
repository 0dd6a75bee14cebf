"""Pooling bags of rows where the rows live, and spreading a pooled gradient back over them.

A *bag* is a list of row ids (with optional weights) whose rows are
combined into one vector, as TensorFlow's ``embedding_lookup_sparse`` does.
A parameter server gets, for one table part, the ids of that part in every
bag that has some (:class:`BagRead`): it answers one partial sum per bag,
``sum(weight * row)``; the trainer adds the parts' partial sums and divides
by what the combiner asks (it alone sees whole bags). The gradient comes
back the same way (:class:`BagGrad`): one vector per bag, already divided,
which the server multiplies by each id's weight and adds into the rows.

So that a gradient need not carry the ids again, a server remembers the
bags of the last :data:`REMEMBERED` lookups of each client process (its
*lane*) for each table: a gradient then names the lookup by its token.
Tokens count up in each lane; a server keeps a token until one
:data:`REMEMBERED` or more higher arrives, and the client, which knows the
highest token it sent, only names a lookup the server still holds.

>>> rows = np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]], np.float32)
>>> pool(rows[[0, 2, 1]], np.array([2, 1]), None, None)
array([[3., 2.],
       [0., 1.]], dtype=float32)
>>> spread(np.array([[1.0, 1.0], [5.0, 5.0]], np.float32), np.array([2, 1]), np.array([1.0, 0.5, 2.0], np.float32))
array([[ 1. ,  1. ],
       [ 0.5,  0.5],
       [10. , 10. ]], dtype=float32)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

REMEMBERED = 8  # lookups per lane and table a server keeps for their gradients
Bag = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]  # ids, lengths, weights


class BagRead(NamedTuple):
    """Pool, on one table part, the rows ``ids`` in consecutive bags of ``lengths`` (each >= 1).

    ``weights`` (one per id) or ``None`` for ones; rows are clipped to an L2
    norm of ``max_norm`` first if it is given. ``lane`` and ``token`` name
    the lookup for a gradient to come (``lane`` ``None``: nothing is kept).
    """

    ids: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray | None = None
    max_norm: float | None = None
    lane: str | None = None
    token: int = 0


class BagGrad(NamedTuple):
    """A gradient of pooled bags for one table part: a row of ``values`` per bag.

    Either the bags themselves (``ids``, ``lengths``, ``weights``, as in
    :class:`BagRead`), or ``ids`` ``None`` and the ``lane`` and ``token`` of
    the lookup whose bags these are. ``max_norm``: the lookup clipped rows to
    it, so each row's gradient goes through that clipping (:func:`unclip`).
    """

    values: np.ndarray
    ids: np.ndarray | None = None
    lengths: np.ndarray | None = None
    weights: np.ndarray | None = None
    lane: str | None = None
    token: int = 0
    max_norm: float | None = None


def check_bags(ids: Any, lengths: Any, weights: Any, what: str) -> Bag:
    """The arrays of a :class:`BagRead` or :class:`BagGrad`, checked: 1-D integer ids, lengths >= 1
    adding up to the ids, float weights one per id."""
    ids, lengths = np.asarray(ids), np.asarray(lengths)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TypeError(f"{what}: bag ids must be a 1-D integer array, got {ids.dtype} of shape {ids.shape}")
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (len(lengths) and lengths.min() < 1):
        raise ValueError(f"{what}: bag lengths must be a 1-D array of ints >= 1")
    if int(lengths.sum(dtype=np.int64)) != len(ids):
        raise ValueError(f"{what}: bag lengths add up to {int(lengths.sum())}, but there are {len(ids)} ids")
    if weights is not None:
        weights = np.asarray(weights)
        if weights.shape != ids.shape or weights.dtype.kind != "f":
            raise ValueError(f"{what}: bag weights must be floats, one per id ({ids.shape}), "
                             f"got {weights.dtype} of shape {weights.shape}")
    return ids, lengths, weights


def check_max_norm(max_norm: Any, what: str) -> float | None:
    """``max_norm`` as a positive float (or ``None``)."""
    if max_norm is None:
        return None
    value = float(max_norm)
    if not value > 0:  # NaN too
        raise ValueError(f"{what}: max_norm must be a positive number, got {max_norm!r}")
    return value


def clip(rows: np.ndarray, max_norm: float) -> np.ndarray:
    """``rows`` (a row per item of axis 0) scaled down to an L2 norm of at most ``max_norm``."""
    flat = rows.reshape(len(rows), int(np.prod(rows.shape[1:])))
    norms = np.sqrt(np.einsum("ij,ij->i", flat, flat, dtype=np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(norms > max_norm, max_norm / norms, 1.0)
    return (rows * scale.reshape((-1,) + (1,) * (rows.ndim - 1))).astype(rows.dtype, copy=False)


def pool(rows: np.ndarray, lengths: np.ndarray, weights: np.ndarray | None, max_norm: float | None) -> np.ndarray:
    """``sum(weight * row)`` over each bag of consecutive ``rows`` (bags of ``lengths``, each >= 1)."""
    if max_norm is not None:
        rows = clip(rows, max_norm)
    if weights is not None:
        rows = rows * weights.astype(rows.dtype, copy=False).reshape((-1,) + (1,) * (rows.ndim - 1))
    if len(lengths) == len(rows):  # bags of one: nothing to add up
        return rows
    starts = np.zeros(len(lengths), np.intp)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.add.reduceat(rows, starts, axis=0)


def unclip(grads: np.ndarray, rows: np.ndarray, max_norm: float) -> np.ndarray:
    """The gradients of ``rows`` given those of their clipped copies (:func:`clip`): the clipping's Jacobian.

    A row of norm ``n > max_norm`` became ``row * c / n``; its gradient is
    ``(c / n) * (g - row * (row . g) / n**2)``. Other rows pass ``g`` through.
    """
    width = int(np.prod(grads.shape[1:]))
    flat_g, flat_r = grads.reshape(len(grads), width), rows.reshape(len(rows), width).astype(np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", flat_r, flat_r))
    over = np.flatnonzero(norms > max_norm)
    if not len(over):
        return grads
    out = flat_g.astype(np.float64)
    r, n = flat_r[over], norms[over][:, None]
    g = out[over]
    out[over] = (max_norm / n) * (g - r * np.einsum("ij,ij->i", r, g)[:, None] / (n * n))
    return out.astype(grads.dtype).reshape(grads.shape)


def spread(values: np.ndarray, lengths: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """Each bag's row of ``values`` repeated for each of its ids, times the id's weight."""
    out = np.repeat(values, lengths.astype(np.intp, copy=False), axis=0)
    if weights is not None:
        out *= weights.astype(out.dtype, copy=False).reshape((-1,) + (1,) * (out.ndim - 1))
    return out


class BagMemory:
    """A server's bags of recent lookups, by table key and lane, for the gradients that follow them."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], dict[int, Bag]] = {}

    def keep(self, key: str, read: BagRead, bags: Bag) -> None:
        """Keep the checked ``bags`` of ``read`` for its gradient (nothing for a read without a lane)."""
        if read.lane is None:
            return
        kept = self._kept.setdefault((key, str(read.lane)), {})
        kept[int(read.token)] = bags
        for token in [t for t in kept if t <= read.token - REMEMBERED]:
            del kept[token]

    def find(self, key: str, grad: BagGrad) -> Bag | None:
        """The bags of ``grad``: its own, or those of the lookup it names (kept until :meth:`forget`).

        ``None`` if this server has seen no lookup of ``grad``'s lane for this table: it was made again
        (restored after a loss) since the lookup, whose rows the restore rolled back anyway.
        """
        if grad.ids is not None:
            return check_bags(grad.ids, grad.lengths, grad.weights, "pooled gradient")
        kept = self._kept.get((key, str(grad.lane)))
        if kept is None:
            return None
        if grad.token not in kept:
            raise LookupError(f"a pooled gradient names lookup {grad.token} of {grad.lane}, which this server no "
                              "longer holds (was it restarted?); send the bags with the gradient")
        return kept[grad.token]

    def forget(self, key: str, grad: BagGrad) -> None:
        """Drop what ``grad`` used: a lookup is trained once."""
        kept = self._kept.get((key, str(grad.lane)))
        if grad.ids is None and kept is not None:
            kept.pop(grad.token, None)

    def drop_table(self, key: str) -> None:
        for k in [k for k in self._kept if k[0] == key]:
            del self._kept[k]

    def drop_lanes(self, suffix: str) -> None:
        for k in [k for k in self._kept if k[1].endswith(suffix)]:
            del self._kept[k]
