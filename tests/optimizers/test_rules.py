"""The optimizers' update rules in this process (``daskps._core``): transforms, schedules, clipping, summing rows.

Expected numbers are numpy written from Keras 3's published rules
(``keras/src/optimizers/*.py``, ``keras/src/optimizers/schedules``) or from
the definitions in the docstrings; expected messages are the exact text a
user sees. Nothing is compared with daskps' own output.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from daskps._core import clipping as CL
from daskps._core import schedules as S
from daskps._core import transforms as T

GRADS = [np.array([0.5, -1.0, 2.0]), np.array([-0.3, 0.8, 1.0]), np.array([1.5, 0.1, -2.0]),
         np.array([0.2, -0.4, 0.6])]
START = np.array([1.0, -2.0, 0.5])


def _run(transform, grads=GRADS, start=START):
    param, state = start.copy(), None
    for g in grads:
        state = T.apply_gradient(transform, param, state, "dense", g)
    return param, state


# -- transforms ------------------------------------------------------------------------------------------
def test_rmsprop_centered_with_momentum_is_keras_rule():
    lr, rho, mom, eps = 0.05, 0.8, 0.5, 1e-6
    p, v, m, a = START.copy(), np.zeros(3), np.zeros(3), np.zeros(3)
    for g in GRADS:
        v = rho * v + (1 - rho) * g * g
        a = rho * a + (1 - rho) * g
        inc = lr * g / np.sqrt(v - a * a + eps)
        m = mom * m + inc
        p = p - m
    got, state = _run(T.Chain(T.RMSpropStep(rho=rho, momentum=mom, epsilon=eps, centered=True), lr))
    np.testing.assert_allclose(got, p, rtol=1e-12)
    np.testing.assert_allclose(state.average_gradient, a, rtol=1e-12)
    assert state.count == 4


def test_lion_keeps_its_momentum_with_beta_2():
    b1, b2, lr = 0.9, 0.99, 0.1
    grads = [np.array([1.0]), np.array([1.0]), np.array([-0.18])]  # the third step's sign depends on m * beta_2
    p, m = np.array([0.0]), np.zeros(1)
    for g in grads:
        p = p - lr * np.sign(m * b1 + g * (1 - b1))
        m = m * b2 + g * (1 - b2)
    got, state = _run(T.Chain(T.LionStep(b1, b2), lr), grads, np.array([0.0]))
    np.testing.assert_allclose(got, p, rtol=1e-12)
    np.testing.assert_allclose(state.m, m, rtol=1e-12)
    assert got[0] == pytest.approx(-0.1)  # +0.1 - 0.1 - 0.1 with m * beta_2; -0.3 would be m / beta_2


def test_adagrad_with_a_schedule_uses_the_rate_at_each_count():
    sched = S.InverseTimeDecay(0.5, decay_steps=1, decay_rate=1.0)  # 0.5 / (1 + step)
    p, acc = START.copy(), np.full(3, 0.1)
    for k, g in enumerate(GRADS):
        acc = acc + g * g
        p = p - (0.5 / (1 + k)) * g / np.sqrt(acc + 1e-7)
    got, state = _run(T.Chain(T.AdagradStep(), sched))
    np.testing.assert_allclose(got, p, rtol=1e-12)
    assert state.count == 4


@pytest.mark.parametrize(
    "transform",
    [T.Chain(T.SGDStep(), 0.1), T.Chain(T.SGDStep(momentum=0.5), 0.1), T.Chain(T.AdagradStep(), 0.1), T.Chain(T.AdamStep(), 0.1),
     T.Chain(T.RMSpropStep(), 0.1), T.Chain(T.FtrlStep(), 0.1), T.Chain(T.AdamaxStep(), 0.1), T.Chain(T.NadamStep(), 0.1),
     T.Chain(T.LionStep(), 0.1)],
    ids=lambda t: type(t).__name__,
)
def test_every_update_counts_one_step(transform):
    state = transform.init(START)
    assert state.count == 0
    for k in range(1, 4):
        _, state = transform.update(GRADS[k], state, START)
        assert state.count == k


@pytest.mark.parametrize(
    "transform, slots",
    [
        (T.Chain(T.SGDStep(), 0.1), set()),  # Keras SGD: momentums only when momentum != 0
        (T.Chain(T.SGDStep(momentum=0.9), 0.1), {"momentum"}),
        (T.Chain(T.AdamStep()), {"m", "v"}),  # Keras Adam: velocity_hats only with amsgrad
        (T.Chain(T.AdamStep(amsgrad=True)), {"m", "v", "v_hat"}),
        (T.Chain(T.RMSpropStep()), {"velocity"}),  # Keras RMSprop: momentums if momentum > 0, averages if centered
        (T.Chain(T.RMSpropStep(momentum=0.5)), {"velocity", "momentum"}),
        (T.Chain(T.RMSpropStep(centered=True)), {"velocity", "average_gradient"}),
        (T.Chain(T.AdagradStep(initial_accumulator_value=0.3)), {"accumulator"}),
        (T.Chain(T.LionStep()), {"m"}),
    ],
    ids=[f"case{i}" for i in range(9)],
)
def test_init_makes_the_slots_keras_makes_and_no_others(transform, slots):
    state = transform.init(START)
    assert set(T.slot_arrays(state)) == slots and state.count == 0
    if "accumulator" in slots:
        assert state.accumulator.tolist() == [0.3] * 3


ALL = [T.SGDStep, T.AdagradStep, T.AdamStep, T.RMSpropStep, T.FtrlStep, T.AdamaxStep, T.NadamStep, T.LionStep]


@pytest.mark.parametrize("rule", ALL, ids=lambda k: k.__name__)
def test_a_schedule_is_asked_for_the_rate_at_the_variables_count(rule):
    # Keras: lr = schedule(iterations): 0.1 for the first update, 0.05 for the second
    sched = S.PiecewiseConstantDecay([0], [0.1, 0.05])
    got, state = _run(T.Chain(rule(), sched), GRADS[:2])
    want, fixed = START.copy(), None
    for rate, g in zip((0.1, 0.05), GRADS[:2]):
        t = T.Chain(rule(), rate)
        fixed = T.apply_gradient(t, want, fixed, "dense", g)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert state.count == 2


def test_sgd_without_decay_leaves_an_infinite_parameter_infinite():
    param = np.array([np.inf, 1.0])
    T.apply_gradient(T.Chain(T.SGDStep(), 0.1), param, None, "dense", np.array([1.0, 1.0]))
    assert param[0] == np.inf and param[1] == pytest.approx(0.9)


def test_decay_exempt_by_key_or_by_pattern():
    ex = T.DecayExempt(frozenset({"k1"}), pattern="bias$")
    assert ex.covers("k1", "dense/kernel")
    assert ex.covers("k2", "dense/bias")
    assert not ex.covers("k2", "dense/kernel")
    assert not T.DecayExempt(frozenset({"k1"})).covers("k2", "dense/bias")
    assert not T.DecayExempt().covers("k1", "x")


def test_for_variable_exempts_by_server_key_and_leaves_other_transforms_alone():
    adam = T.Chain(T.AdamStep(), weight_decay=0.1, decay_exempt=T.DecayExempt(frozenset({'k7'})))
    assert T.for_variable(adam, "k7", "any").weight_decay is None
    assert T.for_variable(adam, "k8", "any").weight_decay == 0.1

    class Custom(collections.namedtuple("Custom", "learning_rate weight_decay")):
        pass  # a user's transform without decay_exempt

    custom = Custom(0.1, 0.5)
    assert T.for_variable(custom, "k", "n") is custom


def test_for_variable_drops_weight_decay_only_where_exempt():
    ex = T.DecayExempt(pattern="bias")
    adam = T.Chain(T.AdamStep(), weight_decay=0.1, decay_exempt=ex)
    assert T.for_variable(adam, "k", "dense/bias").weight_decay is None
    assert T.for_variable(adam, "k", "dense/kernel") is adam
    plain = T.Chain(T.AdamStep(), decay_exempt=ex)
    assert T.for_variable(plain, "k", "dense/bias") is plain


def test_state_from_slots_keeps_the_known_slots_and_the_count():
    param = np.zeros(2)
    saved = {"m": np.array([1.0, 2.0]), "unknown": np.array([9.0]), "count": np.array([7.0])}
    state = T.state_from_slots(T.Chain(T.AdamStep()), param, np.int64(5), saved)
    assert state.count == 5 and type(state.count) is int
    assert state.m.tolist() == [1.0, 2.0] and state.v.tolist() == [0.0, 0.0] and state.v_hat is None


def test_sum_rows_sums_each_distinct_index():
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 3, size=200)
    vals = rng.normal(size=(200, 2)).astype(np.float32)
    got_idx, got = T.sum_rows(idx, vals)
    assert got_idx.tolist() == [0, 1, 2] and got.dtype == np.float32
    np.testing.assert_allclose(got, [vals[idx == i].astype(np.float64).sum(axis=0) for i in range(3)], rtol=1e-5)


def test_sum_rows_of_nothing_and_of_no_repeats():
    idx, vals = T.sum_rows(np.zeros(0, np.intp), np.zeros((0, 2)))
    assert idx.shape == (0,) and vals.shape == (0, 2)
    idx, vals = T.sum_rows(np.array([2, 0]), np.array([[1.0], [2.0]]))
    assert idx.tolist() == [0, 2] and vals.tolist() == [[2.0], [1.0]]


def test_additive_only_for_plain_sgd_at_a_fixed_rate():
    assert T.additive(T.Chain(T.SGDStep(), 0.1))
    assert not T.additive(T.Chain(T.SGDStep(), S.ExponentialDecay(0.1, 10, 0.5)))
    assert not T.additive(T.Chain(T.SGDStep(), 0.1, weight_decay=0.01))
    assert not T.additive(T.Chain(T.AdagradStep(), 0.1))


def test_check_trainable_refuses_integers_by_name():
    T.check_trainable(np.dtype("float16"), "w", "adam")
    with pytest.raises(TypeError) as info:
        T.check_trainable(np.dtype("int32"), "w", "adam")
    assert str(info.value) == ("optimizer 'adam' cannot train variable 'w' of dtype int32: only floating-point "
                               "variables have gradients (exclude it from the gradients, or make it float)")


def test_apply_gradient_times_counts_every_merged_step():
    state = T.apply_gradient(T.Chain(T.SGDStep(), 0.5), np.zeros(1), None, "dense", np.array([1.0]), times=2)
    assert state.count == 2
    param = np.zeros(2)
    state = T.apply_gradient(T.Chain(T.SGDStep(), 0.5), param, None, "dense", np.array([1.0, 2.0]), times=3)
    assert state.count == 3 and param.tolist() == [-0.5, -1.0]
    state = T.apply_gradient(T.Chain(T.SGDStep(), 0.5), param, state, "dense", np.array([1.0, 2.0]))
    assert state.count == 4


def test_rows_are_row_local_by_default():
    # TF Addons' LazyAdam: a row not named keeps its value and its moments
    param = np.zeros((2, 1))
    state = T.apply_gradient(T.Chain(T.AdamStep(), 0.1), param, None, "rows", (np.array([0]), np.array([[1.0]])))
    after_first = param.copy()
    state = T.apply_gradient(T.Chain(T.AdamStep(), 0.1), param, state, "rows", (np.array([1]), np.array([[1.0]])))
    assert param[0, 0] == after_first[0, 0] and state.m[0, 0] == pytest.approx(0.1) and state.count == 2


def test_rows_with_lazy_sparse_off_are_a_dense_gradient():
    # Keras' dense behaviour: every row's slots move, repeated rows summed
    param = np.zeros((3, 1))
    state = T.apply_gradient(T.Chain(T.AdamStep(), 0.1), param, None, "rows", (np.array([0, 0]), np.array([[1.0], [1.0]])),
                             lazy_sparse=False)
    assert state.count == 1 and state.m[:, 0].tolist() == pytest.approx([0.2, 0.0, 0.0])


# -- schedules -------------------------------------------------------------------------------------------
def test_cosine_warmup_starts_from_the_initial_rate():
    s = S.CosineDecay(0.1, decay_steps=4, warmup_target=1.0, warmup_steps=4)
    # Keras: (target - initial) * (step / warmup_steps) + initial while warming up
    assert [round(s(k), 10) for k in (0, 1, 2, 4)] == [0.1, 0.325, 0.55, 1.0]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: S.ExponentialDecay(True, 10, 0.5), "initial_learning_rate must be a number, got True"),
        (lambda: S.ExponentialDecay(0.1, 0, 0.5), "decay_steps must be > 0, got 0"),
        (lambda: S.ExponentialDecay(0.1, "10", 0.5), "decay_steps must be a number, got '10'"),
        (lambda: S.ExponentialDecay(0.1, 10, None), "decay_rate must be a number, got None"),
        (lambda: S.InverseTimeDecay("a", 10, 0.5), "initial_learning_rate must be a number, got 'a'"),
        (lambda: S.InverseTimeDecay(0.1, -1, 0.5), "decay_steps must be > 0, got -1"),
        (lambda: S.InverseTimeDecay(0.1, 1, [0.5]), "decay_rate must be a number, got [0.5]"),
        (lambda: S.PolynomialDecay(None, 10), "initial_learning_rate must be a number, got None"),
        (lambda: S.PolynomialDecay(0.1, 0.0), "decay_steps must be > 0, got 0.0"),
        (lambda: S.PolynomialDecay(0.1, 10, end_learning_rate="x"), "end_learning_rate must be a number, got 'x'"),
        (lambda: S.PolynomialDecay(0.1, 10, power=False), "power must be a number, got False"),
        (lambda: S.CosineDecay(None, 10), "initial_learning_rate must be a number, got None"),
        (lambda: S.CosineDecay(0.1, 0), "decay_steps must be > 0, got 0"),
        (lambda: S.CosineDecay(0.1, 10, alpha="0"), "alpha must be a number, got '0'"),
        (lambda: S.CosineDecay(0.1, 10, warmup_target="1"), "warmup_target must be a number, got '1'"),
        (lambda: S.CosineDecay(0.1, 10, warmup_steps=-2), "warmup_steps must be >= 0, got -2"),
        (lambda: S.CosineDecay(0.1, 10, warmup_steps=None), "warmup_steps must be a number, got None"),
        (lambda: S.PiecewiseConstantDecay([1, 2], [1.0, 0.5]),
         "boundaries must have one item fewer than values, got 2 boundaries and 2 values"),
        (lambda: S.PiecewiseConstantDecay(["1"], [1.0, 0.5]), "boundaries must be a number, got '1'"),
        (lambda: S.PiecewiseConstantDecay([1], [1.0, None]), "values must be a number, got None"),
    ],
)
def test_schedule_arguments_are_refused_by_name(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message


def test_piecewise_constant_keeps_tuples_and_hashes():
    s = S.PiecewiseConstantDecay([1, 2], [1.0, 0.5, 0.1])
    assert s.boundaries == (1, 2) and s.values == (1.0, 0.5, 0.1)
    assert hash(s) == hash(S.PiecewiseConstantDecay((1, 2), (1.0, 0.5, 0.1)))


def test_a_schedule_base_class_must_be_subclassed():
    with pytest.raises(NotImplementedError):
        S.LearningRateSchedule()(0)


# -- clipping --------------------------------------------------------------------------------------------
def test_clipvalue_and_global_clipnorm_keep_rows_as_rows():
    rows = ("rows", (np.array([1, 1]), np.array([[3.0], [-4.0]])))
    (kind, (idx, vals)), = CL.clip_gradients(CL.Clipping(clipvalue=2.0), [rows])
    assert kind == "rows" and idx.tolist() == [1, 1] and vals.tolist() == [[2.0], [-2.0]]
    out = CL.clip_gradients(CL.Clipping(global_clipnorm=1.0), [rows, ("dense", np.array([0.0]))])
    (kind, (idx, vals)), (dkind, dense) = out
    assert kind == "rows" and idx.tolist() == [1, 1] and vals[:, 0].tolist() == pytest.approx([0.6, -0.8])
    assert dkind == "dense" and dense.tolist() == [0.0]


def test_global_clipnorm_leaves_small_and_zero_gradients_alone():
    import warnings

    out = CL.clip_gradients(CL.Clipping(global_clipnorm=1.0), [("dense", np.array([0.3, 0.4]))])
    assert out[0][1].tolist() == [0.3, 0.4]
    out = CL.clip_gradients(CL.Clipping(global_clipnorm=2.0), [("dense", np.array([0.3, 0.4]))])
    assert out[0][1].tolist() == [0.3, 0.4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = CL.clip_gradients(CL.Clipping(global_clipnorm=1.0), [("dense", np.zeros(2))])
    assert out[0][1].tolist() == [0.0, 0.0]


def test_global_clipnorm_scales_a_norm_below_one_down_to_the_clip():
    # Keras: g * clip / max(global norm, clip); norm 0.5 over clip 0.25 halves it
    out = CL.clip_gradients(CL.Clipping(global_clipnorm=0.25), [("dense", np.array([0.3, 0.4]))])
    assert out[0][1].tolist() == pytest.approx([0.15, 0.2])


def _summed_by_numpy(indices, values):
    """The reference: each distinct index (sorted) and the sum of its rows, by ``np.add.at``."""
    distinct, where = np.unique(indices, return_inverse=True)
    out = np.zeros((len(distinct),) + values.shape[1:], values.dtype)
    np.add.at(out, where, values)
    return distinct, out


@pytest.mark.parametrize("repeats", ["none", "few", "most", "all one index", "sorted runs"])
@pytest.mark.parametrize("width", [(), (3,)])
def test_sum_rows_and_sum_sorted_agree_with_numpy_for_every_mix_of_repeats(repeats, width):
    """Both paths of sum_sorted (runs added apart from single rows when repeats are rare; every run
    with reduceat when common) against np.add.at, for rows of any width."""
    rng = np.random.default_rng(7)
    n = 400
    indices = {"none": rng.permutation(1000)[:n], "few": np.concatenate([rng.permutation(1000)[:n - 20],
                                                                          rng.integers(0, 1000, 20)]),
               "most": rng.integers(0, 60, n), "all one index": np.full(n, 5),
               "sorted runs": np.sort(rng.integers(0, 100, n))}[repeats]
    values = rng.standard_normal((n,) + width)
    want_idx, want = _summed_by_numpy(indices, values)
    got_idx, got = T.sum_rows(indices, values)
    np.testing.assert_array_equal(got_idx, want_idx)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    order = np.argsort(indices, kind="stable")
    got_idx, got = T.sum_sorted(indices[order], values[order])
    np.testing.assert_array_equal(got_idx, want_idx)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
