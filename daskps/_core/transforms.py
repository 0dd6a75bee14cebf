"""Optimizer maths as pure functions on arrays, in the style of optax.

A *transform* is a small immutable configuration (a ``NamedTuple`` of
hyperparameters) with two pure methods:

- ``init(param) -> state``: the state for one parameter, a ``NamedTuple``
  whose ``count`` is the number of updates applied so far and whose other
  fields are arrays shaped like the parameter (Keras calls them slots);
- ``update(grad, state, param) -> (updates, state)``: the step to add to the
  parameter, and the next state.

Because they are pure, one transform serves every variable and shard, and
the same ``update`` runs on a whole array or on the rows an ``IndexedSlices``
gradient names. A parameter server is sent each transform once and keeps
every state beside its variable. The numbers are Keras 3's.

>>> sgd = SGDTransform(learning_rate=0.1, momentum=0.9)
>>> param = np.zeros(2, np.float32)
>>> updates, state = sgd.update(np.ones(2, np.float32), sgd.init(param), param)
>>> updates, state.count, state.momentum
(array([-0.1, -0.1], dtype=float32), 1, array([-0.1, -0.1], dtype=float32))
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np


class Transform(Protocol):
    """What a parameter server needs of an optimizer."""

    def init(self, param: np.ndarray) -> Any: ...

    def update(self, grad: np.ndarray, state: Any, param: np.ndarray) -> tuple[np.ndarray, Any]: ...


class SGDState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    momentum: np.ndarray | None = None


class SGDTransform(NamedTuple):
    """Gradient descent with optional (Nesterov) momentum, as ``keras.optimizers.SGD``."""

    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False

    def init(self, param: np.ndarray) -> SGDState:
        return SGDState(0, np.zeros_like(param) if self.momentum else None)

    def update(self, grad: np.ndarray, state: SGDState, param: np.ndarray) -> tuple[np.ndarray, SGDState]:
        t = param.dtype.type
        lr, mu = t(self.learning_rate), t(self.momentum)
        if state.momentum is None:
            return grad * -lr, SGDState(state.count + 1)  # (equal to -(grad * lr): one array less)
        m = state.momentum * mu - grad * lr
        return (m * mu - grad * lr if self.nesterov else m), SGDState(state.count + 1, m)


class AdagradState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    accumulator: np.ndarray | None = None


class AdagradTransform(NamedTuple):
    """Adagrad, as ``keras.optimizers.Adagrad``: ``p -= lr * g / sqrt(acc + epsilon)``."""

    learning_rate: float = 0.001
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7

    def init(self, param: np.ndarray) -> AdagradState:
        return AdagradState(0, np.full_like(param, self.initial_accumulator_value))

    def update(self, grad: np.ndarray, state: AdagradState, param: np.ndarray) -> tuple[np.ndarray, AdagradState]:
        t = param.dtype.type
        acc = state.accumulator + np.square(grad)
        return -(t(self.learning_rate) * grad / np.sqrt(acc + t(self.epsilon))), AdagradState(state.count + 1, acc)


class AdamState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    m: np.ndarray | None = None
    v: np.ndarray | None = None
    v_hat: np.ndarray | None = None


class AdamTransform(NamedTuple):
    """Adam, as ``keras.optimizers.Adam`` (``amsgrad`` included).

    The bias correction uses the number of updates the variable has had,
    which equals Keras' ``iterations + 1`` when every step updates it.
    """

    learning_rate: float = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    amsgrad: bool = False

    def init(self, param: np.ndarray) -> AdamState:
        zeros = np.zeros_like
        return AdamState(0, zeros(param), zeros(param), zeros(param) if self.amsgrad else None)

    def update(self, grad: np.ndarray, state: AdamState, param: np.ndarray) -> tuple[np.ndarray, AdamState]:
        t = param.dtype.type
        step = state.count + 1
        b1, b2 = t(self.beta_1), t(self.beta_2)
        alpha = t(self.learning_rate) * np.sqrt(1 - b2 ** t(step)) / (1 - b1 ** t(step))
        m = state.m + (grad - state.m) * (1 - b1)
        v = state.v + (np.square(grad) - state.v) * (1 - b2)
        v_hat = np.maximum(state.v_hat, v) if self.amsgrad else None  # type: ignore[arg-type]
        denom = v if v_hat is None else v_hat
        return -(m * alpha / (np.sqrt(denom) + t(self.epsilon))), AdamState(step, m, v, v_hat)


# -- state as arrays, for checkpoints and row-local updates -------------------------------
def slot_arrays(state: Any) -> dict[str, np.ndarray]:
    """The array fields of ``state`` by name (``count`` and unused slots left out)."""
    return {k: v for k, v in state._asdict().items() if isinstance(v, np.ndarray)}


def state_from_slots(transform: Transform, param: np.ndarray, count: int, slots: dict[str, np.ndarray]) -> Any:
    """A state for ``param`` with the saved ``slots`` (others as ``init`` makes them)."""
    fresh = transform.init(param)
    known = {k: v for k, v in slots.items() if k in fresh._fields and k != "count"}
    return fresh._replace(count=int(count), **known)


def _map_slots(state: Any, fn: Any) -> Any:
    return state._replace(**{k: fn(v) for k, v in slot_arrays(state).items()})


def sum_rows(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``indices`` (sorted) and, for each, the sum of its ``values`` rows, in order of occurrence.

    >>> sum_rows(np.array([3, 1, 3]), np.array([[1.0], [2.0], [4.0]]))
    (array([1, 3]), array([[2.],
           [5.]]))
    """
    order = np.argsort(indices, kind="stable")
    ordered = indices[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if len(ordered) else np.zeros(0, np.intp)
    if len(starts) == len(ordered):  # no repeats: nothing to add up
        return ordered, values[order]
    return ordered[starts], np.add.reduceat(values[order], starts, axis=0)


def check_trainable(dtype: np.dtype, name: str, optimizer: str) -> None:
    """Optimizers train floating-point variables only (Keras refuses others too)."""
    if np.dtype(dtype).kind != "f":
        raise TypeError(
            f"optimizer {optimizer!r} cannot train variable {name!r} of dtype {np.dtype(dtype)}: "
            "only floating-point variables have gradients (exclude it from the gradients, or make it float)"
        )


def apply_gradient(
    transform: Transform, param: np.ndarray, state: Any, kind: str, grad: Any, lazy_sparse: bool = True
) -> Any:
    """Apply one checked gradient to ``param`` in place; return the new state.

    ``kind`` is ``"dense"`` (an array of ``param``'s shape) or ``"rows"``
    (``(indices, values)``). Rows are row-local when ``lazy_sparse``: only the
    named rows of the parameter and of its slots change, repeated rows summed
    first. Otherwise they are scattered into a dense gradient.
    """
    state = transform.init(param) if state is None else state
    if kind == "rows" and not lazy_sparse:
        dense = np.zeros_like(param)
        np.add.at(dense, grad[0], grad[1])
        kind, grad = "dense", dense
    if kind == "dense":
        updates, state = transform.update(grad, state, param)
        param += updates
        return state
    rows, summed = sum_rows(grad[0], grad[1])
    updates, row_state = transform.update(summed, _map_slots(state, lambda a: a[rows]), param[rows])
    param[rows] += updates
    for field, value in slot_arrays(row_state).items():
        getattr(state, field)[rows] = value
    return state._replace(count=row_state.count)
