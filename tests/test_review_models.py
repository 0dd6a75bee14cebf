"""Hostile review of parameter trees, the trainer-side function cache and the Keras-3 optimizers.

References are numpy, written from Keras 3's published update rules, not from daskps.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pickle

import numpy as np
import pytest

import daskps as dps
from tests.helpers.variables import sharded

NT = collections.namedtuple("NT", "kernel bias")


@dataclasses.dataclass
class Block:
    layers: list
    activation: str = "relu"


def f32(*a):
    return np.asarray(a, np.float32)


# -- trees ---------------------------------------------------------------------
def test_odd_structures_round_trip_on_the_servers(strategy):
    x = f32(1, 2)
    tree = {
        "empty": {}, "nested": [[], [[]]], "one": (x,), 3: x * 3, 0: x * 0,
        "od": collections.OrderedDict(b=x, a=x * 2),
        "dc": Block([NT(x, np.float32(5))]), "none": None, "scalar": np.zeros((), np.float16),
        "ints": np.arange(3), "same": [x, x],
    }
    with strategy.scope():
        vs = dps.create_variables(tree, name="m")
    assert vs["empty"] == {} and vs["nested"] == [[], [[]]] and vs["none"] is None
    assert isinstance(vs["one"], tuple) and len(vs["one"]) == 1
    assert type(vs["od"]) is collections.OrderedDict and list(vs["od"]) == ["b", "a"]
    assert vs["dc"].activation == "relu" and isinstance(vs["dc"].layers[0], NT)
    assert vs[3].name == "m/3" and vs["dc"].layers[0].bias.name == "m/dc/layers/0/bias"
    assert vs["scalar"].dtype == np.float16 and vs["scalar"].shape == ()
    assert vs["same"][0] is not vs["same"][1]  # the same array twice: two variables
    vs["same"][0].assign_add(f32(1, 1))
    values = dps.read_values(vs)
    np.testing.assert_array_equal(values["same"][1], x)
    np.testing.assert_array_equal(values["same"][0], x + 1)
    assert values["dc"].layers[0].bias == 5 and values["ints"].dtype == np.arange(3).dtype
    np.testing.assert_array_equal(values[3], x * 3)


def test_read_values_of_row_reads_inside_a_tree(strategy):
    table = sharded(strategy, np.arange(12, dtype=np.float32).reshape(6, 2), [3, 3], name="rv_table")
    with strategy.scope():
        w = dps.Variable(f32(1, 2), name="rv_w")
    got = dps.read_values({"emb": (table, np.array([[5, 0], [2, 3]])), "w": [w], "act": "relu"})
    np.testing.assert_array_equal(got["emb"], np.arange(12, dtype=np.float32).reshape(6, 2)[[[5, 0], [2, 3]]])
    np.testing.assert_array_equal(got["w"][0], [1, 2])
    assert got["act"] == "relu"


Dense = collections.namedtuple("Dense", "kernel activation")


@pytest.mark.parametrize("other", ["relu", 1])
def test_read_values_of_a_namedtuple_of_a_variable_and_a_non_array(strategy, other):
    """A (table, ids) pair is a plain tuple; a namedtuple of two fields is part of the tree (it was read
    as rows ``other`` of the kernel, or refused as ids of strings)."""
    with strategy.scope():
        vs = dps.create_variables({"layer": Dense(np.arange(8, dtype=np.float32).reshape(4, 2), other)}, name="nt")
    got = dps.read_values(vs)["layer"]
    assert isinstance(got, Dense) and got.activation == other
    np.testing.assert_array_equal(got.kernel, np.arange(8).reshape(4, 2))


def test_read_values_of_a_plain_tuple_of_a_variable_and_a_name(strategy):
    with strategy.scope():
        vs = dps.create_variables([(np.ones(2, np.float32), "relu")], name="pt")
    got = dps.read_values(vs)
    assert got[0][1] == "relu"
    np.testing.assert_array_equal(got[0][0], [1, 1])


def state(strategy, opt, vs):
    return dps.read_values(vs), int(opt.iterations.numpy())


@pytest.mark.parametrize("grads, match", [
    ({"w": f32(1, 1), "c": f32(1, 1, 1)}, "'b'"),                   # same number of leaves, other path
    ({"w": f32(1, 1), "b": None, "z": {"q": None}}, "'z/q'"),       # an extra subtree of None
    ({"w": f32(1, 1), "b": f32(1, 1)}, "variable 'rs/b'"),           # a bad shape on the second leaf
    ({"w": "oops", "b": None}, "variable 'rs/w'"),                  # a string gradient
    ({"w": f32(1, 1), "b": np.full(3, np.nan, np.float32).astype(object)}, "rs/b"),  # object dtype
])
def test_refused_trees_name_the_path_and_change_nothing(strategy, grads, match):
    with strategy.scope():
        vs = dps.create_variables({"w": f32(1, 1), "b": f32(0, 0, 0)}, name="rs")
        opt = dps.optimizers.Adam(0.1)
    opt.apply({"w": f32(1, 1), "b": f32(1, 1, 1)}, vs)  # slots and a count exist
    before = state(strategy, opt, vs)
    with pytest.raises((ValueError, TypeError), match=match):
        opt.apply(grads, vs)
    after = state(strategy, opt, vs)
    assert after[1] == before[1]
    for k in ("w", "b"):
        np.testing.assert_array_equal(after[0][k], before[0][k])
    opt.apply({"w": f32(1, 1), "b": f32(1, 1, 1)}, vs)  # the next step is still the second Adam step
    m = 0.1 * 1 + 0.9 * (0.1 * 1)
    v = 0.001 * 1 + 0.999 * (0.001 * 1)
    alpha = 0.1 * np.sqrt(1 - 0.999**2) / (1 - 0.9**2)
    want_w = 1 - 0.1 * np.sqrt(1 - 0.999) / (1 - 0.9) * 0.1 / (np.sqrt(0.001) + 1e-7) - alpha * m / (np.sqrt(v) + 1e-7)
    np.testing.assert_allclose(dps.read_values(vs)["w"], [want_w, want_w], rtol=1e-5)


@pytest.mark.parametrize("bad", [
    lambda: dps.IndexedSlices(np.ones((1, 2), np.float32), [6]),        # a row past the end
    lambda: dps.IndexedSlices(np.ones((1, 2), np.float32), [-1]),       # negative
    lambda: dps.IndexedSlices(np.ones((1, 3), np.float32), [0]),        # rows of the wrong width
    lambda: np.ones((5, 2), np.float32),                                # dense, wrong shape
])
def test_a_bad_gradient_on_a_sharded_leaf_changes_no_server(strategy, bad):
    table = sharded(strategy, np.zeros((6, 2), np.float32), [3, 3], name="bad_table")
    with strategy.scope():
        w = dps.Variable(f32(1, 1), name="bad_w")
        opt = dps.optimizers.Lion(0.1)
    vs = {"w": w, "emb": table}
    opt.apply({"w": f32(1, 1), "emb": dps.IndexedSlices(np.ones((2, 2), np.float32), [0, 5])}, vs)
    before = state(strategy, opt, vs)
    with pytest.raises((ValueError, IndexError, TypeError), match="bad_table"):
        opt.apply({"w": f32(1, 1), "emb": bad()}, vs)
    after = state(strategy, opt, vs)
    assert after[1] == before[1]
    np.testing.assert_array_equal(after[0]["w"], before[0]["w"])
    np.testing.assert_array_equal(after[0]["emb"], before[0]["emb"])
    # the slots too: the next step is Lion's second, m = 0.1 * g after the first
    opt.apply({"w": f32(-1, -1), "emb": dps.IndexedSlices(np.full((1, 2), -1, np.float32), [5])}, vs)
    want = before[0]["emb"].copy()
    want[5] -= 0.1 * np.sign(0.9 * 0.01 * 1 + 0.1 * -1)  # m after step 1 is (1 - 0.99) * 1
    np.testing.assert_allclose(table.numpy(), want, rtol=1e-6, atol=1e-7)


def test_a_variables_tree_with_an_array_where_a_variable_should_be_names_the_path(strategy):
    with strategy.scope():
        w = dps.Variable(f32(1, 1), name="np_w")
        opt = dps.optimizers.SGD(0.1)
    with pytest.raises(TypeError, match="'layer/b'"):
        opt.apply({"w": f32(1, 1), "layer": {"b": f32(1, 1)}}, {"w": w, "layer": {"b": f32(0, 0)}})
    assert int(opt.iterations.numpy()) == 0
    np.testing.assert_array_equal(w.numpy(), [1, 1])


def test_colliding_joined_paths_make_two_variables_of_one_name(strategy, tmp_path):
    """{"a/b": x, "a": {"b": y}}: both join to "a/b"; the variables stay distinct, and a
    gradient tree still reaches each by its path (paths are tuples, not the joined names)."""
    with strategy.scope():
        vs = dps.create_variables({"a/b": f32(0), "a": {"b": f32(0)}}, name="col")
        opt = dps.optimizers.SGD(1.0)
    assert vs["a/b"].name == vs["a"]["b"].name == "col/a/b"
    opt.apply({"a/b": f32(1), "a": {"b": f32(2)}}, vs)
    got = dps.read_values(vs)
    np.testing.assert_array_equal(got["a/b"], [-1])
    np.testing.assert_array_equal(got["a"]["b"], [-2])
    ckpt = dps.Checkpoint(model=vs)  # keyed by the objects' paths, not the names: no clash
    path = ckpt.save(str(tmp_path / "ck"))
    vs["a/b"].assign(f32(7))
    vs["a"]["b"].assign(f32(8))
    ckpt.restore(path)
    got = dps.read_values(vs)
    assert (float(got["a/b"][0]), float(got["a"]["b"][0])) == (-1.0, -2.0)


def test_gradient_on_a_sharded_leaf_of_a_tree_in_a_scheduled_function(strategy, coordinator):
    table = sharded(strategy, np.zeros((4, 2), np.float32), [2, 2], name="tree_table")
    with strategy.scope():
        opt = dps.optimizers.SGD(1.0)
    vs = {"emb": table, "act": "relu", "nothing": None}

    def step():
        opt.apply({"emb": dps.IndexedSlices(np.ones((2, 2), np.float32), [0, 3]), "act": "relu", "nothing": None}, vs)
        return int(opt.iterations.numpy())

    assert coordinator.fetch(coordinator.schedule(step)) == 1
    np.testing.assert_array_equal(table.numpy(), [[-1, -1], [0, 0], [0, 0], [-1, -1]])


# -- function cache --------------------------------------------------------------
def _make_step(value, log):
    def step():
        log.append(value)
        return value, len(log)
    return step


def test_identical_code_with_other_captured_values_is_not_confused(coordinator):
    steps = [_make_step(v, []) for v in range(5)]
    got = coordinator.fetch([coordinator.schedule(s) for s in steps * 4])
    assert [v for v, _ in got] == list(range(5)) * 4


def test_more_functions_than_the_cache_holds_all_run_right(coordinator):
    steps = [_make_step(f"f{v}", []) for v in range(80)]  # > 64
    got = coordinator.fetch([coordinator.schedule(s) for s in steps + steps[::-1]])
    assert [v for v, _ in got] == [f"f{v}" for v in range(80)] + [f"f{v}" for v in reversed(range(80))]


class _FailsOnWorker:
    def __reduce__(self):
        return (_boom, ())


def _boom():
    raise RuntimeError("cannot rebuild this on a trainer")


def _cached_functions() -> list[int]:
    """The keys of this process's function cache (run on each worker with ``client.run``), hashed."""
    from daskps.trainer import batches

    return sorted(hash(key) for key in list(batches._functions()._functions))


def test_a_function_that_fails_to_unpickle_on_the_trainer_reports_and_is_not_kept(client, coordinator):
    bad = _FailsOnWorker()

    def step():
        return bad

    before = client.run(_cached_functions)
    coordinator.schedule(step)
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        coordinator.join()
    assert client.run(_cached_functions) == before  # no trainer's cache gained (or lost) an entry for it
    coordinator.schedule(step)  # fails again (not a cached broken function), then the coordinator works on
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        coordinator.join()
    assert coordinator.fetch(coordinator.schedule(_make_step(7, []))) == (7, 1)


def test_a_function_rescheduled_after_its_variable_was_dropped_and_recreated(strategy, coordinator):
    """The function keeps what it captured at its first schedule (documented): it updates the
    variable it was pickled with, which stays alive for it; a new function sees the new one."""
    with strategy.scope():
        box = {"v": dps.Variable(0.0, name="dropped")}
    old = box["v"]

    def step():
        box["v"].assign_add(1.0)

    coordinator.fetch(coordinator.schedule(step))
    with strategy.scope():
        box["v"] = dps.Variable(100.0, name="dropped")
    coordinator.schedule(step)
    coordinator.join()
    assert float(old.numpy()) == 2.0 and float(box["v"].numpy()) == 100.0

    def step2():
        box["v"].assign_add(1.0)

    coordinator.schedule(step2)
    coordinator.join()
    assert float(box["v"].numpy()) == 101.0


def test_captured_state_mutated_by_a_step_stays_on_each_trainer(coordinator):
    log: list[int] = []
    step = _make_step(1, log)
    got = coordinator.fetch([coordinator.schedule(step) for _ in range(40)])
    assert log == []  # the coordinator's copy is untouched
    assert max(n for _, n in got) > 1  # warm: the list grew on some trainer


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
