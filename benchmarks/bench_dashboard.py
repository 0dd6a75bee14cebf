"""What an open dashboard costs training: compare.py's daskps workloads with every daskps page open, and without.

Each round runs the workloads on a fresh ``LocalPSCluster`` twice, once with
a headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright)
holding every daskps page open in its own tab (the tables page and the five
plot pages, each refreshed every second) and once without, the order
alternating between rounds. Prints the best of each and the ratio.

    python benchmarks/bench_dashboard.py                    # dense and ctr, 3 rounds
    python benchmarks/bench_dashboard.py --only dense --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import time

import _run_daskps
from playwright.sync_api import sync_playwright

import daskps as dps
from daskps.ui.dashboard import ROUTE
from daskps.ui.plots import PAGES

CHROMIUM = "/usr/bin/chromium"
STEPS = {"dense": 3000, "ctr": 3000, "dispatch": 20000, "small": 1500}
# Counts the page's animation frames: Bokeh draws a plot in one, so frames/s says the page kept drawing.
COUNT_FRAMES = """(() => {
  let frames = 0;
  const request = window.requestAnimationFrame.bind(window);
  window.requestAnimationFrame = (callback) => request((t) => { frames += 1; return callback(t); });
  Object.defineProperty(window, "daskpsFrames", {get: () => frames});
})();"""


@contextlib.contextmanager
def pages_open(base: str):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        tabs = []
        for route in [ROUTE, *PAGES]:
            tab = browser.new_page(viewport={"width": 1200, "height": 900})
            tab.add_init_script(COUNT_FRAMES)
            tab.goto(base + route)
            tabs.append(tab)
        try:
            yield tabs
        finally:
            browser.close()


def one_run(workloads: list[str], browser: bool) -> dict[str, float]:
    out = {}
    with dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster, cluster.get_client() as client:
        partitioner = dps.partitioners.MinSizePartitioner(256 << 10, max_shards=2)
        with dps.ParameterServerStrategy(client, variable_partitioner=partitioner) as strategy:
            coordinator = dps.ClusterCoordinator(strategy)
            base = cluster.dashboard_link.rsplit("/", 1)[0]
            with pages_open(base) if browser else contextlib.nullcontext() as tabs:
                time.sleep(2)  # the pages have loaded and refresh
                frames = [tab.evaluate("window.daskpsFrames") for tab in tabs or []]
                start = time.perf_counter()
                for name in workloads:
                    out[name] = getattr(_run_daskps, f"_daskps_{name}")(strategy, coordinator, STEPS[name])
                if tabs:
                    seconds = time.perf_counter() - start
                    drawn = [tab.evaluate("window.daskpsFrames") - f for tab, f in zip(tabs, frames)]
                    print("    frames/s per page while training: "
                          + ", ".join(f"{r.rsplit('-', 1)[-1]} {d / seconds:.1f}" for r, d in zip([ROUTE, *PAGES], drawn)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="dense,ctr")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workloads = args.only.split(",")
    best: dict[bool, dict[str, float]] = {False: {}, True: {}}
    for r in range(args.rounds):
        for browser in ((False, True) if r % 2 == 0 else (True, False)):
            got = one_run(workloads, browser)
            print(f"  round {r + 1} {'pages open' if browser else 'no pages '} {got}", flush=True)
            for k, v in got.items():
                best[browser][k] = max(best[browser].get(k, 0.0), v)
    print(f"# best of {args.rounds} rounds; 2 ps, 2 trainers")
    print("| workload | no pages | every daskps page open | open / none |")
    print("| --- | --- | --- | --- |")
    for name in workloads:
        print(f"| {name} | {best[False][name]:,.0f} | {best[True][name]:,.0f} | "
              f"{best[True][name] / best[False][name]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
