"""Metrics whose state lives on a parameter server.

Create them inside ``strategy.scope()`` on the coordinator; their state
variables go together to one server. ``update_state`` may be called from
scheduled functions on any trainer (one update call to that server);
``result()`` and ``reset_state()`` are for the coordinator (or anywhere).

>>> import daskps as dps
>>> m = dps.metrics.Mean()
>>> m.update_state([1.0, 2.0, 3.0])
>>> m.update_state([10.0], sample_weight=[3.0])
>>> float(m.result()), m.result().numpy()
(6.0, array(6., dtype=float32))
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskps.client import protocol
from daskps.distribute import context
from daskps.variables.variable import Variable, read_values

__all__ = ["Accuracy", "Mean", "Metric", "SparseCategoricalAccuracy", "Sum"]


class Result(np.ndarray):
    """A metric's value: a 0-d numpy array that also answers TensorFlow's ``.numpy()``."""

    def numpy(self) -> np.ndarray:
        return np.asarray(self).copy()

    def __repr__(self) -> str:
        return repr(np.asarray(self))


def _result(value: Any, dtype: np.dtype) -> Result:
    return np.asarray(value, dtype=dtype).view(Result)


class Metric:
    """Base class: named state variables, colocated on one parameter server.

    State is float64, so long runs do not lose counts; ``result()`` returns
    ``dtype`` (float32 by default, as Keras).
    """

    _state_names: tuple[str, ...] = ()

    def __init__(self, name: str | None = None, dtype: Any = np.float32):
        self.name = name or type(self).__name__.lower()
        self.dtype = np.dtype(dtype)
        strategy = context.current_mode().strategy
        first, *rest = self._state_names
        state = [Variable(np.float64(0), trainable=False, name=f"{self.name}/{first}")]
        with strategy.extended.colocate_vars_with(state[0]):
            state += [Variable(np.float64(0), trainable=False, name=f"{self.name}/{n}") for n in rest]
        self._state = state

    @property
    def variables(self) -> list[Variable]:
        return list(self._state)

    def _add(self, *deltas: float) -> None:
        protocol.update([(v.handle, "add", np.float64(d)) for v, d in zip(self._state, deltas)])

    def reset_state(self) -> None:
        """Zero the state (one call to its server)."""
        protocol.update([(v.handle, "assign", np.float64(0)) for v in self._state])

    def reset_states(self) -> None:
        """Same as :meth:`reset_state` (TensorFlow 2's older name)."""
        self.reset_state()

    def result(self) -> Result:
        raise NotImplementedError

    def value_if_any(self) -> float | None:
        """The result as a float, or ``None`` while it has no value (a mean of nothing, since a reset):
        what a logger shows as a gap rather than a 0."""
        return float(self.result())

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Result:
        """Update with these values, then return the result."""
        self.update_state(*args, **kwargs)
        return self.result()

    def __repr__(self) -> str:
        return f"<daskps.metrics.{type(self).__name__} {self.name!r} on {self._state[0].device}>"


def _weighted(values: Any, sample_weight: Any) -> tuple[float, float]:
    """``(sum(values * w), sum(w))`` with ``w`` broadcast to ``values``."""
    values = np.asarray(values, dtype=np.float64)
    if sample_weight is None:
        return float(values.sum()), float(values.size)
    weights = np.asarray(sample_weight, dtype=np.float64)
    try:
        weights = np.broadcast_to(weights.reshape(weights.shape + (1,) * (values.ndim - weights.ndim)), values.shape)
    except ValueError:
        raise ValueError(
            f"sample_weight of shape {np.shape(sample_weight)} does not broadcast to values of shape {values.shape}"
        ) from None
    return float((values * weights).sum()), float(weights.sum())


class Sum(Metric):
    """The (weighted) sum of every value seen."""

    _state_names = ("total",)

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        self._add(_weighted(values, sample_weight)[0])

    def result(self) -> Result:
        return _result(read_values(self._state)[0], self.dtype)


class Mean(Metric):
    """The (weighted) mean of every value seen; 0 before any."""

    _state_names = ("total", "count")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        self._add(*_weighted(values, sample_weight))

    def result(self) -> Result:
        total, count = read_values(self._state)
        return _result(total / count if count else 0.0, self.dtype)

    def value_if_any(self) -> float | None:
        total, count = read_values(self._state)
        return float(_result(total / count, self.dtype)) if count else None


class Accuracy(Mean):
    """How often ``y_pred`` equals ``y_true``."""

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
        if y_true.shape != y_pred.shape:
            if y_true.size != y_pred.size:
                raise ValueError(f"y_true has shape {y_true.shape} but y_pred has shape {y_pred.shape}")
            y_true = y_true.reshape(y_pred.shape)
        super().update_state(y_true == y_pred, sample_weight)


class SparseCategoricalAccuracy(Mean):
    """How often ``argmax(y_pred, -1)`` equals the integer label ``y_true``."""

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        y_pred = np.asarray(y_pred)
        predicted = np.argmax(y_pred, axis=-1)
        y_true = np.asarray(y_true)
        if y_true.shape != predicted.shape:
            if y_true.size != predicted.size:
                raise ValueError(
                    f"y_true has shape {y_true.shape}; expected labels of shape {predicted.shape} "
                    f"for y_pred of shape {y_pred.shape}"
                )
            y_true = y_true.reshape(predicted.shape)
        super().update_state(predicted == y_true, sample_weight)
