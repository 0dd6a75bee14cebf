"""Keras 3's newer optimizers (RMSprop, Adamax, Lion, AdamW, Nadam, Ftrl) on sharded tables in scheduled functions,
clipping over whole sharded variables, and schedules resumed from checkpoints, against numpy written from Keras 3's
published update rules (not from daskps).
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

import daskps as dps
from tests.helpers.variables import sharded


def f32(*a):
    return np.asarray(a, np.float32)


# -- optimizers against numpy written from Keras 3's update rules ----------------------
def _rmsprop(lr, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False):
    def init(x):
        return {"v": np.zeros_like(x), "ag": np.zeros_like(x), "m": np.zeros_like(x)}

    def step(x, g, s, t):
        s["v"] = rho * s["v"] + (1 - rho) * g * g
        if centered:
            s["ag"] = rho * s["ag"] + (1 - rho) * g
            denom = s["v"] - s["ag"] ** 2 + epsilon
        else:
            denom = s["v"] + epsilon
        inc = lr(t) * g / np.sqrt(denom)
        if momentum > 0:
            s["m"] = momentum * s["m"] + inc
            return x - s["m"]
        return x - inc
    return init, step


def _adamax(lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    def init(x):
        return {"m": np.zeros_like(x), "u": np.zeros_like(x)}

    def step(x, g, s, t):
        s["m"] = s["m"] + (g - s["m"]) * (1 - beta_1)
        s["u"] = np.maximum(beta_2 * s["u"], np.abs(g))
        return x - lr(t) * s["m"] / ((1 - beta_1 ** (t + 1)) * (s["u"] + epsilon))
    return init, step


def _lion(lr, beta_1=0.9, beta_2=0.99):
    def init(x):
        return {"m": np.zeros_like(x)}

    def step(x, g, s, t):
        new = x - lr(t) * np.sign(s["m"] * beta_1 + g * (1 - beta_1))
        s["m"] = s["m"] * beta_2 + g * (1 - beta_2)
        return new
    return init, step


def _adamw(lr, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    def init(x):
        return {"m": np.zeros_like(x), "v": np.zeros_like(x)}

    def step(x, g, s, t):
        x = x - x * weight_decay * lr(t)
        s["m"] = s["m"] + (g - s["m"]) * (1 - beta_1)
        s["v"] = s["v"] + (g * g - s["v"]) * (1 - beta_2)
        alpha = lr(t) * np.sqrt(1 - beta_2 ** (t + 1)) / (1 - beta_1 ** (t + 1))
        return x - alpha * s["m"] / (np.sqrt(s["v"]) + epsilon)
    return init, step


def _nadam(lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    def init(x):
        return {"m": np.zeros_like(x), "v": np.zeros_like(x)}

    def step(x, g, s, t):
        u_t = beta_1 * (1 - 0.5 * 0.96 ** (t + 1))
        u_t1 = beta_1 * (1 - 0.5 * 0.96 ** (t + 2))
        # the product from the (shard's) count, as the README says: the same for a row first touched late
        up_t = np.prod([beta_1 * (1 - 0.5 * 0.96 ** (k + 1)) for k in range(t + 1)])
        up_t1 = up_t * u_t1
        s["m"] = s["m"] + (g - s["m"]) * (1 - beta_1)
        s["v"] = s["v"] + (g * g - s["v"]) * (1 - beta_2)
        m_hat = u_t1 * s["m"] / (1 - up_t1) + (1 - u_t) * g / (1 - up_t)
        v_hat = s["v"] / (1 - beta_2 ** (t + 1))
        return x - lr(t) * m_hat / (np.sqrt(v_hat) + epsilon)
    return init, step


def _ftrl(lr, learning_rate_power=-0.5, initial_accumulator_value=0.1, l1_regularization_strength=0.0,
          l2_regularization_strength=0.0, l2_shrinkage_regularization_strength=0.0, beta=0.0):
    def init(x):
        return {"acc": np.full_like(x, initial_accumulator_value), "lin": np.zeros_like(x)}

    def step(x, g, s, t):
        rate, p = lr(t), -learning_rate_power
        adjusted_l2 = l2_regularization_strength + beta / (2 * rate)
        grad_to_use = g + 2 * l2_shrinkage_regularization_strength * x
        new_acc = s["acc"] + g * g
        s["lin"] = s["lin"] + grad_to_use - (new_acc ** p - s["acc"] ** p) / rate * x
        quadratic = new_acc ** p / rate + 2 * adjusted_l2
        clipped = np.clip(s["lin"], -l1_regularization_strength, l1_regularization_strength)
        s["acc"] = new_acc
        return (clipped - s["lin"]) / quadratic
    return init, step


def _constant(rate):
    return lambda t: rate


def _exponential(t):  # ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
    return 0.05 * 0.5 ** (t / 2)


CASES = {
    "AdamW": (lambda lr, **k: dps.optimizers.AdamW(lr, weight_decay=0.1, **k), lambda lr: _adamw(lr, weight_decay=0.1)),
    "RMSprop": (lambda lr, **k: dps.optimizers.RMSprop(lr, momentum=0.5, centered=True, **k),
                lambda lr: _rmsprop(lr, momentum=0.5, centered=True)),
    "Ftrl": (lambda lr, **k: dps.optimizers.Ftrl(lr, **k, l1_regularization_strength=0.01, l2_regularization_strength=0.02,
                                            l2_shrinkage_regularization_strength=0.03, beta=0.1),
             lambda lr: _ftrl(lr, l1_regularization_strength=0.01, l2_regularization_strength=0.02,
                              l2_shrinkage_regularization_strength=0.03, beta=0.1)),
    "Adamax": (lambda lr, **k: dps.optimizers.Adamax(lr, **k), _adamax),
    "Nadam": (lambda lr, **k: dps.optimizers.Nadam(lr, **k), _nadam),
    "Lion": (lambda lr, **k: dps.optimizers.Lion(lr, **k), _lion),
}
START = np.linspace(-1, 1, 12, dtype=np.float32).reshape(6, 2)
# (rows, values) per step; every step touches both shards (rows 0-2 on one, 3-5 on the other)
SLICES = [([0, 4], [[0.5, -1.0], [2.0, 0.25]]), ([1, 5, 4], [[-0.3, 0.7], [1.0, 1.0], [-0.5, 0.1]]),
          ([0, 3], [[0.1, 0.2], [-0.4, 0.9]])]


def _reference(make_ref, lr, lazy):
    init, step = make_ref(lr)
    x = START.astype(np.float64).copy()
    states = [init(x[r]) for r in range(len(x))]
    for t, (rows, vals) in enumerate(SLICES):
        dense = np.zeros_like(x)
        np.add.at(dense, rows, np.asarray(vals))
        for r in (sorted(set(rows)) if lazy else range(len(x))):
            x[r] = step(x[r], dense[r], states[r], t)
    return x


@pytest.mark.parametrize("mode", ["lazy", "dense"])
@pytest.mark.parametrize("schedule", ["constant", "exponential"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_new_optimizers_on_a_sharded_table_in_scheduled_functions_match_numpy(strategy, coordinator, name, mode,
                                                                               schedule):
    make_opt, make_ref = CASES[name]
    lr = (dps.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
          if schedule == "exponential" else 0.05)
    with strategy.scope():
        opt = make_opt(lr, lazy_sparse=mode == "lazy")
    table = sharded(strategy, START, [3, 3], name=f"opt_{name}")

    def step(rows, vals):
        opt.apply([dps.IndexedSlices(np.asarray(vals, np.float32), np.asarray(rows))], [table])

    for rows, vals in SLICES:  # one at a time: the steps' order matters
        coordinator.fetch(coordinator.schedule(step, args=(rows, vals)))
    want = _reference(make_ref, _exponential if schedule == "exponential" else _constant(0.05), mode == "lazy")
    np.testing.assert_allclose(table.numpy(), want, rtol=2e-5, atol=2e-6)
    assert int(opt.iterations.numpy()) == len(SLICES)


def test_lazy_sparse_cannot_be_changed_behind_the_servers_back(strategy):
    """The servers take ``lazy_sparse`` at construction. Assigning the attribute afterwards used to
    change nothing there until a later reconfiguration (learning_rate setter, exclude_from_weight_decay,
    a re-created server) silently switched the mode mid-training."""
    with strategy.scope():
        opt = dps.optimizers.Adamax(0.1)
    with pytest.raises(AttributeError, match="lazy_sparse"):
        opt.lazy_sparse = False
    assert opt.lazy_sparse is True
    assert pickle.loads(pickle.dumps(opt)).lazy_sparse is True


# -- clipping -------------------------------------------------------------------------
def test_global_clipnorm_over_dense_and_sparse_gradients_with_none_among_them(strategy, coordinator):
    table = sharded(strategy, np.zeros((4, 2), np.float32), [2, 2], name="clip_table")
    with strategy.scope():
        w = dps.Variable(np.zeros(3, np.float32), name="clip_w")
        skipped = dps.Variable(np.zeros(2, np.float32), name="clip_skipped")
        opt = dps.optimizers.SGD(1.0, global_clipnorm=1.5)
    g_w = f32(3, 0, 4)
    vals = np.array([[1, 2], [2, 1], [0, 1]], np.float32)  # row 1 repeated: the norm is of the values as given
    rows = np.array([1, 1, 3])

    def step():
        opt.apply([g_w, None, dps.IndexedSlices(vals, rows)], [w, skipped, table])

    coordinator.fetch(coordinator.schedule(step))
    norm = np.sqrt((g_w**2).sum() + (vals**2).sum())
    scale = 1.5 / max(norm, 1.5)
    np.testing.assert_allclose(w.numpy(), -scale * g_w, rtol=1e-6)
    want = np.zeros((4, 2))
    np.add.at(want, rows, -scale * vals)
    np.testing.assert_allclose(table.numpy(), want, rtol=1e-6)
    np.testing.assert_array_equal(skipped.numpy(), [0, 0])


@pytest.mark.parametrize("kw, ref", [
    ({"clipnorm": 1.0}, lambda g: g * 1.0 / max(np.linalg.norm(g), 1.0)),
    ({"clipvalue": 0.5}, lambda g: np.clip(g, -0.5, 0.5)),
])
def test_clipnorm_is_over_a_whole_sharded_variable_and_clipvalue_per_element(strategy, kw, ref):
    table = sharded(strategy, np.zeros((4, 2), np.float32), [2, 2], name="clip2")
    with strategy.scope():
        opt = dps.optimizers.SGD(1.0, **kw)
        none_var = dps.Variable(f32(1), name="clip2_none")
    g = np.array([[3, 0], [0, 0], [0, 4], [1, -1]], np.float32)
    opt.apply([None, g], [none_var, table])
    np.testing.assert_allclose(table.numpy(), -ref(g), rtol=1e-6)
    np.testing.assert_array_equal(none_var.numpy(), [1])


# -- schedules and learning_rate ------------------------------------------------------
def _schedule_round_trip(strategy, tmp_path, make):
    """Step 0 at 0.5, step 1 at 0.25; save after step 0, step, restore, step again: the same value."""
    sched = dps.optimizers.schedules.PiecewiseConstantDecay([0, 1], [0.5, 0.25, 0.125])
    with strategy.scope():
        w = dps.Variable(f32(0, 0), name="ck_w")
        opt = make(sched)
    ckpt = dps.Checkpoint(w=w, opt=opt)
    opt.apply([f32(1, 1)], [w])
    path = ckpt.save(str(tmp_path / "ck"))
    opt.apply([f32(1, 1)], [w])
    first = w.numpy().copy()
    ckpt.restore(path)
    assert int(opt.iterations.numpy()) == 1 and float(opt.learning_rate) == 0.25
    opt.apply([f32(1, 1)], [w])
    np.testing.assert_allclose(w.numpy(), first, rtol=1e-6)
    return opt, w


def test_a_schedule_resumes_at_the_saved_step_with_slots(strategy, tmp_path):
    _schedule_round_trip(strategy, tmp_path, lambda s: dps.optimizers.Adam(s))


def test_a_schedule_resumes_at_the_saved_step_without_slots(strategy, tmp_path):
    _schedule_round_trip(strategy, tmp_path, lambda s: dps.optimizers.SGD(s))


def test_learning_rate_setter_with_schedules(strategy):
    with strategy.scope():
        w = dps.Variable(f32(0, 0), name="lr_w")
        opt = dps.optimizers.SGD(dps.optimizers.schedules.PiecewiseConstantDecay([0], [0.5, 0.25]))
    opt.apply([f32(1, 1)], [w])
    opt.apply([f32(1, 1)], [w])
    with pytest.raises(TypeError, match="LearningRateSchedule .* cannot be set to the number 0.3"):
        opt.learning_rate = 0.3  # a schedule may not become a number (as Keras)
    opt.learning_rate = dps.optimizers.schedules.ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    assert float(opt.learning_rate) == pytest.approx(0.25)  # at iterations == 2
    opt.apply([f32(1, 1)], [w])  # w's own count is 2: 1.0 * 0.5**2
    np.testing.assert_allclose(w.numpy(), [-1.0, -1.0])


def _cosine(step, init, ds, alpha=0.0, wt=None, ws=0):
    if wt is not None and step < ws:
        return init + (wt - init) * step / ws
    c = 0.5 * (1 + math.cos(math.pi * min(step - ws, ds) / ds))
    return (wt if wt is not None else init) * ((1 - alpha) * c + alpha)


def _polynomial(step, init, ds, end=1e-4, power=1.0, cycle=False):
    if cycle:
        ds = ds * (1 if step == 0 else math.ceil(step / ds))
    else:
        step = min(step, ds)
    return (init - end) * (1 - step / ds) ** power + end


@pytest.mark.parametrize("make, ref", [
    (lambda S: S.CosineDecay(0.1, 10, alpha=0.2), lambda s: _cosine(s, 0.1, 10, 0.2)),
    (lambda S: S.CosineDecay(0.0, 10, warmup_target=0.5, warmup_steps=5, alpha=0.1),
     lambda s: _cosine(s, 0.0, 10, 0.1, 0.5, 5)),
    (lambda S: S.PolynomialDecay(0.1, 4, end_learning_rate=0.01, power=2.0, cycle=True),
     lambda s: _polynomial(s, 0.1, 4, 0.01, 2.0, True)),
    (lambda S: S.PolynomialDecay(0.1, 4, end_learning_rate=0.01, power=0.5), lambda s: _polynomial(s, 0.1, 4, 0.01, 0.5)),
    (lambda S: S.InverseTimeDecay(0.1, 3, 0.5, staircase=True), lambda s: 0.1 / (1 + 0.5 * (s // 3))),
    (lambda S: S.ExponentialDecay(0.1, 3, 0.5, staircase=True), lambda s: 0.1 * 0.5 ** (s // 3)),
])
def test_schedules_match_keras_formulas(make, ref):
    sched = make(dps.optimizers.schedules)
    np.testing.assert_allclose([float(sched(s)) for s in range(22)], [ref(s) for s in range(22)], rtol=1e-6)


def test_all_shards_of_a_variable_count_a_step_even_without_rows_in_it(strategy):
    """Lazy mode: shard 1 gets no row in the first step, yet its second step is Adam's second
    (t = 2 for the bias correction), so the shards of one variable stay in step, as Keras' iterations."""
    table = sharded(strategy, np.zeros((4, 1), np.float32), [2, 2], name="count_table")
    with strategy.scope():
        opt = dps.optimizers.Adam(0.1)
    opt.apply([dps.IndexedSlices(np.ones((1, 1), np.float32), [0])], [table])
    opt.apply([dps.IndexedSlices(np.ones((1, 1), np.float32), [2])], [table])
    m, v = 0.1, 0.001  # the row's own slots after its first update, at t = 2
    want = -0.1 * np.sqrt(1 - 0.999**2) / (1 - 0.9**2) * m / (np.sqrt(v) + 1e-7)
    np.testing.assert_allclose(table.numpy()[:, 0], [-0.1, 0, want, 0], rtol=1e-5, atol=1e-7)
