"""Checkpoint save and restore of a 1 GiB sharded model on 2 parameter servers.

The model is one float32 table of 1 GiB split in 2 shards (one per server),
built on the servers by a partition-aware initializer. Side by side, in
alternating rounds:

- ``Checkpoint.write``: each server writes its shard straight to disk, both
  at once; the coordinator writes the manifest;
- ``Checkpoint.restore`` of that checkpoint (each server reads its rows);
- the baseline: the same bytes written with ``np.save`` (and read with
  ``np.load``) from one process.

    python benchmarks/bench_checkpoint.py [--mib 1024] [--rounds 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import daskps as dps


def _init(shape, dtype, partition_shape, partition_offset):
    return np.random.default_rng(partition_offset[0]).random(partition_shape, dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    cols = 1024
    rows = args.mib * (1 << 20) // (4 * cols)
    mib = rows * cols * 4 / 2**20
    work = Path(tempfile.mkdtemp(prefix="daskps-bench-", dir=args.dir))
    with dps.LocalPSCluster(num_ps=2, num_workers=1) as cluster:
        strategy = dps.ParameterServerStrategy(
            cluster.get_client(), variable_partitioner=dps.partitioners.FixedShardsPartitioner(2)
        )
        with strategy.scope():
            table = dps.Variable(_init, shape=(rows, cols), dtype=np.float32, name="table")
        ckpt = dps.Checkpoint(table=table)
        local = np.random.default_rng(0).random((rows, cols), dtype=np.float32)  # the baseline's array
        times: dict[str, list[float]] = {"save": [], "restore": [], "np.save": [], "np.load": []}
        try:
            for r in range(-1, args.rounds):  # round -1 warms every path up (page cache, allocations) untimed
                path = str(work / f"ckpt-{r + 1}")
                t0 = time.perf_counter()
                ckpt.write(path)
                times["save"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ckpt.restore(path)
                times["restore"].append(time.perf_counter() - t0)
                shutil.rmtree(path)
                target = work / f"plain-{r}.npy"
                t0 = time.perf_counter()
                np.save(target, local)
                times["np.save"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                np.load(target)
                times["np.load"].append(time.perf_counter() - t0)
                target.unlink()
                if r < 0:
                    for v in times.values():
                        v.clear()
        finally:
            shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: {mib:.0f} MiB float32 in {len(table.variables)} shards on 2 ps; {args.rounds} rounds; dir {args.dir}")
    for key, label in [("save", "daskps Checkpoint.write (2 ps at once)"), ("np.save", "np.save, one process"),
                       ("restore", "daskps Checkpoint.restore (2 ps at once)"), ("np.load", "np.load, one process")]:
        rounds = ", ".join(f"{x:.2f}" for x in times[key])
        print(f"{label:42s}: {med[key]:6.2f} s  {mib / med[key]:8.0f} MiB/s  ({rounds})")
    print(f"save throughput ratio daskps / np.save   : {med['np.save'] / med['save']:.2f}")
    print(f"restore throughput ratio daskps / np.load: {med['np.load'] / med['restore']:.2f}")


if __name__ == "__main__":
    main()
