"""What an open dashboard costs training: compare.py's daskps workloads with every daskps page open, and without.

Each round runs the workloads on a fresh ``LocalPSCluster`` twice, once with
a headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright)
holding every daskps page open in its own tab (the tables page and the five
plot pages, each refreshed every second) and once without, the order
alternating between rounds. Prints the best of each, their ratio and the
median of each round's own ratio (pages open / none), and while the pages
are open, how often each page drew and how much CPU the browser used.

By default the browser gets a core of its own (the last one) and the
cluster, the coordinator and the scheduler the others, in both arms: a user's
browser runs on the user's machine, not on the cluster's, so this measures
what the pages cost the servers (the scheduler's Bokeh sessions, the numbers
they read). ``--share-cores`` lets the browser draw on the cluster's cores
instead, as on a laptop that runs both: then the ratio also counts the
browser's own painting.

    python benchmarks/bench_dashboard.py                    # dense and ctr, 3 rounds
    python benchmarks/bench_dashboard.py --only dense --rounds 5
    python benchmarks/bench_dashboard.py --share-cores
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import _run_daskps
import psutil
from playwright.sync_api import sync_playwright

import daskps as dps
from daskps.ui.dashboard import ROUTE
from daskps.ui.plots import PAGES

CHROMIUM = "/usr/bin/chromium"
STEPS = {"dense": 3000, "ctr": 3000, "dispatch": 100000, "small": 1500}
# Counts the page's animation frames: Bokeh draws a plot in one, so frames/s says the page kept drawing.
COUNT_FRAMES = """(() => {
  let frames = 0;
  const request = window.requestAnimationFrame.bind(window);
  window.requestAnimationFrame = (callback) => request((t) => { frames += 1; return callback(t); });
  Object.defineProperty(window, "daskpsFrames", {get: () => frames});
})();"""


def _descendants() -> dict[int, psutil.Process]:
    return {c.pid: c for c in psutil.Process().children(recursive=True)}


def _thread_cores(process: psutil.Process) -> set[frozenset[int]]:
    """The cores each thread of ``process`` may run on (one entry per distinct set)."""
    out = set()
    for tid in os.listdir(f"/proc/{process.pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out.add(frozenset(os.sched_getaffinity(int(tid))))
    return out


def _pin_threads(processes: list[psutil.Process], cores: set[int]) -> None:
    """Every thread of ``processes`` on ``cores`` (threads and processes they start later inherit it).
    Chromium pins some of its own (SwiftShader's workers, "Thread<NN>") to cores of its choosing, whatever
    it inherited: its processes are pinned again once started."""
    for process in processes:
        with contextlib.suppress(FileNotFoundError):
            for tid in os.listdir(f"/proc/{process.pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cores)


def _check_placement(processes: list[psutil.Process], cores: set[int], what: str) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error, FileNotFoundError):
            where = _thread_cores(process)
            if where != {frozenset(cores)}:
                raise RuntimeError(f"{what}: {process.name()} ({process.pid}) has threads on {where}, not {cores}")


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        with contextlib.suppress(psutil.Error):
            times = p.cpu_times()
            total += times.user + times.system
    return total


@contextlib.contextmanager
def pages_open(base: str, core: int | None = None):
    """Every daskps page in its own tab; yields (tabs, the processes Playwright started: its driver, the
    browser). With ``core``, those run on that core alone, and every thread of the cluster's processes
    started before them on the other cores (checked)."""
    cores = os.sched_getaffinity(0)
    cluster_side = list(_descendants().values())
    if core is not None:
        os.sched_setaffinity(0, {core})  # this thread only: the driver and the browser it starts inherit it
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            tabs = []
            for route in [ROUTE, *PAGES]:
                tab = browser.new_page(viewport={"width": 1200, "height": 900})
                tab.add_init_script(COUNT_FRAMES)
                tab.goto(base + route)
                tabs.append(tab)
            os.sched_setaffinity(0, cores)
            known = {c.pid for c in cluster_side}
            browser_side = [p for pid, p in _descendants().items() if pid not in known]
            if core is not None:
                if not any("chrom" in p.name() for p in browser_side):
                    raise RuntimeError("found no browser process to check")
                _pin_threads(browser_side, {core})
                _check_placement(browser_side, {core}, "the browser's side")
                _check_placement(cluster_side, cores - {core}, "the cluster's side")
            try:
                yield tabs, browser_side
            finally:
                browser.close()
    finally:
        os.sched_setaffinity(0, cores)


def one_run(workloads: list[str], browser: bool, core: int | None) -> dict[str, float]:
    out = {}
    with dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster, cluster.get_client() as client:
        partitioner = dps.partitioners.MinSizePartitioner(256 << 10, max_shards=2)
        with dps.ParameterServerStrategy(client, variable_partitioner=partitioner) as strategy:
            coordinator = dps.ClusterCoordinator(strategy)
            base = cluster.dashboard_link.rsplit("/", 1)[0]
            with contextlib.ExitStack() as stack:
                tabs, browser_side = stack.enter_context(pages_open(base, core)) if browser else ([], [])
                time.sleep(2)  # the pages have loaded and refresh
                frames = [tab.evaluate("window.daskpsFrames") for tab in tabs]
                drawing = _cpu_seconds(browser_side)
                start = time.perf_counter()
                for name in workloads:
                    out[name] = getattr(_run_daskps, f"_daskps_{name}")(strategy, coordinator, STEPS[name])
                if tabs:
                    seconds = time.perf_counter() - start
                    if core is not None:  # still where they were put
                        _check_placement(browser_side, {core}, "the browser's side, after training")
                    drawn = [tab.evaluate("window.daskpsFrames") - f for tab, f in zip(tabs, frames)]
                    busy = (_cpu_seconds(browser_side) - drawing) / seconds
                    print("    frames/s per page while training: "
                          + ", ".join(f"{r.rsplit('-', 1)[-1]} {d / seconds:.1f}" for r, d in zip([ROUTE, *PAGES], drawn))
                          + f"; the browser and its driver used {busy:.0%} of a core")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="dense,ctr")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--share-cores", action="store_true",
                        help="let the browser draw on the cluster's cores (default: it gets the last core alone)")
    args = parser.parse_args()
    workloads = args.only.split(",")
    cores = sorted(os.sched_getaffinity(0))
    core = None if args.share_cores or len(cores) < 2 else cores[-1]
    if core is not None:
        _pin_threads([psutil.Process()], set(cores[:-1]))  # the cluster's processes, started later, inherit it
        print(f"# the cluster, coordinator and scheduler on cores {cores[:-1]}; the browser on core {core}")
    else:
        print(f"# the browser shares cores {cores} with the cluster, coordinator and scheduler")
    best: dict[bool, dict[str, float]] = {False: {}, True: {}}
    paired: dict[str, list[float]] = {name: [] for name in workloads}  # open / none within each round
    for r in range(args.rounds):
        got = {}
        for browser in ((False, True) if r % 2 == 0 else (True, False)):
            got[browser] = one_run(workloads, browser, core)
            print(f"  round {r + 1} {'pages open' if browser else 'no pages '} {got[browser]}", flush=True)
            for k, v in got[browser].items():
                best[browser][k] = max(best[browser].get(k, 0.0), v)
        for name in workloads:
            paired[name].append(got[True][name] / got[False][name])
    print(f"# {args.rounds} rounds; 2 ps, 2 trainers; browser "
          + ("sharing the cluster's cores" if core is None else f"on core {core} alone"))
    print("| workload | no pages (best) | every daskps page open (best) | best / best "
          "| median of each round's ratio | lowest, highest |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in workloads:
        print(f"| {name} | {best[False][name]:,.0f} | {best[True][name]:,.0f} | "
              f"{best[True][name] / best[False][name]:.3f}x | {statistics.median(paired[name]):.3f}x | "
              f"{min(paired[name]):.3f}x, {max(paired[name]):.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
