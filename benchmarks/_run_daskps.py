"""``compare.py``'s runners for daskps and for raw Dask (one LocalPSCluster each run)."""

from __future__ import annotations

import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported here and in the cluster's workers

import numpy as np
from _workloads import (
    BATCH,
    DIM,
    FIELDS,
    LR,
    SMALL_SIZE,
    SMALL_VARS,
    VOCAB,
    best_rate,
    ctr_batches,
    ctr_grads,
    ctr_hash_init,
    ctr_table,
    dense_batches,
    dense_grads,
    dense_init,
    dense_jax_grad,
    dense_keras_model,
    small_grads,
    small_init,
    timed_schedule,
)
from distributed import wait

import daskps as dps


def _pause():
    time.sleep(0.05)


def _timed(coordinator, fn, args, steps: int, warmup: int, name: str = "") -> float:
    # Warm every trainer (a first batch imports code and opens connections there): work that
    # takes a while is spread over all of them.
    pauses = [_pause] * (4 * len(coordinator.strategy.trainer_names))
    return timed_schedule(coordinator, fn, args, steps, warmup, name, first=pauses)


def _noop():
    return None


def run_daskps(workloads: list[str], num_ps: int, num_workers: int, steps: dict[str, int],
               staleness: int = 0) -> dict[str, float]:
    out = {}
    with dps.LocalPSCluster(num_ps=num_ps, num_workers=num_workers) as cluster, cluster.get_client() as client:
        partitioner = dps.partitioners.MinSizePartitioner(256 << 10, max_shards=num_ps)
        with dps.ParameterServerStrategy(client, variable_partitioner=partitioner) as strategy:
            coordinator = dps.ClusterCoordinator(strategy, staleness=staleness)
            for name in workloads:
                out[name] = globals()[f"_daskps_{name}"](strategy, coordinator, steps[name])
    return out


def _daskps_dispatch(strategy, coordinator, steps: int) -> float:
    return _timed(coordinator, _noop, (), steps, warmup=100, name="dispatch")


def _daskps_dense(strategy, coordinator, steps: int) -> float:
    with strategy.scope():
        params = [dps.Variable(v, name=k) for k, v in dense_init().items()]
        opt = dps.optimizers.SGD(LR)
    data = coordinator.create_per_worker_dataset(lambda ctx: _cycle(dense_batches(ctx.input_pipeline_id)))

    def step(it):
        x, y = next(it)
        loss, grads = dense_grads(*dps.read_values(params), x, y)
        opt.apply_gradients(zip(grads, params))
        return loss

    return BATCH * _timed(coordinator, step, (iter(data),), steps, warmup=20)


def _daskps_dense_jax(strategy, coordinator, steps: int) -> float:
    grad = dense_jax_grad()  # captured by the step: compiled once per trainer, as the trainers keep the function
    with strategy.scope():
        params = dps.create_variables(dense_init())  # w1, b1, w2, b2: the names and placement of ``dense``
        opt = dps.optimizers.SGD(LR)
    data = coordinator.create_per_worker_dataset(lambda ctx: _cycle(dense_batches(ctx.input_pipeline_id)))

    def step(it):
        x, y = next(it)
        loss, grads = grad(dps.read_values(params), x, y)
        opt.apply(grads, params)
        return float(loss)

    return BATCH * _timed(coordinator, step, (iter(data),), steps, warmup=20)


def _daskps_keras_fit(strategy, coordinator, steps: int, steps_per_execution: int = 1) -> float:
    """``dense`` as a Keras model through ``dps.keras.fit``: Keras' own step (loss tracker included) per batch."""
    import daskps.keras  # noqa: F401

    with strategy.scope():
        model = dense_keras_model()

    def dataset_fn(ctx):
        return ((x, y) for x, y in _cycle(dense_batches(ctx.input_pipeline_id)))

    kwargs = dict(verbose=0, coordinator=coordinator, steps_per_execution=steps_per_execution)
    # Warm up until every trainer has built the model and compiled its step (a short fit may run on one
    # trainer only: the other would then build it, ~2 s of CPU, inside the timed fit).
    for _ in range(20):
        coordinator.schedule(_pause)  # keeps one trainer busy a moment, so the next steps go to others too
        dps.keras.fit(model, dataset_fn, steps_per_epoch=8 * len(strategy.trainer_names), **kwargs)
        coordinator.join()
        if all(coordinator.strategy.client.run(_keras_steps_built).values()):
            break
    start = time.perf_counter()
    dps.keras.fit(model, dataset_fn, steps_per_epoch=steps, **kwargs)
    return BATCH * steps / (time.perf_counter() - start)


def _keras_steps_built() -> bool:
    """On a worker: whether a dps.keras program with a compiled training step lives in this process."""
    import sys

    program = sys.modules.get("daskps.keras.program")
    return program is not None and program.programs_with_train_step() > 0


def _daskps_keras_fit4(strategy, coordinator, steps: int) -> float:
    return _daskps_keras_fit(strategy, coordinator, steps, steps_per_execution=4)


def _daskps_ctr(strategy, coordinator, steps: int) -> float:
    with strategy.scope():
        table = dps.Variable(ctr_table, shape=(FIELDS * VOCAB, DIM), dtype=np.float32, name="table")
    return _ctr(strategy, coordinator, steps, table)


def _daskps_ctr_hash(strategy, coordinator, steps: int) -> float:
    """``ctr`` with its table an EmbeddingTable: any int64 ids, rows made on first sight, spread by hash."""
    with strategy.scope():
        table = dps.EmbeddingTable(DIM, initializer=ctr_hash_init, name="table")
    return _ctr(strategy, coordinator, steps, table)


def _ctr(strategy, coordinator, steps: int, table) -> float:
    with strategy.scope():
        w = dps.Variable(np.full((FIELDS * DIM, 1), 0.01, np.float32), name="w")
        opt = dps.optimizers.SGD(LR)
    data = coordinator.create_per_worker_dataset(lambda ctx: _cycle(ctr_batches(ctx.input_pipeline_id)))

    def step(it):
        ids, y = next(it)
        rows, w_now = dps.read_values([(table, ids), w])  # one message per server
        loss, row_grads, gw = ctr_grads(rows, w_now, ids, y)
        opt.apply_gradients([(dps.IndexedSlices(row_grads, ids.ravel()), table), (gw, w)])
        return loss

    return BATCH * _timed(coordinator, step, (iter(data),), steps, warmup=20)


def _daskps_small(strategy, coordinator, steps: int) -> float:
    with strategy.scope():
        vs = [dps.Variable(v, name=f"v{i}") for i, v in enumerate(small_init())]
        opt = dps.optimizers.SGD(LR)
    assert len(vs) == SMALL_VARS and vs[0].shape == (SMALL_SIZE,)

    def step():
        opt.apply_gradients(zip(small_grads(dps.read_values(vs)), vs))

    return _timed(coordinator, step, (), steps, warmup=20)


def _cycle(batches):
    while True:
        yield from batches


def run_dask(workloads: list[str], num_ps: int, num_workers: int, steps: dict[str, int]) -> dict[str, float]:
    """Raw Dask: empty tasks to worker-tagged workers, submitted and waited for."""
    out = {}
    if "dispatch" not in workloads:
        return out
    with dps.LocalPSCluster(num_ps=num_ps, num_workers=num_workers) as cluster, cluster.get_client() as client:
        n = steps["dispatch"]
        wait([client.submit(_noop, resources={"worker": 1}, pure=False) for _ in range(100)])
        out["dispatch"] = best_rate("dispatch", n, lambda: wait(
            [client.submit(_noop, resources={"worker": 1}, pure=False) for _ in range(n)]))
    return out
