"""JAX, PyTorch and Keras models trained on a real cluster, their parameter trees, and the example scripts.

Each test skips, saying why, when the library it needs is not installed
(``pip install "daskps[jax]"``, ``daskps[torch]``, ``daskps[keras]``).
Keras must run on the JAX backend in this process and in the cluster's
workers: ``KERAS_BACKEND`` is set below, at import (before the shared
cluster starts its worker processes, which inherit it).
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "jax"

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from typing import NamedTuple  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from distributed import get_worker  # noqa: E402

import daskps as dps  # noqa: E402
from tests.helpers.paths import ROOT

EXAMPLES = ROOT / "examples"
STEPS = 150  # training steps in each training test


def report(what: str, before: float, after: float) -> None:
    print(f"{what}: held-out loss {before:.4f} -> {after:.4f} ({after / before:.3f} of it)")


@pytest.fixture
def jax():
    return pytest.importorskip("jax", reason="JAX is not installed (pip install 'daskps[jax]')")


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'daskps[torch]')")


@pytest.fixture
def keras(jax):
    keras = pytest.importorskip("keras", reason="Keras is not installed (pip install 'daskps[keras]')")
    if keras.backend.backend() != "jax":
        pytest.skip(f"Keras runs on the {keras.backend.backend()!r} backend here; these tests need KERAS_BACKEND=jax")
    return keras


class Context(NamedTuple):
    input_pipeline_id: int


def train(coordinator, step, dataset_fn, steps: int) -> None:
    """Schedule ``step(iterator)`` ``steps`` times on a per-worker dataset, and wait."""
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    for _ in range(steps):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()


def held_out(dataset_fn, **kwargs):
    """A batch no trainer sees: pipeline 99's."""
    return next(dataset_fn(Context(99), **kwargs))


def teacher_batches(ctx, batch_size: int = 64, features: int = 8):
    """``(x, y)``: ``y`` from a fixed random tanh network (the same teacher on every trainer)."""
    rng = np.random.default_rng(0)
    w1, w2 = rng.normal(size=(features, 16)), rng.normal(size=16) / 2
    rng = np.random.default_rng([1, ctx.input_pipeline_id])
    while True:
        x = rng.normal(size=(batch_size, features)).astype(np.float32)
        yield x, (np.tanh(x @ w1) @ w2).astype(np.float32)


def init_mlp(sizes: list[int], seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {"layers": [{"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), "b": np.zeros(b, np.float32)}
                       for a, b in zip(sizes[:-1], sizes[1:])]}


# ----------------------------------------------------------------------------------------------- training


def test_jax_mlp_trains(strategy, coordinator, jax):
    jnp = jax.numpy
    with strategy.scope():
        variables = dps.create_variables(init_mlp([8, 32, 1]), name="jax_mlp")
        optimizer = dps.optimizers.Adam(0.02)

    def loss(params, x, y):
        hidden, last = params["layers"]
        h = jnp.tanh(x @ hidden["w"] + hidden["b"])
        return jnp.mean(((h @ last["w"] + last["b"])[:, 0] - y) ** 2)

    loss_and_grads = jax.jit(jax.value_and_grad(loss))

    def step(iterator):
        x, y = next(iterator)
        value, grads = loss_and_grads(dps.read_values(variables), x, y)
        optimizer.apply(grads, variables)
        return float(value)

    x, y = held_out(teacher_batches, batch_size=1000)
    before = float(loss(dps.read_values(variables), x, y))
    train(coordinator, step, teacher_batches, steps=STEPS)
    after = float(loss(dps.read_values(variables), x, y))
    report("jax mlp", before, after)
    assert after < 0.2 * before, (before, after)


def bag_batches(ctx, vocab: int = 200, bag: int = 4, batch_size: int = 32):
    """``(ids, y)``: ``y`` is the mean of a fixed random table's rows ``ids``, times a fixed vector."""
    rng = np.random.default_rng(0)
    table, w = rng.normal(size=(vocab, 4)), rng.normal(size=4)
    rng = np.random.default_rng([2, ctx.input_pipeline_id])
    while True:
        ids = rng.integers(0, vocab, size=(batch_size, bag))
        yield ids, (table[ids].mean(axis=1) @ w).astype(np.float32)


def test_jax_embedding_model_trains_with_row_gradients(strategy, coordinator, jax):
    jnp = jax.numpy
    with strategy.scope():
        table = dps.Variable(np.random.default_rng(3).normal(0, 0.1, size=(200, 4)).astype(np.float32), name="bag_table")
        head = dps.create_variables({"w": np.zeros(4, np.float32), "b": np.zeros((), np.float32)}, name="bag_head")
        optimizer = dps.optimizers.Adam(0.05)

    def loss(rows, head, y):
        return jnp.mean((jnp.mean(rows, axis=1) @ head["w"] + head["b"] - y) ** 2)

    loss_and_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def step(iterator):
        ids, y = next(iterator)
        value, (row_grads, head_grads) = loss_and_grads(dps.embedding_lookup(table, ids), dps.read_values(head), y)
        optimizer.apply({"table": dps.IndexedSlices(row_grads.reshape(-1, 4), ids.reshape(-1)), "head": head_grads},
                        {"table": table, "head": head})
        return float(value)

    ids, y = held_out(bag_batches, batch_size=1000)
    before = float(loss(dps.embedding_lookup(table, ids), dps.read_values(head), y))
    train(coordinator, step, bag_batches, steps=STEPS)
    after = float(loss(dps.embedding_lookup(table, ids), dps.read_values(head), y))
    report("jax embedding", before, after)
    assert after < 0.05 * before, (before, after)


def test_torch_module_trains_with_autograd(strategy, coordinator, torch):
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    with strategy.scope():
        variables = dps.create_variables(net, name="torch_net")
        optimizer = dps.optimizers.Adam(0.02)

    def step(iterator):
        x, y = next(iterator)
        values = dps.read_values(variables)
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(torch.as_tensor(values[name]))
        net.zero_grad()
        loss = torch.mean((net(torch.from_numpy(x))[:, 0] - torch.from_numpy(y)) ** 2)
        loss.backward()
        optimizer.apply({name: p.grad for name, p in net.named_parameters()}, variables)
        return loss.item()

    x, y = (torch.from_numpy(a) for a in held_out(teacher_batches, batch_size=1000))

    def held_out_loss():  # the module as the servers have it, without changing this process's copy
        params = {k: torch.from_numpy(v) for k, v in dps.read_values(variables).items()}
        return torch.mean((torch.func.functional_call(net, params, (x,))[:, 0] - y) ** 2).item()

    before = held_out_loss()
    train(coordinator, step, teacher_batches, steps=STEPS)
    after = held_out_loss()
    report("torch", before, after)
    assert after < 0.2 * before, (before, after)


def test_keras_model_trains_with_stateless_call(strategy, coordinator, keras, jax):
    jnp = jax.numpy
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(1)])
    with strategy.scope():
        variables = dps.create_variables(model, name="keras_model")
        optimizer = dps.optimizers.Adam(0.02)
    paths = list(variables)  # a model unpickled on a trainer may name its variables differently

    def loss(trainable, x, y):
        pred, _ = model.stateless_call(trainable, [], x)
        return jnp.mean((pred[:, 0] - y) ** 2)

    loss_and_grads = jax.jit(jax.value_and_grad(loss))

    def step(iterator):
        x, y = next(iterator)
        values = dps.read_values(variables)
        value, grads = loss_and_grads([values[p] for p in paths], x, y)
        optimizer.apply(dict(zip(paths, grads)), variables)
        return float(value)

    x, y = held_out(teacher_batches, batch_size=1000)
    before = float(loss([dps.read_values(variables)[p] for p in paths], x, y))
    train(coordinator, step, teacher_batches, steps=STEPS)
    after = float(loss([dps.read_values(variables)[p] for p in paths], x, y))
    report("keras", before, after)
    assert after < 0.2 * before, (before, after)


# ----------------------------------------------------------------------------------- gradients as numpy


def _sgd_case(strategy, name: str):
    rng = np.random.default_rng(7)
    params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
    grads = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
    with strategy.scope():
        variables = dps.create_variables(params, name=name)
        optimizer = dps.optimizers.SGD(0.5)
    return params, grads, variables, optimizer


def _assert_one_sgd_step(variables, params, grads, lr=0.5):
    after = dps.read_values(variables)
    for k in params:
        assert type(after[k]) is np.ndarray and after[k].dtype == np.float32, (k, type(after[k]), after[k].dtype)
        np.testing.assert_allclose(after[k], params[k] - np.float32(lr) * grads[k], rtol=1e-6, atol=1e-7)


def test_jax_gradients_land_as_numpy(strategy, coordinator, jax):
    params, grads, variables, optimizer = _sgd_case(strategy, "jax_grads")

    def step():
        jax_grads = {k: jax.numpy.asarray(g) for k, g in grads.items()}
        assert all(isinstance(g, jax.Array) for g in jax_grads.values())
        optimizer.apply(jax_grads, variables)

    coordinator.schedule(step)
    coordinator.join()
    _assert_one_sgd_step(variables, params, grads)


def test_torch_gradients_land_as_numpy(strategy, coordinator, torch):
    params, grads, variables, optimizer = _sgd_case(strategy, "torch_grads")

    def step():
        # One that still requires grad (it must be detached first), one plain.
        optimizer.apply({"w": torch.tensor(grads["w"], requires_grad=True), "b": torch.from_numpy(grads["b"])},
                        variables)

    coordinator.schedule(step)
    coordinator.join()
    _assert_one_sgd_step(variables, params, grads)


def test_torch_indexed_slices_update_only_their_rows(strategy, coordinator, torch):
    table0 = np.random.default_rng(8).normal(size=(10, 3)).astype(np.float32)
    rows, ids = np.ones((3, 3), np.float32), np.array([1, 4, 4])
    with strategy.scope():
        table = dps.Variable(table0, name="torch_rows")
        optimizer = dps.optimizers.SGD(0.5)

    def step():  # values that still require grad, as dense gradients may
        grad = dps.IndexedSlices(torch.tensor(rows, requires_grad=True), torch.from_numpy(ids))
        optimizer.apply([grad], [table])

    coordinator.schedule(step)
    coordinator.join()
    expected = table0.copy()
    expected[1] -= 0.5
    expected[4] -= 1.0  # repeated rows are summed
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)


def test_jax_sparse_step_updates_only_the_looked_up_rows(strategy, coordinator, jax):
    jnp = jax.numpy
    table0 = np.random.default_rng(9).normal(size=(20, 4)).astype(np.float32)
    ids, y = np.array([[3, 7], [7, 11]]), np.array([1.0, -1.0], np.float32)
    with strategy.scope():
        table = dps.Variable(table0, name="jax_rows")
        optimizer = dps.optimizers.SGD(0.5)

    loss_and_grads = jax.jit(jax.value_and_grad(lambda rows, y: jnp.sum((rows.sum(axis=(1, 2)) - y) ** 2)))

    def step():
        _, row_grads = loss_and_grads(dps.embedding_lookup(table, ids), y)
        optimizer.apply([dps.IndexedSlices(row_grads.reshape(-1, 4), ids.reshape(-1))], [table])

    coordinator.schedule(step)
    coordinator.join()
    after = table.numpy()
    untouched = np.setdiff1d(np.arange(20), ids)
    np.testing.assert_array_equal(after[untouched], table0[untouched])  # not one bit changed
    # numpy's own gradient: d/d rows of sum((sum of a bag's rows - y)^2) is 2 (sum - y) on every element of the bag
    grad_per_bag = 2 * (table0[ids].sum(axis=(1, 2)) - y)
    expected = table0.copy()
    np.add.at(expected, ids.reshape(-1), -0.5 * np.repeat(grad_per_bag, 2)[:, None] * np.ones(4, np.float32))
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(after[[3, 7, 11]], table0[[3, 7, 11]])


# ------------------------------------------------------------------------------------- compiled once


def _note_trace() -> None:
    worker = get_worker()
    worker.daskps_test_traces = getattr(worker, "daskps_test_traces", 0) + 1


def _traces(dask_worker) -> int:
    return dask_worker.__dict__.pop("daskps_test_traces", 0)


def test_a_jitted_step_scheduled_200_times_compiles_once_or_twice_per_trainer(client, strategy, coordinator, jax):
    jnp = jax.numpy
    client.run(_traces)  # start from zero
    with strategy.scope():
        w = dps.Variable(np.zeros(4, np.float32), name="jitted_w")
        optimizer = dps.optimizers.SGD(0.1)

    def loss(w, x):
        _note_trace()  # Python code in a jitted function runs only while JAX traces it: once per compilation
        return jnp.sum((w - x) ** 2)

    grad = jax.jit(jax.grad(loss))

    def step():
        optimizer.apply([grad(w.numpy(), np.ones(4, np.float32))], [w])

    for _ in range(200):
        coordinator.schedule(step)
    coordinator.join()
    traces = {addr: n for addr, n in client.run(_traces).items() if n}
    print("traces per trainer:", traces)
    assert traces, "the jitted function never ran on a trainer"
    assert all(n <= 2 for n in traces.values()), traces  # unpickled per call, it would trace 200 times
    np.testing.assert_allclose(w.numpy(), np.ones(4), atol=1e-4)  # the 200 steps ran


# -------------------------------------------------------------------------------- parameter trees


def test_torch_module_round_trip(strategy, torch):
    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2).double())
    net[0].bias.requires_grad_(False)  # frozen parameters are parameters too; buffers are not
    with strategy.scope():
        variables = dps.create_variables(net, name="net")
    named = dict(net.named_parameters())
    assert list(variables) == list(named) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    values = dps.read_values(variables)
    for key, p in named.items():
        v = variables[key]
        assert v.name == f"net/{key}" and v.shape == tuple(p.shape), (v.name, v.shape)
        assert v.dtype == p.detach().numpy().dtype and values[key].dtype == v.dtype, (key, v.dtype)
        np.testing.assert_array_equal(values[key], p.detach().numpy())
    assert values["2.weight"].dtype == np.float64


def test_keras_model_round_trip(strategy, keras):
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2, dtype="float16")])
    with strategy.scope():
        variables = dps.create_variables(model, name="model")
    trainable = model.trainable_variables
    assert list(variables) == [v.path for v in trainable]  # trainable_variables order; no moving mean or variance
    assert not any("moving" in k for k in variables) and len(variables) == 6
    values = dps.read_values(variables)
    for v in trainable:
        var = variables[v.path]
        assert var.name == f"model/{v.path}" and var.shape == tuple(v.shape), (var.name, var.shape)
        assert var.dtype == np.dtype(v.dtype) and values[v.path].dtype == var.dtype, (v.path, var.dtype)
        np.testing.assert_array_equal(values[v.path], v.numpy())
    assert values[trainable[-1].path].dtype == np.float16


def test_jax_custom_pytree_round_trip(strategy, jax):
    @jax.tree_util.register_pytree_node_class
    class Dense:
        def __init__(self, kernel, bias, activation="tanh"):
            self.kernel, self.bias, self.activation = kernel, bias, activation

        def tree_flatten(self):
            return (self.kernel, self.bias), self.activation

        @classmethod
        def tree_unflatten(cls, activation, children):
            return cls(*children, activation=activation)

    rng = np.random.default_rng(4)
    layer = Dense(jax.numpy.asarray(rng.normal(size=(3, 2)).astype(np.float32)), np.arange(2, dtype=np.int64), "relu")
    with strategy.scope():
        variables = dps.create_variables({"dense": layer}, name="pytree")
    made = variables["dense"]
    assert type(made) is Dense and made.activation == "relu"
    assert isinstance(made.kernel, dps.Variable) and made.kernel.name == "pytree/dense/0"
    assert made.bias.name == "pytree/dense/1" and made.bias.dtype == np.int64
    values = dps.read_values(variables)["dense"]
    assert type(values) is Dense and values.activation == "relu"
    np.testing.assert_array_equal(values.kernel, np.asarray(layer.kernel))
    np.testing.assert_array_equal(values.bias, layer.bias)


def test_a_sharded_variable_leaf_round_trip(client):
    table = np.arange(30, dtype=np.float32).reshape(10, 3)
    strategy = dps.ParameterServerStrategy(client, variable_partitioner=dps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        variables = dps.create_variables({"table": table, "scale": np.float32(2.0)}, name="sharded")
    assert isinstance(variables["table"], dps.ShardedVariable) and len(variables["table"].variables) == 2
    assert isinstance(variables["scale"], dps.Variable)  # a scalar is never split
    values = dps.read_values(variables)
    np.testing.assert_array_equal(values["table"], table)
    assert values["scale"] == 2.0


# -------------------------------------------------------------------------------------------- examples


def _epoch_losses(output: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for what, loss in re.findall(r"^(\w+) epoch \d+: mean loss ([\d.]+)$", output, flags=re.M):
        found.setdefault(what, []).append(float(loss))
    return found


@pytest.mark.parametrize("script, needs, models", [
    ("train_jax.py", ("jax",), ("mlp", "embedding")),
    ("train_torch.py", ("torch",), ("torch",)),
    ("train_keras.py", ("jax", "keras"), ("keras",)),
])
def test_example_runs_and_its_loss_falls(cluster, script, needs, models):
    for module in needs:
        pytest.importorskip(module, reason=f"{module} is not installed (pip install 'daskps[{needs[-1]}]')")
    # On the shared cluster (--scheduler): starting one per script would take most of this file's time.
    cmd = [sys.executable, str(EXAMPLES / script), "--epochs", "3", "--steps", "40", "--lr", "0.02", "--scheduler",
           cluster.scheduler_address]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    losses = _epoch_losses(out.stdout)
    print(script, losses)
    assert set(losses) == set(models), out.stdout
    for what, values in losses.items():
        assert len(values) == 3 and values == sorted(values, reverse=True), (what, values)  # falls every epoch
        assert values[-1] < 0.6 * values[0], (what, values)
