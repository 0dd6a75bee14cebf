"""Optimizer maths as pure functions on arrays, composed in the style of optax.

A transform has two pure methods:

- ``init(param) -> state``: the state for one parameter, a ``NamedTuple``
  whose ``count`` is the number of updates applied so far and whose other
  fields are arrays shaped like the parameter (Keras calls them slots);
- ``update(grad, state, param) -> (updates, state)``: the change to add to
  the parameter, and the next state.

Every optimizer is a :class:`Chain`: what all optimizers share, declared
once (the learning rate, a number or a schedule called with ``state.count``
on the server; Keras 3's decoupled ``weight_decay``, applied first with the
step's rate; the variables exempt from it, a mask), around the *step rule*
that makes it Adam or Adagrad (``AdamStep``, ``AdagradStep``, ...). A step
rule declares only its own hyperparameters and gets the step's count and
rate in a :class:`Step`; where Keras folds the rate into a slot (SGD's and
RMSprop's momentum, Ftrl's linear term) the rule uses it there, and
elsewhere it scales its direction by it last, as Keras does.

Because they are pure, one transform serves every variable and shard, and
the same ``update`` runs on a whole array or on the rows an ``IndexedSlices``
gradient names. A parameter server is sent each transform once and keeps
every state beside its variable. The numbers are Keras 3's.

>>> sgd = Chain(SGDStep(momentum=0.9), learning_rate=0.1)
>>> param = np.zeros(2, np.float32)
>>> updates, state = sgd.update(np.ones(2, np.float32), sgd.init(param), param)
>>> updates, state.count, state.momentum
(array([-0.1, -0.1], dtype=float32), 1, array([-0.1, -0.1], dtype=float32))
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, Protocol

import numpy as np


class Transform(Protocol):
    """What a parameter server needs of an optimizer."""

    def init(self, param: np.ndarray) -> Any: ...

    def update(self, grad: np.ndarray, state: Any, param: np.ndarray) -> tuple[np.ndarray, Any]: ...


def learning_rate_at(learning_rate: Any, step: int) -> float:
    """A fixed ``learning_rate``, or a schedule's value at ``step`` (the updates the variable has had so far).

    >>> learning_rate_at(0.5, 3), learning_rate_at(lambda step: 1 / (step + 1), 3)
    (0.5, 0.25)
    """
    return float(learning_rate(step)) if callable(learning_rate) else float(learning_rate)


class Step(NamedTuple):
    """What a step rule is told of this step besides the gradient and its state (whose ``count`` is its step)."""

    lr: Any  # this step's learning rate (from a schedule at the state's count), a scalar of the parameter's dtype


class Chain(NamedTuple):
    """An optimizer as the servers run it: a step rule inside what every optimizer shares.

    Keras 3's order: the variable is first shrunk by decoupled weight decay,
    ``p - p * weight_decay * lr`` (unless ``decay_exempt`` covers it, see
    :func:`for_variable`), then the rule computes its step from the shrunk
    variable, with this step's rate.
    """

    rule: Any  # a step rule: init(param) -> state; update(grad, state, param, Step) -> (step, state)
    learning_rate: Any = 0.001  # a number, or a schedule called with the variable's count
    weight_decay: float | None = None
    decay_exempt: DecayExempt | None = None  # the variables weight decay leaves alone

    def init(self, param: np.ndarray) -> Any:
        return self.rule.init(param)

    def update(self, grad: np.ndarray, state: Any, param: np.ndarray) -> tuple[np.ndarray, Any]:
        t = param.dtype.type
        lr = t(learning_rate_at(self.learning_rate, state.count))
        decayed = param if self.weight_decay is None else param - param * t(self.weight_decay) * lr
        step, state = self.rule.update(grad, state, decayed, Step(lr))
        return with_decay(param, decayed, step), state


def with_decay(param: np.ndarray, decayed: np.ndarray, update: np.ndarray) -> np.ndarray:
    """The whole change to ``param``: the weight decay (if any) and then ``update``."""
    return update if decayed is param else (decayed - param) + update


class SGDState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    momentum: np.ndarray | None = None


class SGDStep(NamedTuple):
    """Gradient descent with optional (Nesterov) momentum, as ``keras.optimizers.SGD``."""

    momentum: float = 0.0
    nesterov: bool = False

    def init(self, param: np.ndarray) -> SGDState:
        return SGDState(0, np.zeros_like(param) if self.momentum else None)

    def update(self, grad: np.ndarray, state: SGDState, param: np.ndarray, at: Step) -> tuple[np.ndarray, SGDState]:
        t, lr = param.dtype.type, at.lr
        mu = t(self.momentum)
        if state.momentum is None:
            return grad * -lr, SGDState(state.count + 1)  # (-(grad * lr), one array less)
        m = state.momentum * mu - grad * lr
        return m * mu - grad * lr if self.nesterov else m, SGDState(state.count + 1, m)


class AdagradState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    accumulator: np.ndarray | None = None


class AdagradStep(NamedTuple):
    """Adagrad, as ``keras.optimizers.Adagrad``: ``p -= lr * g / sqrt(acc + epsilon)``."""

    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7

    def init(self, param: np.ndarray) -> AdagradState:
        return AdagradState(0, np.full_like(param, self.initial_accumulator_value))

    def update(self, grad: np.ndarray, state: AdagradState, param: np.ndarray, at: Step) -> tuple[np.ndarray, AdagradState]:
        t, lr = param.dtype.type, at.lr
        acc = state.accumulator + np.square(grad)
        step = -(lr * grad / np.sqrt(acc + t(self.epsilon)))
        return step, AdagradState(state.count + 1, acc)


class AdamState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    m: np.ndarray | None = None
    v: np.ndarray | None = None
    v_hat: np.ndarray | None = None


class AdamStep(NamedTuple):
    """Adam, as ``keras.optimizers.Adam`` (``amsgrad`` included).

    The bias correction uses the number of updates the variable has had,
    which equals Keras' ``iterations + 1`` when every step updates it.
    """

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    amsgrad: bool = False

    def init(self, param: np.ndarray) -> AdamState:
        zeros = np.zeros_like
        return AdamState(0, zeros(param), zeros(param), zeros(param) if self.amsgrad else None)

    def update(self, grad: np.ndarray, state: AdamState, param: np.ndarray, at: Step) -> tuple[np.ndarray, AdamState]:
        t, lr = param.dtype.type, at.lr
        step = state.count + 1
        b1, b2 = t(self.beta_1), t(self.beta_2)
        alpha = lr * np.sqrt(1 - b2 ** t(step)) / (1 - b1 ** t(step))
        # Keras rounds 1 - beta once (from the Python float) for the moments, and uses the rounded beta's powers.
        m = state.m + (grad - state.m) * t(1 - self.beta_1)
        v = state.v + (np.square(grad) - state.v) * t(1 - self.beta_2)
        v_hat = np.maximum(state.v_hat, v) if self.amsgrad else None  # type: ignore[arg-type]
        denom = v if v_hat is None else v_hat
        update = -(m * alpha / (np.sqrt(denom) + t(self.epsilon)))
        return update, AdamState(step, m, v, v_hat)


class RMSpropState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    velocity: np.ndarray | None = None
    momentum: np.ndarray | None = None
    average_gradient: np.ndarray | None = None


class RMSpropStep(NamedTuple):
    """RMSprop, as ``keras.optimizers.RMSprop``: steps scaled by a moving root mean square of the gradients.

    ``centered`` subtracts the square of the moving mean of the gradients
    (an estimate of their variance); ``momentum > 0`` accumulates the steps.
    """

    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-7
    centered: bool = False

    def init(self, param: np.ndarray) -> RMSpropState:
        zeros = np.zeros_like
        return RMSpropState(0, zeros(param), zeros(param) if self.momentum > 0 else None,
                            zeros(param) if self.centered else None)

    def update(self, grad: np.ndarray, state: RMSpropState, param: np.ndarray, at: Step) -> tuple[np.ndarray, RMSpropState]:
        t, lr = param.dtype.type, at.lr
        rho, keep, eps = t(self.rho), t(1 - self.rho), t(self.epsilon)
        velocity = rho * state.velocity + keep * np.square(grad)
        average = None
        if state.average_gradient is not None:
            average = rho * state.average_gradient + keep * grad
            denominator = velocity - np.square(average) + eps
        else:
            denominator = velocity + eps
        increment = lr * grad / np.sqrt(denominator)
        momentum = None if state.momentum is None else t(self.momentum) * state.momentum + increment
        step = -(increment if momentum is None else momentum)
        return step, RMSpropState(state.count + 1, velocity, momentum, average)


class FtrlState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    accumulator: np.ndarray | None = None
    linear: np.ndarray | None = None


class FtrlStep(NamedTuple):
    """Follow The Regularized Leader, as ``keras.optimizers.Ftrl`` (its L1, L2, L2-shrinkage and ``beta``).

    The new value is computed from the accumulated ``linear`` term, not
    added to the old one; the update returned is the difference (from the
    variable after weight decay, which the chain adds).
    """

    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float = 0.0

    def init(self, param: np.ndarray) -> FtrlState:
        return FtrlState(0, np.full_like(param, self.initial_accumulator_value), np.zeros_like(param))

    def update(self, grad: np.ndarray, state: FtrlState, param: np.ndarray, at: Step) -> tuple[np.ndarray, FtrlState]:
        t, lr, p = param.dtype.type, at.lr, param
        power = t(-self.learning_rate_power)
        l1 = t(self.l1_regularization_strength)
        l2 = t(self.l2_regularization_strength) + t(self.beta) / (t(2) * lr)
        shrunk_grad = grad + t(2 * self.l2_shrinkage_regularization_strength) * p
        accumulator = state.accumulator + np.square(grad)
        grown = np.power(accumulator, power)
        linear = state.linear + (shrunk_grad - (grown - np.power(state.accumulator, power)) / lr * p)  # type: ignore[arg-type]
        quadratic = grown / lr + t(2) * l2
        new = (np.clip(linear, -l1, l1) - linear) / quadratic
        return new - param, FtrlState(state.count + 1, accumulator, linear)


class AdamaxState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    m: np.ndarray | None = None
    u: np.ndarray | None = None


class AdamaxStep(NamedTuple):
    """Adamax, as ``keras.optimizers.Adamax``: Adam with the infinity norm in place of ``v``."""

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    def init(self, param: np.ndarray) -> AdamaxState:
        return AdamaxState(0, np.zeros_like(param), np.zeros_like(param))

    def update(self, grad: np.ndarray, state: AdamaxState, param: np.ndarray, at: Step) -> tuple[np.ndarray, AdamaxState]:
        t, lr = param.dtype.type, at.lr
        step = state.count + 1
        b1, b2 = t(self.beta_1), t(self.beta_2)
        m = state.m + (grad - state.m) * t(1 - self.beta_1)
        u = np.maximum(b2 * state.u, np.abs(grad))
        update = -(lr * m / ((1 - b1 ** t(step)) * (u + t(self.epsilon))))
        return update, AdamaxState(step, m, u)


class NadamState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    m: np.ndarray | None = None
    v: np.ndarray | None = None


def nadam_momentum_product(beta_1: float, steps: int) -> float:
    """The product of Nadam's momentum terms ``beta_1 * (1 - 0.5 * 0.96 ** i)`` for ``i = 1 .. steps``.

    Keras keeps this product in a variable (``u_product``) that it multiplies
    once per step. Here it is a function of the variable's own step count,
    so a shard, a restored checkpoint or a re-created server needs nothing
    more than ``count``. Beyond ~900 terms ``0.96 ** i`` is below float64's
    resolution next to 1, so at most that many are multiplied.

    >>> round(nadam_momentum_product(0.9, 2), 6) == round(0.9 * 0.52 * 0.9 * (1 - 0.5 * 0.96**2), 6)
    True
    """
    i = np.arange(1, min(steps, 1000) + 1, dtype=np.float64)
    return float(beta_1 ** steps * np.prod(1 - 0.5 * 0.96**i))


class NadamStep(NamedTuple):
    """Nadam (Adam with Nesterov momentum), as ``keras.optimizers.Nadam``.

    Keras' ``u_product`` (a product of momentum-decay terms, one per step) is
    computed from the variable's own step count by
    :func:`nadam_momentum_product`; it equals Keras' when every step updates
    every variable.
    """

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    def init(self, param: np.ndarray) -> NadamState:
        return NadamState(0, np.zeros_like(param), np.zeros_like(param))

    def update(self, grad: np.ndarray, state: NadamState, param: np.ndarray, at: Step) -> tuple[np.ndarray, NadamState]:
        t, lr = param.dtype.type, at.lr
        step = state.count + 1
        b1, b2, decay = t(self.beta_1), t(self.beta_2), t(0.96)
        u_now = b1 * (t(1) - t(0.5) * decay ** t(step))
        u_next = b1 * (t(1) - t(0.5) * decay ** t(step + 1))
        product = t(nadam_momentum_product(self.beta_1, step))
        m = state.m + (grad - state.m) * (1 - b1)
        v = state.v + (np.square(grad) - state.v) * (1 - b2)
        m_hat = u_next * m / (1 - product * u_next) + (1 - u_now) * grad / (1 - product)
        v_hat = v / (1 - b2 ** t(step))
        update = -(m_hat * lr / (np.sqrt(v_hat) + t(self.epsilon)))
        return update, NadamState(step, m, v)


class LionState(NamedTuple):
    count: int = 0  # type: ignore[assignment]  # optax's name; shadows tuple.count
    m: np.ndarray | None = None


class LionStep(NamedTuple):
    """Lion, as ``keras.optimizers.Lion``: steps of size ``learning_rate`` along the sign of a momentum mix."""

    beta_1: float = 0.9
    beta_2: float = 0.99

    def init(self, param: np.ndarray) -> LionState:
        return LionState(0, np.zeros_like(param))

    def update(self, grad: np.ndarray, state: LionState, param: np.ndarray, at: Step) -> tuple[np.ndarray, LionState]:
        t, lr = param.dtype.type, at.lr
        b1, b2 = t(self.beta_1), t(self.beta_2)
        update = -(lr * np.sign(state.m * b1 + grad * (t(1) - b1)))
        m = state.m * b2 + grad * (t(1) - b2)
        return update, LionState(state.count + 1, m)


class DecayExempt(NamedTuple):
    """Variables that ``weight_decay`` leaves alone: by server key, or by a pattern searched in the name."""

    keys: frozenset = frozenset()
    pattern: str | None = None

    def covers(self, key: str, name: str) -> bool:
        return key in self.keys or (self.pattern is not None and re.search(self.pattern, name) is not None)


def for_variable(transform: Any, key: str, name: str) -> Any:
    """``transform`` as it applies to variable ``key`` called ``name``: without weight decay if exempt."""
    exempt = getattr(transform, "decay_exempt", None)
    if exempt is not None and transform.weight_decay is not None and exempt.covers(key, name):
        return transform._replace(weight_decay=None)
    return transform


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
    if len(indices) < 2 or bool(np.all(indices[1:] > indices[:-1])):  # already distinct and sorted
        return indices, values
    order = np.argsort(indices, kind="stable")
    return sum_sorted(indices[order], np.take(values, order, axis=0))


def sum_sorted(ordered: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sum_rows` of indices already sorted (``rows`` in their order)."""
    if not len(ordered):
        return ordered, rows
    new_run = np.empty(len(ordered), bool)
    new_run[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=new_run[1:])
    starts = np.flatnonzero(new_run)
    if len(starts) == len(ordered):  # no repeats: nothing to add up
        return ordered, rows
    counts = np.empty(len(starts), np.intp)
    np.subtract(starts[1:], starts[:-1], out=counts[:-1])
    counts[-1] = len(ordered) - starts[-1]
    multi = np.flatnonzero(counts > 1)
    if len(multi) * 4 > len(starts):  # repeats are common: add every run
        return ordered[starts], np.add.reduceat(rows, starts, axis=0)
    # Mostly single rows: copy those, and add up only the runs of repeated rows.
    out = np.take(rows, starts, axis=0)
    lengths = counts[multi]
    at = np.zeros(len(multi), np.intp)  # where each run starts among the picked rows
    np.cumsum(lengths[:-1], out=at[1:])
    pick = np.repeat(starts[multi] - at, lengths) + np.arange(int(lengths.sum()))
    out[multi] = np.add.reduceat(np.take(rows, pick, axis=0), at, axis=0)
    return ordered[starts], out


def additive(transform: Any) -> bool:
    """Whether applying gradients one after another equals applying their sum once.

    True for plain gradient descent at a fixed learning rate (no momentum,
    no weight decay): every step is ``-lr * grad``, independent of the
    parameter and of the state. Bounded staleness merges such pushes.

    >>> additive(Chain(SGDStep(), 0.1)), additive(Chain(SGDStep(momentum=0.9), 0.1))
    (True, False)
    """
    return (isinstance(transform, Chain) and type(transform.rule) is SGDStep and not transform.rule.momentum
            and transform.weight_decay is None and not callable(transform.learning_rate))


def check_trainable(dtype: np.dtype, name: str, optimizer: str) -> None:
    """Optimizers train floating-point variables only (Keras refuses others too)."""
    if np.dtype(dtype).kind != "f":
        raise TypeError(
            f"optimizer {optimizer!r} cannot train variable {name!r} of dtype {np.dtype(dtype)}: "
            "only floating-point variables have gradients (exclude it from the gradients, or make it float)"
        )


def apply_gradient(
    transform: Transform, param: np.ndarray, state: Any, kind: str, grad: Any, lazy_sparse: bool = True,
    times: int = 1,
) -> Any:
    """Apply one checked gradient to ``param`` in place; return the new state.

    ``kind`` is ``"dense"`` (an array of ``param``'s shape) or ``"rows"``
    (``(indices, values)``). Rows are row-local when ``lazy_sparse``: only the
    named rows of the parameter and of its slots change, repeated rows summed
    first. Otherwise they are scattered into a dense gradient. ``times`` > 1:
    ``grad`` adds up that many steps' gradients of an :func:`additive`
    transform; the state's count advances by ``times``.
    """
    state = transform.init(param) if state is None else state
    if times != 1:
        state = state._replace(count=state.count + times - 1)
    if kind == "rows" and not lazy_sparse:
        dense = np.zeros_like(param)
        np.add.at(dense, grad[0], grad[1])
        kind, grad = "dense", dense
    if kind == "dense":
        updates, state = transform.update(grad, state, param)
        param += updates
        return state
    rows, summed = sum_rows(grad[0], grad[1])
    here = np.take(param, rows, axis=0)
    updates, row_state = transform.update(summed, _map_slots(state, lambda a: np.take(a, rows, axis=0)), here)
    param[rows] = here + updates  # (rows are distinct)
    for field, value in slot_arrays(row_state).items():
        getattr(state, field)[rows] = value
    return state._replace(count=row_state.count)
