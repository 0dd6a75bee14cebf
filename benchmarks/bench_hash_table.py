"""An EmbeddingTable with a capacity under a stream of far more distinct keys: does memory stay bounded?

Streams ``--keys`` distinct keys through a table with ``capacity=--capacity``
on 2 parameter servers, from 2 trainers: each step looks up ``--fresh`` keys
never seen before plus ``--head`` keys drawn from a Zipf(1.1) head of 100,000
popular keys, and applies an Adagrad gradient to all of them. At the end it
reports, per server, the rows held, the bytes the table's structures take
(rows, slots, keys, clocks, index: ``strategy.ps_stats()``) and the growth of
the server process's resident memory, against what ``capacity`` rows and
their Adagrad slots need (``capacity * dim * 4 * 2`` bytes).

    python benchmarks/bench_hash_table.py                      # 10M keys through capacity 1M, dim 16
    python benchmarks/bench_hash_table.py --keys 1000000 --capacity 100000
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import psutil

import daskps as dps


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _trimmed_rss() -> int:
    """RSS after glibc hands back the free memory it keeps for reuse (up to daskps' trim threshold, 64 MiB)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _rss()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=10_000_000)
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--fresh", type=int, default=4096)
    parser.add_argument("--head", type=int, default=1024)
    args = parser.parse_args()
    steps = -(-args.keys // args.fresh)
    with dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster, cluster.get_client() as client:
        strategy = dps.ParameterServerStrategy(client)
        servers = list(strategy.cluster_resolver.cluster_spec()["ps"])
        before = client.run(_rss, workers=servers)
        with strategy.scope():
            table = dps.EmbeddingTable(args.dim, capacity=args.capacity, name="stream")
            opt = dps.optimizers.Adagrad(0.05)
        coordinator = dps.ClusterCoordinator(strategy)
        fresh, head, dim = args.fresh, args.head, args.dim

        def step(i: int) -> None:
            rng = np.random.default_rng(i)
            new = (np.arange(i * fresh, (i + 1) * fresh, dtype=np.int64) * 2_654_435_761) % (2**62)
            popular = -1 - np.minimum(rng.zipf(1.1, head), 100_000).astype(np.int64)  # negative: apart from new
            ids = np.concatenate([new, popular])
            dps.embedding_lookup(table, ids)
            grads = rng.normal(size=(len(ids), dim)).astype(np.float32)
            opt.apply_gradients([(dps.IndexedSlices(grads, ids), table)])

        start = time.perf_counter()
        for first in range(0, steps, max(1, steps // 10)):
            coordinator.fetch([coordinator.schedule(step, args=(i,)) for i in range(first, min(steps, first + max(1, steps // 10)))])
            print(f"  {min(steps, first + max(1, steps // 10)) * fresh:,} keys streamed, "
                  f"{table.size():,} rows held, {time.perf_counter() - start:.0f} s", flush=True)
        after = client.run(_rss, workers=servers)
        trimmed = client.run(_trimmed_rss, workers=servers)
        stats = {s["task_id"]: s for s in strategy.ps_stats()}
        per_server = table.stats()
        need = args.capacity * args.dim * 4 * 2  # rows and one Adagrad accumulator each
        print(f"\n{steps * fresh:,} distinct keys (+ a Zipf head) through capacity {args.capacity:,}, dim {args.dim}, "
              f"Adagrad; {steps * (fresh + head) / (time.perf_counter() - start):,.0f} lookups+updates/s")
        print("| server | rows held | evicted | table bytes | RSS growth | RSS growth after malloc_trim |")
        print("| --- | --- | --- | --- | --- | --- |")
        table_bytes = rss = rss_trimmed = 0
        for i, address in enumerate(servers):
            s = stats[i]
            mine = s["nbytes"] + s["slot_nbytes"]
            table_bytes += mine
            rss += after[address] - before[address]
            rss_trimmed += trimmed[address] - before[address]
            print(f"| ps-{i} | {per_server[i]['rows']:,} | {per_server[i]['evicted']:,} | {mine / 2**20:,.1f} MiB | "
                  f"{(after[address] - before[address]) / 2**20:,.1f} MiB | "
                  f"{(trimmed[address] - before[address]) / 2**20:,.1f} MiB |")
        print(f"what {args.capacity:,} rows and their slots need: {need / 2**20:,.1f} MiB; table bytes "
              f"{table_bytes / need:.2f}x of it, RSS growth {rss / need:.2f}x ({rss_trimmed / need:.2f}x after "
              "malloc_trim)")
        strategy.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
