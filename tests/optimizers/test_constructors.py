"""The optimizers' constructors against Keras 3's: every default, every argument kept, names.

Keras (installed with the test extra, on the JAX backend) is the reference:
a daskps optimizer made with no arguments holds Keras' default for every
hyperparameter the two share, and one made with other values holds those.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import daskps as dps

keras = pytest.importorskip("keras")

NAMES = ["SGD", "Adagrad", "Adam", "AdamW", "RMSprop", "Ftrl", "Adamax", "Nadam", "Lion"]
NOT_OURS = {"name", "use_ema", "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor",
            "gradient_accumulation_steps"}
# Values other than the defaults that both accept, for each hyperparameter.
OTHER = {"learning_rate": 0.25, "momentum": 0.5, "nesterov": True, "initial_accumulator_value": 0.3,
         "epsilon": 1e-3, "beta_1": 0.8, "beta_2": 0.95, "amsgrad": True, "rho": 0.7, "centered": True,
         "learning_rate_power": -0.25, "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02,
         "l2_shrinkage_regularization_strength": 0.03, "beta": 0.1, "weight_decay": 0.05, "clipnorm": 2.0,
         "clipvalue": 3.0, "global_clipnorm": None}


def _shared(name):
    return {k: v for k, v in getattr(keras.optimizers, name)().get_config().items() if k not in NOT_OURS}


def _same(ours, theirs) -> bool:
    if isinstance(theirs, float) and isinstance(ours, (int, float)) and not isinstance(ours, bool):
        return math.isclose(ours, theirs, rel_tol=1e-6)
    return ours == theirs and type(ours) is type(theirs)


@pytest.mark.parametrize("name", NAMES)
def test_every_default_is_keras(name):
    ours = getattr(dps.optimizers, name)()
    shared = _shared(name)
    assert len(shared) >= 5, shared
    wrong = {k: (getattr(ours, k), v) for k, v in shared.items() if not _same(getattr(ours, k), v)}
    assert not wrong, wrong
    assert ours.name == name and ours.lazy_sparse is True


@pytest.mark.parametrize("name", NAMES)
def test_every_argument_given_is_kept(name):
    shared = _shared(name)
    given = {k: OTHER[k] for k in shared if k not in ("clipvalue", "global_clipnorm")}  # one kind of clipping
    ours = getattr(dps.optimizers, name)(**given, lazy_sparse=False, name="mine")
    theirs = getattr(keras.optimizers, name)(**given).get_config()
    wrong = {k: (getattr(ours, k), theirs[k]) for k in given if not _same(getattr(ours, k), theirs[k])}
    assert not wrong, wrong
    assert ours.name == "mine" and ours.lazy_sparse is False
    assert getattr(dps.optimizers, name)(clipvalue=3.0).clipvalue == 3.0
    assert getattr(dps.optimizers, name)(global_clipnorm=4.0).global_clipnorm == 4.0


@pytest.mark.parametrize("name", NAMES)
def test_get_config_names_kerass_hyperparameters_and_from_config_makes_the_same_optimizer(name):
    """Keras' get_config()/from_config(): the keys are Keras' own (less what we do not have) and ``lazy_sparse``;
    each hyperparameter is read once from where the optimizer declares it."""
    given = {k: OTHER[k] for k in _shared(name) if k not in ("clipvalue", "global_clipnorm")}
    ours = getattr(dps.optimizers, name)(**given, name="mine")
    config = ours.get_config()
    assert set(config) == set(_shared(name)) | {"name", "lazy_sparse"}
    assert all(config[k] == getattr(ours, k) for k in config), config
    again = type(ours).from_config(config)
    assert type(again) is type(ours) and again.get_config() == config


# -- refusals, word for word (docs/reference/bad-input.md) -----------------------------------

@pytest.mark.parametrize("make, kind, message", [
    (lambda: dps.optimizers.SGD(-1), ValueError, "learning_rate must be a positive finite number, got -1"),
    (lambda: dps.optimizers.SGD(0), ValueError, "learning_rate must be a positive finite number, got 0"),
    (lambda: dps.optimizers.SGD("x"), ValueError,
     "learning_rate must be a positive finite number or a LearningRateSchedule, got 'x'"),
    (lambda: dps.optimizers.SGD(momentum=-0.5), ValueError, "momentum must be a non-negative finite number, got -0.5"),
    (lambda: dps.optimizers.SGD(weight_decay=-0.1), ValueError,
     "weight_decay must be a non-negative finite number, got -0.1"),
    (lambda: dps.optimizers.SGD(clipnorm=0.0), ValueError, "clipnorm must be a positive finite number, got 0.0"),
    (lambda: dps.optimizers.SGD(clipvalue=-1.0), ValueError, "clipvalue must be a positive finite number, got -1.0"),
    (lambda: dps.optimizers.SGD(global_clipnorm=float("inf")), ValueError,
     "global_clipnorm must be a positive finite number, got inf"),
    (lambda: dps.optimizers.SGD(clipnorm=1.0, clipvalue=2.0), ValueError,
     "only one of clipnorm, clipvalue and global_clipnorm can be set, got {'clipnorm': 1.0, 'clipvalue': 2.0}"),
    (lambda: dps.optimizers.SGD(clipvalue=1.0, global_clipnorm=2.0), ValueError,
     "only one of clipnorm, clipvalue and global_clipnorm can be set, got {'clipvalue': 1.0, 'global_clipnorm': 2.0}"),
    (lambda: dps.optimizers.RMSprop(rho=1.5), ValueError, "rho must be in [0, 1], got 1.5"),
    (lambda: dps.optimizers.Adam(beta_1=1.0), ValueError, "beta_1 must be in [0, 1), got 1.0"),
    (lambda: dps.optimizers.Adam(beta_2=-0.1), ValueError, "beta_2 must be in [0, 1), got -0.1"),
    (lambda: dps.optimizers.Lion(beta_1=0.0), ValueError, "beta_1 must be in (0, 1], got 0.0"),
    (lambda: dps.optimizers.Lion(beta_2=1.01), ValueError, "beta_2 must be in [0, 1], got 1.01"),
    (lambda: dps.optimizers.Adagrad(epsilon=0.0), ValueError, "epsilon must be a positive finite number, got 0.0"),
    (lambda: dps.optimizers.Adam(amsgrad="yes"), TypeError, "amsgrad must be True or False, got 'yes'"),
    (lambda: dps.optimizers.SGD(name=3), TypeError, "name must be a string, got int"),
    (lambda: dps.optimizers.SGD(name=""), ValueError, "name must be a non-empty string, got ''"),
    (lambda: dps.optimizers.SGD(lazy_sparse="no"), TypeError, "lazy_sparse must be True or False, got 'no'"),
])
def test_a_bad_argument_is_refused_word_for_word(make, kind, message):
    with pytest.raises(kind) as info:
        make()
    assert str(info.value) == message


def test_the_closed_ends_of_the_ranges_are_accepted():
    assert dps.optimizers.RMSprop(rho=1.0).rho == 1.0 and dps.optimizers.RMSprop(rho=0).rho == 0.0
    assert dps.optimizers.Lion(beta_1=1.0, beta_2=1.0).beta_2 == 1.0
    assert dps.optimizers.Adam(beta_1=0.0).beta_1 == 0.0
    assert dps.optimizers.SGD(momentum=0).momentum == 0.0 and dps.optimizers.SGD(weight_decay=0).weight_decay == 0.0
    assert dps.optimizers.RMSprop(epsilon=0.0).epsilon == 0.0


# -- the optimizer object, on variables of this process ------------------------------------

def _f32(*values):
    return np.array(values, np.float32)


def test_iterations_counts_each_apply_and_is_not_trainable():
    opt = dps.optimizers.SGD(0.5, name="mine")
    w = dps.Variable(_f32(1.0, 2.0))
    assert opt.iterations.name == "mine/iterations" and opt.iterations.trainable is False
    assert opt.iterations.dtype == np.int64 and int(opt.iterations.numpy()) == 0
    assert opt.apply_gradients([(_f32(1.0, 1.0), w)]) is opt.iterations
    opt.apply([_f32(2.0, 2.0)], [w])
    np.testing.assert_allclose(w.numpy(), [1.0 - 0.5 - 1.0, 2.0 - 0.5 - 1.0])
    assert int(opt.iterations.numpy()) == 2


def test_hyperparameters_read_as_attributes_and_nothing_else_does():
    opt = dps.optimizers.Adam(0.2, beta_1=0.7)
    assert (opt.learning_rate, opt.beta_1, opt.amsgrad) == (0.2, 0.7, False)
    with pytest.raises(AttributeError) as info:
        getattr(opt, "nope")  # noqa: B009
    assert str(info.value) == "'Adam' object has no attribute 'nope'"
    assert repr(opt) == "<daskps.optimizers.Adam 'Adam' learning_rate=0.2>"
    with pytest.raises(AttributeError, match=r"lazy_sparse of optimizer 'Adam' is fixed when it is made"):
        opt.lazy_sparse = False
    assert opt.lazy_sparse is True


def test_setting_the_learning_rate_changes_the_next_step_and_keeps_slots():
    w = dps.Variable(_f32(0.0))
    opt = dps.optimizers.SGD(0.1, momentum=0.5)
    opt.apply([_f32(1.0)], [w])  # m = -0.1
    opt.learning_rate = 0.2
    opt.apply([_f32(1.0)], [w])  # m = 0.5 * -0.1 - 0.2 = -0.25
    np.testing.assert_allclose(w.numpy(), [-0.35], rtol=1e-6)
    assert opt.learning_rate == 0.2
    with pytest.raises(ValueError, match="learning_rate must be a positive finite number, got -1"):
        opt.learning_rate = -1
    assert opt.learning_rate == 0.2
    scheduled = dps.optimizers.SGD(dps.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5))
    assert scheduled.learning_rate == 1.0
    with pytest.raises(TypeError, match=r"optimizer 'SGD' was made with a LearningRateSchedule .* the number 0.5"):
        scheduled.learning_rate = 0.5


def test_build_remembers_the_variables_apply_trains():
    a, b = dps.Variable(_f32(1.0)), dps.Variable(_f32(2.0))
    opt = dps.optimizers.SGD(1.0)
    with pytest.raises(ValueError) as info:
        opt.apply([_f32(1.0)])
    assert str(info.value) == ("trainable_variables must be given, or the optimizer built first with "
                               "build(var_list)")
    opt.build([a, b])
    opt.apply([_f32(1.0), None])
    np.testing.assert_array_equal([a.numpy(), b.numpy()], [[0.0], [2.0]])
    with pytest.raises(TypeError, match="var_list"):
        opt.build([a, 3.0])


def test_exclude_from_weight_decay_follows_keras_rule():
    """Keras' SGD with weight decay: ``p -= lr * wd * p``, then ``p -= lr * g``; excluded variables skip the first."""
    lr, wd = 0.1, 0.5
    kernel, bias, other = (dps.Variable(_f32(1.0, 2.0), name=n) for n in ("dense/kernel", "dense/bias", "other"))
    opt = dps.optimizers.SGD(lr, weight_decay=wd)
    opt.exclude_from_weight_decay(var_list=[other], var_names=["bias"])
    g = _f32(1.0, 1.0)
    opt.apply([g, g, g], [kernel, bias, other])
    start = np.array([1.0, 2.0])
    np.testing.assert_allclose(kernel.numpy(), start - lr * wd * start - lr * g, rtol=1e-6)
    np.testing.assert_allclose(bias.numpy(), start - lr * g, rtol=1e-6)
    np.testing.assert_allclose(other.numpy(), start - lr * g, rtol=1e-6)
    opt.exclude_from_weight_decay(var_names=["kernel", "other"])  # replaces the first choice
    before = [v.numpy() for v in (kernel, bias, other)]
    opt.apply([g, g, g], [kernel, bias, other])
    np.testing.assert_allclose(kernel.numpy(), before[0] - lr * g, rtol=1e-6)
    np.testing.assert_allclose(bias.numpy(), before[1] - lr * wd * before[1] - lr * g, rtol=1e-6)
    np.testing.assert_allclose(other.numpy(), before[2] - lr * g, rtol=1e-6)
    opt.exclude_from_weight_decay()  # nothing excluded
    before = kernel.numpy()
    opt.apply([g], [kernel])
    np.testing.assert_allclose(kernel.numpy(), before - lr * wd * before - lr * g, rtol=1e-6)
    with pytest.raises(TypeError) as info:
        opt.exclude_from_weight_decay(var_names=["bias", 3])
    assert str(info.value) == "var_names must be strings, got 3"
    with pytest.raises(TypeError, match="var_list"):
        opt.exclude_from_weight_decay(var_list=[3.0])


def test_pairs_and_trees_are_checked_with_messages_that_say_what_to_do():
    w = dps.Variable(_f32(1.0, 2.0))
    opt = dps.optimizers.SGD(1.0)
    with pytest.raises(TypeError, match=r"^apply_gradients takes one argument, a list of \(gradient, variable\) "):
        opt.apply_gradients([_f32(1.0, 1.0)], [w])
    with pytest.raises(TypeError) as info:
        opt.apply_gradients([_f32(1.0, 1.0)])
    assert str(info.value).startswith("grads_and_vars must be (gradient, variable) pairs; item 0 is a ndarray of "
                                      "shape (2,). To pass")
    with pytest.raises(ValueError) as info:
        opt.apply([_f32(1.0, 1.0), _f32(1.0)], [w])
    assert str(info.value) == "grads and trainable_variables must have the same length, got 2 gradients for 1 variables"
    with pytest.raises(TypeError) as info:
        opt.apply({"a": _f32(1.0, 1.0), "b": _f32(1.0)}, {"a": w, "b": 3})
    assert str(info.value) == "trainable_variables at 'b' must be a Variable to take a gradient, got a int"
    with pytest.raises(TypeError) as info:
        opt.apply_gradients([(_f32(1.0, 1.0), np.zeros(2))])
    assert str(info.value) == "gradients must be paired with Variables, got a ndarray of shape (2,)"
    opt.apply({"a": _f32(1.0, 1.0), "act": None}, {"a": w, "act": "relu"})  # leaves without gradients are skipped
    np.testing.assert_array_equal(w.numpy(), [0.0, 1.0])
    assert int(opt.iterations.numpy()) == 1


def test_gradients_of_other_array_types_are_converted():
    jnp = pytest.importorskip("jax.numpy")
    w = dps.Variable(np.zeros((3, 2), np.float32))
    opt = dps.optimizers.SGD(1.0)
    opt.apply([jnp.ones((3, 2), jnp.float32)], [w])
    opt.apply([dps.IndexedSlices(jnp.ones((1, 2), jnp.float32), jnp.array([2]))], [w])
    np.testing.assert_array_equal(w.numpy(), [[-1, -1], [-1, -1], [-2, -2]])


def test_sharded_variables_get_each_shard_its_part():
    full = np.arange(10, dtype=np.float32).reshape(5, 2)
    sv = dps.ShardedVariable(dps.create_partitioned_variables((5, 2), [2, 1], full, name="emb"))
    opt = dps.optimizers.SGD(1.0)
    opt.apply([np.ones((5, 2), np.float32)], [sv])
    np.testing.assert_array_equal(sv.numpy(), full - 1)
    opt.apply([dps.IndexedSlices(np.ones((3, 2), np.float32), np.array([4, 0, 4]))], [sv])
    want = full - 1
    want[0] -= 1
    want[4] -= 2
    np.testing.assert_array_equal(sv.numpy(), want)
    np.testing.assert_array_equal(sv.variables[0].numpy(), want[:3])


def test_an_embedding_table_takes_indexed_slices_only():
    table = dps.EmbeddingTable(2, initializer=lambda shape, dtype: np.zeros(shape, dtype), name="t")
    opt = dps.optimizers.SGD(1.0)
    keys = np.array([7, 100, 7], np.int64)
    np.testing.assert_array_equal(dps.embedding_lookup(table, np.array([7, 100])), np.zeros((2, 2)))  # rows made
    opt.apply([dps.IndexedSlices(np.ones((3, 2), np.float32), keys)], [table])
    np.testing.assert_array_equal(dps.embedding_lookup(table, np.array([7, 100])), [[-2, -2], [-1, -1]])
    with pytest.raises(TypeError) as info:
        opt.apply([np.ones((3, 2), np.float32)], [table])
    assert str(info.value) == ("the gradient for embedding table 't' must be IndexedSlices(values, keys), "
                               "got a ndarray of shape (3, 2)")
    with pytest.raises(ValueError) as info:
        opt.apply([dps.IndexedSlices(np.ones((3, 3), np.float32), keys)], [table])
    assert str(info.value) == "gradient values for embedding table 't' must have shape (3, 2), got (3, 3)"
    np.testing.assert_array_equal(dps.embedding_lookup(table, np.array([7, 100])), [[-2, -2], [-1, -1]])


def test_a_pickled_optimizer_keeps_its_settings_and_its_key():
    import pickle

    w = dps.Variable(_f32(1.0))
    opt = dps.optimizers.SGD(0.5, clipvalue=0.25, name="p")
    copy = pickle.loads(pickle.dumps(opt))
    assert (copy.name, copy.learning_rate, copy.clipvalue, copy.lazy_sparse) == ("p", 0.5, 0.25, True)
    assert copy.server_key == opt.server_key
    copy.apply([_f32(4.0)], [w])  # clipped to 0.25
    np.testing.assert_allclose(w.numpy(), [1.0 - 0.5 * 0.25])


@pytest.mark.parametrize("name", NAMES)
def test_every_hyperparameter_is_named_when_refused(name):
    """A bad value of each of Keras' hyperparameters is refused with a message that starts with its name."""
    for key, default in _shared(name).items():
        if key in ("learning_rate", "clipnorm", "clipvalue", "global_clipnorm"):
            continue
        bad = "yes" if isinstance(default, bool) else 5.0 if key == "learning_rate_power" else -5.0
        with pytest.raises((ValueError, TypeError)) as info:
            getattr(dps.optimizers, name)(**{key: bad})
        assert str(info.value).startswith(f"{key} must be"), (key, str(info.value))


def test_the_few_rules_of_one_optimizer():
    with pytest.raises(ValueError) as info:
        dps.optimizers.AdamW(weight_decay=None)
    assert str(info.value) == "weight_decay must be a non-negative number for AdamW, got None (use Adam for none)"
    assert dps.optimizers.SGD(momentum=1.0).momentum == 1.0
    with pytest.raises(ValueError) as info:
        dps.optimizers.SGD(momentum=1.5)
    assert str(info.value) == "momentum must be in [0, 1], got 1.5"


def test_gradient_refusals_name_the_variable_and_change_nothing():
    import collections

    w, ints = dps.Variable(np.zeros(2, np.float32), name="w"), dps.Variable(np.zeros(2, np.int32), name="iv")
    table = dps.EmbeddingTable(2, initializer=lambda shape, dtype: np.zeros(shape, dtype), name="t")
    opt = dps.optimizers.SGD(1.0)
    pair = collections.namedtuple("Pair", "a b")
    cases = [
        (([np.ones(3, np.float32)], [w]), "gradient for variable 'w' must have shape (2,), got (3,)"),
        (([np.ones(2, np.int32)], [ints]), "optimizer 'SGD' cannot train variable 'iv' of dtype int32: only "
                                           "floating-point variables have gradients (exclude it from the "
                                           "gradients, or make it float)"),
        (({"a": np.ones(2, np.float32)}, {"b": w}),
         "grads must have the structure of trainable_variables: trainable_variables has 'b', which grads lacks"),
        (([None, np.ones(2, np.float32)], [w]),
         "grads and trainable_variables must have the same length, got 2 gradients for 1 variables"),
        ((pair(np.ones(2, np.float32), np.ones(2, np.float32)), [w]),
         "grads must have the structure of trainable_variables: trainable_variables has '0', which grads lacks"),
        (([dps.IndexedSlices(np.ones((2, 1, 2), np.float32), np.array([[1], [2]]))], [table]),
         "gradient keys for embedding table 't' must be 1-D, got shape (2, 1)"),
        (([dps.IndexedSlices(np.array([["a", "b"], ["c", "d"]]), np.array([1, 2]))], [table]),
         "gradient values for variable 't' must be numeric, got dtype <U1 from ndarray"),
    ]
    for (grads, variables), message in cases:
        with pytest.raises((ValueError, TypeError)) as info:
            opt.apply(grads, variables)
        assert str(info.value) == message
    assert int(opt.iterations.numpy()) == 0 and not w.numpy().any()


def test_a_tree_of_gradients_may_hold_indexed_slices_and_tables_among_variables():
    w = dps.Variable(np.zeros((3, 2), np.float32), name="w")
    table = dps.EmbeddingTable(2, initializer=lambda shape, dtype: np.zeros(shape, dtype), name="t")
    dps.embedding_lookup(table, np.array([4]))
    b = dps.Variable(np.zeros(1, np.float32), name="b")
    opt = dps.optimizers.SGD(1.0)
    opt.apply({"w": dps.IndexedSlices(np.ones((1, 2), np.float32), np.array([1])),
               "t": dps.IndexedSlices(np.ones((1, 2), np.float32), np.array([4])), "b": np.ones(1, np.float32)},
              {"w": w, "t": table, "b": b})
    np.testing.assert_array_equal(w.numpy(), [[0, 0], [-1, -1], [0, 0]])
    np.testing.assert_array_equal(dps.embedding_lookup(table, np.array([4])), [[-1, -1]])
    np.testing.assert_array_equal(b.numpy(), [-1])  # the variable after the table was trained too


def test_the_messages_that_say_what_to_do_word_for_word():
    w = dps.Variable(np.zeros(2, np.float32), name="w")
    opt = dps.optimizers.SGD(1.0)
    cases = [
        (lambda: opt.exclude_from_weight_decay(var_list=[3.0]), "var_list must contain Variables or ShardedVariables, "
                                                                "got float"),
        (lambda: opt.build([w, 3.0]), "var_list must contain Variables or ShardedVariables, got float"),
        (lambda: opt.apply_gradients([np.ones(2, np.float32)], [w]),
         "apply_gradients takes one argument, a list of (gradient, variable) pairs; to pass gradients and variables "
         "as two lists, use optimizer.apply(grads, variables)"),
        (lambda: opt.apply_gradients([np.ones(2, np.float32)]),
         "grads_and_vars must be (gradient, variable) pairs; item 0 is a ndarray of shape (2,). To pass gradients "
         "and variables as two lists, use optimizer.apply(grads, variables)"),
    ]
    for call, message in cases:
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == message
