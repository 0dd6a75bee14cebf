"""Where a training step's time goes: CPU per step in each process, and py-spy profiles.

Runs one of ``compare.py``'s workloads on daskps (2 ps, 2 trainers by
default) and reports, per process role (coordinator, scheduler, trainers,
parameter servers), the CPU milliseconds spent per step. With ``--py-spy DIR``
it also records each process with py-spy (``pip install py-spy``) while the
steps run and writes one speedscope/flamegraph file per role to ``DIR``.

    python benchmarks/profile_step.py --workload dense --steps 300
    python benchmarks/profile_step.py --workload dense --py-spy /tmp/prof
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _run_daskps  # noqa: E402
import _workloads  # noqa: E402

import daskps as dps  # noqa: E402
from daskps.distribute.cluster import cluster_workers  # noqa: E402


def _pids(client) -> dict[str, int]:
    scheduler = client.run_on_scheduler(os.getpid)
    roles = {"coordinator": os.getpid()} if scheduler == os.getpid() else {"coordinator": os.getpid(), "scheduler": scheduler}
    for addr, info in cluster_workers(client).items():
        roles[str(info["name"])] = client.run(os.getpid, workers=[addr])[addr]
    return roles


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for role, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[role] = t.user + t.system
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="dense", choices=["dispatch", "dense", "dense_jax", "ctr", "ctr_hash", "small"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=0, help="bounded staleness k (0: none)")
    parser.add_argument("--idle", action="store_true", help="py-spy also samples threads that wait")
    parser.add_argument("--py-spy", default=None, metavar="DIR", help="record every process with py-spy into DIR")
    args = parser.parse_args()
    with dps.LocalPSCluster(num_ps=args.ps, num_workers=args.workers) as cluster, cluster.get_client() as client:
        partitioner = dps.partitioners.MinSizePartitioner(256 << 10, max_shards=args.ps)
        with dps.ParameterServerStrategy(client, variable_partitioner=partitioner) as strategy:
            coordinator = dps.ClusterCoordinator(strategy, **({"staleness": args.staleness} if args.staleness else {}))
            if args.workload == "dense":  # count the model's own CPU on the trainers
                _run_daskps.dense_grads = _workloads.counted(_workloads.dense_grads)
            run = getattr(_run_daskps, f"_daskps_{args.workload}")
            run(strategy, coordinator, 20)  # warm up: build datasets, connections
            pids = _pids(client)
            spies = _start_spies(pids, args.py_spy, args.idle) if args.py_spy else []
            model_before = client.run(_model_cpu)
            before, start = _cpu(pids), time.perf_counter()
            rate = run(strategy, coordinator, args.steps)
            wall, after = time.perf_counter() - start, _cpu(pids)
            model = {a: (c[0] - model_before[a][0], c[1] - model_before[a][1]) for a, c in client.run(_model_cpu).items()}
            for spy in spies:
                spy.send_signal(2)
            for spy in spies:
                spy.wait(timeout=60)
    steps = args.steps + 20  # the runner's own warm-up steps count too
    print(f"{args.workload}: {rate:,.1f} per second; {1e3 * wall / steps:.2f} ms wall per step")
    total = 0.0
    for role in pids:
        ms = 1e3 * (after[role] - before[role]) / steps
        total += ms
        label = role + (" (+scheduler)" if role == "coordinator" and "scheduler" not in pids else "")
        print(f"  {label:26s} {ms:7.2f} ms CPU per step")
    print(f"  {'all':26s} {total:7.2f} ms CPU per step ({os.cpu_count()} cores give {os.cpu_count() * 1e3 * wall / steps:.2f})")
    model_seconds, model_calls = sum(m[0] for m in model.values()), sum(m[1] for m in model.values())
    if model_calls:
        trainers = sum(after[r] - before[r] for r in pids if r.startswith("worker-"))
        own = 1e3 * trainers / model_calls  # CPU per trainer step (a trainer's own step), all its threads
        inside = 1e3 * model_seconds / model_calls
        print(f"  per trainer step: {own:.2f} ms CPU, of which the model's maths {inside:.2f} ms, "
              f"outside it {own - inside:.2f} ms ({model_calls} steps timed)")
    return 0


def _model_cpu() -> tuple[float, int]:
    return tuple(_workloads.MODEL_CPU)  # type: ignore[return-value]


def _start_spies(pids: dict[str, int], out: str, idle: bool = False) -> list[subprocess.Popen]:
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    os.makedirs(out, exist_ok=True)
    return [subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", "200", "--format", "speedscope",
                              "--output", os.path.join(out, f"{role}.json"), "--nonblocking", *(["--idle"] if idle else [])],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for role, pid in pids.items()]


if __name__ == "__main__":
    sys.exit(main())
