"""A JAX model trained on parameter servers: a dense MLP, then a sparse embedding model.

Part 1, dense: an MLP's parameters (a pytree of dicts and lists) become
variables with ``dps.create_variables``; each step reads them all with
``dps.read_values`` (one round trip per server), computes the loss and
gradients with a jitted ``jax.value_and_grad`` and pushes the gradient tree
with ``optimizer.apply``. The target is a hidden "teacher" network.

Part 2, sparse: a bag-of-ids regression model. Each step looks up only the
rows it needs with ``dps.embedding_lookup`` (on the servers), takes the
gradient with respect to those rows with JAX, and pushes them back as
``dps.IndexedSlices(row_grads, ids)``: only the touched rows, and their Adam
slots, change.

The jitted functions are captured by the step functions: each trainer
unpickles a scheduled function once and keeps it, so each compiles once per
trainer, not once per step.

    python examples/train_jax.py                  # ~20 s on 2 cores
    python examples/train_jax.py --epochs 2 --steps 50
    python examples/train_jax.py --scheduler tcp://host:8786   # an existing cluster

Needs ``pip install ".[jax]"`` in the daskps checkout.
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import daskps as dps

NUM_FEATURES, HIDDEN = 8, 32
VOCAB, BAG, DIM = 1000, 5, 8


# ------------------------------------------------------------------------------------------ dense: an MLP


def init_mlp(seed: int, sizes: list[int], scale: float = 1.0) -> dict:
    """``{"layers": [{"w": ..., "b": ...}, ...]}`` of numpy arrays."""
    rng = np.random.default_rng(seed)
    return {"layers": [{"w": (rng.normal(size=(a, b)) * scale / np.sqrt(a)).astype(np.float32),
                        "b": np.zeros(b, np.float32)} for a, b in zip(sizes[:-1], sizes[1:])]}


def mlp(params: dict, x):
    """The MLP's output: tanh hidden layers, a linear last one."""
    *hidden, last = params["layers"]
    for layer in hidden:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return (x @ last["w"] + last["b"])[:, 0]


def mse(params: dict, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)


def mlp_batches(worker: int, batch_size: int):
    """An endless stream of ``(x, y)`` batches labelled by the teacher network."""
    teacher = init_mlp(0, [NUM_FEATURES, 16, 1], scale=2.0)
    rng = np.random.default_rng([1, worker])
    while True:
        x = rng.normal(size=(batch_size, NUM_FEATURES)).astype(np.float32)
        yield x, np.asarray(mlp(teacher, x))


def train_mlp(strategy, coordinator, args) -> list[float]:
    with strategy.scope():
        variables = dps.create_variables(init_mlp(1, [NUM_FEATURES, HIDDEN, 1]), name="mlp")
        optimizer = dps.optimizers.Adam(args.lr)
    print("mlp/layers/0/w on", variables["layers"][0]["w"].device)

    loss_and_grads = jax.jit(jax.value_and_grad(mse))  # compiled once per trainer, then kept

    def train_step(iterator):
        x, y = next(iterator)
        params = dps.read_values(variables)  # the whole tree, one round trip per server
        loss, grads = loss_and_grads(params, x, y)
        optimizer.apply(grads, variables)  # JAX arrays in, numpy on the servers
        return float(loss)

    dataset = coordinator.create_per_worker_dataset(lambda ctx: mlp_batches(ctx.input_pipeline_id, args.batch_size))
    return run_epochs("mlp", coordinator, train_step, iter(dataset), args)


# ------------------------------------------------------------------------------- sparse: an embedding model


def bag_model(rows, head):
    """Prediction from the looked-up rows ``(batch, BAG, DIM)``: the bag's mean row, times ``head["w"]``."""
    return jnp.mean(rows, axis=1) @ head["w"] + head["b"]


def bag_loss(rows, head, y):
    return jnp.mean((bag_model(rows, head) - y) ** 2)


def bag_batches(worker: int, batch_size: int):
    """``(ids, y)``: bags of ids and the teacher's prediction for them."""
    teacher_rng = np.random.default_rng(0)
    table, w = teacher_rng.normal(size=(VOCAB, DIM)), teacher_rng.normal(size=DIM)
    rng = np.random.default_rng([2, worker])
    while True:
        ids = rng.integers(0, VOCAB, size=(batch_size, BAG))
        yield ids, (table[ids].mean(axis=1) @ w).astype(np.float32)


def train_embedding(strategy, coordinator, args) -> list[float]:
    rng = np.random.default_rng(3)
    with strategy.scope():
        table = dps.Variable(rng.normal(0, 0.1, size=(VOCAB, DIM)).astype(np.float32), name="table")
        head = dps.create_variables({"w": np.zeros(DIM, np.float32), "b": np.zeros((), np.float32)}, name="head")
        optimizer = dps.optimizers.Adam(args.lr * 5)  # lazy: only the looked-up rows and their slots change

    loss_and_grads = jax.jit(jax.value_and_grad(bag_loss, argnums=(0, 1)))

    def train_step(iterator):
        ids, y = next(iterator)
        rows = dps.embedding_lookup(table, ids)  # (batch, BAG, DIM): only these rows travel
        loss, (row_grads, head_grads) = loss_and_grads(rows, dps.read_values(head), y)
        optimizer.apply({"table": dps.IndexedSlices(row_grads.reshape(-1, DIM), ids.reshape(-1)), "head": head_grads},
                        {"table": table, "head": head})
        return float(loss)

    dataset = coordinator.create_per_worker_dataset(lambda ctx: bag_batches(ctx.input_pipeline_id, args.batch_size))
    return run_epochs("embedding", coordinator, train_step, iter(dataset), args)


# ------------------------------------------------------------------------------------------------ driver


def run_epochs(what: str, coordinator, train_step, iterator, args) -> list[float]:
    """Schedule ``args.steps`` steps per epoch; print and return each epoch's mean loss."""
    means = []
    for epoch in range(args.epochs):
        losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(args.steps)]
        coordinator.join()
        means.append(float(np.mean(coordinator.fetch(losses))))
        print(f"{what} epoch {epoch}: mean loss {means[-1]:.4f}", flush=True)
    return means


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate (x5 for the embedding model)")
    parser.add_argument("--scheduler", help="address of a running daskps cluster (default: start a local one)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    local = contextlib.nullcontext() if args.scheduler else dps.LocalPSCluster(num_ps=2, num_workers=2)
    with local as cluster, dps.ParameterServerStrategy(args.scheduler or cluster.get_client()) as strategy:
        coordinator = dps.ClusterCoordinator(strategy)
        for what, train in (("mlp", train_mlp), ("embedding", train_embedding)):
            means = train(strategy, coordinator, args)
            print(f"{what}: mean loss {means[0]:.4f} in the first epoch, {means[-1]:.4f} in the last", flush=True)


if __name__ == "__main__":
    main()
