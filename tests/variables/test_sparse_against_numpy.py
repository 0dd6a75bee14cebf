"""Sparse gradients against an independent reference: every optimizer, lazy and dense, on two servers.

The reference is numpy (float64), written from the published update rules:
Keras 3's ``update_step`` of each optimizer (``keras/src/optimizers/*.py``)
and, for the row-local mode, TensorFlow Addons' ``LazyAdam``
(``_resource_apply_sparse``: repeated rows summed, then only those rows of
the variable and its slots are gathered, updated and scattered back, with
the bias correction at the optimizer's global step ``iterations + 1``).
Nothing here calls daskps' maths.

- ``lazy_sparse=True``: that row-local rule for every optimizer. A step
  whose gradient names no row of a shard still counts for it (LazyAdam's
  step is global): here step 3 touches only the first shard.
- ``lazy_sparse=False``: Keras given the densified gradient (repeated rows
  summed, every row updated: momentum and weight decay move rows the
  gradient does not name).

Each case runs five steps with repeated indices, on a variable split over
both parameter servers, and is compared after every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import daskps as dps

ROWS, DIM = 8, 3  # two shards of 4 rows, one per server
# Repeated rows in a step (summed); step 3 names rows of the first shard only; row 6 is never named.
INDICES = [[1, 5, 1, 4], [0, 5, 5, 7], [2, 1, 2], [7, 1, 7, 4], [5, 0, 5, 3]]
RNG = np.random.default_rng(21)
START = RNG.normal(size=(ROWS, DIM)).astype(np.float32)
VALUES = [RNG.normal(size=(len(ix), DIM)).astype(np.float32) for ix in INDICES]
ATOL = 2e-5

Slots = dict[str, np.ndarray]
Step = Callable[[np.ndarray, Slots, np.ndarray, int, float], tuple[np.ndarray, Slots]]


# -- the published rules, one per optimizer: init(param) -> slots; step(g, slots, p, t, lr) -> (p, slots) ------
def sgd(momentum: float = 0.0, nesterov: bool = False, **_: Any) -> tuple[Callable, Step]:
    def step(g, s, p, t, lr):
        if not momentum:
            return p - lr * g, s
        m = momentum * s["m"] - lr * g
        return p + (momentum * m - lr * g if nesterov else m), {"m": m}

    return (lambda p: {"m": np.zeros_like(p)}), step


def adagrad(initial_accumulator_value: float = 0.1, epsilon: float = 1e-7, **_: Any) -> tuple[Callable, Step]:
    def step(g, s, p, t, lr):
        acc = s["acc"] + g * g
        return p - lr * g / np.sqrt(acc + epsilon), {"acc": acc}

    return (lambda p: {"acc": np.full_like(p, initial_accumulator_value)}), step


def adam(beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7, amsgrad: bool = False,
         **_: Any) -> tuple[Callable, Step]:
    def step(g, s, p, t, lr):
        alpha = lr * np.sqrt(1 - beta_2**t) / (1 - beta_1**t)
        m = beta_1 * s["m"] + (1 - beta_1) * g
        v = beta_2 * s["v"] + (1 - beta_2) * g * g
        v_hat = np.maximum(s["v_hat"], v) if amsgrad else v
        return p - alpha * m / (np.sqrt(v_hat) + epsilon), {"m": m, "v": v, "v_hat": v_hat}

    return (lambda p: {k: np.zeros_like(p) for k in ("m", "v", "v_hat")}), step


def rmsprop(rho: float = 0.9, momentum: float = 0.0, epsilon: float = 1e-7, centered: bool = False,
            **_: Any) -> tuple[Callable, Step]:
    def step(g, s, p, t, lr):
        vel = rho * s["vel"] + (1 - rho) * g * g
        avg = rho * s["avg"] + (1 - rho) * g
        denominator = vel - avg * avg + epsilon if centered else vel + epsilon
        increment = lr * g / np.sqrt(denominator)
        mom = momentum * s["mom"] + increment
        return p - (mom if momentum > 0 else increment), {"vel": vel, "avg": avg, "mom": mom}

    return (lambda p: {k: np.zeros_like(p) for k in ("vel", "avg", "mom")}), step


def ftrl(learning_rate_power: float = -0.5, initial_accumulator_value: float = 0.1,
         l1_regularization_strength: float = 0.0, l2_regularization_strength: float = 0.0,
         l2_shrinkage_regularization_strength: float = 0.0, beta: float = 0.0, **_: Any) -> tuple[Callable, Step]:
    def step(g, s, p, t, lr):
        l2 = l2_regularization_strength + beta / (2 * lr)
        new_acc = s["acc"] + g * g
        grown = new_acc ** -learning_rate_power
        linear = s["linear"] + (g + 2 * l2_shrinkage_regularization_strength * p
                                - (grown - s["acc"] ** -learning_rate_power) / lr * p)
        quadratic = grown / lr + 2 * l2
        l1 = l1_regularization_strength
        return (np.clip(linear, -l1, l1) - linear) / quadratic, {"acc": new_acc, "linear": linear}

    return (lambda p: {"acc": np.full_like(p, initial_accumulator_value), "linear": np.zeros_like(p)}), step


def adamax(beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7, **_: Any) -> tuple[Callable, Step]:
    def step(g, s, p, t, lr):
        m = s["m"] + (g - s["m"]) * (1 - beta_1)
        u = np.maximum(beta_2 * s["u"], np.abs(g))
        return p - lr * m / ((1 - beta_1**t) * (u + epsilon)), {"m": m, "u": u}

    return (lambda p: {"m": np.zeros_like(p), "u": np.zeros_like(p)}), step


def nadam(beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7, **_: Any) -> tuple[Callable, Step]:
    def u(i):  # Keras' momentum-decay term of step i; u_product is their running product
        return beta_1 * (1 - 0.5 * 0.96**i)

    def step(g, s, p, t, lr):
        product = np.prod([u(i) for i in range(1, t + 1)])
        m = s["m"] + (g - s["m"]) * (1 - beta_1)
        v = s["v"] + (g * g - s["v"]) * (1 - beta_2)
        m_hat = u(t + 1) * m / (1 - product * u(t + 1)) + (1 - u(t)) * g / (1 - product)
        v_hat = v / (1 - beta_2**t)
        return p - m_hat * lr / (np.sqrt(v_hat) + epsilon), {"m": m, "v": v}

    return (lambda p: {"m": np.zeros_like(p), "v": np.zeros_like(p)}), step


def lion(beta_1: float = 0.9, beta_2: float = 0.99, **_: Any) -> tuple[Callable, Step]:
    def step(g, s, p, t, lr):
        new = p - lr * np.sign(s["m"] * beta_1 + g * (1 - beta_1))
        return new, {"m": s["m"] * beta_2 + g * (1 - beta_2)}

    return (lambda p: {"m": np.zeros_like(p)}), step


RULES = {"SGD": sgd, "Adagrad": adagrad, "Adam": adam, "AdamW": adam, "RMSprop": rmsprop, "Ftrl": ftrl,
         "Adamax": adamax, "Nadam": nadam, "Lion": lion}

# Every option that changes a sparse path, of every optimizer daskps ships.
CASES = {
    "SGD": ("SGD", {"learning_rate": 0.1}),
    "SGD-momentum": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
    "SGD-nesterov": ("SGD", {"learning_rate": 0.1, "momentum": 0.8, "nesterov": True}),
    "SGD-weight_decay": ("SGD", {"learning_rate": 0.1, "momentum": 0.5, "weight_decay": 0.3}),
    "Adagrad": ("Adagrad", {"learning_rate": 0.2, "initial_accumulator_value": 0.3, "epsilon": 1e-5}),
    "Adam": ("Adam", {"learning_rate": 0.1, "beta_1": 0.8, "beta_2": 0.95}),
    "Adam-amsgrad": ("Adam", {"learning_rate": 0.1, "beta_1": 0.8, "beta_2": 0.95, "amsgrad": True}),
    "Adam-schedule": ("Adam", {"learning_rate": ("ExponentialDecay", 0.1, 2, 0.5)}),
    "AdamW": ("AdamW", {"learning_rate": 0.1, "weight_decay": 0.2, "amsgrad": True}),
    "RMSprop": ("RMSprop", {"learning_rate": 0.05, "rho": 0.8}),
    "RMSprop-momentum": ("RMSprop", {"learning_rate": 0.05, "momentum": 0.7}),
    "RMSprop-centered": ("RMSprop", {"learning_rate": 0.05, "rho": 0.7, "momentum": 0.5, "centered": True,
                                     "epsilon": 1e-3}),
    "Ftrl": ("Ftrl", {"learning_rate": 0.2}),
    "Ftrl-regularized": ("Ftrl", {"learning_rate": 0.2, "learning_rate_power": -0.7, "initial_accumulator_value": 0.2,
                                  "l1_regularization_strength": 0.05, "l2_regularization_strength": 0.1,
                                  "l2_shrinkage_regularization_strength": 0.07, "beta": 0.3, "weight_decay": 0.1}),
    "Adamax": ("Adamax", {"learning_rate": 0.1, "beta_1": 0.8, "beta_2": 0.9}),
    "Nadam": ("Nadam", {"learning_rate": 0.1, "beta_1": 0.8, "beta_2": 0.95}),
    "Lion": ("Lion", {"learning_rate": 0.05, "beta_1": 0.8, "beta_2": 0.95, "weight_decay": 0.5}),
}


def learning_rate(kwargs: dict, count: int) -> float:
    """The rate at ``count`` updates so far: ExponentialDecay is ``initial * rate ** (count / decay_steps)``."""
    rate = kwargs["learning_rate"]
    if isinstance(rate, tuple):
        _, initial, decay_steps, decay_rate = rate
        return initial * decay_rate ** (count / decay_steps)
    return rate


def reference(kind: str, kwargs: dict, lazy: bool) -> list[np.ndarray]:
    """The variable after each step, by the published rules, in float64."""
    init, step = RULES[kind](**kwargs)
    p = START.astype(np.float64)
    slots = init(p)
    wd = kwargs.get("weight_decay", 0.0)
    out = []
    for t, (idx, vals) in enumerate(zip(INDICES, VALUES), start=1):
        lr = learning_rate(kwargs, t - 1)
        dense = np.zeros_like(p)
        np.add.at(dense, idx, vals.astype(np.float64))  # repeated rows summed, in both modes
        rows = np.unique(idx) if lazy else np.arange(ROWS)
        sub = p[rows] - p[rows] * wd * lr  # decoupled weight decay first, with this step's rate
        new, changed = step(dense[rows], {k: a[rows] for k, a in slots.items()}, sub, t, lr)
        p[rows] = new
        for k, a in changed.items():
            slots[k][rows] = a
        out.append(p.copy())
    return out


def make(kind: str, kwargs: dict, lazy: bool) -> Any:
    kw = dict(kwargs)
    if isinstance(kw["learning_rate"], tuple):
        _, initial, decay_steps, decay_rate = kw["learning_rate"]
        kw["learning_rate"] = dps.optimizers.schedules.ExponentialDecay(initial, decay_steps, decay_rate)
    return getattr(dps.optimizers, kind)(**kw, lazy_sparse=lazy)


@pytest.fixture(scope="module")
def two_shard_strategy(client):
    return dps.ParameterServerStrategy(client, variable_partitioner=dps.partitioners.FixedShardsPartitioner(2))


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "dense"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sparse_steps_match_the_published_rule(two_shard_strategy, case, lazy):
    kind, kwargs = CASES[case]
    strategy = two_shard_strategy
    with strategy.scope():
        table = dps.Variable(START, name=f"ref/{case}")
        opt = make(kind, kwargs, lazy)
    assert isinstance(table, dps.ShardedVariable)
    assert [v.shape[0] for v in table.variables] == [4, 4]
    assert len({v.device for v in table.variables}) == 2  # one shard on each server
    want = reference(kind, kwargs, lazy)
    for i, (idx, vals) in enumerate(zip(INDICES, VALUES)):
        opt.apply_gradients([(dps.IndexedSlices(vals, np.array(idx)), table)])
        got = table.numpy()
        np.testing.assert_allclose(got, want[i], rtol=1e-5, atol=ATOL, err_msg=f"{case}, step {i + 1}")
        if lazy:  # rows never named keep their exact start
            named = np.unique(np.concatenate(INDICES[: i + 1]))
            untouched = np.setdiff1d(np.arange(ROWS), named)
            np.testing.assert_array_equal(got[untouched], START[untouched])
    assert int(opt.iterations.numpy()) == len(INDICES)


def test_lazy_adam_after_three_steps_is_tf_addons_number(two_shard_strategy):
    """LazyAdam(0.1) with gradient 1 on one row, three times: each step is -0.1 (bias corrected), -0.300 in all.

    A row whose step count stayed at 1 would move -0.1, -0.134, -0.157 (-0.391).
    """
    with two_shard_strategy.scope():
        table = dps.Variable(np.zeros((ROWS, 1), np.float32), name="ref/lazy_adam")
        opt = dps.optimizers.Adam(0.1)
    for _ in range(3):
        opt.apply_gradients([(dps.IndexedSlices(np.ones((1, 1), np.float32), np.array([5])), table)])
    np.testing.assert_allclose(table.numpy()[5], [-0.3], atol=1e-5)
    np.testing.assert_allclose(reference_adam_row(3), -0.3, atol=1e-6)


def reference_adam_row(steps: int) -> float:
    init, step = adam()
    p, s = np.zeros(1), init(np.zeros(1))
    for t in range(1, steps + 1):
        p, s = step(np.ones(1), s, p, t, 0.1)
    return float(p[0])
