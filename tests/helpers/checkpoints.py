"""A small model to checkpoint: a sharded table, a dense weight, Adam and a metric, trained a little."""

from __future__ import annotations

import numpy as np

import daskps as dps


def build(client, shards: int, seed: int = 0):
    """A small model: a sharded table, a dense weight, Adam, a metric."""
    partitioner = dps.partitioners.FixedShardsPartitioner(shards) if shards > 1 else None
    strategy = dps.ParameterServerStrategy(client, variable_partitioner=partitioner)
    rng = np.random.default_rng(seed)
    with strategy.scope():
        table = dps.Variable(rng.normal(size=(12, 3)).astype(np.float32), name="table")
        dense = dps.Variable(rng.normal(size=(3,)).astype(np.float32), name="dense")
        opt = dps.optimizers.Adam(0.1)
        loss = dps.metrics.Mean(name="loss")
    return strategy, table, dense, opt, loss


def train(table, dense, opt, loss, steps: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, 12, size=5)
        opt.apply_gradients([
            (dps.IndexedSlices(rng.normal(size=(5, 3)).astype(np.float32), ids), table),
            (rng.normal(size=3).astype(np.float32), dense),
        ])
        loss.update_state(rng.normal(size=4))


def values(table, dense, opt, loss):
    return np.asarray(table).copy(), dense.numpy(), int(opt.iterations.numpy()), float(loss.result())
