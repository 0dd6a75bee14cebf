"""Parameter trees: create_variables, read_values and optimizer.apply keep a model's structure."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

import daskps as dps

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
