"""Optimizers that run on the parameter servers, beside the variables.

Each optimizer is a pair of pure functions in the style of optax:
``init(param) -> state`` and ``update(grad, state, param, step) ->
(new_param, new_state)``, with ``state`` a dict of arrays shaped like the
parameter (its slots). Because they are pure, one pickled optimizer serves
every variable and shard, and the same ``update`` works on a whole array or
on just the rows an ``IndexedSlices`` gradient names.

``apply_gradients`` groups the gradients by parameter server and sends each
server one call; the server keeps the slots next to the variable (or shard)
and applies the update there. ``iterations`` lives on a server too and is
bumped within one of those calls.

The arithmetic is Keras 3's for optimizers of the same name and arguments.

>>> import daskps as dps
>>> w = dps.Variable([1.0, 2.0])
>>> opt = dps.optimizers.SGD(learning_rate=0.1)
>>> opt.apply_gradients([(np.array([1.0, 1.0], np.float32), w)])
>>> w.numpy(), int(opt.iterations.numpy())
(array([0.9, 1.9], dtype=float32), 1)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np

from daskps import context
from daskps.indexed_slices import IndexedSlices
from daskps.transport import Call, transport_for
from daskps.updates import check_indices, coerce_values
from daskps.variables import Variable, _by_server

__all__ = ["SGD", "Adagrad", "Adam", "Optimizer"]

State = dict[str, Any]


def _positive(value: Any, arg: str, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{arg} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}")
    return float(value)


class Optimizer:
    """Base class: subclasses define ``init`` and ``update`` (pure, on arrays).

    Parameters
    ----------
    learning_rate : float
    lazy_sparse : bool
        With an ``IndexedSlices`` gradient, update only the rows it names
        (their slot rows too): the usual choice for embeddings, as
        TensorFlow Addons' ``LazyAdam``. ``False`` turns the gradient into a
        dense one (repeated rows summed) and updates every row, as Keras does.
    name : str

    Create optimizers inside ``strategy.scope()``, so that ``iterations``
    lives on a parameter server and every trainer counts into it.
    """

    def __init__(self, learning_rate: float, lazy_sparse: bool = True, name: str = "Optimizer"):
        self.learning_rate = _positive(learning_rate, "learning_rate")
        self.lazy_sparse = bool(lazy_sparse)
        self.name = name
        self.slot_key = f"{name}@{uuid.uuid4().hex[:12]}"  # names this optimizer's slots on the servers
        mode = context._current_mode()
        in_scope = getattr(mode.strategy, "_variable_creator", None) is not None and mode.replica_context is None
        if in_scope and getattr(mode.strategy, "_client", None) is None:
            raise RuntimeError("create optimizers on the coordinator, not inside a scheduled function")
        self.iterations = Variable(np.int64(0), trainable=False, name=f"{name}/iterations")

    # -- the pure part --------------------------------------------------------
    def init(self, param: np.ndarray) -> State:
        """The slots for ``param`` (arrays of its shape)."""
        raise NotImplementedError

    def update(self, grad: np.ndarray, state: State, param: np.ndarray, step: int) -> tuple[np.ndarray, State]:
        """New parameter and slots after one step (``step`` counts from 1)."""
        raise NotImplementedError

    # -- applying, wherever the variable lives -----------------------------------
    def apply(self, param: np.ndarray, state: State | None, kind: str, grad: Any) -> State:
        """Apply a checked gradient to ``param`` in place; return the new slots.

        ``state`` also holds ``"step"``: how many updates this variable has had.
        """
        state = dict(self.init(param), step=np.int64(0)) if state is None else state
        step = int(state["step"]) + 1
        slots = {k: v for k, v in state.items() if k != "step"}
        if kind == "rows" and not self.lazy_sparse:
            dense = np.zeros_like(param)
            np.add.at(dense, grad[0], grad[1])
            kind, grad = "dense", dense
        if kind == "dense":
            new_param, new_slots = self.update(grad, slots, param, step)
            param[...] = new_param
        else:
            rows, inverse = np.unique(grad[0], return_inverse=True)
            summed = np.zeros((len(rows),) + param.shape[1:], param.dtype)
            np.add.at(summed, inverse.ravel(), grad[1])
            new_rows, row_slots = self.update(summed, {k: v[rows] for k, v in slots.items()}, param[rows], step)
            param[rows] = new_rows
            new_slots = slots
            for k, v in row_slots.items():
                new_slots[k][rows] = v
        return dict(new_slots, step=np.int64(step))

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], name: str | None = None) -> None:
        """Apply ``(gradient, variable)`` pairs: one call per parameter server, all at once.

        Gradients are arrays of the variable's shape or ``IndexedSlices`` of
        its rows; ``None`` gradients are skipped. Every gradient is checked
        before anything is sent, and each server checks again before applying.
        """
        from daskps.sharding import ShardedVariable

        items: list[tuple[Variable, str, Any]] = []
        for pair in grads_and_vars:
            grad, var = pair
            if grad is None:
                continue
            if isinstance(var, ShardedVariable):
                items.extend(_split_gradient(var, grad))
            elif isinstance(var, Variable):
                items.append((var, *check_gradient(var.shape, var.dtype, var.name, grad)))
            else:
                raise TypeError(f"grads_and_vars must pair gradients with Variables, got {type(var).__name__}")
        self._send(items)

    def _send(self, items: list[tuple[Variable, str, Any]]) -> None:
        counter = self.iterations
        by_ps, local, client = _by_server([v for v, _, _ in items] + [counter])
        counter_ps = next((ps for ps, idx in by_ps.items() if len(items) in idx), None)
        if counter_ps is None and by_ps:
            raise RuntimeError(
                f"optimizer {self.name!r} was created outside strategy.scope(), so its iterations "
                "counter is not on a parameter server; create it inside the scope"
            )
        calls = []
        for ps, idx in by_ps.items():
            work = [(items[i][0]._store.key, items[i][1], items[i][2]) for i in idx if i < len(items)]
            bump = counter._store.key if ps == counter_ps else None
            calls.append(Call(ps, "apply_gradients", (self, work, bump)))
        for i in local:
            if i == len(items):
                counter._store.value += 1
            else:
                var, kind, grad = items[i]
                store = var._store
                store.slots = getattr(store, "slots", {})
                store.slots[self.slot_key] = self.apply(store.value, store.slots.get(self.slot_key), kind, grad)
        if calls:
            transport_for(client).call_many(calls)

    def __repr__(self) -> str:
        return f"<daskps.optimizers.{type(self).__name__} {self.name!r} learning_rate={self.learning_rate}>"


def check_gradient(shape: tuple, dtype: np.dtype, name: str, grad: Any) -> tuple[str, Any]:
    """``("dense", array)`` or ``("rows", (indices, values))``, checked against the variable."""
    if isinstance(grad, IndexedSlices):
        return check_gradient_of_kind(shape, dtype, name, "rows", (grad.indices, grad.values))
    return check_gradient_of_kind(shape, dtype, name, "dense", grad)


def check_gradient_of_kind(shape: tuple, dtype: np.dtype, name: str, kind: str, grad: Any) -> tuple[str, Any]:
    """As :func:`check_gradient`, for a gradient already split into ``kind`` and payload."""
    if kind == "rows":
        if not shape:
            raise ValueError(f"gradient for scalar variable {name!r} cannot be IndexedSlices")
        idx = check_indices(grad[0], shape[0], name, "gradient indices")
        values = coerce_values(grad[1], dtype, name, "gradient values")
        if values.shape != idx.shape + tuple(shape[1:]):
            raise ValueError(
                f"gradient values for variable {name!r} must have shape {idx.shape + tuple(shape[1:])}, "
                f"got {values.shape}"
            )
        return "rows", (idx, values)
    arr = coerce_values(grad, dtype, name, "gradient")
    if arr.shape != tuple(shape):
        raise ValueError(f"gradient for variable {name!r} must have shape {tuple(shape)}, got {arr.shape}")
    return "dense", arr


def _split_gradient(var: Any, grad: Any) -> list[tuple[Variable, str, Any]]:
    kind, payload = check_gradient(var.shape, var.dtype, var.name, grad)
    if kind == "dense":
        return [(v, "dense", payload[a:b]) for v, a, b in var._spans()]
    # Every shard gets its part, even an empty one, so that all shards count the
    # same steps and Adam's bias correction does not depend on the sharding.
    return [(v, "rows", part) for v, part in var._split_rows(*payload)]


class SGD(Optimizer):
    """Gradient descent, with optional (Nesterov) momentum, as ``keras.optimizers.SGD``.

    >>> opt = SGD(0.1, momentum=0.9)
    >>> p, s = opt.update(np.ones(2, np.float32), opt.init(np.zeros(2, np.float32)), np.zeros(2, np.float32), 1)
    >>> p, s["momentum"]
    (array([-0.1, -0.1], dtype=float32), array([-0.1, -0.1], dtype=float32))
    """

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 lazy_sparse: bool = True, name: str = "SGD"):
        self.momentum = _positive(momentum, "momentum", allow_zero=True)
        if self.momentum > 1:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        self.nesterov = bool(nesterov)
        super().__init__(learning_rate, lazy_sparse, name)

    def init(self, param: np.ndarray) -> State:
        return {"momentum": np.zeros_like(param)} if self.momentum else {}

    def update(self, grad: np.ndarray, state: State, param: np.ndarray, step: int) -> tuple[np.ndarray, State]:
        t = param.dtype.type
        lr, mu = t(self.learning_rate), t(self.momentum)
        if not self.momentum:
            return param - grad * lr, state
        m = state["momentum"] * mu - grad * lr
        return (param + (m * mu - grad * lr) if self.nesterov else param + m), {"momentum": m}


class Adagrad(Optimizer):
    """Adagrad, as ``keras.optimizers.Adagrad``: ``p -= lr * g / sqrt(acc + epsilon)``."""

    def __init__(self, learning_rate: float = 0.001, initial_accumulator_value: float = 0.1,
                 epsilon: float = 1e-7, lazy_sparse: bool = True, name: str = "Adagrad"):
        self.initial_accumulator_value = _positive(initial_accumulator_value, "initial_accumulator_value", True)
        self.epsilon = _positive(epsilon, "epsilon")
        super().__init__(learning_rate, lazy_sparse, name)

    def init(self, param: np.ndarray) -> State:
        return {"accumulator": np.full_like(param, self.initial_accumulator_value)}

    def update(self, grad: np.ndarray, state: State, param: np.ndarray, step: int) -> tuple[np.ndarray, State]:
        t = param.dtype.type
        acc = state["accumulator"] + np.square(grad)
        return param - t(self.learning_rate) * grad / np.sqrt(acc + t(self.epsilon)), {"accumulator": acc}


class Adam(Optimizer):
    """Adam, as ``keras.optimizers.Adam`` (``amsgrad`` included).

    The bias correction uses the number of updates the variable has had,
    which equals Keras' ``iterations + 1`` when every step updates it.
    """

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, amsgrad: bool = False, lazy_sparse: bool = True, name: str = "Adam"):
        for arg, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{arg} must be in [0, 1), got {value!r}")
        self.beta_1, self.beta_2 = float(beta_1), float(beta_2)
        self.epsilon = _positive(epsilon, "epsilon")
        self.amsgrad = bool(amsgrad)
        super().__init__(learning_rate, lazy_sparse, name)

    def init(self, param: np.ndarray) -> State:
        state = {"m": np.zeros_like(param), "v": np.zeros_like(param)}
        if self.amsgrad:
            state["v_hat"] = np.zeros_like(param)
        return state

    def update(self, grad: np.ndarray, state: State, param: np.ndarray, step: int) -> tuple[np.ndarray, State]:
        t = param.dtype.type
        b1, b2 = t(self.beta_1), t(self.beta_2)
        alpha = t(self.learning_rate) * np.sqrt(1 - b2 ** t(step)) / (1 - b1 ** t(step))
        m = state["m"] + (grad - state["m"]) * (1 - b1)
        v = state["v"] + (np.square(grad) - state["v"]) * (1 - b2)
        new = {"m": m, "v": v}
        if self.amsgrad:
            v = new["v_hat"] = np.maximum(state["v_hat"], v)
        return param - m * alpha / (np.sqrt(v) + t(self.epsilon)), new
