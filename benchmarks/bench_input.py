"""Input from Dask collections: ``dps.data.from_dask`` against a hand-written generator.

1. **iterate**: one trainer reads a persisted dask Array of float32 features
   (``--rows`` x ``--cols``, ``--chunks`` chunks, all in that trainer's
   worker) in batches of 256, inside one scheduled function that drains an
   epoch: batches/s through ``from_dask`` against a generator slicing the
   same chunks, taken from the worker's memory, into the same batches
   (``shuffle=False``; and, with ``--shuffle``, both shuffling: ``from_dask``'s
   buffer against a generator permuting each chunk).
2. **dense**: ``compare.py``'s dense MLP (784 -> 256 -> 10, numpy step,
   batch 256, SGD 0.05, one step per scheduled function) on 1 ps and the
   trainers, fed from a persisted dask Array pair ``(x, y)`` through
   ``from_dask`` against the same arrays fed from a ``dataset_fn`` (a
   generator over the chunks in the trainer's memory): examples/s.

The two sides alternate within each round, the order flipping every round.

    python benchmarks/bench_input.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dask.array as da  # noqa: E402
from _workloads import BATCH, LR, dense_grads, dense_init  # noqa: E402
from distributed import futures_of, get_worker, wait  # noqa: E402

import daskps as dps  # noqa: E402
from daskps.errors import OutOfRangeError  # noqa: E402


def _local_chunks(keys):
    """The chunks (numpy) under ``keys``, from this worker's memory."""
    data = get_worker().data
    return [np.asarray(data[k]) for k in keys]


def _plain_batches(keys, epochs=1):
    chunks = _local_chunks(keys)
    for _ in range(epochs):
        rest = None
        for c in chunks:
            start = 0
            if rest is not None:
                start = BATCH - len(rest)
                yield np.concatenate([rest, c[:start]])
                rest = None
            full = start + (len(c) - start) // BATCH * BATCH
            for i in range(start, full, BATCH):
                yield c[i:i + BATCH]
            if full < len(c):
                rest = c[full:]
        if rest is not None:
            yield rest


def _shuffled_batches(keys, epochs=1, seed=0):
    chunks = _local_chunks(keys)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        for j in rng.permutation(len(chunks)):
            c = chunks[j][rng.permutation(len(chunks[j]))]
            for i in range(0, len(c), BATCH):
                yield c[i:i + BATCH]


def _drain(it, touch: bool):
    """Batches read until the end, and the seconds it took; ``touch``: sum each batch (a consumer reading it)."""
    n, start = 0, time.perf_counter()
    try:
        while (batch := next(it, None)) is not None:
            n += 1
            if touch:
                batch.sum()
    except OutOfRangeError:  # a dataset_fn's generator ran out (from_dask's end is StopIteration)
        pass
    return n, time.perf_counter() - start


def iterate_makers(coordinator, x, keys, shuffle: bool, epochs: int) -> dict[str, Any]:
    """The two ways to make the dataset of the ``iterate`` part."""
    def with_from_dask():
        data = dps.data.from_dask(x, batch_size=BATCH, shuffle=shuffle, seed=0, epochs=epochs)
        return coordinator.create_per_worker_dataset(data)

    def by_hand():
        gen = _shuffled_batches if shuffle else _plain_batches
        return coordinator.create_per_worker_dataset(lambda ctx: gen(keys, epochs))

    return {"from_dask": with_from_dask, "generator": by_hand}


def _first(it):
    start = time.perf_counter()
    next(it)
    return time.perf_counter() - start


def _time_drain(coordinator, make, touch: bool) -> tuple[float, int, float]:
    """Batches/s after the first batch (timed on its own: building the pipeline, the first partition)."""
    it = iter(make())
    first = coordinator.schedule(_first, args=(it,)).fetch()
    n, seconds = coordinator.schedule(_drain, args=(it, touch)).fetch()
    return n / seconds, n + 1, first


def dense_rate(strategy, coordinator, make_data, steps: int, warmup: int) -> float:
    with strategy.scope():
        params = [dps.Variable(v) for v in dense_init().values()]
        opt = dps.optimizers.SGD(LR)
    it = iter(make_data())

    def step(iterator):
        x, y = next(iterator)
        loss, grads = dense_grads(*dps.read_values(params), x, y)
        opt.apply_gradients(zip(grads, params))
        return loss

    for _ in range(warmup):
        coordinator.schedule(step, args=(it,))
    coordinator.join()
    start = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step, args=(it,))
    coordinator.join()
    return BATCH * steps / (time.perf_counter() - start)


def _dense_pair_batches(xkeys, ykeys):
    """(x, y) batches over the chunks in this worker's memory, forever (as ``from_dask(..., epochs=None)``)."""
    while True:
        for x, y in zip(_plain_batches(xkeys), _plain_batches(ykeys)):
            yield x, y


def _report(name: str, unit: str, got: dict[str, list[float]], bar: float) -> str:
    a, b = got["from_dask"], got["generator"]
    best = max(a) / max(b)
    ratios = [p / q for p, q in zip(a, b)]
    line = (f"{name}: from_dask best {max(a):,.0f} {unit} ({min(a):,.0f}-{max(a):,.0f}), generator best "
            f"{max(b):,.0f} ({min(b):,.0f}-{max(b):,.0f}); best/best {best:.2f}x, per-round ratio "
            f"{min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.2f}x (bar >= {bar}x)")
    print(line, flush=True)
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=3, help="epochs drained per timing in the iterate part")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shuffle", action="store_true", help="also time both sides shuffling")
    parser.add_argument("--dense-rows", type=int, default=200_000, help="rows of the dense workload's (x, y)")
    parser.add_argument("--dense-steps", type=int, default=1000)
    parser.add_argument("--dense-workers", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: iterate, dense")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    lines = []

    if "iterate" not in skip:
        with dps.LocalPSCluster(num_ps=1, num_workers=1) as cluster, cluster.get_client() as client, \
                dps.ParameterServerStrategy(client) as strategy:
            coordinator = dps.ClusterCoordinator(strategy)
            trainer = [addr for _, addr in strategy.cluster_resolver.training_workers()]
            x = da.random.default_rng(0).random((args.rows, args.cols), dtype=np.float32,
                                                chunks=(-(-args.rows // args.chunks), args.cols))
            x = client.persist(x, workers=trainer)
            wait(x)
            keys = [f.key for f in sorted(futures_of(x), key=lambda f: f.key[1:])]
            print(f"iterate: {x.nbytes / 2**20:,.0f} MiB float32 {x.shape}, {len(keys)} chunks, batch {BATCH}",
                  flush=True)
            for shuffle, touch in [(False, False), (False, True)] + [(True, True)] * args.shuffle:
                makers = iterate_makers(coordinator, x, keys, shuffle, args.epochs)
                got: dict[str, list[float]] = {k: [] for k in makers}
                firsts: dict[str, list[float]] = {k: [] for k in makers}
                for r in range(args.rounds):
                    for name in (list(makers) if r % 2 == 0 else list(makers)[::-1]):
                        rate, n, first = _time_drain(coordinator, makers[name], touch)
                        got[name].append(rate)
                        firsts[name].append(first)
                        print(f"  round {r + 1} shuffle={shuffle} sum={touch} {name:9s} {rate:9,.0f} batches/s "
                              f"({n} batches, first {1e3 * first:.1f} ms)", file=sys.stderr, flush=True)
                what = f"iterate shuffle={shuffle}, consumer {'sums each batch' if touch else 'does nothing'}"
                lines.append(_report(what, "batches/s", got, 0.8) + "; first batch (ms, median) " + ", ".join(
                    f"{k} {1e3 * statistics.median(v):.1f}" for k, v in firsts.items()))

    if "dense" not in skip:
        with dps.LocalPSCluster(num_ps=1, num_workers=args.dense_workers) as cluster, \
                cluster.get_client() as client, dps.ParameterServerStrategy(client) as strategy:
            coordinator = dps.ClusterCoordinator(strategy)
            trainers = [addr for _, addr in strategy.cluster_resolver.training_workers()]
            per = args.dense_rows // args.chunks
            rng = np.random.default_rng(1)
            xs, ys = [], []
            for i in range(args.chunks):  # chunk i on trainer i % len(trainers): known placement for both sides
                where = [trainers[i % len(trainers)]]
                xs.append(client.persist(da.from_array(rng.standard_normal((per, 784), dtype=np.float32),
                                                       chunks=(per, 784)), workers=where))
                ys.append(client.persist(da.from_array(rng.integers(0, 10, per), chunks=per), workers=where))
            x, y = client.persist([da.concatenate(xs), da.concatenate(ys)])
            wait([x, y])
            who = client.who_has([x, y])
            xf = sorted(futures_of(x), key=lambda f: f.key[1:])
            yf = sorted(futures_of(y), key=lambda f: f.key[1:])
            by_trainer = {name: ([f.key for f in xf if addr in who[f.key]], [f.key for f in yf if addr in who[f.key]])
                          for name, addr in strategy.cluster_resolver.training_workers()}
            assert all(len(a) == len(b) and a for a, b in by_trainer.values()), by_trainer
            print(f"dense: {x.nbytes / 2**20:,.0f} MiB features, {len(xf)} chunks over {len(trainers)} trainers "
                  f"({ {k: len(v[0]) for k, v in by_trainer.items()} }), {args.dense_steps} steps", flush=True)

            def fed_by_from_dask():
                return coordinator.create_per_worker_dataset(dps.data.from_dask((x, y), batch_size=BATCH, epochs=None))

            def fed_by_dataset_fn():
                # Each trainer reads the chunks its own worker holds.
                return coordinator.create_per_worker_dataset(
                    lambda ctx: _dense_pair_batches(*by_trainer[get_worker().name]))

            makers = {"from_dask": fed_by_from_dask, "generator": fed_by_dataset_fn}
            got = {k: [] for k in makers}
            for r in range(args.rounds):
                for name in (list(makers) if r % 2 == 0 else list(makers)[::-1]):
                    rate = dense_rate(strategy, coordinator, makers[name], args.dense_steps, warmup=50)
                    got[name].append(rate)
                    print(f"  round {r + 1} dense {name:9s} {rate:9,.0f} examples/s", file=sys.stderr, flush=True)
            lines.append(_report("dense", "examples/s", got, 0.9))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
