"""Dispatch overhead: empty functions through daskps vs raw Dask, side by side.

Both sides send the same no-op to ``worker``-tagged workers of one
LocalPSCluster: daskps through ``ClusterCoordinator.schedule`` + ``join``,
raw Dask through a ``client.submit(..., resources={"worker": 1},
pure=False)`` loop + ``wait``. Rounds alternate between the two so drift in
machine load hits both alike; the figure that matters is the ratio.

    python benchmarks/bench_dispatch.py [--tasks 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from distributed import wait

import daskps as dps


def noop():
    return None


def time_daskps(coordinator, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        coordinator.schedule(noop)
    coordinator.join()
    return n / (time.perf_counter() - start)


def time_raw(client, n: int) -> float:
    start = time.perf_counter()
    futures = [client.submit(noop, resources={"worker": 1}, pure=False) for _ in range(n)]
    wait(futures)
    elapsed = time.perf_counter() - start
    del futures
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-workers", type=int, default=2)
    args = parser.parse_args()
    with dps.LocalPSCluster(num_ps=2, num_workers=args.num_workers) as cluster:
        client = cluster.get_client()
        coordinator = dps.ClusterCoordinator(dps.ParameterServerStrategy(client))
        time_daskps(coordinator, 200)  # warm up both paths
        time_raw(client, 200)
        ours, raw = [], []
        for _ in range(args.rounds):
            ours.append(time_daskps(coordinator, args.tasks))
            raw.append(time_raw(client, args.tasks))
        o, r = statistics.median(ours), statistics.median(raw)
        print(f"tasks per round: {args.tasks}, rounds: {args.rounds}, workers: {args.num_workers}")
        print(f"raw Dask submit+wait   : {r:8.0f} tasks/s  (rounds: {', '.join(f'{x:.0f}' for x in raw)})")
        print(f"daskps schedule+join   : {o:8.0f} tasks/s  (rounds: {', '.join(f'{x:.0f}' for x in ours)})")
        print(f"ratio daskps / raw Dask: {o / r:.2f}")


if __name__ == "__main__":
    main()
