"""A Keras 3 model (JAX backend) trained on parameter servers.

``dps.create_variables(model, name="model")`` makes one variable per
trainable variable of the model, a dict keyed by ``variable.path``
(``sequential/dense/kernel``, ...). Each step reads them all (one round
trip per server), runs ``model.stateless_call`` inside a jitted
``jax.value_and_grad`` and pushes the gradients, keyed by the same paths,
with ``optimizer.apply``. The model and the jitted function are captured by
the step function: each trainer unpickles them once and keeps them.

Keras picks its backend when it is first imported, in this process and in
every worker process: ``KERAS_BACKEND=jax`` is set below before anything
imports Keras and before the cluster's workers start (they inherit it). With
``--scheduler``, start the cluster's workers with ``KERAS_BACKEND=jax`` set.

    python examples/train_keras.py                  # ~20 s on 2 cores
    python examples/train_keras.py --epochs 2 --steps 50
    python examples/train_keras.py --scheduler tcp://host:8786   # an existing cluster

Needs ``pip install ".[keras]"`` in the daskps checkout.
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "jax"

import argparse  # noqa: E402
import contextlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskps as dps  # noqa: E402

NUM_FEATURES, HIDDEN = 8, 32


def make_model(hidden: int = HIDDEN, seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((NUM_FEATURES,)), keras.layers.Dense(hidden, activation="tanh"),
                             keras.layers.Dense(1)])


def batches(worker: int, batch_size: int):
    """An endless stream of ``(x, y)`` batches labelled by a fixed random "teacher" network."""
    rng = np.random.default_rng(0)
    w1, w2 = rng.normal(size=(NUM_FEATURES, 16)), rng.normal(size=16) / 2
    rng = np.random.default_rng([1, worker])
    while True:
        x = rng.normal(size=(batch_size, NUM_FEATURES)).astype(np.float32)
        yield x, (np.tanh(x @ w1) @ w2).astype(np.float32)


def train(strategy, coordinator, args) -> list[float]:
    model = make_model()
    with strategy.scope():
        variables = dps.create_variables(model, name="model")  # {variable.path: Variable "model/<path>"}
        optimizer = dps.optimizers.Adam(args.lr)
    print("variables:", {k: v.shape for k, v in variables.items()})
    # The paths as named here: a model unpickled on a trainer may name its variables differently.
    paths = list(variables)
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_fn(trainable, x, y):
        pred, _ = model.stateless_call(trainable, non_trainable, x)
        return jnp.mean((pred[:, 0] - y) ** 2)

    loss_and_grads = jax.jit(jax.value_and_grad(loss_fn))  # compiled once per trainer, then kept

    def train_step(iterator):
        x, y = next(iterator)
        values = dps.read_values(variables)  # {path: numpy array}, one round trip per server
        loss, grads = loss_and_grads([values[p] for p in paths], x, y)  # model.trainable_variables order
        optimizer.apply(dict(zip(paths, grads)), variables)
        return float(loss)

    dataset = coordinator.create_per_worker_dataset(lambda ctx: batches(ctx.input_pipeline_id, args.batch_size))
    iterator = iter(dataset)
    means = []
    for epoch in range(args.epochs):
        losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(args.steps)]
        coordinator.join()
        means.append(float(np.mean(coordinator.fetch(losses))))
        print(f"keras epoch {epoch}: mean loss {means[-1]:.4f}", flush=True)
    return means


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate")
    parser.add_argument("--scheduler", help="address of a running daskps cluster (default: start a local one)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    local = contextlib.nullcontext() if args.scheduler else dps.LocalPSCluster(num_ps=2, num_workers=2)
    with local as cluster, dps.ParameterServerStrategy(args.scheduler or cluster.get_client()) as strategy:
        means = train(strategy, dps.ClusterCoordinator(strategy), args)
        print(f"keras: mean loss {means[0]:.4f} in the first epoch, {means[-1]:.4f} in the last", flush=True)


if __name__ == "__main__":
    main()
