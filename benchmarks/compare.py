"""daskps against TensorFlow's ParameterServerStrategy, Ray actors, PyTorch RPC and raw Dask, side by side.

Four workloads (see ``_workloads.py``) on 2 parameter servers and 2 trainers
by default: empty-function dispatch, a dense MLP, a CTR model with a sharded
embedding table, and 64 small variables; and on daskps alone ``dense_jax``,
the dense MLP with a jitted JAX step (when JAX is installed), read against
daskps' own ``dense``; ``keras_fit`` and ``keras_fit4``, the same MLP as a compiled
Keras 3 model trained by ``dps.keras.fit`` (``steps_per_execution`` 1 and 4, JAX
backend), read against ``dense_jax``; and ``ctr_hash``, the CTR model with a hash
``EmbeddingTable``, read against daskps' own ``ctr``. Each system runs in a fresh
subprocess per round, the systems alternating, over ``--rounds`` rounds; the
table shows the best round of each and daskps' ratio to each peer.

    pip install ".[compare]"                      # tensorflow-cpu, ray and torch
    python benchmarks/compare.py                  # the table
    python benchmarks/compare.py --workers 2,4,8  # scaling: dispatch and dense per trainer count
                                                  # (dispatch: 5,000 functions; dense: 1,000 steps per trainer)

``dlrm`` (``_dlrm.py``) is a DLRM with 8 multi-hot features pooled by mean,
run by daskps (2 ps, 2 trainers), TensorFlow's ParameterServerStrategy
(``safe_embedding_lookup_sparse``) and TorchRec (``DistributedModelParallel``
over 2 gloo processes, fused row-wise Adagrad); besides examples/s it
prints each system's held-out AUC after the same number of examples and
the bytes daskps' servers moved per example.

Systems that are not installed are skipped, and said so. Every peer listens
on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _workloads import BATCH, EXAMPLES_PER_STEP, UNITS, run_child  # noqa: E402

SYSTEMS = {"daskps": "daskps", "tf": "tensorflow", "ray": "ray", "torch": "torch", "torchrec": "torchrec",
           "dask": "distributed"}
NAMES = {"daskps": "daskps", "tf": "TensorFlow PSS", "ray": "Ray actors", "torch": "PyTorch RPC", "torchrec": "TorchRec",
         "dask": "raw Dask"}
WORKLOADS = ["dispatch", "dense", "dense_jax", "keras_fit", "keras_fit4", "ctr", "ctr_hash", "small", "dlrm"]
# Workloads only some systems run (the others run every workload but dlrm; TorchRec runs dlrm only).
ONLY_ON = {"dense_jax": ("daskps",), "keras_fit": ("daskps",), "keras_fit4": ("daskps",), "ctr_hash": ("daskps",),
           "dlrm": ("daskps", "tf", "torchrec")}
STEPS = {"dispatch": 1000, "dense": 1000, "dense_jax": 1000, "keras_fit": 1000, "keras_fit4": 1000, "ctr": 1000,
         "ctr_hash": 1000, "small": 1000, "dlrm": 800}  # long enough for a steady state (dlrm: 204,800 examples)
STEPS_PER_TRAINER = {"dense": 1000}  # in the scaling mode
SCALING_STEPS = {"dispatch": 5000}  # in the scaling mode: long enough to time on a big machine


def run_one(system: str, workloads: list[str], num_ps: int, num_workers: int, steps: dict[str, int],
            staleness: int = 0) -> dict:
    """In a subprocess: run ``workloads`` on ``system`` and return rates."""
    if system == "bound":  # one core's maths alone, steps per second (see ``bound``)
        import _workloads

        return {w: _workloads.maths_rate(w) for w in workloads if w in _workloads.BOUND_MATHS}
    module = {"daskps": "_run_daskps", "dask": "_run_daskps", "tf": "_run_tf", "ray": "_run_ray",
              "torch": "_run_torch", "torchrec": "_run_torchrec"}[system]
    runner = getattr(__import__(module), f"run_{system}")
    if system == "daskps":
        return runner(workloads, num_ps, num_workers, steps, staleness=staleness)
    return runner(workloads, num_ps, num_workers, steps)


def _spawn(system: str, workloads: list[str], num_ps: int, num_workers: int, steps: dict, timeout: float,
           staleness: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", system, "--ps", str(num_ps), "--workers", str(num_workers),
           "--only", ",".join(workloads), "--steps", json.dumps(steps), "--staleness", str(staleness)]
    return run_child(cmd, timeout)


def bound(workloads: list[str], timeout: float) -> dict[str, float]:
    """The machine's compute bound per workload (examples per second): the workload's maths alone (gradients
    and SGD update, numpy, on arrays in one process) in one thread with one BLAS thread, times the cores
    this process may use. No system moves parameters for free, so none reaches it; how close each comes
    is the share of the machine its own costs leave to the maths."""
    one = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # as Dask's workers run
    cmd = [sys.executable, __file__, "--child", "bound", "--only", ",".join(workloads)]
    got = run_child(cmd, timeout, **one)
    return {w: rate * EXAMPLES_PER_STEP[w] * CORES for w, rate in got.items() if w != "error"}


CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _available(systems: list[str]) -> tuple[list[str], list[str]]:
    have = [s for s in systems if importlib.util.find_spec(SYSTEMS[s]) is not None]
    return have, [s for s in systems if s not in have]


def compare(systems: list[str], workloads: list[str], rounds: int, num_ps: int, num_workers: int,
            steps: dict, timeout: float, label: str = "round", staleness: int = 0) -> dict[str, dict[str, float]]:
    best: dict[str, dict[str, float]] = {s: {} for s in systems}
    for r in range(rounds):
        if "daskps" in systems:  # the bound measured in every round, beside the systems; the best one kept
            for w, rate in bound(workloads, timeout).items():
                best.setdefault("bound", {})[w] = max(best.get("bound", {}).get(w, 0.0), rate)
        order = systems if r % 2 == 0 else systems[::-1]  # alternate, so load drifts hit all alike
        for system in order:
            wanted = ["dispatch"] if system == "dask" else workloads
            wanted = [w for w in wanted if w in workloads and system in ONLY_ON.get(w, ("daskps", "tf", "ray", "torch"))]
            # dlrm runs in a process of its own (its tables are placed whole, and it holds its data).
            for group in ([w for w in wanted if w != "dlrm"], [w for w in wanted if w == "dlrm"]):
                if not group:
                    continue
                got = _spawn(system, group, num_ps, num_workers, steps, timeout, staleness)
                print(f"  {label if rounds == 1 else f'round {r + 1}'} {NAMES[system]:15s} {got}", file=sys.stderr,
                      flush=True)
                if "dlrm" in got:  # keep the AUC and bytes of the fastest run with it
                    if got["dlrm"] > best[system].get("dlrm", 0.0):
                        best[system].update({k: v for k, v in got.items() if k.startswith("dlrm")})
                    continue
                for w, rate in got.items():
                    if w != "error":
                        best[system][w] = max(best[system].get(w, 0.0), rate)
    return best


def table(best: dict[str, dict[str, float]], workloads: list[str]) -> str:
    peers = [s for s in ("tf", "ray", "torch", "torchrec", "dask") if s in best and s != "bound"]
    head = ["workload", "unit"] + [NAMES[s] for s in ["daskps"] + peers] + [f"daskps / {NAMES[p]}" for p in peers]
    rows = [head, ["---"] * len(head)]
    for w in workloads:
        mine = best.get("daskps", {}).get(w)
        row = [w, UNITS[w]] + [f"{best[s][w]:,.0f}" if w in best.get(s, {}) else "-" for s in ["daskps"] + peers]
        row += [f"{mine / best[p][w]:.2f}x" if mine and w in best[p] else "-" for p in peers]
        rows.append(row)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="daskps,tf,ray,torch,torchrec,dask")
    parser.add_argument("--only", default=",".join(WORKLOADS), help="workloads to run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", default="2", help="trainers; a list (2,4,8) runs the scaling mode")
    parser.add_argument("--steps", default=None, help="JSON: steps per workload")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--staleness", type=int, default=0,
                        help="daskps' bounded staleness k (0: none, the default; the peers do not change)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = dict(STEPS, **(json.loads(args.steps) if args.steps else {}))
    workloads = [w for w in args.only.split(",") if w]
    if args.child:
        print("RESULT " + json.dumps(run_one(args.child, workloads, args.ps, int(args.workers), steps, args.staleness)),
              flush=True)
        return 0
    systems, missing = _available([s for s in args.systems.split(",") if s])
    if "dense_jax" in workloads and importlib.util.find_spec("jax") is None:
        workloads.remove("dense_jax")
        print("# JAX not installed, dense_jax skipped (pip install '.[jax]')")
    for w in ("keras_fit", "keras_fit4"):
        if w in workloads and importlib.util.find_spec("keras") is None:
            workloads.remove(w)
            print(f"# Keras not installed, {w} skipped (pip install '.[keras]')")
    print(f"# {platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}; {args.ps} ps")
    if missing:
        print(f"# not installed, skipped: {', '.join(NAMES[s] for s in missing)} (pip install '.[compare]')")
    counts = [int(w) for w in args.workers.split(",")]
    if len(counts) > 1:
        return _scaling(systems, counts, args, steps)
    best = compare(systems, workloads, args.rounds, args.ps, counts[0], steps, args.timeout, staleness=args.staleness)
    print(f"# {counts[0]} trainers, best of {args.rounds} rounds"
          + (f"; daskps with staleness={args.staleness}" if args.staleness else ""))
    print(table(best, workloads))
    mine = best.get("daskps", {})
    if best.get("bound"):
        print(bound_report(best, workloads))
    if "dense" in mine and "dense_jax" in mine:
        print(f"# daskps dense_jax / dense: {mine['dense_jax'] / mine['dense']:.2f}x")
    for w in ("keras_fit", "keras_fit4"):
        if "dense_jax" in mine and w in mine:
            print(f"# daskps {w} / dense_jax: {mine[w] / mine['dense_jax']:.2f}x")
    if "ctr" in mine and "ctr_hash" in mine:
        print(f"# daskps ctr_hash / ctr: {mine['ctr_hash'] / mine['ctr']:.2f}x")
    if "dlrm" in workloads:
        print(dlrm_report(best, steps["dlrm"]))
    return 0


def bound_report(best: dict[str, dict[str, float]], workloads: list[str]) -> str:
    """The compute bound lines: each workload's bound, and the share of it each system reached."""
    limit = best["bound"]
    lines = [f"# compute bound ({CORES} cores x the maths alone in one thread, one BLAS thread, best of the rounds); "
             f"numpy here: the dense step's maths {limit['dense'] / BATCH / CORES:,.0f} steps/s per core"
             if "dense" in limit else f"# compute bound ({CORES} cores x the maths alone in one thread)"]
    for w in workloads:
        if w in limit:
            shares = ", ".join(f"{NAMES[s]} {best[s][w] / limit[w]:.0%}" for s in best
                               if s != "bound" and w in best[s])
            lines.append(f"#   {w}: bound {limit[w]:,.0f} {UNITS[w]}; share reached: {shares}")
    return "\n".join(lines)


def dlrm_report(best: dict[str, dict[str, float]], steps: int) -> str:
    """The dlrm lines: held-out AUC of each system's fastest run after the same examples, and daskps' bytes."""
    import _dlrm

    lines = [f"# dlrm held-out AUC after {steps * _dlrm.BATCH:,} examples (each system's fastest run): "
             + ", ".join(f"{NAMES[s]} {v['dlrm_auc']:.4f}" for s, v in best.items() if "dlrm_auc" in v)]
    mine = best.get("daskps", {})
    if "dlrm_bytes" in mine:
        lines.append(f"# dlrm bytes on the wire per example (daskps servers' counters, all traffic): "
                     f"{mine['dlrm_bytes']:,.0f}")
    if "dlrm_pooled_bytes" in mine:
        mean_bag = mine.get("dlrm_mean_bag", (1 + _dlrm.MAX_BAG) / 2)
        ratio = mine["dlrm_pooled_bytes"] / mine["dlrm_rows_bytes"]
        lines.append(f"# dlrm embedding bytes per example (servers' counters): pooled {mine['dlrm_pooled_bytes']:,.0f}, "
                     f"every id row by row {mine['dlrm_rows_bytes']:,.0f} (ratio {ratio:.4f}; bar 1.2/L = "
                     f"{1.2 / mean_bag:.4f} for the batches' mean bag size L = {mean_bag:.2f}), distinct ids row by row "
                     f"{mine['dlrm_unique_bytes']:,.0f}")
    return "\n".join(lines)


def _scaling(systems: list[str], counts: list[int], args: argparse.Namespace, steps: dict) -> int:
    workloads = [w for w in args.only.split(",") if w in ("dispatch", "dense")] or ["dispatch", "dense"]
    rows: dict[int, dict[str, dict[str, float]]] = {n: {s: {} for s in systems} for n in counts}
    for r in range(args.rounds):  # rounds outermost, counts alternating: load drifts hit every count alike
        for n in counts if r % 2 == 0 else counts[::-1]:
            # A steady state for every count: more trainers get more steps (ramp-up and tail stay small).
            scaled = {w: max(steps[w], SCALING_STEPS.get(w, 0), STEPS_PER_TRAINER.get(w, 0) * n) for w in steps}
            got = compare(systems if r % 2 == 0 else systems[::-1], workloads, 1, args.ps, n, scaled, args.timeout,
                          label=f"round {r + 1}, {n:2d} trainers")
            for s, rates in got.items():
                for w, rate in rates.items():
                    rows[n].setdefault(s, {})[w] = max(rows[n][s].get(w, 0.0), rate)
    for w in workloads:
        shown = [s for s in systems if any(w in rows[n].get(s, {}) for n in counts)]
        print(f"\n{w} ({UNITS[w]}), best of {args.rounds} rounds")
        print("| trainers | " + " | ".join(NAMES[s] for s in shown) + " |")
        print("| --- " * (len(shown) + 1) + "|")
        for n in counts:
            print(f"| {n} | " + " | ".join(f"{rows[n][s].get(w, 0):,.0f}" for s in shown) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
