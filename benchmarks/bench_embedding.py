"""Embedding lookup on a 1M x 16 float32 table split over 2 parameter servers.

Compares, side by side in one run (alternating rounds):

- daskps ``embedding_lookup(table, ids)`` from the coordinator;
- the same lookups inside scheduled functions on the trainers (worker to ps);
- raw Dask: two actors holding the table's halves, read with the
  ``actor.method(rows).result()`` calls a Dask user would write (unique
  rows, one call per actor, both in flight at once);
- pulling the whole table and indexing it locally.

Bytes moved are measured on the servers (``bytes_read`` in ``ps_stats``).

    python benchmarks/bench_embedding.py [--batch 4096] [--lookups 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import daskps as dps
from daskps.distribute.cluster import cluster_workers

ROWS, DIM = 1_000_000, 16


class TableHalf:
    """A raw Dask actor holding rows ``[start, start + len(values))``."""

    def __init__(self, start: int, rows: int, dim: int):
        self.start = start
        self.values = np.random.default_rng(start).normal(size=(rows, dim)).astype(np.float32)

    def gather(self, rows):
        return self.values[rows - self.start]


def _table_init(shape, dtype, partition_shape, partition_offset):
    return np.random.default_rng(partition_offset[0]).normal(size=partition_shape).astype(dtype)


def make_batches(n: int, batch: int, seed: int = 0) -> list[np.ndarray]:
    """Zipf-like ids, as real feature ids are: a few hot rows, a long tail."""
    rng = np.random.default_rng(seed)
    return [np.minimum(rng.zipf(1.2, size=batch) - 1, ROWS - 1) for _ in range(n)]


def time_daskps(table, batches) -> float:
    start = time.perf_counter()
    for ids in batches:
        dps.embedding_lookup(table, ids)
    return sum(len(b) for b in batches) / (time.perf_counter() - start)


def time_workers(coordinator, table, batches, per_step: int = 10) -> float:
    def step(chunk):
        for ids in chunk:
            dps.embedding_lookup(table, ids)

    start = time.perf_counter()
    for i in range(0, len(batches), per_step):
        coordinator.schedule(step, args=(batches[i : i + per_step],))
    coordinator.join()
    return sum(len(b) for b in batches) / (time.perf_counter() - start)


def time_raw_actors(actors, split: int, batches) -> float:
    start = time.perf_counter()
    for ids in batches:
        uniq, inverse = np.unique(ids, return_inverse=True)
        cut = np.searchsorted(uniq, split)
        parts = [actors[0].gather(uniq[:cut]), actors[1].gather(uniq[cut:])]
        rows = np.concatenate([p.result() for p in parts])
        rows[inverse]
    return sum(len(b) for b in batches) / (time.perf_counter() - start)


def time_whole_table(table, batches) -> float:
    start = time.perf_counter()
    for ids in batches:
        table.numpy()[ids]
    return sum(len(b) for b in batches) / (time.perf_counter() - start)


def bytes_per_lookup(strategy, fn, batches) -> float:
    before = sum(s["bytes_read"] for s in strategy.ps_stats())
    for ids in batches:
        fn(ids)
    return (sum(s["bytes_read"] for s in strategy.ps_stats()) - before) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--lookups", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster:
        client = cluster.get_client()
        strategy = dps.ParameterServerStrategy(
            client, variable_partitioner=dps.partitioners.FixedShardsPartitioner(2)
        )
        coordinator = dps.ClusterCoordinator(strategy)
        with strategy.scope():
            table = dps.Variable(_table_init, shape=(ROWS, DIM), dtype=np.float32, name="table")
        ps = [a for a, w in cluster_workers(client).items() if w["name"].startswith("ps-")]
        split = ROWS // 2
        actors = [
            client.submit(TableHalf, 0, split, DIM, actor=True, workers=[ps[0]]).result(),
            client.submit(TableHalf, split, ROWS - split, DIM, actor=True, workers=[ps[1]]).result(),
        ]
        batches = make_batches(args.lookups, args.batch)
        few = batches[:3]
        time_daskps(table, few), time_workers(coordinator, table, few), time_raw_actors(actors, split, few)
        results: dict[str, list[float]] = {"daskps": [], "workers": [], "raw": [], "whole": []}
        for _ in range(args.rounds):
            results["daskps"].append(time_daskps(table, batches))
            results["workers"].append(time_workers(coordinator, table, batches))
            results["raw"].append(time_raw_actors(actors, split, batches))
            results["whole"].append(time_whole_table(table, few))
        med = {k: statistics.median(v) for k, v in results.items()}
        moved = bytes_per_lookup(strategy, lambda ids: dps.embedding_lookup(table, ids), batches[:20])
        whole = bytes_per_lookup(strategy, lambda ids: table.numpy()[ids], few)
        unique = np.mean([len(np.unique(b)) for b in batches])
        print(f"table {ROWS} x {DIM} float32 ({table.nbytes / 2**20:.0f} MiB) in {len(table.variables)} shards on 2 ps")
        print(f"batch {args.batch} ids (zipf 1.2, {unique:.0f} distinct on average), {args.lookups} lookups x {args.rounds} rounds")
        for key, label in [("daskps", "daskps, from the coordinator"), ("workers", "daskps, in scheduled functions"),
                           ("raw", "raw Dask actors, from the client"), ("whole", "pull whole table, index locally")]:
            rounds = ", ".join(f"{x:,.0f}" for x in results[key])
            print(f"{label:34s}: {med[key]:12,.0f} ids/s  ({rounds})")
        print(f"ratio daskps / raw Dask actors      : {med['daskps'] / med['raw']:.2f}")
        print(f"ratio daskps / whole-table pull     : {med['daskps'] / med['whole']:.0f}")
        print(f"bytes per lookup: daskps {moved:,.0f}  whole table {whole:,.0f}  ({whole / moved:,.0f}x less)")


if __name__ == "__main__":
    main()
