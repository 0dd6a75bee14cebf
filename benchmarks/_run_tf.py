"""``compare.py``'s runner for TensorFlow: ParameterServerStrategy + ClusterCoordinator.

The ps and worker tasks are ``tf.distribute.Server``s in processes of their
own, addressed as 127.0.0.1 ports; this process is the chief (coordinator).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

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
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(256 << 10, max_shards=num_ps)
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        return {name: globals()[f"_tf_{name}"](tf, strategy, coordinator, steps[name]) for name in workloads}
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
