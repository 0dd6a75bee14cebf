"""Parameter trees: create_variables, read_values and optimizer.apply keep a model's structure."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

import daskps as dps
from tests.helpers.variables import sharded

Pair = collections.namedtuple("Pair", "w b")


@dataclasses.dataclass(frozen=True)
class Layer:
    kernel: np.ndarray
    bias: np.ndarray
    activation: str = "relu"


def _tree():
    rng = np.random.default_rng(0)
    return {
        "dense": {"kernel": rng.normal(size=(3, 2)).astype(np.float32), "bias": np.zeros(2, np.float32)},
        "layers": [rng.normal(size=4), (np.arange(3, dtype=np.int64), None)],
        "pair": Pair(np.float32(1.5), rng.normal(size=(2, 2)).astype(np.float32)),
        "layer": Layer(rng.normal(size=(2, 3)).astype(np.float32), np.ones(3, np.float32)),
    }


EXPECTED_NAMES = {
    "mlp/dense/kernel", "mlp/dense/bias", "mlp/layers/0", "mlp/layers/1/0",
    "mlp/pair/w", "mlp/pair/b", "mlp/layer/kernel", "mlp/layer/bias",
}


def _variables(tree):
    out = []

    def walk(x):
        if isinstance(x, (dps.Variable, dps.ShardedVariable)):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))

    walk(tree)
    return out


def test_every_structure_round_trips_with_names_shapes_dtypes_and_values(strategy):
    tree = _tree()
    with strategy.scope():
        variables = dps.create_variables(tree, name="mlp")
    made = _variables(variables)
    assert {v.name for v in made} == EXPECTED_NAMES
    assert {v.device.split("/")[3] for v in made} == {"task:0", "task:1"} and all("job:ps" in v.device for v in made)  # on the servers, round robin
    assert isinstance(variables["pair"], Pair) and isinstance(variables["layer"], Layer)
    assert variables["layer"].activation == "relu" and variables["layers"][1][1] is None
    values = dps.read_values(variables)
    assert isinstance(values["layers"], list) and isinstance(values["layers"][1], tuple)
    assert isinstance(values["pair"], Pair) and isinstance(values["layer"], Layer)
    assert values["layer"].activation == "relu" and values["layers"][1][1] is None
    for got, want in [
        (values["dense"]["kernel"], tree["dense"]["kernel"]), (values["dense"]["bias"], tree["dense"]["bias"]),
        (values["layers"][0], tree["layers"][0]), (values["layers"][1][0], tree["layers"][1][0]),
        (values["pair"].w, tree["pair"].w), (values["pair"].b, tree["pair"].b),
        (values["layer"].kernel, tree["layer"].kernel), (values["layer"].bias, tree["layer"].bias),
    ]:
        assert isinstance(got, np.ndarray)
        assert got.dtype == np.asarray(want).dtype and got.shape == np.shape(want)
        np.testing.assert_array_equal(got, want)


def test_names_without_a_prefix_are_the_paths(strategy):
    with strategy.scope():
        variables = dps.create_variables({"dense": {"kernel": np.ones((2, 2))}, "out": [np.ones(1)]})
    assert variables["dense"]["kernel"].name == "dense/kernel"
    assert variables["out"][0].name == "out/0"


def test_a_partitioned_leaf_becomes_a_sharded_variable(client):
    strategy = dps.ParameterServerStrategy(client, variable_partitioner=dps.partitioners.FixedShardsPartitioner(2))
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    with strategy.scope():
        variables = dps.create_variables({"table": table, "bias": np.ones(3, np.float32)}, name="m")
    assert isinstance(variables["table"], dps.ShardedVariable)
    assert [s.name for s in variables["table"].variables] == ["m/table/part_0", "m/table/part_1"]
    np.testing.assert_array_equal(dps.read_values(variables)["table"], table)


def test_a_gradient_tree_is_applied_leaf_by_leaf(strategy):
    tree = _tree()
    with strategy.scope():
        variables = dps.create_variables(
            {"dense": tree["dense"], "pair": tree["pair"], "layer": tree["layer"]}, name="m")
        opt = dps.optimizers.SGD(0.5)
    rng = np.random.default_rng(1)
    grads = {
        "dense": {"bias": rng.normal(size=2).astype(np.float32), "kernel": None},  # keys in another order
        "pair": Pair(np.float32(2.0), rng.normal(size=(2, 2)).astype(np.float32)),
        "layer": Layer(rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=3).astype(np.float32)),
    }
    opt.apply(grads, variables)
    got = dps.read_values(variables)
    np.testing.assert_array_equal(got["dense"]["kernel"], tree["dense"]["kernel"])  # None: skipped
    for have, start, g in [
        (got["dense"]["bias"], tree["dense"]["bias"], grads["dense"]["bias"]),
        (got["pair"].w, tree["pair"].w, grads["pair"].w), (got["pair"].b, tree["pair"].b, grads["pair"].b),
        (got["layer"].kernel, tree["layer"].kernel, grads["layer"].kernel),
        (got["layer"].bias, tree["layer"].bias, grads["layer"].bias),
    ]:
        np.testing.assert_allclose(have, start - np.float32(0.5) * g, rtol=1e-6)
    assert int(opt.iterations.numpy()) == 1


def test_sparse_gradients_in_a_tree(strategy):
    table = np.ones((5, 2), np.float32)
    with strategy.scope():
        variables = dps.create_variables({"emb": table, "w": np.ones(2, np.float32)})
        opt = dps.optimizers.SGD(1.0)
    opt.apply({"emb": dps.IndexedSlices(np.full((2, 2), 0.5, np.float32), np.array([1, 3])), "w": None}, variables)
    want = table.copy()
    want[[1, 3]] -= 0.5
    np.testing.assert_array_equal(variables["emb"].numpy(), want)


def test_a_structure_mismatch_names_the_first_differing_path_and_changes_nothing(strategy):
    with strategy.scope():
        variables = dps.create_variables({"a": np.ones(2, np.float32), "b": [np.ones(3, np.float32)]}, name="m")
        opt = dps.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="trainable_variables has 'b/0', which grads lacks"):
        opt.apply({"a": np.ones(2, np.float32), "b": []}, variables)
    with pytest.raises(ValueError, match="grads has 'c', which trainable_variables lacks"):
        opt.apply({"a": np.ones(2, np.float32), "b": [np.ones(3, np.float32)], "c": np.ones(1)}, variables)
    with pytest.raises(ValueError, match="gradient for variable 'm/b/0' must have shape"):
        opt.apply({"a": np.ones(2, np.float32), "b": [np.ones(4, np.float32)]}, variables)  # checked before any push
    values = dps.read_values(variables)
    np.testing.assert_array_equal(values["a"], np.ones(2))
    np.testing.assert_array_equal(values["b"][0], np.ones(3))
    assert int(opt.iterations.numpy()) == 0


def test_flat_lists_keep_the_length_message(strategy):
    with strategy.scope():
        a, b = dps.Variable(1.0), dps.Variable(2.0)
        opt = dps.optimizers.SGD(0.1)
    with pytest.raises(ValueError, match="same length, got 1 gradients for 2 variables"):
        opt.apply([np.float32(1.0)], [a, b])


def test_read_values_still_refuses_arrays_that_are_not_variables(strategy):
    with strategy.scope():
        variables = dps.create_variables({"a": np.ones(2)})
    variables["b"] = np.ones(2)
    with pytest.raises(TypeError, match="variables at 'b'"):
        dps.read_values(variables)


def test_create_variables_names_a_bad_name():
    with pytest.raises(TypeError, match="name must be a string"):
        dps.create_variables({"a": np.ones(1)}, name=3)


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
