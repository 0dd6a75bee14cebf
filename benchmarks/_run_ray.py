"""``compare.py``'s runner for Ray: the parameter-server pattern with actors.

Parameter shards are actors holding numpy arrays; trainers are actors
holding their batches; the driver dispatches one step per call, round robin,
and waits for all. A step pulls what it needs (one call per server, all at
once), computes, and pushes its gradients (one call per server, waited for,
as a TensorFlow step waits for its updates). Everything listens on
127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``).
"""

from __future__ import annotations

import os

import numpy as np
from _workloads import (
    BATCH,
    DIM,
    FIELDS,
    LR,
    VOCAB,
    best_rate,
    ctr_batches,
    ctr_grads,
    ctr_table,
    dense_batches,
    dense_grads,
    dense_init,
    small_grads,
    small_init,
)


class ParamShard:
    """A parameter server: named arrays (whole variables or row ranges of one)."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    def put(self, name, value):
        self.arrays[name] = value.copy()

    def pull(self, names):
        return [self.arrays[n] for n in names]

    def push(self, names, grads, lr):
        for n, g in zip(names, grads):
            self.arrays[n] -= lr * g

    def gather(self, name, rows):
        return self.arrays[name][rows]

    def scatter_sub(self, name, rows, values):
        np.subtract.at(self.arrays[name], rows, values)


def _layout(names: list[str], num_ps: int) -> list[list[str]]:
    return [names[i::num_ps] for i in range(num_ps)]


class Trainer:
    def __init__(self, kind, worker, servers, num_ps):
        import ray

        self.ray, self.kind, self.servers, self.num_ps = ray, kind, servers, num_ps
        self.batches = {"dense": dense_batches, "ctr": ctr_batches}.get(kind, lambda w: [None])(worker)
        self.i = 0

    def noop(self):
        return None

    def step(self):
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        return getattr(self, f"_{self.kind}")(batch)

    def _dense(self, batch):
        ray, names = self.ray, ["w1", "b1", "w2", "b2"]
        where = _layout(names, self.num_ps)
        pulled = ray.get([s.pull.remote(ns) for s, ns in zip(self.servers, where)])
        values = dict(zip([n for ns in where for n in ns], [v for vs in pulled for v in vs]))
        loss, grads = dense_grads(*(values[n] for n in names), *batch)
        g = dict(zip(names, grads))
        ray.get([s.push.remote(ns, [g[n] for n in ns], LR) for s, ns in zip(self.servers, where)])
        return loss

    def _ctr(self, batch):
        ray = self.ray
        ids, y = batch
        rows = VOCAB * FIELDS // self.num_ps
        uniq, inverse = np.unique(ids.ravel(), return_inverse=True)
        owner = uniq // rows
        parts = [uniq[owner == s] - s * rows for s in range(self.num_ps)]
        got = ray.get([s.gather.remote("table", p) for s, p in zip(self.servers, parts)]
                      + [self.servers[0].pull.remote(["w"])])
        table_rows = np.concatenate(got[:-1])[inverse].reshape(ids.shape + (DIM,))
        loss, row_grads, gw = ctr_grads(table_rows, got[-1][0], ids, y)
        flat = ids.ravel()
        pushes = [s.scatter_sub.remote("table", flat[flat // rows == i] - i * rows, LR * row_grads[flat // rows == i])
                  for i, s in enumerate(self.servers)]
        ray.get(pushes + [self.servers[0].push.remote(["w"], [gw], LR)])
        return loss

    def _small(self, batch):
        ray, names = self.ray, [f"v{i}" for i in range(64)]
        where = _layout(names, self.num_ps)
        pulled = ray.get([s.pull.remote(ns) for s, ns in zip(self.servers, where)])
        grads = small_grads([v for vs in pulled for v in vs])
        it = iter(grads)
        ray.get([s.push.remote(ns, [next(it) for _ in ns], LR) for s, ns in zip(self.servers, where)])
        return 0.0


def run_ray(workloads: list[str], num_ps: int, num_workers: int, steps: dict[str, int]) -> dict[str, float]:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    ray.init(num_cpus=max(2, num_ps + num_workers), include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)
    try:
        shard_cls = ray.remote(num_cpus=0)(ParamShard)
        trainer_cls = ray.remote(num_cpus=0)(Trainer)
        out = {}
        for name in workloads:
            servers = [shard_cls.remote() for _ in range(num_ps)]
            _fill(ray, name, servers, num_ps)
            trainers = [trainer_cls.remote(name, w, servers, num_ps) for w in range(num_workers)]
            call = (lambda t: t.noop.remote()) if name == "dispatch" else (lambda t: t.step.remote())
            ray.get([call(t) for t in trainers for _ in range(5)])
            n = steps[name]
            rate = best_rate(name, n, lambda c=call, ts=trainers, n=n: ray.get([c(ts[i % num_workers]) for i in range(n)]))
            out[name] = rate * (BATCH if name in ("dense", "ctr") else 1)
            for a in servers + trainers:
                ray.kill(a)
        return out
    finally:
        ray.shutdown()


def _fill(ray, name: str, servers, num_ps: int) -> None:
    if name == "dense":
        values = dense_init()
        where = _layout(list(values), num_ps)
    elif name == "ctr":
        rows = VOCAB * FIELDS // num_ps
        ray.get([s.put.remote("table", ctr_table((rows, DIM), np.float32, (rows, DIM), (i * rows, 0)))
                 for i, s in enumerate(servers)])
        ray.get(servers[0].put.remote("w", np.full((FIELDS * DIM, 1), 0.01, np.float32)))
        return
    elif name == "small":
        values = {f"v{i}": v for i, v in enumerate(small_init())}
        where = _layout(list(values), num_ps)
    else:
        return
    ray.get([s.put.remote(n, values[n]) for s, ns in zip(servers, where) for n in ns])
