"""Bounded staleness: throughput and the loss reached after the same examples, for k = 0, 1, 4, 8.

Two models that can be learnt, on 2 parameter servers and 2 trainers
(``LocalPSCluster``), SGD, the same initial values, data and number of
steps for every ``k``:

- ``dense``: ``compare.py``'s MLP (784 -> 256 -> 10, the first layer split
  over both servers) on examples labelled by a fixed random linear teacher;
- ``ctr``: ``compare.py``'s CTR model (8 fields, embedding dim 16, one
  sharded table and a 128 x 1 output layer), 1,000 ids per field, clicks
  drawn from a fixed random logistic teacher over the ids.

Each trainer cycles through 32 batches made once on it (so data making is
not timed). The loss is measured on 4,096 held-out examples with the values
read after ``join()``. Every ``k`` runs ``--rounds`` times, the order of the
``k`` reversed every other round; the table shows the best throughput and
the mean loss.

    python benchmarks/bench_staleness.py --steps 600 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _workloads import BATCH, DIM, FIELDS, ctr_grads, dense_grads, dense_init  # noqa: E402

import daskps as dps  # noqa: E402

IDS = 1_000  # per field
LR = {"dense": 0.1, "ctr": 2.0}
HELD_OUT = 4096
CYCLE = 32


def _dense_teacher(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    teacher = np.random.default_rng(7).normal(size=(784, 10)).astype(np.float32)
    x = np.random.default_rng(seed).normal(size=(n, 784)).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1)


def _ctr_teacher(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    weights = np.random.default_rng(8).normal(size=FIELDS * IDS) * 0.8
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, IDS, size=(n, FIELDS)) + np.arange(FIELDS) * IDS
    p = 1 / (1 + np.exp(-(weights[ids].sum(axis=1) - 0.5)))
    return ids.astype(np.int64), (rng.random(n) < p).astype(np.float32)


def _batches(kind: str, worker: int):
    make = _dense_teacher if kind == "dense" else _ctr_teacher
    x, y = make(CYCLE * BATCH, 1000 + worker)
    while True:
        for i in range(CYCLE):
            yield x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]


def _dense_loss(values, x, y) -> float:
    return float(dense_grads(*values, x, y)[0])


def _ctr_loss(table, w, ids, y) -> float:
    return float(ctr_grads(table[ids], w, ids, y)[0])


def _run(strategy, coordinator, kind: str, k: int, steps: int) -> tuple[float, float]:
    """Examples per second and held-out loss after ``steps`` steps with staleness ``k``."""
    lr = LR[kind]
    with strategy.scope():
        opt = dps.optimizers.SGD(lr)
        if kind == "dense":
            params = [dps.Variable(v, name=n) for n, v in dense_init().items()]

            def step(it):
                x, y = next(it)
                loss, grads = dense_grads(*dps.read_values(params), x, y)
                opt.apply_gradients(zip(grads, params))
                return loss
        else:
            rng = np.random.default_rng(0)
            table = dps.Variable((rng.normal(size=(FIELDS * IDS, DIM)) * 0.1).astype(np.float32), name="table")
            w = dps.Variable((rng.normal(size=(FIELDS * DIM, 1)) * 0.1).astype(np.float32), name="w")

            def step(it):
                ids, y = next(it)
                rows, w_now = dps.read_values([(table, ids), w])
                loss, row_grads, gw = ctr_grads(rows, w_now, ids, y)
                opt.apply_gradients([(dps.IndexedSlices(row_grads, ids.ravel()), table), (gw, w)])
                return loss
    data = coordinator.create_per_worker_dataset(lambda ctx: _batches(kind, ctx.input_pipeline_id))
    it = iter(data)
    start = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step, args=(it,), staleness=k)
    coordinator.join()
    rate = steps * BATCH / (time.perf_counter() - start)
    if kind == "dense":
        x, y = _dense_teacher(HELD_OUT, 1)
        loss = _dense_loss(dps.read_values(params), x, y)
    else:
        ids, y = _ctr_teacher(HELD_OUT, 1)
        loss = _ctr_loss(table.numpy(), w.numpy(), ids, y)
    return rate, loss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", default="0,1,4,8")
    parser.add_argument("--only", default="dense,ctr")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    kinds = args.only.split(",")
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster, cluster.get_client() as client:
        partitioner = dps.partitioners.MinSizePartitioner(256 << 10, max_shards=2)
        with dps.ParameterServerStrategy(client, variable_partitioner=partitioner) as strategy:
            coordinator = dps.ClusterCoordinator(strategy)
            for kind in kinds:
                _run(strategy, coordinator, kind, 0, 40)  # warm up: imports, connections, data
            for r in range(args.rounds):
                for kind in kinds:
                    for k in ks if r % 2 == 0 else ks[::-1]:
                        got.setdefault((kind, k), []).append(_run(strategy, coordinator, kind, k, args.steps))
                        rate, loss = got[kind, k][-1]
                        print(f"  round {r + 1} {kind} k={k}: {rate:,.0f} examples/s, loss {loss:.4f}",
                              file=sys.stderr, flush=True)
    print(f"# {os.cpu_count()} cores, {args.steps} steps of {BATCH} examples, best of {args.rounds} rounds "
          "(throughput), mean (loss)")
    print("| model | k | examples/s | vs k=0 | held-out loss | vs k=0 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind in kinds:
        base_rate = max(r for r, _ in got[kind, ks[0]])
        base_loss = statistics.mean(loss for _, loss in got[kind, ks[0]])
        for k in ks:
            rate = max(r for r, _ in got[kind, k])
            loss = statistics.mean(loss for _, loss in got[kind, k])
            print(f"| {kind} | {k} | {rate:,.0f} | {rate / base_rate:.2f}x | {loss:.4f} | "
                  f"{100 * (loss / base_loss - 1):+.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
