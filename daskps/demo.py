"""The main job: a click-through-rate model trained asynchronously, with checkpoints.

The data come from a known "teacher" of the same shape as the student: each
example has ``NUM_FIELDS`` categorical ids (out of ``VOCAB``), a multi-hot
field (a bag of 1 to ``MAX_ITEMS`` recent items out of ``ITEMS``, padded
with -1) and ``NUM_DENSE`` dense features; the click probability is
``sigmoid(sum_f E*[id_f] @ u* + mean(I*[items]) @ v* + x @ w* + b*)``. The
student has a sharded embedding table (split over the parameter servers), an
item table whose bags are pooled on the servers (``dps.embedding_lookup_sparse``,
one vector per bag each way) and a dense part, trained with a server-side
Adam optimizer (row-local for the tables). Each epoch ends
with a checkpoint; a second run resumes from the latest one. The run checks
itself: the student's test log-loss should approach the teacher's own (the
best possible) and its AUC the teacher's.

The coordinator has the checkpoint manager, so a parameter server lost
during training is re-created and restored from the latest checkpoint;
``kill_ps_at_epoch`` SIGKILLs ``ps-0`` part-way through that epoch to show it.

``input="dask"`` feeds the trainers from Dask Arrays of the teacher's
examples (made on the workers, ``DASK_ROWS`` of them) through
``dps.data.from_dask``: each trainer reads the partitions it holds, shuffled,
repeating; the default is a generator on each trainer.

``model="jax"`` trains the same model with gradients from a jitted
``jax.value_and_grad`` of its log-loss instead of the numpy ones written
out by hand (JAX is optional: ``pip install ".[jax]"`` in the checkout).

``model="keras"`` writes the same model as a compiled Keras 3 model (an
``Embedding`` sharded over the servers and updated row by row, a dense part,
Adam) and trains it with ``dps.keras.fit``; Keras' ``BackupAndRestore`` keeps
its progress in the checkpoint directory, so a rerun with more epochs goes on
from the last one (``pip install ".[keras]"``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass

import numpy as np

import daskps as dps

VOCAB = 20_000
NUM_FIELDS = 4
EMBED_DIM = 4
ITEMS, MAX_ITEMS = 5_000, 6  # the multi-hot field: bags of 1 to MAX_ITEMS item ids, padded with -1
NUM_DENSE = 8
MODELS = ("numpy", "jax", "keras")
INPUTS = ("generator", "dask")
DASK_ROWS, DASK_CHUNK = 100_000, 10_000
KERAS_MISSING = ('the demo\'s Keras model needs Keras 3 and JAX, which are not installed: pip install ".[keras]" '
                 "in the daskps checkout")
JAX_MISSING = ('the demo\'s JAX model needs JAX, which is not installed: pip install ".[jax]" in the '
               "daskps checkout (or pip install jax)")


@dataclass(frozen=True)
class DemoConfig:
    num_ps: int = 2
    num_workers: int = 2
    epochs: int = 6
    steps_per_epoch: int = 120
    steps_per_call: int = 4
    batch_size: int = 256
    learning_rate: float = 0.05
    checkpoint_dir: str = "daskps-demo-checkpoints"
    seed: int = 0
    kill_ps_at_epoch: int | None = None  # SIGKILL ps-0 part-way through this epoch (a local cluster's)
    model: str = "numpy"  # how gradients are computed: "numpy" (by hand) or "jax" (jax.value_and_grad)
    input: str = "generator"  # where batches come from: a generator per trainer, or "dask" (dps.data.from_dask)
    logdir: str | None = None  # TensorBoard scalars go here (dps.summary.ScalarLogger; needs tensorboardX)
    keep_open: bool = False  # after training, keep the cluster (its own) and its dashboard up until Ctrl-C


def teacher(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "table": rng.normal(0, 0.7, size=(VOCAB, EMBED_DIM)),
        "u": rng.normal(size=EMBED_DIM),
        "w": rng.normal(0, 0.5, size=NUM_DENSE),
        "b": np.array(-0.5),
        "items": rng.normal(0, 1.5, size=(ITEMS, EMBED_DIM)),
        "v": rng.normal(size=EMBED_DIM),
    }


def mean_pool(table: np.ndarray, items: np.ndarray) -> np.ndarray:
    """The mean of each row's rows of ``table`` (ids < 0 are padding), in numpy: the teacher's pooling."""
    valid = items >= 0
    return (table[np.where(valid, items, 0)] * valid[..., None]).sum(axis=1) / valid.sum(axis=1, keepdims=True)


def teacher_logit(truth: dict, ids: np.ndarray, items: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (truth["table"][ids].sum(axis=1) @ truth["u"] + mean_pool(truth["items"], items) @ truth["v"]
            + x @ truth["w"] + truth["b"])


def sample(rng: np.random.Generator, n: int, truth: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``n`` examples: Zipf-like ids, bags of items (padded with -1), normal dense features, clicks drawn
    from the teacher."""
    ids = np.minimum(rng.zipf(1.3, size=(n, NUM_FIELDS)) - 1, VOCAB - 1).astype(np.int64)
    items = np.minimum(rng.zipf(1.3, size=(n, MAX_ITEMS)) - 1, ITEMS - 1).astype(np.int64)
    items[np.arange(MAX_ITEMS) >= rng.integers(1, MAX_ITEMS + 1, size=n)[:, None]] = -1
    x = rng.normal(size=(n, NUM_DENSE)).astype(np.float32)
    p = _sigmoid(teacher_logit(truth, ids, items, x))
    return ids, items, x, (rng.random(n) < p).astype(np.float32)


def bags(items: np.ndarray) -> dps.Bags:
    """The item bags of a batch, to pool by mean on the servers (the -1 padding is dropped)."""
    return dps.Bags((items.reshape(-1), np.full(len(items), items.shape[1])), combiner="mean")


def make_batches(seed: int, worker: int, batch_size: int, stream: int = 0):
    """Endless batches from the teacher ``seed``; ``stream`` picks fresh examples (e.g. after a resume)."""
    truth = teacher(seed)
    rng = np.random.default_rng([seed, worker + 1, stream])
    while True:
        yield sample(rng, batch_size, truth)


def _sample_block(seed: int, block: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return sample(np.random.default_rng([seed, 10_000 + block]), n, teacher(seed))


def dask_examples(seed: int, rows: int = DASK_ROWS, chunk: int = DASK_CHUNK) -> tuple:
    """``rows`` of the teacher's examples as Dask Arrays ``(ids, items, x, y)``, each chunk made on a worker."""
    import dask
    import dask.array as da

    parts: list[list] = [[], [], [], []]
    for block, start in enumerate(range(0, rows, chunk)):
        n = min(chunk, rows - start)
        made = dask.delayed(_sample_block, pure=True)(seed, block, n)
        for i, (shape, dtype) in enumerate((((n, NUM_FIELDS), np.int64), ((n, MAX_ITEMS), np.int64),
                                            ((n, NUM_DENSE), np.float32), ((n,), np.float32))):
            parts[i].append(da.from_delayed(made[i], shape=shape, dtype=dtype))
    ids, items, x, y = (da.concatenate(p) for p in parts)
    return ids, items, x, y


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))


sigmoid = _sigmoid  # for the Keras demo (daskps.demo_keras), which is handed this module


def forward(rows, pooled, u, v, w, b, x):
    """Click probabilities; ``rows`` are the embedding rows of the ids (shape ids.shape + (dim,)),
    ``pooled`` the mean of each example's item rows."""
    return _sigmoid(rows.sum(axis=1) @ u + pooled @ v + x @ w + b)


def log_loss(p, y) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def auc(p, y) -> float:
    order = np.argsort(p)
    ranks = np.empty(len(p))
    ranks[order] = np.arange(1, len(p) + 1)
    pos = y > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def gradients(rows, pooled, u, v, w, b, ids, item_bags, x, y):
    """Mean log-loss gradients: sparse rows for the table, a vector per bag for the items, dense for the rest."""
    summed = rows.sum(axis=1)
    g = (forward(rows, pooled, u, v, w, b, x) - y) / len(y)
    row_grad = np.repeat((g[:, None] * u[None, :])[:, None, :], NUM_FIELDS, axis=1)
    table_grad = dps.IndexedSlices(row_grad.reshape(-1, EMBED_DIM).astype(np.float32), ids.ravel())
    items_grad = dps.PooledSlices((g[:, None] * v[None, :]).astype(np.float32), item_bags)
    return (table_grad, items_grad, (summed.T @ g).astype(np.float32), (pooled.T @ g).astype(np.float32),
            (x.T @ g).astype(np.float32), np.float32(g.sum()))


def loss_and_gradients(rows, pooled, u, v, w, b, ids, item_bags, x, y):
    """The batch's log-loss and the gradients of :func:`gradients`, in numpy."""
    return (log_loss(forward(rows, pooled, u, v, w, b, x), y),
            gradients(rows, pooled, u, v, w, b, ids, item_bags, x, y))


def jax_loss_and_gradients():
    """A function like :func:`loss_and_gradients`, its maths a jitted ``jax.value_and_grad`` of the log-loss.

    Scheduled functions that capture it carry the ``jax.jit`` object; each
    trainer keeps the functions it unpickled, so it compiles once per trainer
    (and batch shape).
    """
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        raise ImportError(JAX_MISSING) from exc

    def loss(rows, pooled, u, v, w, b, x, y):
        z = rows.sum(axis=1) @ u + pooled @ v + x @ w + b
        return jnp.mean(jax.nn.softplus(z) - y * z)  # the log-loss of sigmoid(z)

    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5)))

    def loss_and_grads(rows, pooled, u, v, w, b, ids, item_bags, x, y):
        value, (g_rows, g_pooled, g_u, g_v, g_w, g_b) = value_and_grad(rows, pooled, u, v, w, b, x, y)
        table_grad = dps.IndexedSlices(np.asarray(g_rows).reshape(-1, EMBED_DIM), ids.ravel())
        items_grad = dps.PooledSlices(g_pooled, item_bags)  # the gradient of the pooled vectors, one per bag
        return float(value), (table_grad, items_grad, g_u, g_v, g_w, g_b)  # JAX arrays: taken as they are

    return loss_and_grads


def run_demo(config: DemoConfig = DemoConfig(), cluster=None, log=print) -> dict:
    """Train on ``cluster`` (a new LocalPSCluster if None); return the final metrics."""
    if config.model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(map(repr, MODELS))}, got {config.model!r}")
    if config.input not in INPUTS:
        raise ValueError(f"input must be one of {', '.join(map(repr, INPUTS))}, got {config.input!r}")
    if config.model == "keras" and config.kill_ps_at_epoch is not None:
        raise ValueError("kill_ps_at_epoch works with the numpy and jax models, whose checkpoints restore a lost "
                         "server while training goes on; the keras model resumes between runs instead")
    if config.model == "keras":
        os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is imported, here and in the workers
    else:
        step_maths = jax_loss_and_gradients() if config.model == "jax" else loss_and_gradients  # before any cluster
    own = cluster is None
    if own:
        log(f"starting a LocalPSCluster: {config.num_ps} ps, {config.num_workers} workers")
        cluster = dps.LocalPSCluster(num_ps=config.num_ps, num_workers=config.num_workers)
    try:
        if config.model == "keras":
            from daskps.demo_keras import train_keras

            result = train_keras(config, cluster, log, sys.modules[__name__])
        else:
            result = _train(config, cluster, log, step_maths)
        if own and config.keep_open:
            _keep_open(cluster, log)
        return result
    finally:
        if own:
            cluster.close()


def _keep_open(cluster, log) -> None:
    """Wait for Ctrl-C, the cluster and its dashboard up meanwhile."""
    log(f"training done; the cluster and its dashboard stay up until Ctrl-C: {dashboard_of(cluster)}")
    try:
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        log("Ctrl-C: closing the cluster")


def dashboard_of(cluster) -> str:
    """daskps' page of ``cluster`` (Dask's own pages are a click away), or Dask's link for another cluster."""
    return getattr(cluster, "daskps_link", None) or str(cluster.dashboard_link)


def _kill_ps(client, coordinator, after: int, log) -> None:
    """SIGKILL the process of worker ``ps-0`` once ``after`` more functions have finished.

    Then wait until the coordinator has noticed (the scheduler tells it), so
    that what follows (``join()``, reading the model) waits for the recovery.
    """
    start, seen = coordinator.summary()["done"], len(coordinator.recoveries)
    info = client.run(lambda dask_worker: (dask_worker.name, os.getpid()))
    pid = next(pid for name, pid in info.values() if name == "ps-0")
    while coordinator.summary()["done"] < start + after and coordinator.summary()["in_flight"]:
        time.sleep(0.005)
    log(f"killing ps-0 (pid {pid}) with {coordinator.summary()['in_flight']} functions pending")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (coordinator.recovery_state.name != "RECOVERING" and len(coordinator.recoveries) == seen
           and time.monotonic() < deadline):
        time.sleep(0.01)


def _build(config: DemoConfig, client):
    partitioner = dps.partitioners.MinSizePartitioner(min_shard_bytes=64 << 10, max_shards=config.num_ps)
    strategy = dps.ParameterServerStrategy(client, variable_partitioner=partitioner)
    seed = config.seed

    def init_table(shape, dtype, partition_shape, partition_offset):  # runs on each ps, for its shard
        rng = np.random.default_rng([seed, partition_offset[0]])
        return rng.normal(0, 0.01, size=partition_shape).astype(dtype)

    with strategy.scope():
        model = {
            "table": dps.Variable(init_table, shape=(VOCAB, EMBED_DIM), dtype=np.float32, name="table"),
            "items": dps.Variable(init_table, shape=(ITEMS, EMBED_DIM), dtype=np.float32, name="items"),
            "u": dps.Variable(np.full(EMBED_DIM, 0.1, np.float32), name="u"),
            "v": dps.Variable(np.full(EMBED_DIM, 0.1, np.float32), name="v"),
            "w": dps.Variable(np.zeros(NUM_DENSE, np.float32), name="w"),
            "b": dps.Variable(np.float32(0.0), name="b"),
        }
        optimizer = dps.optimizers.Adam(config.learning_rate)
        train_loss = dps.metrics.Mean(name="train_loss")
    return strategy, model, optimizer, train_loss


def _train(config: DemoConfig, cluster, log, step_maths) -> dict:
    client = cluster.get_client()
    log(f"dashboard: {dashboard_of(cluster)}")
    if config.model == "jax":
        log("gradients: jax.jit(jax.value_and_grad(log-loss)), compiled once per trainer")
    strategy, model, optimizer, train_loss = _build(config, client)
    table, items, u, v, w, b = (model[k] for k in ("table", "items", "u", "v", "w", "b"))
    log(f"embedding table {table.shape} in {len(getattr(table, 'variables', [table]))} shards: "
        + ", ".join(v.device.split("/")[3].replace("task:", "ps-") for v in getattr(table, "variables", [table])))
    log(f"item table {items.shape}: each example's bag of 1-{MAX_ITEMS} items pooled (mean) on the servers, "
        "one vector per bag each way (dps.embedding_lookup_sparse)")
    ckpt = dps.Checkpoint(model=model, optimizer=optimizer)
    directory = os.path.abspath(config.checkpoint_dir) if "://" not in config.checkpoint_dir else config.checkpoint_dir
    manager = dps.CheckpointManager(ckpt, directory, max_to_keep=3)
    coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)  # lost servers come back
    restored = manager.restore_or_initialize()
    done = ckpt.save_counter if restored else 0
    if restored:
        log(f"resumed from {restored} (epoch {done}, optimizer step {int(optimizer.iterations.numpy())})")
    kill = config.kill_ps_at_epoch
    if kill is not None and not done < kill <= config.epochs:
        runs = f"epochs {done + 1}-{config.epochs}" if done < config.epochs else "no epoch"
        log(f"--kill-ps-in-epoch {kill}: nothing is killed, as this run trains {runs} (the latest checkpoint has "
            f"{done} epochs). Pass an epoch in that range with a larger --epochs (e.g. --epochs {max(done, kill) + 1} "
            f"--kill-ps-in-epoch {done + 1}), or a new --checkpoint-dir to start afresh")
    seed, batch, k = config.seed, config.batch_size, config.steps_per_call
    if config.input == "dask":
        examples = dask_examples(seed)
        log(f"input: {DASK_ROWS:,} examples as Dask Arrays in {examples[0].npartitions} partitions, read by "
            "the trainers holding them (dps.data.from_dask, shuffled, repeating)")
        data = dps.data.from_dask(examples, batch_size=batch, shuffle=True, seed=seed + done, epochs=None)
        dataset = coordinator.create_per_worker_dataset(data)
    else:
        dataset = coordinator.create_per_worker_dataset(
            lambda ctx: make_batches(seed, ctx.input_pipeline_id, batch, stream=done))

    def train_steps(iterator):
        for _ in range(k):
            ids, item_ids, x, y = next(iterator)
            item_bags = bags(item_ids)
            # One message per server: the ids' rows (only these travel), each bag's pooled item vector
            # (pooled where the item rows live), and the dense part.
            rows, pooled, *dense = dps.read_values([(table, ids), (items, item_bags), u, v, w, b])
            loss, grads = step_maths(rows, pooled, *dense, ids, item_bags, x, y)
            optimizer.apply_gradients(zip(grads, [table, items, u, v, w, b]))  # one call per ps
            train_loss.update_state(loss)

    truth = teacher(seed)
    ids_t, items_t, x_t, y_t = sample(np.random.default_rng([seed, 999]), 20_000, truth)
    p_best = _sigmoid(teacher_logit(truth, ids_t, items_t, x_t))
    best = {"log_loss": log_loss(p_best, y_t), "auc": auc(p_best, y_t)}

    def evaluate() -> dict:
        rows, pooled, u_now, v_now, w_now, b_now = dps.read_values([(table, ids_t), (items, bags(items_t)), u, v, w, b])
        p = forward(rows, pooled, u_now, v_now, w_now, b_now, x_t)
        return {"log_loss": log_loss(p, y_t), "auc": auc(p, y_t)}

    first = evaluate()
    log(f"before epoch {done + 1}: test log-loss {first['log_loss']:.4f} (teacher {best['log_loss']:.4f}), "
        f"AUC {first['auc']:.3f} (teacher {best['auc']:.3f})")
    calls = max(1, config.steps_per_epoch // k)
    iterator, started, history = iter(dataset), time.perf_counter(), []
    metrics = first
    logger = None
    if config.logdir is not None:  # train loss and examples/s every tenth of an epoch; test metrics each epoch
        logger = dps.summary.ScalarLogger(coordinator, config.logdir, {"train/loss": train_loss},
                                          every_n_steps=max(1, calls // 10), examples_per_step=k * batch,
                                          step=lambda: int(optimizer.iterations.numpy())).start()  # as printed
        log(f"TensorBoard scalars in {config.logdir} (tensorboard --logdir {config.logdir})")
    try:
        for epoch in range(done + 1, config.epochs + 1):
            t0 = time.perf_counter()
            train_loss.reset_state()
            for _ in range(calls):
                coordinator.schedule(train_steps, args=(iterator,))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", dps.errors.RollbackWarning)
                if epoch == config.kill_ps_at_epoch:
                    _kill_ps(client, coordinator, calls // 3, log)
                coordinator.join()
            for warning in caught:
                log(str(warning.message)) if issubclass(warning.category, dps.errors.RollbackWarning) else \
                    warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
            metrics = evaluate()
            path = manager.save()
            assert path is not None  # no checkpoint_interval: every save writes
            history.append(metrics)
            rate = calls * k * batch / (time.perf_counter() - t0)
            log(f"epoch {epoch:>2}/{config.epochs}  train loss {float(train_loss.result()):.4f}  "
                f"test log-loss {metrics['log_loss']:.4f}  AUC {metrics['auc']:.3f}  "
                f"{rate:,.0f} examples/s  saved {os.path.basename(path)}")
            if logger is not None:  # the test metrics at the optimizer step they were taken (as printed)
                step = int(optimizer.iterations.numpy())
                logger.writer.add_scalar("test/log_loss", metrics["log_loss"], step)
                logger.writer.add_scalar("test/auc", metrics["auc"], step)
    finally:
        if logger is not None:
            logger.stop()
    if not history:
        log(f"nothing to train: the latest checkpoint already has {done} of {config.epochs} epochs")
    result = {
        "resumed_from": restored,
        "epochs_trained": len(history),
        "start_log_loss": first["log_loss"],
        "log_loss": metrics["log_loss"],
        "auc": metrics["auc"],
        "teacher_log_loss": best["log_loss"],
        "teacher_auc": best["auc"],
        "steps": int(optimizer.iterations.numpy()),
        "checkpoints": manager.checkpoints,
        "seconds": time.perf_counter() - started,
    }
    log(f"done: optimizer step {result['steps']}; test log-loss {result['log_loss']:.4f} "
        f"(teacher {best['log_loss']:.4f}), AUC {result['auc']:.3f} (teacher {best['auc']:.3f}); "
        f"checkpoints in {directory}")
    return result
