"""The demo's click-through-rate model as a Keras 3 model, trained by ``dps.keras.fit`` (``daskps demo --model keras``).

The same teacher, data and test set as :mod:`daskps.demo`; the student is
written in Keras: an ``Embedding`` of the ``VOCAB`` ids (the strategy's
partitioner splits it over the parameter servers; its gradients travel as
the rows a batch touched), mean-pooled over the fields; another for the
bags of items (ids shifted by one, 0 the masked padding, averaged by a
masked ``GlobalAveragePooling1D``); and a dense part,
compiled with Adam and Keras' AUC. Each trainer draws its own batches
(a per-worker ``dataset_fn``). ``BackupAndRestore`` in the checkpoint
directory lets a rerun with more epochs go on from the last epoch.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import daskps as dps

__all__ = ["keras_model", "train_keras"]


def keras_model(learning_rate: float, seed: int, demo: Any) -> Any:
    """The student: logits = pooled embeddings @ u + x @ w + b, as Keras layers."""
    import keras

    keras.utils.set_random_seed(seed)
    ids = keras.Input((demo.NUM_FIELDS,), dtype="int32", name="ids")
    items = keras.Input((demo.MAX_ITEMS,), dtype="int32", name="items")  # a bag of items + 1, padded with 0
    x = keras.Input((demo.NUM_DENSE,), name="features")
    rows = keras.layers.Embedding(demo.VOCAB, demo.EMBED_DIM, name="table",
                                  embeddings_initializer=keras.initializers.RandomNormal(0.0, 0.01))(ids)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(rows)
    item_rows = keras.layers.Embedding(demo.ITEMS + 1, demo.EMBED_DIM, mask_zero=True, name="item_table",
                                       embeddings_initializer=keras.initializers.RandomNormal(0.0, 0.01))(items)
    item_vector = keras.layers.GlobalAveragePooling1D(name="item_pool")(item_rows)
    logits = keras.layers.Add(name="logits")([keras.layers.Dense(1, use_bias=False, name="u")(pooled),
                                             keras.layers.Dense(1, use_bias=False, name="v")(item_vector),
                                             keras.layers.Dense(1, name="w")(x)])
    model = keras.Model([ids, items, x], keras.layers.Activation("sigmoid", name="click")(logits), name="ctr")
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc")])
    return model


def _dataset_fn(seed: int, batch: int, make_batches: Any):
    def dataset_fn(ctx):
        for ids, items, x, y in make_batches(seed, ctx.input_pipeline_id, batch, stream=int(time.time())):
            yield (ids.astype(np.int32), (items + 1).astype(np.int32), x), y

    return dataset_fn


def train_keras(config: Any, cluster: Any, log: Any, demo: Any) -> dict:
    """Train the Keras student on ``cluster``; the same result dict as the numpy and JAX demo.

    ``demo`` is :mod:`daskps.demo`, handed in (it imports this module): the teacher, data and measures.
    """
    import keras

    client = cluster.get_client()
    log(f"dashboard: {demo.dashboard_of(cluster)}")
    partitioner = dps.partitioners.MinSizePartitioner(min_shard_bytes=64 << 10, max_shards=config.num_ps)
    strategy = dps.ParameterServerStrategy(client, variable_partitioner=partitioner)
    with strategy.scope():
        model = keras_model(config.learning_rate, config.seed, demo)
    truth = demo.teacher(config.seed)
    ids_t, items_t, x_t, y_t = demo.sample(np.random.default_rng([config.seed, 999]), 20_000, truth)
    p_best = demo.sigmoid(demo.teacher_logit(truth, ids_t, items_t, x_t))
    best = {"log_loss": demo.log_loss(p_best, y_t), "auc": demo.auc(p_best, y_t)}

    def evaluate() -> dict:
        p = model.predict([ids_t.astype(np.int32), (items_t + 1).astype(np.int32), x_t], batch_size=4096,
                          verbose=0)[:, 0]
        return {"log_loss": demo.log_loss(p, y_t), "auc": demo.auc(p, y_t)}

    directory = os.path.abspath(config.checkpoint_dir) if "://" not in config.checkpoint_dir else config.checkpoint_dir
    backup = keras.callbacks.BackupAndRestore(os.path.join(directory, "keras-backup"), delete_checkpoint=False)
    first = evaluate()
    history: list[dict] = []

    class Report(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.at = time.perf_counter()
            first.update(evaluate())  # after BackupAndRestore gave the model its backup's weights, if any
            if self.model.optimizer.iterations.numpy() > 0:
                log(f"resumed from {backup.backup_dir} (optimizer step {int(self.model.optimizer.iterations.numpy())})")

        def on_epoch_end(self, epoch, logs=None):
            metrics = evaluate()  # the local model holds the servers' weights here
            history.append(metrics)
            rate = config.steps_per_epoch * config.batch_size / (time.perf_counter() - self.at)
            self.at = time.perf_counter()
            log(f"epoch {epoch + 1:>2}/{config.epochs}  train loss {logs['loss']:.4f}  train AUC {logs['auc']:.3f}  "
                f"test log-loss {metrics['log_loss']:.4f}  AUC {metrics['auc']:.3f}  {rate:,.0f} examples/s")

    table = model.get_layer("table").embeddings
    log(f"keras model {model.name!r}: embedding table {tuple(table.shape)}, Adam on the servers; "
        f"fresh: test log-loss {first['log_loss']:.4f} (teacher {best['log_loss']:.4f})")
    started = time.perf_counter()
    dps.keras.fit(model, _dataset_fn(config.seed, config.batch_size, demo.make_batches), epochs=config.epochs,
                  steps_per_epoch=config.steps_per_epoch, steps_per_execution=config.steps_per_call, verbose=0,
                  callbacks=[backup, Report()])
    metrics = history[-1] if history else first
    if not history:
        log(f"nothing to train: the backup in {backup.backup_dir} already has {config.epochs} epochs")
    result = {
        "resumed_from": None, "epochs_trained": len(history), "start_log_loss": first["log_loss"],
        "log_loss": metrics["log_loss"], "auc": metrics["auc"], "teacher_log_loss": best["log_loss"],
        "teacher_auc": best["auc"], "steps": int(model.optimizer.iterations.numpy()), "checkpoints": [],
        "seconds": time.perf_counter() - started,
    }
    log(f"done: optimizer step {result['steps']}; test log-loss {result['log_loss']:.4f} "
        f"(teacher {best['log_loss']:.4f}), AUC {result['auc']:.3f} (teacher {best['auc']:.3f}); "
        f"backup in {backup.backup_dir}")
    strategy.close()
    return result
