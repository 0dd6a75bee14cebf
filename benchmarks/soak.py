"""Soak: does anything grow that the user does not hold?

Starts a real ``dask scheduler`` and four ``dask worker`` processes (2
parameter servers, 2 trainers) on 127.0.0.1, then in ten rounds: creates
100 variables (1,000 in all), schedules 2,000 functions that use them
(20,000 in all), joins, and drops the variables. Beside it, raw Dask does
the same number of tasks (``client.submit`` + ``wait``, futures released) on
the same cluster. Reports the resident memory of this process (the
coordinator), the scheduler, the servers and the trainers at the start, the
middle and the end of each.

    python benchmarks/soak.py                 # 20,000 functions, 1,000 variables
    python benchmarks/soak.py --functions 2000 --variables 100
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
from distributed import Client, wait

import daskps as dps
from daskps.distribute.cluster import cluster_workers

ROUNDS = 10


def _start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    return subprocess.Popen([sys.executable, "-m", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _cluster(tmp: str) -> tuple[list[subprocess.Popen], str]:
    sched_file = os.path.join(tmp, "scheduler.json")
    procs = [_start(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
                     "--dashboard-address", "127.0.0.1:0", "--scheduler-file", sched_file])]
    deadline = time.monotonic() + 60
    while not os.path.exists(sched_file):
        if time.monotonic() > deadline:
            raise RuntimeError("dask scheduler did not start")
        time.sleep(0.1)
    time.sleep(0.2)
    address = json.load(open(sched_file))["address"]
    for name, resource in (("ps-0", "ps"), ("ps-1", "ps"), ("worker-0", "worker"), ("worker-1", "worker")):
        procs.append(_start(["distributed.cli.dask_worker", address, "--host", "127.0.0.1", "--nthreads", "1",
                             "--resources", f"{resource}=1", "--name", name, "--no-dashboard",
                             "--dashboard-address", "127.0.0.1:0"]))  # its HTTP server listens anyway
    return procs, address


def _pids(client: Client) -> dict[str, int]:
    pids = {"coordinator": os.getpid(), "scheduler": client.run_on_scheduler(os.getpid)}
    for addr, info in sorted(cluster_workers(client).items(), key=lambda kv: kv[1]["name"]):
        pids[info["name"]] = client.run(os.getpid, workers=[addr])[addr]
    return pids


def _rss(pids: dict[str, int]) -> dict[str, float]:
    gc.collect()
    time.sleep(1.0)  # let releases and forgets settle
    return {role: psutil.Process(pid).memory_info().rss / 2**20 for role, pid in pids.items()}


def _noop(x):
    return x


def soak_dask(client: Client, functions: int, pids: dict[str, int]) -> list[dict[str, float]]:
    marks = [_rss(pids)]
    per_round = functions // ROUNDS
    for r in range(ROUNDS):
        futures = [client.submit(_noop, i, resources={"worker": 1}, pure=False) for i in range(per_round)]
        wait(futures)
        del futures
        if r == ROUNDS // 2 - 1:
            marks.append(_rss(pids))
    marks.append(_rss(pids))
    return marks


def soak_daskps(client: Client, functions: int, variables: int, pids: dict[str, int]) -> list[dict[str, float]]:
    strategy = dps.ParameterServerStrategy(client)
    coordinator = dps.ClusterCoordinator(strategy)
    per_round, vars_per_round = functions // ROUNDS, variables // ROUNDS
    marks = [_rss(pids)]
    for r in range(ROUNDS):
        with strategy.scope():
            vs = [dps.Variable(np.zeros(8192, np.float32), name=f"v{r}_{i}") for i in range(vars_per_round)]
        for i in range(per_round):
            coordinator.schedule(_bump, args=(vs[i % len(vs)],))
        coordinator.join()
        del vs
        if r == ROUNDS // 2 - 1:
            marks.append(_rss(pids))
    marks.append(_rss(pids))
    held = sum(s["num_variables"] for s in strategy.ps_stats())
    strategy.close()
    return marks + [{"variables still on the servers": held}]


def _bump(v):
    v.assign_add(np.ones(8192, np.float32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--functions", type=int, default=20_000)
    parser.add_argument("--variables", type=int, default=1_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        procs, address = _cluster(tmp)
        try:
            with Client(address) as client:
                client.wait_for_workers(4, timeout=60)
                pids = _pids(client)
                # Warm both paths (imports, connections, first allocations) before the first mark.
                wait([client.submit(_noop, i, resources={"worker": 1}, pure=False) for i in range(200)])
                soak_daskps(client, 400, 20, pids)
                started = time.perf_counter()
                raw = soak_dask(client, args.functions, pids)
                mine = soak_daskps(client, args.functions, args.variables, pids)
                took = time.perf_counter() - started
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                p.wait(timeout=30)
    print(f"# {args.functions:,} functions / tasks and {args.variables:,} variables of 32 KiB, "
          f"{ROUNDS} rounds; {took:.0f} s; resident memory in MiB")
    print("| process | raw Dask: start | middle | end | growth | daskps: start | middle | end | growth |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for role in pids:
        a, b = [m[role] for m in raw], [m[role] for m in mine[:3]]
        print(f"| {role} | {a[0]:.1f} | {a[1]:.1f} | {a[2]:.1f} | {a[2] - a[0]:+.1f} "
              f"| {b[0]:.1f} | {b[1]:.1f} | {b[2]:.1f} | {b[2] - b[0]:+.1f} |")
    print(f"variables left on the servers after dropping all of them: {mine[3]['variables still on the servers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
