"""Where a training step's time goes: CPU per step in each process, and py-spy profiles.

Runs one of ``compare.py``'s workloads on daskps (2 ps, 2 trainers by
default) and reports, per process role (coordinator, scheduler, trainers,
parameter servers), the CPU milliseconds spent per step. With ``--py-spy DIR``
it also records each process with py-spy (``pip install py-spy``) while the
steps run and writes one speedscope/flamegraph file per role to ``DIR``.

    python benchmarks/profile_step.py --workload dense --steps 300
    python benchmarks/profile_step.py --workload dense --py-spy /tmp/prof
    python benchmarks/profile_step.py --workload dense --trace     # per-hop table of a step
    python benchmarks/profile_step.py --workload dense --threads   # CPU per step of every thread

With ``--trace`` every process records when each hop of the hot path started
and ended (``daskps._core.trace``: a trainer's sends, waits, reads of the
answers, held pushes and reports; a server's reading, running and answering
of each message; the coordinator's handling of report events), and the
script prints what one step costs per hop and how a trainer's wall time per
step divides between them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _run_daskps  # noqa: E402
import _workloads  # noqa: E402

import daskps as dps  # noqa: E402
from daskps._core import trace  # noqa: E402
from daskps.distribute.cluster import cluster_workers  # noqa: E402


def _pids(client) -> dict[str, int]:
    scheduler = client.run_on_scheduler(os.getpid)
    roles = {"coordinator": os.getpid()} if scheduler == os.getpid() else {"coordinator": os.getpid(), "scheduler": scheduler}
    for addr, info in cluster_workers(client).items():
        roles[str(info["name"])] = client.run(os.getpid, workers=[addr])[addr]
    return roles


def _thread_names() -> dict[int, str]:
    """This process's threads: native id -> Python name (run in each process)."""
    import threading

    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def _thread_cpu(pids: dict[str, int]) -> dict[tuple[str, int], float]:
    """CPU seconds of each thread of each role's process so far, by (role, native id)."""
    out = {}
    for role, pid in pids.items():
        for t in psutil.Process(pid).threads():
            out[role, t.id] = t.user_time + t.system_time
    return out


def _cpu(pids: dict[str, int]) -> dict[str, tuple[float, float]]:
    """CPU seconds (user, system) of each role's process so far."""
    out = {}
    for role, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[role] = (t.user, t.system)
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
    parser.add_argument("--trace", action="store_true", help="time every hop of each step (see above)")
    parser.add_argument("--threads", action="store_true", help="CPU per step of each thread of each process")
    parser.add_argument("--trace-out", default=None, metavar="FILE", help="with --trace: write every span as JSON")
    args = parser.parse_args()
    if args.trace:
        os.environ["DASKPS_TRACE"] = "1"  # before daskps is imported in the cluster's processes
        trace.ON = True
    with dps.LocalPSCluster(num_ps=args.ps, num_workers=args.workers) as cluster, cluster.get_client() as client:
        partitioner = dps.partitioners.MinSizePartitioner(256 << 10, max_shards=args.ps)
        with dps.ParameterServerStrategy(client, variable_partitioner=partitioner) as strategy:
            coordinator = dps.ClusterCoordinator(strategy, **({"staleness": args.staleness} if args.staleness else {}))
            if args.workload == "dense":  # count the model's own CPU on the trainers
                _run_daskps.dense_grads = _workloads.counted(_workloads.dense_grads)
            run = getattr(_run_daskps, f"_daskps_{args.workload}")
            run(strategy, coordinator, 20)  # warm up: build datasets, connections
            pids = _pids(client)
            seen: dict = {}

            @contextlib.contextmanager
            def measured():  # around the timed steps alone: after the runner's variables, data and warm-up
                spies = _start_spies(pids, args.py_spy, args.idle) if args.py_spy else []
                model_before = client.run(_model_cpu)
                client.run(trace.collect)
                trace.collect()
                threads_before = _thread_cpu(pids) if args.threads else {}
                before, start = _cpu(pids), time.perf_counter()
                yield
                seen["start"], seen["wall"], after = start, time.perf_counter() - start, _cpu(pids)
                if args.threads:
                    names = {pid: client.run(_thread_names, workers=[a])[a]
                             for a, info in cluster_workers(client).items()
                             for pid in [pids[str(info["name"])]]}
                    names[os.getpid()] = _thread_names()
                    names[pids.get("scheduler", os.getpid())] = client.run_on_scheduler(_thread_names)
                    grown = _thread_cpu(pids)
                    seen["threads"] = [(role, names[pids[role]].get(tid, f"thread {tid}"),
                                        cpu - threads_before.get((role, tid), 0.0)) for (role, tid), cpu in grown.items()]
                seen["cpu"] = {role: sum(after[role]) - sum(before[role]) for role in pids}
                seen["system"] = {role: after[role][1] - before[role][1] for role in pids}
                seen["spans"] = {cluster_workers(client)[a]["name"]: s for a, s in client.run(trace.collect).items()}
                seen["spans"]["coordinator"] = trace.collect()
                seen["model"] = {a: tuple(x - y for x, y in zip(c, model_before[a]))
                                 for a, c in client.run(_model_cpu).items()}
                for spy in spies:
                    spy.send_signal(2)
                for spy in spies:
                    spy.wait(timeout=60)

            _workloads.AROUND_TIMED = measured
            rate = run(strategy, coordinator, args.steps)
            _workloads.AROUND_TIMED = contextlib.nullcontext
    wall, cpu, spans, model = seen["wall"], seen["cpu"], seen["spans"], seen["model"]
    steps = args.steps
    print(f"{args.workload}: {rate:,.1f} per second; {1e3 * wall / steps:.2f} ms wall per step")
    total = 0.0
    for role in cpu:
        ms = 1e3 * cpu[role] / steps
        total += ms
        label = role + (" (+scheduler)" if role == "coordinator" and "scheduler" not in cpu else "")
        print(f"  {label:26s} {ms:7.2f} ms CPU per step ({1e3 * seen['system'][role] / steps:.2f} in the kernel)")
    cores = len(os.sched_getaffinity(0))
    print(f"  {'all':26s} {total:7.2f} ms CPU per step ({cores} cores give {cores * 1e3 * wall / steps:.2f}: "
          f"{1 - total / (cores * 1e3 * wall / steps):.0%} idle)")
    if args.threads:
        by_thread: dict = {}
        for role, name, cpu_s in seen["threads"]:
            key = (role, re.sub(r"[-_ ]?\d+$", "", name))  # a pool's threads together
            by_thread[key] = by_thread.get(key, 0.0) + cpu_s
        print("  by thread, ms CPU per step:")
        for (role, name), cpu_s in sorted(by_thread.items(), key=lambda kv: -kv[1]):
            if 1e3 * cpu_s / steps >= 0.005:
                print(f"    {role:14s} {name:40s} {1e3 * cpu_s / steps:6.3f}")
    model_seconds, model_calls = sum(m[0] for m in model.values()), sum(m[1] for m in model.values())
    if model_calls:
        trainers = sum(cpu[r] for r in cpu if r.startswith("worker-"))
        own = 1e3 * trainers / model_calls  # CPU per trainer step (a trainer's own step), all its threads
        inside = 1e3 * model_seconds / model_calls
        print(f"  per trainer step: {own:.2f} ms CPU, of which the model's maths {inside:.2f} ms, "
              f"outside it {own - inside:.2f} ms ({model_calls} steps timed)")
    if args.trace:
        print(hop_table(spans, wall, model))
        if args.trace_out:
            with open(args.trace_out, "w") as f:
                json.dump({"start": seen["start"], "wall": wall, "spans": spans}, f)
    return 0


TRAINER_HOPS = ("send", "wait", "receive", "hold")  # inside a function, outside its own code


def hop_table(spans: dict[str, list[tuple[str, float, float]]], wall: float, model: dict) -> str:
    """What a step costs per hop (ms per step, over every process of a role), and how a trainer's wall
    time per step divides: its hops, the function's own code, the time between functions and between
    batches."""
    functions = sum(1 for s in spans.values() for hop, _, _ in s if hop == "function")
    if not functions:
        return "  (no functions traced)"
    totals: dict[tuple[str, str], float] = {}
    for name, rows in spans.items():
        role = "trainer" if str(name).startswith("worker-") else "server" if str(name).startswith("ps-") else str(name)
        for hop, start, end in rows:
            totals[role, hop] = totals.get((role, hop), 0.0) + (end - start)
    lines = [f"  hops, ms per step ({functions} functions traced, every process of the role together):",
             "  | where | hop | ms per step |", "  | --- | --- | ---: |"]
    for (role, hop), seconds in sorted(totals.items()):
        lines.append(f"  | {role} | {hop} | {1e3 * seconds / functions:.3f} |")
    trainers = [n for n in spans if str(n).startswith("worker-")]
    inside = {h: totals.get(("trainer", h), 0.0) for h in TRAINER_HOPS}
    own = totals.get(("trainer", "function"), 0.0) - sum(inside.values())
    maths = sum(m[2] for m in model.values())  # wall time in the maths (a thread that waits for a core counts)
    between = totals.get(("trainer", "batch"), 0.0) - totals.get(("trainer", "function"), 0.0)
    idle = len(trainers) * wall - totals.get(("trainer", "batch"), 0.0)
    parts = [("send (pack, write)", inside["send"]), ("wait for the answers", inside["wait"]),
             ("receive (read, unpack)", inside["receive"]), ("hold pushes (copy)", inside["hold"]),
             ("the function's code: maths", min(maths, own) if maths else 0.0),
             ("the function's code: the rest", own - (min(maths, own) if maths else 0.0)),
             ("between functions (flush, report)", between), ("between batches (no batch)", idle)]
    lines += [f"  a trainer's wall time per step ({1e3 * len(trainers) * wall / functions:.3f} ms):",
              "  | part | ms per step | share |", "  | --- | ---: | ---: |"]
    for label, seconds in parts:
        lines.append(f"  | {label} | {1e3 * seconds / functions:.3f} | {seconds / (len(trainers) * wall):.0%} |")
    served = sum(totals.get(("server", h), 0.0) for h in ("read in", "execute", "write"))
    lines.append(f"  of the wait, the servers' own handling of the messages (read in, execute, write): "
                 f"{1e3 * served / functions:.3f} ms per step")
    return "\n".join(lines)


def _model_cpu() -> tuple[float, int, float]:
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
