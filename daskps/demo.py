"""The main job: asynchronous training of a softmax classifier on a local cluster.

The data come from a known "teacher": labels are the argmax of ``x @ W* + b*``
for fixed random ``W*``, ``b*``. A student trained by asynchronous SGD on
parameter servers should reach high test accuracy, and its weights should
point the same way as the teacher's; both are printed, so the run checks
itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

import daskps as dps

NUM_FEATURES = 20
NUM_CLASSES = 4


@dataclass(frozen=True)
class DemoConfig:
    num_ps: int = 2
    num_workers: int = 2
    epochs: int = 8
    steps_per_epoch: int = 100
    steps_per_call: int = 5
    batch_size: int = 64
    learning_rate: float = 0.5
    seed: int = 0


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


def run_demo(config: DemoConfig = DemoConfig(), cluster=None, log=print) -> dict:
    """Train on ``cluster`` (a new LocalPSCluster if None); return the final metrics."""
    own = cluster is None
    if own:
        log(f"starting a LocalPSCluster: {config.num_ps} ps, {config.num_workers} workers")
        cluster = dps.LocalPSCluster(num_ps=config.num_ps, num_workers=config.num_workers)
    try:
        return _train(config, cluster, log)
    finally:
        if own:
            cluster.close()


def _train(config: DemoConfig, cluster, log) -> dict:
    client = cluster.get_client()
    log(f"dashboard: {cluster.dashboard_link}")
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    with strategy.scope():
        w = dps.Variable(np.zeros((NUM_FEATURES, NUM_CLASSES), np.float32), name="softmax/w")
        b = dps.Variable(np.zeros(NUM_CLASSES, np.float32), name="softmax/b")
    seed, batch, lr, k = config.seed, config.batch_size, config.learning_rate, config.steps_per_call
    dataset = coordinator.create_per_worker_dataset(
        lambda ctx: make_batches(seed, ctx.input_pipeline_id, batch)
    )

    def train_steps(iterator):
        losses = []
        for _ in range(k):
            x, y = next(iterator)
            w_now, b_now = dps.read_values([w, b])
            loss, gw, gb = softmax_loss_and_grads(w_now, b_now, x, y)
            w.assign_sub(lr * gw)
            b.assign_sub(lr * gb)
            losses.append(loss)
        return strategy.reduce("MEAN", np.asarray(losses), axis=0)

    rng = np.random.default_rng([seed, 999])
    x_test = rng.normal(size=(4000, NUM_FEATURES)).astype(np.float32)
    w_star, b_star = teacher(seed)
    y_test = np.argmax(x_test @ w_star + b_star, axis=1)
    calls = max(1, config.steps_per_epoch // k)
    history = []
    started = time.perf_counter()
    iterator = iter(dataset)
    for epoch in range(1, config.epochs + 1):
        t0 = time.perf_counter()
        results = [coordinator.schedule(train_steps, args=(iterator,)) for _ in range(calls)]
        coordinator.join()
        loss = float(np.mean(coordinator.fetch(results)))
        w_now, b_now = dps.read_values([w, b])
        acc = accuracy(w_now, b_now, x_test, y_test)
        rate = calls * k / (time.perf_counter() - t0)
        history.append(loss)
        log(f"epoch {epoch:>2}/{config.epochs}  loss {loss:.4f}  test accuracy {acc:.3f}  {rate:,.0f} steps/s")
    w_now, _ = dps.read_values([w, b])
    centred = lambda m: m - m.mean(axis=1, keepdims=True)  # noqa: E731  softmax ignores row shifts
    cos = float(np.sum(centred(w_now) * centred(w_star)) / (np.linalg.norm(centred(w_now)) * np.linalg.norm(centred(w_star))))
    result = {
        "loss_first_epoch": history[0],
        "loss_last_epoch": history[-1],
        "test_accuracy": acc,
        "weight_cosine": cos,
        "steps": config.epochs * calls * k,
        "seconds": time.perf_counter() - started,
    }
    log(
        f"done: {result['steps']} steps in {result['seconds']:.1f}s; final test accuracy "
        f"{acc:.3f}; cosine(student, teacher weights) {cos:.3f}"
    )
    return result
