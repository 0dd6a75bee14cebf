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
        rest = [w for w in workloads if w != "dlrm"]
        if rest:
            with dps.ParameterServerStrategy(client, variable_partitioner=partitioner) as strategy:
                coordinator = dps.ClusterCoordinator(strategy, staleness=staleness)
                for name in rest:
                    out[name] = globals()[f"_daskps_{name}"](strategy, coordinator, steps[name])
        if "dlrm" in workloads:  # its tables whole, one per server in turn (TorchRec's table-wise sharding)
            with dps.ParameterServerStrategy(client) as strategy:
                out.update(_daskps_dlrm(strategy, dps.ClusterCoordinator(strategy, staleness=staleness),
                                        steps["dlrm"]))
    return out


def _daskps_dlrm(strategy, coordinator, steps: int) -> dict[str, float]:
    """The DLRM of ``_dlrm.py``: each step pools its 8 features' bags on the servers (one vector per bag
    each way) and reads the dense layers, all in one message per server."""
    import _dlrm

    init = _dlrm.init_params(1)
    with strategy.scope():
        dense = [dps.Variable(init[n], name=n) for n in _dlrm.DENSE_NAMES]
        tables = [dps.Variable(init[f"table{t}"], name=f"table{t}") for t in range(_dlrm.TABLES)]
        opt = dps.optimizers.Adagrad(_dlrm.LR, initial_accumulator_value=0.0)
    n = steps * _dlrm.BATCH
    trainers = len(strategy.trainer_names)

    def dataset_fn(ctx):
        import _dlrm

        train, _ = _dlrm.make_data(n)
        # Its share of the batches, then (should it take more steps than its share) the others'.
        for start in _dlrm.trainer_batches(train, ctx.input_pipeline_id, trainers) + _dlrm.trainer_batches(train, 0, 1):
            yield train.batch(start, start + _dlrm.BATCH)

    def step(it):
        x, bags, y = next(it)
        bags = [dps.Bags(b) for b in bags]  # mean pooling
        got = dps.read_values(dense + list(zip(tables, bags)))
        params = dict(zip(_dlrm.DENSE_NAMES, got))
        logit, saved = _dlrm.forward(params, x, got[len(dense):])
        loss, dlogit = _dlrm.log_loss_grad(logit, y)
        grads, pooled_grads = _dlrm.backward(params, saved, dlogit)
        opt.apply_gradients([(grads[k], v) for k, v in zip(_dlrm.DENSE_NAMES, dense)]
                            + [(dps.PooledSlices(g, b), t) for g, b, t in zip(pooled_grads, bags, tables)])
        return loss

    _dlrm.make_data(n)  # made once here, before the trainers load it
    it = iter(coordinator.create_per_worker_dataset(dataset_fn))
    warmup = 20
    for _ in range(warmup):
        coordinator.schedule(step, args=(it,))
    coordinator.join()
    before = _bytes(strategy)
    start = time.perf_counter()
    for _ in range(steps - warmup):
        coordinator.schedule(step, args=(it,))
    coordinator.join()
    rate = _dlrm.BATCH * (steps - warmup) / (time.perf_counter() - start)
    moved = _bytes(strategy) - before
    out = {"dlrm": rate, "dlrm_auc": _dlrm_auc(dense, tables, n), "dlrm_bytes": moved / (_dlrm.BATCH * (steps - warmup))}
    out.update(_embedding_bytes(strategy, tables, opt, n))
    return out


def _embedding_bytes(strategy, tables, opt, n: int, batches: int = 20) -> dict[str, float]:
    """Bytes per example the servers count for the 8 features' lookups and gradients alone, three ways:
    pooled (``Bags``/``PooledSlices``), every id row by row (each id's row read and its gradient row sent,
    what ``embedding_lookup`` and an ``IndexedSlices`` per id move when no id repeats), and as a user
    writes it without pooling (each distinct id's row read, its summed gradient row sent)."""
    import _dlrm

    from daskps.client import protocol

    train, _ = _dlrm.make_data(n)
    starts = [i * _dlrm.BATCH for i in range(batches)]
    zero = np.zeros((_dlrm.BATCH, _dlrm.DIM), np.float32)
    out = {}
    for way in ("pooled", "rows", "unique"):
        before = _bytes(strategy)
        for a in starts:
            _, bags, _ = train.batch(a, a + _dlrm.BATCH)
            if way == "pooled":
                pooled = [dps.Bags(b) for b in bags]
                dps.read_values(list(zip(tables, pooled)))
                opt.apply_gradients([(dps.PooledSlices(zero, b), t) for b, t in zip(pooled, tables)])
            elif way == "rows":
                protocol.read([(t.handle, values) for t, (values, _) in zip(tables, bags)])
                opt.apply_gradients([(dps.IndexedSlices(np.zeros((len(v), _dlrm.DIM), np.float32), v), t)
                                     for t, (v, _) in zip(tables, bags)])
            else:
                dps.read_values([(t, values) for t, (values, _) in zip(tables, bags)])
                uniq = [np.unique(v) for v, _ in bags]
                opt.apply_gradients([(dps.IndexedSlices(np.zeros((len(u), _dlrm.DIM), np.float32), u), t)
                                     for t, u in zip(tables, uniq)])
        protocol.flush()
        out[f"dlrm_{way}_bytes"] = (_bytes(strategy) - before) / (batches * _dlrm.BATCH)
    out["dlrm_mean_bag"] = float(train.lengths[: batches * _dlrm.BATCH].mean())
    return out


def _bytes(strategy) -> int:
    """Bytes the servers sent and received so far (values out; ids, bags, updates and gradients in)."""
    return sum(s["bytes_read"] + s["bytes_received"] for s in strategy.ps_stats())


def _dlrm_auc(dense, tables, n: int) -> float:
    """The held-out AUC of the model on the servers now."""
    import _dlrm

    _, test = _dlrm.make_data(n)
    params = dict(zip(_dlrm.DENSE_NAMES, dps.read_values(dense)))
    weights = dps.read_values(tables)
    x, bags, y = test.batch(0, len(test))
    pooled = [_dlrm.pool_mean(w, v, ln) for w, (v, ln) in zip(weights, bags)]
    return _dlrm.auc(y, _dlrm.forward(params, x, pooled)[0])


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
