"""``compare.py``'s runner for PyTorch RPC: PyTorch's own parameter-server pattern.

As PyTorch's parameter-server tutorial builds it with ``torch.distributed.rpc``:
server processes hold the parameter shards (numpy arrays, sent as tensors);
trainer processes run their own training loops, each step pulling every
shard it needs with one ``rpc_async`` per server (all at once), computing
the same numpy gradients as the other systems and pushing them with one
``rpc_async`` per server, waited for before the next step (as a TensorFlow
step waits for its updates). The driver starts the loops and times them; in
``dispatch`` it calls an empty function on the trainers, round robin, and
waits for all.

Shards are placed as ``MinSizePartitioner(256 KiB, max_shards=num_ps)``
places daskps' variables: the dense layer's 784 x 256 weights and the CTR
table split by rows over the servers, the small variables whole, round robin.

Only loopback: the processes meet through a file store
(``init_method="file://..."``; the default TCP store listens on every
interface) and TensorPipe's ``uv`` transport is bound to ``lo``
(``TP_SOCKET_IFNAME``); its ``shm`` channel uses Unix sockets.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time

import numpy as np
from _workloads import (
    BATCH,
    DIM,
    FIELDS,
    LR,
    N_BATCHES,
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

THREADS = 8  # RPC threads per process


# -- on a server ------------------------------------------------------------------------------
ARRAYS: dict[str, np.ndarray] = {}
LOCK = threading.Lock()


def _put(name, value):
    with LOCK:
        ARRAYS[name] = value.numpy().copy()


def _pull(names):
    with LOCK:  # copies taken under the lock: a push running beside cannot tear them
        return [_tensor(ARRAYS[n].copy()) for n in names]


def _push(names, grads, lr):
    with LOCK:
        for n, g in zip(names, grads):
            ARRAYS[n] -= lr * g.numpy()


def _gather(name, rows):
    with LOCK:
        return _tensor(np.take(ARRAYS[name], rows.numpy(), axis=0))


def _scatter_sub(name, rows, values):
    with LOCK:
        np.subtract.at(ARRAYS[name], rows.numpy(), values.numpy())


def _clear():
    with LOCK:
        ARRAYS.clear()


def _tensor(a: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))


# -- placement --------------------------------------------------------------------------------
def _dense_layout(num_ps: int) -> tuple[list[list[str]], dict[str, np.ndarray]]:
    """Names on each server and their initial values: w1 split by rows, the rest round robin."""
    values = dense_init()
    parts = np.array_split(values.pop("w1"), num_ps)
    where: list[list[str]] = [[f"w1/{i}"] for i in range(num_ps)]
    init = {f"w1/{i}": p for i, p in enumerate(parts)}
    for k, (name, value) in enumerate(values.items()):
        where[k % num_ps].append(name)
        init[name] = value
    return where, init


def _small_layout(num_ps: int) -> tuple[list[list[str]], dict[str, np.ndarray]]:
    init = {f"v{i}": v for i, v in enumerate(small_init())}
    names = list(init)
    return [names[i::num_ps] for i in range(num_ps)], init


# -- on a trainer -----------------------------------------------------------------------------
class _Trainer:
    def __init__(self, kind: str, worker: int, num_ps: int):
        self.kind, self.num_ps, self.i = kind, num_ps, 0
        self.servers = [f"ps{s}" for s in range(num_ps)]
        self.batches = {"dense": dense_batches, "ctr": ctr_batches}.get(kind, lambda w: [None])(worker)
        if kind == "dense":
            self.where, _ = _dense_layout(num_ps)
        elif kind == "small":
            self.where, _ = _small_layout(num_ps)

    def step(self) -> float:
        batch = self.batches[self.i % N_BATCHES] if self.kind in ("dense", "ctr") else None
        self.i += 1
        return getattr(self, f"_{self.kind}")(batch)

    def _pull_all(self):
        from torch.distributed import rpc

        futures = [rpc.rpc_async(s, _pull, args=(ns,)) for s, ns in zip(self.servers, self.where)]
        return {n: t.numpy() for ns, f in zip(self.where, futures) for n, t in zip(ns, f.wait())}

    def _push_all(self, grads: dict[str, np.ndarray]) -> None:
        import torch
        from torch.distributed import rpc

        futures = [rpc.rpc_async(s, _push, args=(ns, [_tensor(grads[n]) for n in ns], LR))
                   for s, ns in zip(self.servers, self.where)]
        torch.futures.wait_all(futures)

    def _dense(self, batch) -> float:
        v = self._pull_all()
        w1 = np.concatenate([v[f"w1/{i}"] for i in range(self.num_ps)])
        loss, (g1, gb1, g2, gb2) = dense_grads(w1, v["b1"], v["w2"], v["b2"], *batch)
        grads = {f"w1/{i}": p for i, p in enumerate(np.array_split(g1, self.num_ps))}
        grads.update(b1=gb1, w2=g2, b2=gb2)
        self._push_all(grads)
        return float(loss)

    def _ctr(self, batch) -> float:
        import torch
        from torch.distributed import rpc

        ids, y = batch
        rows = VOCAB * FIELDS // self.num_ps
        uniq, inverse = np.unique(ids.ravel(), return_inverse=True)
        owner = uniq // rows
        gathers = [rpc.rpc_async(s, _gather, args=("table", _tensor(uniq[owner == i] - i * rows)))
                   for i, s in enumerate(self.servers)]
        w_now = rpc.rpc_async(self.servers[0], _pull, args=(["w"],))
        table_rows = np.concatenate([f.wait().numpy() for f in gathers])[inverse].reshape(ids.shape + (DIM,))
        loss, row_grads, gw = ctr_grads(table_rows, w_now.wait()[0].numpy(), ids, y)
        flat = ids.ravel()
        pushes = [rpc.rpc_async(s, _scatter_sub, args=("table", _tensor(flat[flat // rows == i] - i * rows),
                                                        _tensor(LR * row_grads[flat // rows == i])))
                  for i, s in enumerate(self.servers)]
        pushes.append(rpc.rpc_async(self.servers[0], _push, args=(["w"], [_tensor(gw)], LR)))
        torch.futures.wait_all(pushes)
        return float(loss)

    def _small(self, batch) -> float:
        v = self._pull_all()
        names = [n for ns in self.where for n in ns]
        grads = dict(zip(names, small_grads([v[n] for n in names])))
        self._push_all(grads)
        return 0.0


TRAINER: dict[str, _Trainer] = {}


def _noop():
    return None


def _train(kind: str, worker: int, num_ps: int, steps: int) -> float:
    """Run ``steps`` steps of this trainer's own loop; the last loss."""
    trainer = TRAINER.get(kind)
    if trainer is None:
        trainer = TRAINER[kind] = _Trainer(kind, worker, num_ps)
    loss = 0.0
    for _ in range(steps):
        loss = trainer.step()
    return loss


# -- processes --------------------------------------------------------------------------------
def _options(init_method: str):
    from torch.distributed import rpc

    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, num_worker_threads=THREADS, rpc_timeout=600,
                                           _transports=["shm", "uv"], _channels=["basic"])


def _member(name: str, rank: int, world: int, init_method: str) -> None:
    """A server or trainer process: join the group, serve calls until the driver shuts it down."""
    os.environ["TP_SOCKET_IFNAME"] = "lo"
    import torch
    from torch.distributed import rpc

    torch.set_num_threads(1)
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=_options(init_method))
    rpc.shutdown()


def run_torch(workloads: list[str], num_ps: int, num_workers: int, steps: dict[str, int]) -> dict[str, float]:
    os.environ["TP_SOCKET_IFNAME"] = "lo"
    # One maths thread per process, as Dask's nanny sets for daskps' workers: trainers and servers
    # share the cores, and each BLAS call spreading over all of them only slows the others.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    import torch
    from torch.distributed import rpc

    torch.set_num_threads(1)
    names = [f"ps{i}" for i in range(num_ps)] + [f"trainer{i}" for i in range(num_workers)]
    world = len(names) + 1
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/store"
        procs = [ctx.Process(target=_member, args=(n, r + 1, world, init_method), daemon=True)
                 for r, n in enumerate(names)]
        for p in procs:
            p.start()
        rpc.init_rpc("driver", rank=0, world_size=world, rpc_backend_options=_options(init_method))
        try:
            return {name: _workload(rpc, name, num_ps, num_workers, steps[name]) for name in workloads}
        finally:
            rpc.shutdown()
            for p in procs:
                p.join(30)


def _workload(rpc, name: str, num_ps: int, num_workers: int, n: int) -> float:
    trainers = [f"trainer{i}" for i in range(num_workers)]
    if name == "dispatch":
        rpc.rpc_sync(trainers[0], _noop)
        for f in [rpc.rpc_async(trainers[i % num_workers], _noop) for i in range(100)]:
            f.wait()
        return best_rate(name, n, lambda: [f.wait() for f in [rpc.rpc_async(trainers[i % num_workers], _noop)
                                                               for i in range(n)]])
    servers = [f"ps{i}" for i in range(num_ps)]
    for s in servers:
        rpc.rpc_sync(s, _clear)
    _fill(rpc, name, servers)

    def run(per_trainer: int) -> None:
        futures = [rpc.rpc_async(t, _train, args=(name, w, num_ps, per_trainer)) for w, t in enumerate(trainers)]
        for f in futures:
            f.wait()

    run(20 // num_workers + 1)  # warm up: connections, imports, the trainers' batches
    per = max(1, n // num_workers)
    start = time.perf_counter()
    run(per)
    rate = per * num_workers / (time.perf_counter() - start)
    return rate * (BATCH if name in ("dense", "ctr") else 1)


def _fill(rpc, name: str, servers: list[str]) -> None:
    num_ps = len(servers)
    if name == "ctr":
        rows = VOCAB * FIELDS // num_ps
        for i, s in enumerate(servers):
            rpc.rpc_sync(s, _put, args=("table", _tensor(ctr_table((rows, DIM), np.float32, (rows, DIM), (i * rows, 0)))))
        rpc.rpc_sync(servers[0], _put, args=("w", _tensor(np.full((FIELDS * DIM, 1), 0.01, np.float32))))
        return
    where, init = (_dense_layout if name == "dense" else _small_layout)(num_ps)
    for s, ns in zip(servers, where):
        for n in ns:
            rpc.rpc_sync(s, _put, args=(n, _tensor(init[n])))
