"""Asynchronous parameter-server training on a local Dask cluster.

A softmax classifier learns labels produced by a hidden "teacher" model, with
manual numpy gradients. Variables live on two parameter servers; two trainers
run the steps; the coordinator (this script) schedules them and checks the
result against the known answer.

    python examples/train_softmax.py
    python examples/train_softmax.py --scheduler tcp://scheduler:8786   # an existing cluster

An existing cluster is one started as in docs/howto/cluster.md (workers with
``--resources "ps=1"`` and ``--resources "worker=1"``):
``dps.ParameterServerStrategy`` takes its address, a ``distributed.Client``
or a cluster object alike.
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np

import daskps as dps

NUM_FEATURES, NUM_CLASSES = 20, 4


def teacher(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(NUM_FEATURES, NUM_CLASSES)), rng.normal(size=NUM_CLASSES)


def make_batches(seed: int, worker: int, batch_size: int):
    """An endless stream of (x, y) batches labelled by the teacher."""
    w_star, b_star = teacher(seed)
    rng = np.random.default_rng([seed, worker + 1])
    while True:
        x = rng.normal(size=(batch_size, NUM_FEATURES)).astype(np.float32)
        yield x, np.argmax(x @ w_star + b_star, axis=1)


def softmax_loss_and_grads(w, b, x, y):
    """Mean cross-entropy of softmax(x @ w + b) and its gradients."""
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = -np.log(p[np.arange(n), y] + 1e-12).mean()
    p[np.arange(n), y] -= 1.0
    return loss, x.T @ p / n, p.sum(axis=0) / n


def accuracy(w, b, x, y) -> float:
    return float((np.argmax(x @ w + b, axis=1) == y).mean())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheduler", help="address of a running daskps cluster (default: start a local one)")
    args = parser.parse_args(argv)
    local = contextlib.nullcontext() if args.scheduler else dps.LocalPSCluster(num_ps=2, num_workers=2)
    with local as cluster, dps.ParameterServerStrategy(args.scheduler or cluster) as strategy:
        coordinator = dps.ClusterCoordinator(strategy)
        print("cluster:", strategy.cluster_resolver.cluster_spec())

        with strategy.scope():  # variables go to the parameter servers, round robin
            w = dps.Variable(np.zeros((NUM_FEATURES, NUM_CLASSES), np.float32), name="w")
            b = dps.Variable(np.zeros(NUM_CLASSES, np.float32), name="b")
        print("w on", w.device, "| b on", b.device)

        # Built on each trainer, from its own seed; only a tiny handle travels per step.
        dataset = coordinator.create_per_worker_dataset(lambda ctx: make_batches(0, ctx.input_pipeline_id, 64))

        def train_step(iterator):
            x, y = next(iterator)
            w_now, b_now = dps.read_values([w, b])  # one round trip per parameter server
            loss, gw, gb = softmax_loss_and_grads(w_now, b_now, x, y)
            w.assign_sub(0.5 * gw)
            b.assign_sub(0.5 * gb)
            return loss

        iterator = iter(dataset)
        for epoch in range(5):
            losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(200)]
            coordinator.join()
            print(f"epoch {epoch}: mean loss {np.mean(coordinator.fetch(losses)):.4f}")

        rng = np.random.default_rng(1)
        x = rng.normal(size=(2000, NUM_FEATURES)).astype(np.float32)
        w_star, b_star = teacher(0)
        y = np.argmax(x @ w_star + b_star, axis=1)
        print(f"test accuracy against the teacher: {accuracy(w.numpy(), b.numpy(), x, y):.3f}")


if __name__ == "__main__":
    main()
