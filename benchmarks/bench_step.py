"""The dense step's maths alone, in one process: numpy (``dense_grads``) against the jitted JAX step.

What ``compare.py``'s ``dense`` and ``dense_jax`` workloads compute per step
without daskps around it: loss and gradients of the 784-256-10 MLP for one
batch of 256, the JAX one from ``jax.jit(jax.value_and_grad(loss))`` with its
gradients turned into numpy arrays (as ``optimizer.apply`` does). Wall and
CPU time (all threads of the process) per call, the two alternating over
``--rounds`` rounds, after one untimed warm-up round (the compilation).

    python benchmarks/bench_step.py --calls 300 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _workloads import dense_batches, dense_grads, dense_init, dense_jax_grad  # noqa: E402


def _steps():
    params, batches = dense_init(), dense_batches(0)
    grad = dense_jax_grad()
    i = 0

    def numpy_step():
        nonlocal i
        x, y = batches[i % len(batches)]
        i += 1
        return dense_grads(*params.values(), x, y)

    def jax_step():
        nonlocal i
        x, y = batches[i % len(batches)]
        i += 1
        loss, grads = grad(params, x, y)
        return float(loss), {k: np.asarray(g) for k, g in grads.items()}

    return {"numpy": numpy_step, "jax": jax_step}


def _time(step, calls: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        step()
    return 1e3 * (time.perf_counter() - wall) / calls, 1e3 * (time.process_time() - cpu) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    steps = _steps()
    for step in steps.values():
        _time(step, 20)
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in steps if r % 2 == 0 else list(steps)[::-1]:
            got[name].append(_time(steps[name], args.calls))
            wall, cpu = got[name][-1]
            print(f"round {r + 1} {name:5s} {wall:6.2f} ms wall {cpu:6.2f} ms CPU per call", file=sys.stderr)
    for name, times in got.items():
        walls, cpus = [w for w, _ in times], [c for _, c in times]
        print(f"{name:5s} median {statistics.median(walls):.2f} ms wall ({min(walls):.2f}-{max(walls):.2f}), "
              f"{statistics.median(cpus):.2f} ms CPU ({min(cpus):.2f}-{max(cpus):.2f}) per call")
    ratio = statistics.median(c for _, c in got["jax"]) / statistics.median(c for _, c in got["numpy"])
    print(f"jax / numpy CPU per call: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
