"""``compare.py``'s runner for TensorFlow: ParameterServerStrategy + ClusterCoordinator.

The ps and worker tasks are ``tf.distribute.Server``s in processes of their
own, addressed as 127.0.0.1 ports; this process is the chief (coordinator).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import numpy as np
from _workloads import (
    BATCH,
    DIM,
    FIELDS,
    LR,
    SMALL_VARS,
    VOCAB,
    ctr_batches,
    dense_batches,
    dense_init,
    small_init,
    timed_schedule,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(cluster: dict, job: str, index: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf

    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index,
                                  protocol="grpc", start=True)
    server.join()


def run_tf(workloads: list[str], num_ps: int, num_workers: int, steps: dict[str, int]) -> dict[str, float]:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    cluster = {
        "chief": [f"127.0.0.1:{_free_port()}"],
        "ps": [f"127.0.0.1:{_free_port()}" for _ in range(num_ps)],
        "worker": [f"127.0.0.1:{_free_port()}" for _ in range(num_workers)],
    }
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_serve, args=(cluster, job, i), daemon=True)
             for job in ("ps", "worker") for i in range(len(cluster[job]))]
    for p in procs:
        p.start()
    try:
        import tensorflow as tf

        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
        # dlrm (run alone) keeps its tables whole, one per server in turn, as daskps and TorchRec do.
        partitioner = None if workloads == ["dlrm"] else tf.distribute.experimental.partitioners.MinSizePartitioner(
            256 << 10, max_shards=num_ps)
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        out = {}
        for name in workloads:
            got = globals()[f"_tf_{name}"](tf, strategy, coordinator, steps[name])
            out.update(got if isinstance(got, dict) else {name: got})
        return out
    finally:
        for p in procs:
            p.terminate()


def _leaves(variables):
    """Shards in place of sharded variables: what gradients are taken and applied to (as Keras does)."""
    return [s for v in variables for s in getattr(v, "variables", [v])]


def _dataset(tf, strategy, coordinator, make):
    def dataset_fn(ctx):
        batches = make(ctx.input_pipeline_id if ctx else 0)
        return tf.data.Dataset.from_tensor_slices(tuple(np.stack(a) for a in zip(*batches))).repeat()

    per_worker = coordinator.create_per_worker_dataset(strategy.distribute_datasets_from_function(dataset_fn))
    return iter(per_worker)


def _tf_dispatch(tf, strategy, coordinator, steps: int) -> float:
    noop = tf.function(lambda: tf.constant(0))
    return timed_schedule(coordinator, noop, (), steps, warmup=100, name="dispatch")


def _tf_dense(tf, strategy, coordinator, steps: int) -> float:
    with strategy.scope():
        params = [tf.Variable(v, name=k) for k, v in dense_init().items()]
        leaves = _leaves(params)
        opt = tf.keras.optimizers.SGD(LR)
        opt.build(leaves)

    @tf.function
    def step(it):
        def replica(x, y):
            with tf.GradientTape() as tape:
                w1, b1, w2, b2 = params
                logits = tf.nn.relu(x @ w1 + b1) @ w2 + b2
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            opt.apply_gradients(zip(tape.gradient(loss, leaves), leaves))
            return loss

        x, y = next(it)
        return strategy.run(replica, args=(x, y))

    return BATCH * timed_schedule(coordinator, step, (_dataset(tf, strategy, coordinator, dense_batches),), steps, 20)


def _tf_ctr(tf, strategy, coordinator, steps: int) -> float:
    with strategy.scope():
        init = tf.random_normal_initializer(stddev=0.01)
        table = tf.Variable(lambda: init((FIELDS * VOCAB, DIM)), name="table")
        w = tf.Variable(np.full((FIELDS * DIM, 1), 0.01, np.float32), name="w")
        leaves = _leaves([table, w])
        opt = tf.keras.optimizers.SGD(LR)
        opt.build(leaves)

    @tf.function
    def step(it):
        def replica(ids, y):
            with tf.GradientTape() as tape:
                emb = tf.reshape(tf.nn.embedding_lookup(table, ids), (-1, FIELDS * DIM))
                z = tf.squeeze(emb @ w, 1)
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(y, z))
            opt.apply_gradients(zip(tape.gradient(loss, leaves), leaves))
            return loss

        ids, y = next(it)
        return strategy.run(replica, args=(ids, y))

    return BATCH * timed_schedule(coordinator, step, (_dataset(tf, strategy, coordinator, ctr_batches),), steps, 20)


def _tf_small(tf, strategy, coordinator, steps: int) -> float:
    with strategy.scope():
        vs = [tf.Variable(v, name=f"v{i}") for i, v in enumerate(small_init())]
        opt = tf.keras.optimizers.SGD(LR)
        opt.build(vs)
    assert len(vs) == SMALL_VARS

    @tf.function
    def step():
        def replica():
            opt.apply_gradients([(0.01 * v + 0.001, v) for v in vs])  # reads every variable
            return tf.constant(0)

        return strategy.run(replica)

    return timed_schedule(coordinator, step, (), steps, warmup=20)


def _tf_dlrm(tf, strategy, coordinator, steps: int) -> dict[str, float]:
    """The DLRM of ``_dlrm.py``: ``tf.nn.safe_embedding_lookup_sparse`` (mean) on 8 tables, raw layers, Adagrad."""
    import _dlrm

    n = steps * _dlrm.BATCH
    train, test = _dlrm.make_data(n)
    init = _dlrm.init_params(1)
    with strategy.scope():
        dense = {k: tf.Variable(init[k], name=k.replace("/", "_")) for k in _dlrm.DENSE_NAMES}
        tables = [tf.Variable(init[f"table{t}"], name=f"table{t}") for t in range(_dlrm.TABLES)]
        leaves = _leaves(list(dense.values()) + tables)
        opt = tf.keras.optimizers.Adagrad(_dlrm.LR, initial_accumulator_value=0.0)
        opt.build(leaves)
    pairs = tf.constant(_dlrm.PAIRS[0] * (_dlrm.TABLES + 1) + _dlrm.PAIRS[1])

    def dataset_fn(ctx):
        ragged = tuple(tf.RaggedTensor.from_row_lengths(v, train.lengths[:, t])
                       for t, v in enumerate(train.values))
        ds = tf.data.Dataset.from_tensor_slices((train.dense, ragged, train.labels)).batch(_dlrm.BATCH)
        return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).repeat()

    def model(x, bags):
        h0 = tf.nn.relu(x @ dense["bottom0/w"] + dense["bottom0/b"])
        d = tf.nn.relu(h0 @ dense["bottom1/w"] + dense["bottom1/b"])
        pooled = [tf.nn.safe_embedding_lookup_sparse(table, ids, combiner="mean") for table, ids in zip(tables, bags)]
        z = tf.stack([d, *pooled], axis=1)
        gram = tf.reshape(tf.matmul(z, z, transpose_b=True), (-1, (_dlrm.TABLES + 1) ** 2))
        top_in = tf.concat([d, tf.gather(gram, pairs, axis=1)], axis=1)
        h2 = tf.nn.relu(top_in @ dense["top0/w"] + dense["top0/b"])
        return tf.squeeze(h2 @ dense["top1/w"] + dense["top1/b"], 1)

    @tf.function
    def step(it):
        def replica(x, bags, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(y, model(x, bags)))
            opt.apply_gradients(zip(tape.gradient(loss, leaves), leaves))
            return loss

        x, bags, y = next(it)
        return strategy.run(replica, args=(x, bags, y))

    per_worker = coordinator.create_per_worker_dataset(strategy.distribute_datasets_from_function(dataset_fn))
    it = iter(per_worker)
    warmup = 20
    for _ in range(warmup):
        coordinator.schedule(step, args=(it,))
    coordinator.join()
    start = time.perf_counter()
    for _ in range(steps - warmup):
        coordinator.schedule(step, args=(it,))
    coordinator.join()
    rate = _dlrm.BATCH * (steps - warmup) / (time.perf_counter() - start)
    params = {k: v.numpy() for k, v in dense.items()}
    weights = [np.concatenate([s.numpy() for s in getattr(t, "variables", [t])]) for t in tables]
    x, bags, y = test.batch(0, len(test))
    pooled = [_dlrm.pool_mean(w, v, ln) for w, (v, ln) in zip(weights, bags)]
    return {"dlrm": rate, "dlrm_auc": _dlrm.auc(y, _dlrm.forward(params, x, pooled)[0])}
