"""How daskps' costs grow with the number of trainers and servers (issue 44): a scale harness.

Runs N simulated trainers and M servers on this machine: a ``dask scheduler`` process of its own, the
servers and trainers as Dask workers several to a process (``_scale_host.py``: one event loop, one
thread per worker), and the coordinator in this process. Each scheduled function reads a 64-float
variable, pushes a gradient to it, spins for ``--work-us`` microseconds and sleeps ``--sleep-ms``
(the variables are spread over the servers). For each (N, M) it reports:

- functions per second, over ``--functions-per-trainer`` x N functions (at least 1,000), and how many
  trainers ran a batch meanwhile (short functions go to few trainers: that is the batching policy);
- CPU per function of the coordinator (this process) and of the scheduler, less what each costs
  idle over the same time (measured first, with nothing scheduled), and of the trainers' and the
  servers' processes together (their idle cost subtracted too);
- the scheduler's task transitions and events per function (what flows through it);
- the coordinator's and the scheduler's resident memory;
- seconds for ``ParameterServerStrategy(client)`` to start and for ``strategy.close()``, and the CPU
  seconds the coordinator and the scheduler spent in each (the rest of a start-up is the servers' own
  start, which a real cluster runs on machines of their own, all at once, and this one on two cores).

    python benchmarks/bench_scale.py --trainers 8,32,128,512 --servers 2,8 --plot benchmarks/scale.png

Everything listens on 127.0.0.1, ports chosen by the system.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
from distributed import Client

import daskps as dps

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINERS_PER_HOST = 64
SERVERS_PER_HOST = 8


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class Cluster:
    """A ``dask scheduler`` and hosts of simulated workers, started here and stopped on exit."""

    def __init__(self, trainers: int, servers: int, tmp: str, servers_per_host: int = SERVERS_PER_HOST):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        sched_file = os.path.join(tmp, "scheduler.json")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
        self.scheduler = self._start([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                      "--port", "0", "--dashboard-address", "127.0.0.1:0",
                                      "--scheduler-file", sched_file, "--preload", "daskps.dashboard"], env)
        deadline = time.monotonic() + 60
        while True:
            try:
                with open(sched_file) as f:
                    json.load(f)
                break
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise RuntimeError("dask scheduler did not start") from None
                time.sleep(0.1)
        self.sched_file = sched_file
        self.hosts: dict[str, list[psutil.Process]] = {"ps": [], "worker": []}
        for role, total, per in (("ps", servers, servers_per_host), ("worker", trainers, TRAINERS_PER_HOST)):
            for first in range(0, total, per):
                count = min(per, total - first)
                proc = self._start([sys.executable, os.path.join(HERE, "_scale_host.py"), sched_file, role,
                                    str(first), str(count)], env, stdout=subprocess.PIPE)
                self.hosts[role].append(psutil.Process(proc.pid))
        for proc in self.procs[1:]:
            line = proc.stdout.readline()
            if b"ready" not in line:
                raise RuntimeError(f"a host of workers did not start: {line!r}")

    def _start(self, cmd: list[str], env: dict, stdout=None) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=open(os.path.join(self.tmp, f"{len(self.procs)}.log"), "w"))
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _step(vs: list, push, work_us: float, sleep_ms: float):
    """The scheduled function: function ``i`` reads variable ``i`` (mod their number), pushes a gradient to
    it with ``push(gradient, variable)``, spins ``work_us`` and sleeps ``sleep_ms``."""
    grad = np.full(64, 0.001, np.float32)

    def step(i):
        v = vs[i % len(vs)]
        v.read_value()
        push(grad, v)
        _spin(work_us)
        if sleep_ms:
            time.sleep(sleep_ms / 1000)  # the rest of a step off this machine's cores

    return step


def _warm(coordinator, step, trainers: int) -> None:
    """Two functions per trainer, so that every trainer has run something (imports, connections)."""
    for i in range(2 * trainers):
        coordinator.schedule(step, args=(i,))
    coordinator.join()


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def measure(trainers: int, servers: int, per_trainer: int, work_us: float, idle_s: float,
            sleep_ms: float = 0.0, observe: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="daskps-scale-") as tmp:
        cluster = Cluster(trainers, servers, tmp)
        try:
            with Client(scheduler_file=cluster.sched_file) as client:
                me = [psutil.Process()]
                sched = [psutil.Process(cluster.scheduler.pid)]
                cpu0, t0 = _cpu(me + sched), time.perf_counter()
                strategy = dps.ParameterServerStrategy(client)
                started = time.perf_counter() - t0
                start_cpu = _cpu(me + sched) - cpu0
                coordinator = dps.ClusterCoordinator(strategy)
                with strategy.scope():
                    vs = [dps.Variable(np.zeros(64, np.float32), name=f"scale_{i}") for i in range(servers)]
                    opt = dps.optimizers.SGD(0.01)
                step = _step(vs, lambda g, v: opt.apply_gradients([(g, v)]), work_us, sleep_ms)
                _warm(coordinator, step, trainers)
                trainer_addresses = set(strategy.cluster_resolver.cluster_spec()["worker"])
                groups = {"coordinator": me, "scheduler": sched, "trainers": cluster.hosts["worker"],
                          "servers": cluster.hosts["ps"]}
                before = {k: _cpu(p) for k, p in groups.items()}
                time.sleep(idle_s)
                idle = {k: (_cpu(p) - before[k]) / idle_s for k, p in groups.items()}  # cores, idle
                counters = client.run_on_scheduler(_counters)
                tasks = client.run(_executed)
                before = {k: _cpu(p) for k, p in groups.items()}
                n = max(1000, per_trainer * trainers)
                t0 = time.perf_counter()
                for i in range(n):
                    coordinator.schedule(step, args=(i,))
                coordinator.join()
                wall = time.perf_counter() - t0
                after = {k: _cpu(p) for k, p in groups.items()}
                counted = client.run_on_scheduler(_counters)
                ran = client.run(_executed)
                used = sum(1 for w, k in ran.items() if k > tasks.get(w, 0) and str(w) in trainer_addresses)
                out = {"trainers": trainers, "servers": servers, "functions": n, "per_second": n / wall}
                for k in groups:
                    out[f"{k}_us"] = max(0.0, after[k] - before[k] - idle[k] * wall) / n * 1e6
                    out[f"{k}_idle_cores"] = idle[k]
                out["trainers_used"] = used  # that ran a batch while timed
                out["transitions"] = (counted[0] - counters[0]) / n
                out["events"] = (counted[1] - counters[1]) / n
                if observe:
                    out.update(_observe(client, coordinator, step, n, sched, idle["scheduler"]))
                out["coordinator_mb"] = me[0].memory_info().rss / 2**20
                out["scheduler_mb"] = sched[0].memory_info().rss / 2**20
                out["start_s"] = started
                out["start_cpu_s"] = start_cpu  # the coordinator's and the scheduler's part of it
                cpu0, t0 = _cpu(me + sched), time.perf_counter()
                strategy.close()
                out["close_s"] = time.perf_counter() - t0
                out["close_cpu_s"] = _cpu(me + sched) - cpu0
                return out
        finally:
            cluster.close()


def measure_recovery(trainers: int, servers: int, per_trainer: int, work_us: float, sleep_ms: float) -> dict:
    """A server lost while every trainer works: its process SIGKILLed a third of the way through a run, the
    coordinator re-creating it on another server's worker from a checkpoint. Servers one to a process here."""
    import signal

    import dask

    # Its process does not come back (no Nanny): the new server goes to another server's worker at once,
    # not after the default wait for a restarted worker of the same name.
    with tempfile.TemporaryDirectory(prefix="daskps-scale-") as tmp, \
            dask.config.set({"daskps.recovery-same-worker-wait": "0s"}):
        cluster = Cluster(trainers, servers, tmp, servers_per_host=1)
        try:
            with Client(scheduler_file=cluster.sched_file) as client:
                strategy = dps.ParameterServerStrategy(client)
                with strategy.scope():
                    vs = [dps.Variable(np.zeros(64, np.float32), name=f"scale_{i}") for i in range(servers)]
                manager = dps.CheckpointManager(dps.Checkpoint(**{f"v{i}": v for i, v in enumerate(vs)}),
                                                os.path.join(tmp, "ckpt"))
                coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)
                step = _step(vs, lambda g, v: v.assign_sub(g), work_us, sleep_ms)
                _warm(coordinator, step, trainers)
                manager.save()
                ps0 = strategy.servers[0].address
                pid = client.run(os.getpid, workers=[ps0])[ps0]
                n = max(1000, per_trainer * trainers)
                t0 = time.perf_counter()
                remotes = [coordinator.schedule(step, args=(i,)) for i in range(n)]
                deadline = time.monotonic() + 600
                while coordinator.summary()["done"] < 2 * trainers + n // 3 and time.monotonic() < deadline:
                    time.sleep(0.005)
                before = (coordinator.summary()["done"] - 2 * trainers) / (time.perf_counter() - t0)
                os.kill(pid, signal.SIGKILL)
                killed, deadline = time.perf_counter(), time.monotonic() + 600
                while not coordinator.recoveries:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no recovery 10 minutes after the kill: {coordinator.summary()}")
                    time.sleep(0.01)
                recovered = time.perf_counter() - killed
                done_at_recovery = coordinator.summary()["done"]
                coordinator.join()
                ended = time.perf_counter()
                assert all(r.status == "finished" for r in remotes)
                (report,) = coordinator.recoveries
                summary = coordinator.summary()
                after = (summary["done"] - done_at_recovery) / max(1e-9, ended - killed - recovered)
                out = {"trainers": trainers, "servers": servers, "functions": n, "per_second_before": before,
                       "recovered_s": recovered, "recovery_s": report.seconds, "join_after_kill_s": ended - killed,
                       "rerun": summary["rerun"], "per_second_after": after}
                strategy.close()
                return out
        finally:
            cluster.close()


def _observe(client, coordinator, step, n: int, sched: list[psutil.Process], sched_idle: float) -> dict:
    """What watching costs: a ``/metrics`` scrape (its size and the scheduler's CPU for it), and the
    scheduler's CPU per function while the dashboard's trainers page is open in a headless Chromium."""
    import urllib.request

    from playwright.sync_api import sync_playwright

    port = client.scheduler_info()["services"]["dashboard"]
    base = f"http://127.0.0.1:{port}"
    sizes, cpu0, t0 = [], _cpu(sched), time.perf_counter()
    for _ in range(10):
        with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
            sizes.append(len(r.read()))
    scrape_wall = (time.perf_counter() - t0) / 10
    scrape_cpu = max(0.0, _cpu(sched) - cpu0 - sched_idle * scrape_wall * 10) / 10
    body = urllib.request.urlopen(base + "/metrics", timeout=60).read().decode()
    daskps_series = sum(1 for line in body.splitlines() if line.startswith("dask_daskps_"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(base + "/individual-daskps-trainers", timeout=120_000)
            deadline = time.monotonic() + 60
            while page.locator("canvas").count() == 0 and time.monotonic() < deadline:
                page.wait_for_timeout(200)
            time.sleep(3)  # the page's first refresh (the timeline's history) is not what a run costs
            cpu0, t0 = _cpu(sched), time.perf_counter()
            for i in range(n):
                coordinator.schedule(step, args=(i,))
            coordinator.join()
            wall = time.perf_counter() - t0
            with_page = max(0.0, _cpu(sched) - cpu0 - sched_idle * wall) / n * 1e6
        finally:
            browser.close()
    return {"metrics_bytes": sizes[-1], "metrics_daskps_series": daskps_series, "metrics_scrape_ms": scrape_wall * 1e3,
            "metrics_scrape_cpu_ms": scrape_cpu * 1e3, "scheduler_us_with_dashboard": with_page,
            "per_second_with_dashboard": n / wall}


def _executed(dask_worker) -> int:
    return dask_worker.state.executed_count


def _counters(dask_scheduler) -> tuple[int, int]:
    events = sum(t.count for t in dask_scheduler._broker._topics.values())  # every event published, all topics
    return dask_scheduler.transition_counter, events


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", default="8,32,128,512")
    parser.add_argument("--servers", default="2,8")
    parser.add_argument("--functions-per-trainer", type=int, default=30)
    parser.add_argument("--work-us", type=float, default=200.0)
    parser.add_argument("--sleep-ms", type=float, default=0.0,
                        help="each function also sleeps this long: a step whose time is mostly spent off this "
                             "machine's cores (an accelerator, another machine), as for real trainers with "
                             "100 ms steps, which 2 cores cannot run hundreds of")
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--observe", action="store_true",
                        help="also time /metrics scrapes, and the run again with the dashboard's trainers page open "
                             "in a headless Chromium (/usr/bin/chromium, playwright)")
    parser.add_argument("--recovery", action="store_true",
                        help="instead: SIGKILL a server's process a third of the way through a run, and time the "
                             "recovery and the functions/s before and after it")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--plot", default=None, help="draw CPU per function against trainers into this PNG")
    args = parser.parse_args(argv)
    if args.recovery:
        print("| trainers | servers | functions/s before | recovered after (s) | of which re-creating and restoring (s) "
              "| join() after the kill (s) | functions re-run | functions/s after |")
        print("| --- " * 8 + "|")
        for m in (int(x) for x in args.servers.split(",")):
            for n in (int(x) for x in args.trainers.split(",")):
                r = measure_recovery(n, m, args.functions_per_trainer, args.work_us, args.sleep_ms)
                print(f"| {n} | {m} | {r['per_second_before']:,.0f} | {r['recovered_s']:.1f} | {r['recovery_s']:.1f} "
                      f"| {r['join_after_kill_s']:.1f} | {r['rerun']:,} | {r['per_second_after']:,.0f} |", flush=True)
        return
    rows = []
    print("| trainers | servers | functions/s | coordinator us/fn | scheduler us/fn | trainers us/fn | servers us/fn "
          "| transitions/fn | events/fn | coordinator MB | scheduler MB | start s (CPU) | close s (CPU) "
          "| idle cores (sched, trainers) | trainers used |")
    print("| --- " * 15 + "|")
    for m in (int(x) for x in args.servers.split(",")):
        for n in (int(x) for x in args.trainers.split(",")):
            r = measure(n, m, args.functions_per_trainer, args.work_us, args.idle_seconds, args.sleep_ms,
                        args.observe)
            rows.append(r)
            print(f"| {n} | {m} | {r['per_second']:,.0f} | {r['coordinator_us']:,.0f} | {r['scheduler_us']:,.0f} "
                  f"| {r['trainers_us']:,.0f} | {r['servers_us']:,.0f} | {r['transitions']:.2f} | {r['events']:.2f} "
                  f"| {r['coordinator_mb']:.0f} | {r['scheduler_mb']:.0f} | {r['start_s']:.2f} ({r['start_cpu_s']:.2f}) "
                  f"| {r['close_s']:.2f} ({r['close_cpu_s']:.2f}) "
                  f"| {r['scheduler_idle_cores']:.2f}, {r['trainers_idle_cores']:.2f} | {r['trainers_used']} |", flush=True)
    if args.observe:
        print("\n| trainers | servers | /metrics bytes | daskps series | scrape ms (scheduler CPU ms) "
              "| scheduler us/fn, dashboard open | functions/s, dashboard open |")
        print("| --- " * 7 + "|")
        for r in rows:
            print(f"| {r['trainers']} | {r['servers']} | {r['metrics_bytes']:,} | {r['metrics_daskps_series']} "
                  f"| {r['metrics_scrape_ms']:.1f} ({r['metrics_scrape_cpu_ms']:.1f}) "
                  f"| {r['scheduler_us_with_dashboard']:,.0f} (closed: {r['scheduler_us']:,.0f}) "
                  f"| {r['per_second_with_dashboard']:,.0f} (closed: {r['per_second']:,.0f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


def plot(rows: list[dict], path: str, before: list[dict] | None = None, title: str = "") -> None:
    """Coordinator plus scheduler CPU per function against the number of trainers, one line per number of
    servers (log scale in trainers); ``before``: rows of an earlier run, drawn dashed beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, data, style in (("before", before or [], "--"), ("", rows, "-")):
        for m in sorted({r["servers"] for r in data}):
            mine = sorted((r for r in data if r["servers"] == m), key=lambda r: r["trainers"])
            ax.plot([r["trainers"] for r in mine], [r["coordinator_us"] + r["scheduler_us"] for r in mine],
                    "o" + style, label=f"{m} servers" + (f" ({label})" if label else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("simulated trainers")
    ax.set_ylabel("coordinator + scheduler CPU per function (us)")
    ax.set_title(title or "daskps: what one function costs the coordinator and the scheduler")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
