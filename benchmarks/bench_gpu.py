"""A JAX trainer on a GPU: the dense step on the GPU, the parameter servers on the CPUs.

Runs ``compare.py``'s dense MLP (784 -> hidden -> 10, softmax cross-entropy,
SGD) with its loss and gradients from one ``jax.jit(jax.value_and_grad(...))``
on 2 parameter servers (``LocalPSCluster``, ``MinSizePartitioner(256 KiB, 2)``)
and N trainers, once with the trainers' JAX on the CPU (``JAX_PLATFORMS=cpu``)
and once on the GPU (``JAX_PLATFORMS=cuda``; every trainer process shares the
one GPU, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``). The servers never import
JAX: they hold numpy arrays on the CPU either way. Each configuration runs in
a fresh subprocess; every trainer reports the device its step ran on, and
the table also shows the step alone (no servers: the jitted function on
numpy inputs, gradients brought back to numpy), the most a trainer could do.

    python benchmarks/bench_gpu.py --trainers 2,8 --batch 256,4096

Needs JAX with a GPU plugin (``pip install "jax[cuda12]"``, or the image's
own); without a GPU the ``cuda`` rows say why and the ``cpu`` rows still run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _workloads import LR, dense_jax_grad, run_child, timed_schedule  # noqa: E402


def _init(hidden: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(784, hidden)) * 0.05).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.normal(size=(hidden, 10)) * 0.05).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def _batches(worker: int, batch: int, n: int = 4):
    rng = np.random.default_rng(100 + worker)
    teacher = np.random.default_rng(7).normal(size=(784, 10)).astype(np.float32)
    out = []
    for _ in range(n):
        x = rng.normal(size=(batch, 784)).astype(np.float32)
        out.append((x, np.argmax(x @ teacher, axis=1).astype(np.int32)))
    return out


def _cycle(batches):
    while True:
        yield from batches


def _device():
    import jax

    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"


def _step_alone(hidden: int, batch: int, seconds: float = 3.0) -> float:
    """Steps/s of the jitted step in this process, numpy in and out, no servers."""
    grad = dense_jax_grad()
    params = _init(hidden)
    data = _batches(0, batch)
    for x, y in data:
        np.asarray(grad(params, x, y)[1]["w1"])
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        x, y = data[n % len(data)]
        loss, grads = grad(params, x, y)
        [np.asarray(g) for g in grads.values()]
        float(loss)
        n += 1
    return n / (time.perf_counter() - start)


def child(trainers: int, batch: int, hidden: int, steps: int, num_ps: int) -> dict:
    import daskps as dps

    out = {"alone": _step_alone(hidden, batch) * batch, "parent_device": _device()}
    with dps.LocalPSCluster(num_ps=num_ps, num_workers=trainers) as cluster, cluster.get_client() as client:
        partitioner = dps.partitioners.MinSizePartitioner(256 << 10, max_shards=num_ps)
        with dps.ParameterServerStrategy(client, variable_partitioner=partitioner) as strategy:
            coordinator = dps.ClusterCoordinator(strategy)
            grad = dense_jax_grad()
            with strategy.scope():
                params = dps.create_variables(_init(hidden))
                opt = dps.optimizers.SGD(LR)
            data = coordinator.create_per_worker_dataset(lambda ctx: _cycle(_batches(ctx.input_pipeline_id, batch)))

            def step(it):
                x, y = next(it)
                loss, grads = grad(dps.read_values(params), x, y)
                opt.apply(grads, params)
                return float(loss), _device()

            losses = [coordinator.schedule(step, args=(iter(data),)) for _ in range(4 * trainers)]
            coordinator.join()
            first = float(np.mean([r.fetch()[0] for r in losses]))
            out["trainer_devices"] = sorted({r.fetch()[1] for r in losses})
            rate = timed_schedule(coordinator, step, (iter(data),), steps, warmup=10)
            out["rate"] = rate * batch
            tail = [coordinator.schedule(step, args=(iter(data),)) for _ in range(4 * trainers)]
            coordinator.join()
            out["loss_first"], out["loss_last"] = first, float(np.mean([r.fetch()[0] for r in tail]))
            out["servers"] = {k: sorted(v) for k, v in _server_modules(client, strategy).items()}
    return out


def _server_modules(client, strategy) -> dict[str, list[str]]:
    """Whether each parameter server's process imported JAX (it should not)."""
    def probe():
        return ["jax"] if "jax" in sys.modules else []

    return client.run(probe, workers=sorted({s.address for s in strategy.servers}))


def _spawn(platform_name: str, trainers: int, batch: int, hidden: int, steps: int, num_ps: int,
           timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", "--trainers", str(trainers), "--batch", str(batch),
           "--hidden", str(hidden), "--steps", str(steps), "--ps", str(num_ps)]
    return run_child(cmd, timeout, JAX_PLATFORMS=platform_name, XLA_PYTHON_CLIENT_PREALLOCATE="false")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--platforms", default="cpu,cuda", help="JAX_PLATFORMS values to compare")
    parser.add_argument("--trainers", default="2", help="trainer counts, e.g. 2,8")
    parser.add_argument("--batch", default="256", help="batch sizes, e.g. 256,4096")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(int(args.trainers), int(args.batch), args.hidden, args.steps, args.ps)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    print(f"# {platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}; {args.ps} ps, hidden {args.hidden}, {args.steps} steps timed")
    rows = [["trainers", "batch", "JAX on", "examples/s", "step alone (1 process)", "loss first -> last",
             "trainers ran on", "vs cpu"], ["---"] * 8]
    for trainers in [int(t) for t in args.trainers.split(",")]:
        for batch in [int(b) for b in args.batch.split(",")]:
            base = None
            for name in args.platforms.split(","):
                got = _spawn(name, trainers, batch, args.hidden, args.steps, args.ps, args.timeout)
                print(f"  {name} trainers={trainers} batch={batch}: {got}", file=sys.stderr, flush=True)
                if "error" in got:
                    rows.append([str(trainers), str(batch), name, "-", "-", "-", got["error"], "-"])
                    continue
                if any(got["servers"].values()):
                    raise SystemExit(f"a parameter server imported JAX: {got['servers']}")
                base = got["rate"] if name == "cpu" else base
                rows.append([str(trainers), str(batch), name, f"{got['rate']:,.0f}", f"{got['alone']:,.0f}",
                             f"{got['loss_first']:.3f} -> {got['loss_last']:.3f}", ", ".join(got["trainer_devices"]),
                             f"{got['rate'] / base:.2f}x" if base else "-"])
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
