"""``dps.keras.fit``/``evaluate``/``predict`` against Keras itself: the same model, weights, optimizer and data
through ``model.fit`` in this process and through daskps on the shared cluster.

With one trainer (the other given no ``worker`` slot) and ``shuffle=False`` the steps run in Keras'
order, so the history and the trained weights (BatchNormalization's moving statistics and the dropout
seed stream included) must be Keras' own. With two trainers, evaluation adds every batch once, so its
numbers are Keras' too.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np
import pytest

import daskps as dps
from tests.helpers.cluster import datasets_built, set_trainer_slots
from tests.helpers.paths import ROOT
from tests.helpers.waiting import wait_until

keras = pytest.importorskip("keras", reason="Keras is not installed (pip install 'daskps[keras]')")
if keras.backend.backend() != "jax":
    pytest.skip("these tests need KERAS_BACKEND=jax", allow_module_level=True)

RTOL = 2e-3
RNG = np.random.default_rng(0)
X = RNG.normal(size=(300, 6)).astype("float32")
Y = ((X[:, 0] > 0).astype("int64") + (X[:, 1] > 1)).astype("int64")
XV = RNG.normal(size=(90, 6)).astype("float32")
YV = (XV[:, 0] > 0).astype("int64")


def classifier(optimizer=None, seed=1, metrics=("accuracy",)):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.3), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=list(metrics))
    return model


@pytest.fixture
def one_trainer(client, strategy, coordinator):
    """The shared cluster with worker-1 given no trainer slot: every step runs on worker-0, in order."""
    set_trainer_slots(client, "worker-1", 0)
    try:
        yield coordinator
    finally:
        set_trainer_slots(client, "worker-1", 1)


def assert_history_close(ours, theirs, rtol=RTOL):
    assert sorted(ours.history) == sorted(theirs.history)
    for key, values in theirs.history.items():
        np.testing.assert_allclose(ours.history[key], values, rtol=rtol, err_msg=key)


def assert_weights_close(ours, theirs, atol=1e-5):
    assert [v.shape for v in ours.weights] == [v.shape for v in theirs.weights]  # paths differ by Keras' counters
    for a, b in zip(ours.weights, theirs.weights):
        np.testing.assert_allclose(np.asarray(a.value), np.asarray(b.value), rtol=RTOL, atol=atol, err_msg=a.path)


def test_fit_matches_keras_fit_with_validation_batchnorm_and_dropout(strategy, coordinator, one_trainer):
    reference = classifier()
    want = reference.fit(X, Y, batch_size=32, epochs=3, shuffle=False, validation_data=(XV, YV), verbose=0)
    with strategy.scope():
        model = classifier()
    got = dps.keras.fit(model, X, Y, batch_size=32, epochs=3, shuffle=False, validation_data=(XV, YV), verbose=0, coordinator=coordinator)
    assert isinstance(got, keras.callbacks.History) and got is model.history
    assert_history_close(got, want)
    assert_weights_close(model, reference)
    # the moving statistics moved, and the servers hold what the local model now holds
    moving = [v for v in model.non_trainable_variables if "moving_mean" in v.path][0]
    assert np.abs(np.asarray(moving.value)).max() > 0.01


def test_a_second_fit_goes_on_with_the_servers_optimizer_state(strategy, coordinator, one_trainer):
    reference = classifier(keras.optimizers.Adam(0.02))
    reference.fit(X, Y, batch_size=50, epochs=1, shuffle=False, verbose=0)
    want = reference.fit(X, Y, batch_size=50, epochs=2, shuffle=False, verbose=0)
    with strategy.scope():
        model = classifier(keras.optimizers.Adam(0.02))
    dps.keras.fit(model, X, Y, batch_size=50, epochs=1, shuffle=False, verbose=0, coordinator=coordinator)
    got = dps.keras.fit(model, X, Y, batch_size=50, epochs=2, shuffle=False, verbose=0, coordinator=coordinator)
    assert_history_close(got, want)
    assert_weights_close(model, reference)
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 18


def two_outputs(seed=3):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="features")
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, {"score": keras.layers.Dense(1, name="score")(hidden),
                                 "kind": keras.layers.Dense(3, name="kind")(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss={"score": "mse", "kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
                  loss_weights={"score": 0.5, "kind": 2.0},
                  metrics={"score": ["mae"], "kind": ["accuracy"]})
    return model


def test_a_multi_output_model_with_loss_weights_and_sample_weights_matches(strategy, coordinator, one_trainer):
    y = {"score": X[:, :1] * 2.0, "kind": Y}
    weights = np.linspace(0.5, 1.5, len(X)).astype("float32")
    reference = two_outputs()
    want = reference.fit({"features": X}, y, sample_weight=weights, batch_size=40, epochs=2, shuffle=False,
                         verbose=0)
    with strategy.scope():
        model = two_outputs()
    got = dps.keras.fit(model, {"features": X}, y, sample_weight=weights, batch_size=40, epochs=2, shuffle=False,
                        verbose=0, coordinator=coordinator)
    assert {"loss", "score_mae", "kind_accuracy"} <= set(got.history)
    assert_history_close(got, want)
    assert_weights_close(model, reference)


def test_class_weight_matches(strategy, coordinator, one_trainer):
    reference = classifier(keras.optimizers.RMSprop(0.01))
    want = reference.fit(X, Y, class_weight={0: 1.0, 1: 3.0, 2: 0.5}, batch_size=64, epochs=2, shuffle=False,
                         verbose=0)
    with strategy.scope():
        model = classifier(keras.optimizers.RMSprop(0.01))
    got = dps.keras.fit(model, X, Y, class_weight={0: 1.0, 1: 3.0, 2: 0.5}, batch_size=64, epochs=2,
                        shuffle=False, verbose=0, coordinator=coordinator)
    assert_history_close(got, want)


class Recorder(keras.callbacks.Callback):
    """Every hook called, with the batch or epoch and the logs' keys."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def _note(self, hook, index=None, logs=None):
        self.calls.append((hook, index, tuple(sorted(logs or {}))))

    def on_train_begin(self, logs=None):
        self._note("train_begin")

    def on_train_end(self, logs=None):
        self._note("train_end", None, logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._note("epoch_begin", epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._note("epoch_end", epoch, logs)

    def on_test_begin(self, logs=None):
        self._note("test_begin")

    def on_test_end(self, logs=None):
        self._note("test_end", None, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._note("train_batch_end", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._note("test_batch_end", batch, logs)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_callbacks_see_keras_sequence(strategy, coordinator, steps_per_execution):
    reference, ours = Recorder(), Recorder()
    model_ref = classifier()
    model_ref.compile(optimizer=keras.optimizers.Adam(0.01), steps_per_execution=steps_per_execution,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model_ref.fit(X, Y, batch_size=32, epochs=2, validation_data=(XV, YV), callbacks=[reference], verbose=0)
    with strategy.scope():
        model = classifier()
    dps.keras.fit(model, X, Y, batch_size=32, epochs=2, validation_data=(XV, YV), callbacks=[ours], verbose=0,
                  steps_per_execution=steps_per_execution, coordinator=coordinator)
    batch_level = ("train_batch_end", "test_batch_end")
    assert [c for c in ours.calls if c[0] not in batch_level] == [c for c in reference.calls if c[0] not in batch_level]
    # one on_train_batch_end per execution, with Keras' batch indices (10 batches a epoch)
    ends = [c[1] for c in ours.calls if c[0] == "train_batch_end"]
    assert ends == [c[1] for c in reference.calls if c[0] == "train_batch_end"]
    assert ends == (list(range(10)) * 2 if steps_per_execution == 1 else [3, 7, 11] * 2)
    assert {c[2] for c in ours.calls if c[0] == "train_batch_end"} == {("accuracy", "loss")}


def test_early_stopping_stops_at_keras_epoch_and_restores_its_weights(strategy, coordinator, one_trainer):
    def stopper():
        return keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05,
                                             restore_best_weights=True)

    reference = classifier(keras.optimizers.SGD(0.3))
    want = reference.fit(X, Y, batch_size=30, epochs=30, shuffle=False, validation_data=(XV, YV),
                         callbacks=[stopper()], verbose=0)
    with strategy.scope():
        model = classifier(keras.optimizers.SGD(0.3))
    got = dps.keras.fit(model, X, Y, batch_size=30, epochs=30, shuffle=False, validation_data=(XV, YV),
                        callbacks=[stopper()], verbose=0, coordinator=coordinator)
    assert 2 <= len(want.epoch) < 30, "the reference did not stop early: the test shows nothing"
    assert got.epoch == want.epoch
    assert_weights_close(model, reference)


def test_model_checkpoint_files_load_with_the_trained_weights(strategy, coordinator, tmp_path):
    with strategy.scope():
        model = classifier()
    dps.keras.fit(model, X, Y, epochs=2, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m-{epoch}.keras")),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "w-{epoch}.weights.h5"), save_weights_only=True)], coordinator=coordinator)
    whole = keras.saving.load_model(tmp_path / "m-2.keras")
    weights_only = classifier(seed=7)
    weights_only.load_weights(tmp_path / "w-2.weights.h5")
    first = classifier(seed=7)
    first.load_weights(tmp_path / "w-1.weights.h5")
    for loaded in (whole, weights_only):
        assert_weights_close(loaded, model, atol=0)
    # each file holds that epoch's servers' weights, not the initial ones
    kernel = lambda m: np.asarray(m.trainable_variables[0].value)  # noqa: E731
    assert not np.allclose(kernel(first), kernel(model))
    assert not np.allclose(kernel(first), kernel(classifier()))


def test_evaluate_and_predict_on_two_trainers_equal_keras(strategy, coordinator):
    with strategy.scope():
        model = classifier()
    dps.keras.fit(model, X, Y, epochs=1, verbose=0, coordinator=coordinator)
    want = model.evaluate(XV, YV, batch_size=8, verbose=0)  # the local model holds the servers' weights
    got = dps.keras.evaluate(model, XV, YV, batch_size=8, verbose=0, coordinator=coordinator)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    as_dict = dps.keras.evaluate(model, XV, YV, batch_size=8, verbose=0, return_dict=True, coordinator=coordinator)
    assert sorted(as_dict) == ["accuracy", "loss"]
    np.testing.assert_allclose(dps.keras.predict(model, XV, batch_size=8, verbose=0, coordinator=coordinator),
                               model.predict(XV, batch_size=8, verbose=0), rtol=1e-5, atol=1e-6)


def test_evaluate_uses_weights_set_locally_since(strategy, coordinator):
    with strategy.scope():
        model = classifier()
    dps.keras.fit(model, X, Y, epochs=1, verbose=0, coordinator=coordinator)
    model.set_weights([np.zeros_like(w) for w in model.get_weights()])
    np.testing.assert_allclose(dps.keras.predict(model, XV, verbose=0, coordinator=coordinator), 0.0)


def test_learning_rate_callbacks_reach_the_servers(strategy, coordinator, one_trainer):
    def schedule(epoch, lr):
        return 0.05 if epoch == 0 else 0.005

    reference = classifier(keras.optimizers.SGD(0.05))
    want = reference.fit(X, Y, batch_size=50, epochs=2, shuffle=False, verbose=0,
                         callbacks=[keras.callbacks.LearningRateScheduler(schedule)])
    with strategy.scope():
        model = classifier(keras.optimizers.SGD(0.05))
    got = dps.keras.fit(model, X, Y, batch_size=50, epochs=2, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.LearningRateScheduler(schedule)], coordinator=coordinator)
    assert_history_close(got, want)
    assert_weights_close(model, reference)
    assert got.history["learning_rate"] == pytest.approx([0.05, 0.005])


def test_keras_own_logging_and_stopping_callbacks_work_unchanged(strategy, coordinator, one_trainer, tmp_path,
                                                                    capsys):
    from tests.helpers.events import read_scalars

    def callbacks(where):
        return [keras.callbacks.CSVLogger(str(where / "log.csv")),
                keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0)]

    (tmp_path / "keras").mkdir()
    (tmp_path / "ours").mkdir()
    reference = classifier()
    want = reference.fit(X, Y, batch_size=50, epochs=3, shuffle=False, validation_data=(XV, YV), verbose=0,
                         callbacks=callbacks(tmp_path / "keras"))
    with strategy.scope():
        model = classifier()
    got = dps.keras.fit(model, X, Y, batch_size=50, epochs=3, shuffle=False, validation_data=(XV, YV), verbose=1,
                        coordinator=coordinator,
                        callbacks=callbacks(tmp_path / "ours") + [dps.keras.TensorBoard(str(tmp_path / "tb"))])
    assert_history_close(got, want)  # ReduceLROnPlateau halved the rate each epoch, on the servers too
    assert got.history["learning_rate"][-1] == pytest.approx(got.history["learning_rate"][0] / 2)
    ours = (tmp_path / "ours" / "log.csv").read_text().splitlines()
    theirs = (tmp_path / "keras" / "log.csv").read_text().splitlines()
    assert ours[0] == theirs[0] and len(ours) == len(theirs) == 4
    for a, b in zip(ours[1:], theirs[1:]):
        np.testing.assert_allclose([float(v) for v in a.split(",")], [float(v) for v in b.split(",")], rtol=RTOL)
    out = capsys.readouterr().out
    assert "Epoch 3/3" in out and "6/6" in out and "val_accuracy" in out  # Keras' own progress bar
    train, val = read_scalars(tmp_path / "tb" / "train"), read_scalars(tmp_path / "tb" / "validation")
    assert [s for s, _ in train["epoch_loss"]] == [0, 1, 2]
    np.testing.assert_allclose([v for _, v in train["epoch_loss"]], want.history["loss"], rtol=RTOL)
    np.testing.assert_allclose([v for _, v in val["epoch_accuracy"]], want.history["val_accuracy"], rtol=RTOL)


def test_terminate_on_nan_stops_the_first_epoch(strategy, coordinator):
    with strategy.scope():
        model = classifier(keras.optimizers.SGD(1e30))
    history = dps.keras.fit(model, X * 1e10, Y, batch_size=10, epochs=4, verbose=0, coordinator=coordinator,
                            callbacks=[keras.callbacks.TerminateOnNaN()])
    assert history.epoch == [0] and not np.isfinite(history.history["loss"][0])


def test_an_error_mid_epoch_leaves_the_trained_weights_in_the_model(strategy, coordinator):
    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                raise RuntimeError("boom")

    with strategy.scope():
        model = classifier()
    with pytest.raises(RuntimeError, match="boom"):
        dps.keras.fit(model, X, Y, batch_size=10, epochs=3, verbose=0, coordinator=coordinator, callbacks=[Boom()])
    trained = int(model.optimizer.iterations.numpy())
    assert trained >= 6  # the steps that ran are in the local model, not the weights from before fit
    from daskps.keras.binding import binding_for

    servers = dps.read_values(binding_for(model, coordinator).trainable)
    for local, remote in zip(model.trainable_variables, servers):
        np.testing.assert_array_equal(np.asarray(local.value), remote)
    dps.keras.fit(model, X, Y, batch_size=10, epochs=1, verbose=0, coordinator=coordinator)
    assert int(model.optimizer.iterations.numpy()) == trained + 30  # the next fit went on from them


def test_steps_per_epoch_goes_on_through_the_data_as_keras(strategy, coordinator, one_trainer):
    reference = classifier(keras.optimizers.SGD(0.1))
    want = reference.fit(X, Y, steps_per_epoch=4, epochs=4, shuffle=False, verbose=0)  # batch_size from the steps
    with strategy.scope():
        model = classifier(keras.optimizers.SGD(0.1))
    got = dps.keras.fit(model, X, Y, steps_per_epoch=4, epochs=4, shuffle=False, verbose=0, coordinator=coordinator)
    assert_history_close(got, want)
    assert_weights_close(model, reference)
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


def test_a_recompiled_model_trains_with_its_new_loss(strategy, coordinator, one_trainer):
    optimizer = keras.optimizers.SGD(0.05)
    reference = classifier(optimizer)
    reference.fit(X, Y, batch_size=50, epochs=1, shuffle=False, verbose=0)
    reference.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=2),
                      metrics=["accuracy"])
    want = reference.fit(X, Y, batch_size=50, epochs=1, shuffle=False, verbose=0)
    with strategy.scope():
        model = classifier(keras.optimizers.SGD(0.05))
    dps.keras.fit(model, X, Y, batch_size=50, epochs=1, shuffle=False, verbose=0, coordinator=coordinator)
    model.compile(optimizer=model.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=2),
                  metrics=["accuracy"])
    got = dps.keras.fit(model, X, Y, batch_size=50, epochs=1, shuffle=False, verbose=0, coordinator=coordinator)
    assert_history_close(got, want)


def test_a_model_with_its_own_train_step_is_refused_on_jax(strategy, coordinator):
    class Custom(keras.Sequential):
        def train_step(self, state, data):
            raise AssertionError("not run")

    keras.utils.set_random_seed(0)
    model = Custom([keras.Input((6,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="overrides train_step"):
        dps.keras.fit(model, X, X[:, :1], verbose=0, coordinator=coordinator)


def test_the_trained_model_saves_and_predicts_locally(strategy, coordinator, tmp_path):
    with strategy.scope():
        model = classifier()
    before = model.predict(XV, verbose=0)
    history = dps.keras.fit(model, X, Y, epochs=3, verbose=0, coordinator=coordinator)
    assert history.history["loss"][-1] < history.history["loss"][0]
    model.save(tmp_path / "trained.keras")
    after = model.predict(XV, verbose=0)
    assert not np.allclose(before, after)
    np.testing.assert_allclose(keras.saving.load_model(tmp_path / "trained.keras").predict(XV, verbose=0), after,
                               rtol=1e-6)


def test_stop_training_from_a_batch_callback_stops_scheduling(strategy, coordinator):
    from daskps.keras.loop import STEPS_AHEAD_PER_TRAINER

    class StopAfter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1
            if batch == 2:
                self.model.stop_training = True

    with strategy.scope():
        model = classifier()
    stop = StopAfter()
    history = dps.keras.fit(model, X, Y, batch_size=1, epochs=5, callbacks=[stop], verbose=0, coordinator=coordinator)
    assert history.epoch == [0]
    # the steps already scheduled ran (their updates are on the servers); nothing more was scheduled
    window = STEPS_AHEAD_PER_TRAINER * len(strategy.trainer_names)
    assert 3 <= stop.batches <= 3 + window < len(X)
    assert int(model.optimizer.iterations.numpy()) == stop.batches


def test_a_dataset_fn_trains_for_steps_per_epoch(strategy, coordinator):
    def dataset_fn(context):
        rng = np.random.default_rng(context.input_pipeline_id)
        while True:
            x = rng.normal(size=(32, 6)).astype("float32")
            yield x, (x[:, 0] > 0).astype("int64")

    with strategy.scope():
        model = classifier()
    history = dps.keras.fit(model, dataset_fn, epochs=2, steps_per_epoch=7, verbose=0, coordinator=coordinator)
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == 14
    with pytest.raises(ValueError, match="steps_per_epoch is required"):
        dps.keras.fit(model, dataset_fn, epochs=1, verbose=0, coordinator=coordinator)


def test_each_batch_is_trained_exactly_once_across_two_trainers(strategy, coordinator):
    with strategy.scope():
        model = classifier(keras.optimizers.SGD(0.0001))
    history = dps.keras.fit(model, X, Y, batch_size=7, epochs=2, verbose=0, coordinator=coordinator)
    assert int(model.optimizer.iterations.numpy()) == 2 * 43
    # the loss tracker's count is the number of rows seen: each row once per epoch
    counts = [np.asarray(v.value) for v in model.metrics_variables if v.path == "loss/count"]
    assert counts and float(counts[0]) == len(X)
    assert len(history.history["loss"]) == 2


def test_dask_arrays_train_as_keras_does_on_the_same_batches(strategy, coordinator, one_trainer):
    da = pytest.importorskip("dask.array")
    reference = classifier()
    want = reference.fit(X, Y, batch_size=32, epochs=2, shuffle=False, validation_data=(XV, YV), verbose=0)
    with strategy.scope():
        model = classifier()
    # partitions of 96 rows: the batches of 32 (and the last of 12) are Keras' own
    got = dps.keras.fit(model, da.from_array(X, chunks=96), da.from_array(Y, chunks=96), batch_size=32, epochs=2,
                        shuffle=False, validation_data=(da.from_array(XV, chunks=32), da.from_array(YV, chunks=32)),
                        verbose=0, coordinator=coordinator)
    assert_history_close(got, want)
    assert_weights_close(model, reference)
    assert int(model.optimizer.iterations.numpy()) == 20


def test_a_dask_dataframe_and_series_evaluate_as_keras_on_two_trainers(strategy, coordinator):
    dd = pytest.importorskip("dask.dataframe")
    pd = pytest.importorskip("pandas")
    with strategy.scope():
        model = classifier()
    frame = dd.from_pandas(pd.DataFrame(XV, columns=list("abcdef")), npartitions=4)
    labels = dd.from_pandas(pd.Series(YV, name="label"), npartitions=4)
    dps.keras.fit(model, frame, labels, batch_size=16, epochs=1, verbose=0, coordinator=coordinator)
    got = dps.keras.evaluate(model, frame, labels, batch_size=16, verbose=0, coordinator=coordinator)
    np.testing.assert_allclose(got, model.evaluate(XV, YV, batch_size=16, verbose=0), rtol=1e-4)
    with pytest.raises(TypeError, match="y must be a Dask collection too"):
        dps.keras.fit(model, frame, YV, verbose=0, coordinator=coordinator)


def test_predict_on_a_dask_collection_is_a_dask_array_computed_on_the_trainers(client, strategy, coordinator):
    da = pytest.importorskip("dask.array")
    with strategy.scope():
        model = classifier()
    dps.keras.fit(model, X, Y, epochs=1, verbose=0, coordinator=coordinator)
    lazy = dps.keras.predict(model, da.from_array(XV, chunks=25), batch_size=10, coordinator=coordinator)
    assert isinstance(lazy, da.Array) and lazy.shape == (90, 3) and lazy.chunks[0] == (25, 25, 25, 15)
    held = lazy  # already computing: its blocks are futures on the trainers
    np.testing.assert_allclose(held.compute(), model.predict(XV, verbose=0), rtol=1e-5, atol=1e-6)
    trainers = {a for a, w in client.scheduler_info()["workers"].items() if "worker" in (w.get("resources") or {})}
    where = {a for addresses in client.who_has(held).values() for a in addresses}
    assert where and where <= trainers


def test_backup_and_restore_resumes_on_new_servers_with_the_optimizer_state(client, strategy, coordinator,
                                                                           one_trainer, tmp_path):
    reference = classifier()
    want = reference.fit(X, Y, batch_size=50, epochs=4, shuffle=False, verbose=0)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt  # the job dies after its second epoch's backup

    backup = str(tmp_path / "backup")
    with strategy.scope():
        model = classifier()
    with pytest.raises(KeyboardInterrupt):
        dps.keras.fit(model, X, Y, batch_size=50, epochs=4, shuffle=False, verbose=0, coordinator=coordinator,
                      callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
    assert (tmp_path / "backup" / "daskps").exists()
    strategy.close()  # the first servers are gone
    again = dps.ParameterServerStrategy(client)
    with again.scope():
        fresh = classifier(seed=99)  # other initial weights: the backup must replace them
    got = dps.keras.fit(fresh, X, Y, batch_size=50, epochs=4, shuffle=False, verbose=0,
                        coordinator=dps.ClusterCoordinator(again), callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert got.epoch == [2, 3]
    # Adam's moments came back too: the last two epochs and the weights are those of an uninterrupted fit
    np.testing.assert_allclose(got.history["loss"], want.history["loss"][2:], rtol=RTOL)
    assert_weights_close(fresh, reference)
    assert int(fresh.optimizer.iterations.numpy()) == 24
    assert not (tmp_path / "backup").exists()  # deleted at the end, as Keras deletes its own
    again.close()


def recommender(seed=5):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((3,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(2000, 8)(ids))
    model = keras.Model(ids, keras.layers.Dense(1)(pooled))
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


def test_a_sharded_embedding_trains_row_wise_as_keras(client, one_trainer):
    ids = np.random.default_rng(3).integers(0, 2000, size=(256, 3)).astype("int32")
    target = (ids % 7 == 0).sum(axis=1, keepdims=True).astype("float32")
    reference = recommender()
    want = reference.fit(ids, target, batch_size=32, epochs=2, shuffle=False, verbose=0)
    sharded = dps.ParameterServerStrategy(client, variable_partitioner=dps.partitioners.FixedShardsPartitioner(2))
    with sharded.scope():
        model = recommender()
    got = dps.keras.fit(model, ids, target, batch_size=32, epochs=2, shuffle=False, verbose=0)
    from daskps.keras.binding import binding_for

    binding = binding_for(model, dps.ClusterCoordinator(sharded))
    table = binding.trainable[0]
    assert isinstance(table, dps.ShardedVariable) and len(table.variables) == 2 and table.shape == (2000, 8)
    assert binding.train_step.row_wise == (0,)
    assert_history_close(got, want)
    assert_weights_close(model, reference)
    sharded.close()


def ctr_model(table: bool, seed=11):
    """Two id fields and a dense part; the ids' rows from a hash table on the servers, or Keras' Embedding."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((2,), dtype="int64", name="ids")
    dense = keras.Input((4,), name="numeric")
    if table:
        rows = dps.keras.EmbeddingTable(4, name="rows")(ids)
    else:
        rows = keras.layers.Embedding(10_000, 4, embeddings_initializer="zeros", name="rows")(ids)
    return _clicks(ids, dense, keras.layers.Flatten()(rows), keras.optimizers.SGD(0.5))


def _clicks(ids, dense, features, optimizer):
    """The click model of the table-layer tests: the ids' features beside the dense part, two Dense layers."""
    joined = keras.layers.Concatenate()([features, dense])
    model = keras.Model([ids, dense], keras.layers.Dense(1, activation="sigmoid")(
        keras.layers.Dense(8, activation="relu")(joined)))
    model.compile(optimizer=optimizer, loss="binary_crossentropy", metrics=["accuracy"])
    return model


def test_a_hash_table_layer_trains_as_a_keras_embedding_of_the_same_rows(strategy, coordinator, one_trainer):
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 10_000, size=(400, 2)).astype("int64")
    dense = rng.normal(size=(400, 4)).astype("float32")
    label = ((ids[:, 0] % 3 == 0) ^ (dense[:, 0] > 0)).astype("float32")
    reference = ctr_model(table=False)
    want = reference.fit([ids, dense], label, batch_size=40, epochs=3, shuffle=False, verbose=0)
    with strategy.scope():
        model = ctr_model(table=True)
    got = dps.keras.fit(model, [ids, dense], label, batch_size=40, epochs=3, shuffle=False, verbose=0,
                        coordinator=coordinator)
    assert_history_close(got, want)
    layer = model.get_layer("rows")
    table = layer.table
    assert isinstance(table, dps.EmbeddingTable)
    seen = np.unique(ids)
    assert table.size() == len(seen)  # a row per id seen, nothing else: the table was never pulled whole
    keys, rows = table.export()
    order = np.argsort(keys)
    np.testing.assert_allclose(rows[order], np.asarray(reference.get_layer("rows").embeddings)[np.sort(keys)],
                               rtol=RTOL, atol=1e-6)
    # in this process, the layer reads its rows from the servers: Keras' own predict and evaluate work
    np.testing.assert_allclose(model.predict([ids, dense], verbose=0), reference.predict([ids, dense], verbose=0),
                               rtol=RTOL, atol=1e-5)
    np.testing.assert_allclose(dps.keras.evaluate(model, [ids, dense], label, verbose=0, coordinator=coordinator),
                               reference.evaluate([ids, dense], label, verbose=0), rtol=1e-4)


def bag_model(table: bool, seed=12):
    """A bag of up to 5 ids (padded) pooled by mean, and a dense part: pooled on the servers by a hash table
    layer, or by Keras' Embedding (ids shifted by one, 0 the masked padding) and masked average pooling."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((5,), dtype="int64", name="ids")
    dense = keras.Input((4,), name="numeric")
    if table:
        pooled = dps.keras.EmbeddingTable(4, combiner="mean", name="bags")(ids)
    else:
        rows = keras.layers.Embedding(10_001, 4, embeddings_initializer="zeros", mask_zero=True, name="bags")(ids)
        pooled = keras.layers.GlobalAveragePooling1D()(rows)
    return _clicks(ids, dense, pooled, keras.optimizers.Adagrad(0.5))


def test_a_pooling_table_layer_trains_as_keras_masked_average_of_embeddings(strategy, coordinator, one_trainer):
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 10_000, size=(400, 5)).astype("int64")
    sizes = rng.integers(1, 6, size=400)
    ids[np.arange(5) >= sizes[:, None]] = -1  # bags of 1 to 5 ids, padded with -1
    dense = rng.normal(size=(400, 4)).astype("float32")
    label = ((np.where(ids >= 0, ids % 3 == 0, False).sum(1) > 0) ^ (dense[:, 0] > 0)).astype("float32")
    reference = bag_model(table=False)
    want = reference.fit([ids + 1, dense], label, batch_size=40, epochs=3, shuffle=False, verbose=0)
    with strategy.scope():
        model = bag_model(table=True)
    before = sum(s["bytes_received"] for s in strategy.ps_stats())
    got = dps.keras.fit(model, [ids, dense], label, batch_size=40, epochs=3, shuffle=False, verbose=0,
                        coordinator=coordinator)
    assert_history_close(got, want)
    table = model.get_layer("bags").table
    keys, rows = table.export()
    assert keys.tolist() == np.unique(ids[ids >= 0]).tolist()  # padding made no rows
    np.testing.assert_allclose(rows, np.asarray(reference.get_layer("bags").embeddings)[keys + 1],
                               rtol=RTOL, atol=1e-6)
    assert sum(s["bytes_received"] for s in strategy.ps_stats()) > before
    np.testing.assert_allclose(model.predict([ids, dense], verbose=0), reference.predict([ids + 1, dense], verbose=0),
                               rtol=RTOL, atol=1e-5)


def test_a_pooling_table_layer_takes_ids_of_any_rank(strategy, coordinator):
    """Two bags of 3 ids per example (ids of shape (batch, 2, 3)): a vector per bag, (batch, 2, dim)."""
    keras.utils.set_random_seed(3)
    ids = keras.Input((2, 3), dtype="int64")
    pooled = dps.keras.EmbeddingTable(4, combiner="sum", name="two_bags",
                                      initializer=keras_free_initializer)(ids)
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(pooled)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(6).integers(-1, 50, size=(64, 2, 3)).astype("int64")
    y = np.random.default_rng(7).normal(size=(64, 1)).astype("float32")
    history = dps.keras.fit(model, x, y, batch_size=16, epochs=2, verbose=0, coordinator=coordinator)
    assert len(history.history["loss"]) == 2
    on_trainers = dps.keras.predict(model, x, verbose=0, coordinator=coordinator)
    here = model.predict(x, verbose=0)  # the layer pools through the servers from this process
    assert on_trainers.shape == (64, 1)
    np.testing.assert_allclose(on_trainers, here, rtol=1e-5, atol=1e-6)
    table = model.get_layer("two_bags").table
    keys, rows = table.export()
    assert keys.tolist() == np.unique(x[x >= 0]).tolist()
    assert not np.allclose(rows, 0.01)  # trained


def keras_free_initializer(shape, dtype):
    return np.full(shape, 0.01, dtype)


def test_dropping_the_model_releases_what_it_made_on_servers_and_trainers(client, strategy, coordinator):

    def servers():
        return sum(s["num_variables"] for s in strategy.ps_stats())

    def built():  # the ids of the datasets each trainer holds, as (worker, id) pairs
        return {(w, d) for w, ids in client.run(datasets_built).items() for d in ids}

    servers_before, built_before = servers(), built()
    with strategy.scope():
        model = classifier()
    dps.keras.fit(model, X, Y, epochs=1, verbose=0, coordinator=coordinator)
    servers_during = servers()
    ours = built() - built_before  # earlier tests' copies may still be leaving: only the new ids are this model's
    assert servers_during > servers_before  # variables and slots
    assert ours  # the model's copy on the trainers
    del model
    # Releases travel in the background (earlier tests' too: the servers' count may fall below "before")
    wait_until(lambda: not (servers() > servers_before or ours & built()), 30, interval=0.1, failure=lambda: (
        f"still held: {servers()} variables (before: {servers_before}), datasets {sorted(ours & built())}"))


# -- refusals: named arguments, nothing made on a server ---------------------------------------

def _server_variables(strategy):
    return [s["num_variables"] for s in strategy.ps_stats()]


class MySGD(keras.optimizers.SGD):
    pass


def _excluding(optimizer):
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


@pytest.mark.parametrize("bad, match", [
    (lambda m: m.compile(optimizer=MySGD(0.1), loss="mse"), "MySGD"),
    (lambda m: m.compile(optimizer=keras.optimizers.Adafactor(), loss="mse"), "Adafactor"),
    (lambda m: m.compile(optimizer=keras.optimizers.Adam(use_ema=True), loss="mse"), "use_ema"),
    (lambda m: m.compile(optimizer=_excluding(keras.optimizers.AdamW()), loss="mse"), "exclude_from_weight_decay"),
])
def test_an_optimizer_the_servers_cannot_run_is_refused_before_anything_is_made(strategy, coordinator, bad, match):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    bad(model)
    before = _server_variables(strategy)
    with pytest.raises((TypeError, ValueError), match=match):
        dps.keras.fit(model, X, X[:, :1], verbose=0, coordinator=coordinator)
    assert _server_variables(strategy) == before


def test_bad_input_is_refused_with_the_argument_named(strategy, coordinator):
    keras.utils.set_random_seed(0)
    uncompiled = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="compiled"):
        dps.keras.fit(uncompiled, X, Y, coordinator=coordinator)
    model = classifier()
    before = _server_variables(strategy)
    cases = [
        (dict(x=X), ValueError, "y must be given"),
        (dict(x=X, y=Y[:10]), ValueError, "same number of rows"),
        (dict(x=X, y=Y, batch_size=0), ValueError, "batch_size"),
        (dict(x=X, y=Y, epochs=-1), ValueError, "epochs"),
        (dict(x=X, y=Y, steps_per_execution=0), ValueError, "steps_per_execution"),
        (dict(x=X, y=Y, validation_data=XV), ValueError, "validation_data"),
        (dict(x=X, y=Y, shuffle="yes"), ValueError, "shuffle"),
        (dict(x=X, y=Y, validation_freq=0), ValueError, "validation_freq"),
        (dict(x="data.csv", y=Y), TypeError, "numpy arrays"),
        (dict(x={"a": X, "b": X}, y=Y), ValueError, "x and y do not fit the model"),  # one input, two given
        (dict(x=X[:, :4], y=Y), ValueError, "x and y do not fit the model"),  # 4 features for 6
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            dps.keras.fit(model, verbose=0, **kwargs, coordinator=coordinator)
    assert _server_variables(strategy) == before


def test_without_a_coordinator_or_scope_the_error_names_both_ways(client):
    gone = dps.ParameterServerStrategy(client)
    with gone.scope():
        pass
    gone.close()  # the last scope entered belongs to a closed strategy
    two = [dps.ParameterServerStrategy(client), dps.ParameterServerStrategy(client)]  # which one is meant?
    assert len(dps.ParameterServerStrategy.open_strategies()) >= 2
    model = classifier()
    with pytest.raises(ValueError, match="coordinator=.*strategy.scope"):
        dps.keras.fit(model, X, Y, verbose=0)
    for s in two:
        s.close()


def test_fit_after_the_scope_uses_the_strategy_the_model_was_built_in(client, strategy):
    other = dps.ParameterServerStrategy(client)  # open too: the scope decides
    with strategy.scope():
        model = classifier()
    dps.keras.fit(model, X, Y, epochs=1, verbose=0)
    assert strategy.coordinator is not None and strategy.coordinator.stats["done"] == 10
    assert other.coordinator is None
    other.close()


def test_a_trainer_on_another_backend_says_what_to_set():
    from daskps.keras.backend import check_backend

    with pytest.raises(RuntimeError, match="KERAS_BACKEND=torch"):
        check_backend("torch")


# -- the docs' claim: a Keras script moves to daskps by three lines, besides the cluster ------------------

EXAMPLES = ROOT / "examples"
CLUSTER_WORDS = ("LocalPSCluster", "ParameterServerStrategy(", ".close()", "import daskps")


def _code(path):
    lines = path.read_text().splitlines()
    return lines[lines.index('"""') + 1:]  # without the module docstring


def test_the_docs_show_the_whole_diff_and_it_changes_three_lines_besides_the_cluster():
    local, moved = _code(EXAMPLES / "keras_local.py"), _code(EXAMPLES / "keras_fit.py")
    diff = list(difflib.unified_diff(local, moved, "keras_local.py", "keras_fit.py", n=1, lineterm=""))
    page = (EXAMPLES.parent / "docs" / "user-guide" / "keras.md").read_text()
    assert "```diff\n" + "\n".join(diff) + "\n```" in page
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++") and line[1:].strip()]
    changed = [line for line in added if not any(word in line for word in CLUSTER_WORDS)]
    assert [line.strip() for line in changed] == [
        "with strategy.scope():", "model = make_model()",
        "history = dps.keras.fit(model, x, y, batch_size=64, epochs=6, validation_data=(x_val, y_val), "
        "callbacks=callbacks, verbose=2)"]


@pytest.mark.cluster
@pytest.mark.parametrize("script", ["keras_local.py", "keras_fit.py"])
def test_both_example_scripts_train(script, tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = float(re.search(r"validation accuracy (\d\.\d+) after", done.stdout).group(1))
    assert accuracy > 0.85, done.stdout
    assert (tmp_path / "keras_example.keras").exists()  # ModelCheckpoint wrote the model


# -- Keras' PyTorch backend: its own process (this one runs Keras on JAX) -----------------------------------

TORCH_SCRIPT = '''
import json, os, sys
os.environ["KERAS_BACKEND"] = "torch"
import keras, numpy as np
import daskps as dps

def classifier():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.3, seed=7),
                              keras.layers.Dense(3)])  # seeded: Keras' torch Dropout otherwise uses torch's RNG
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model

if __name__ == "__main__":
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)).astype("float32"); y = (x[:, 0] > 0).astype("int64")
    reference = classifier()
    want = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, validation_data=(x[:50], y[:50]), verbose=0)
    with dps.LocalPSCluster(num_ps=2, num_workers=1) as cluster:
        strategy = dps.ParameterServerStrategy(cluster)
        with strategy.scope():
            model = classifier()
        got = dps.keras.fit(model, x, y, batch_size=32, epochs=2, shuffle=False, validation_data=(x[:50], y[:50]),
                            verbose=0)
        evaluated = dps.keras.evaluate(model, x[:50], y[:50], verbose=0)
        predicted = dps.keras.predict(model, x[:50], verbose=0)
        strategy.close()
    print("RESULT " + json.dumps({
        "backend": keras.backend.backend(), "want": want.history, "got": got.history,
        "weights": max(float(np.abs(np.asarray(a.numpy(), float) - np.asarray(b.numpy(), float)).max())
                       for a, b in zip(reference.weights, model.weights)),
        "evaluated": evaluated, "local_evaluate": model.evaluate(x[:50], y[:50], verbose=0),
        "predicted": float(np.abs(predicted - model.predict(x[:50], verbose=0)).max())}))
'''


@pytest.mark.cluster
def test_the_pytorch_backend_trains_as_keras_fit_does(tmp_path):
    pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'daskps[torch]')")
    script = tmp_path / "torch_fit.py"
    script.write_text(TORCH_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=170,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["backend"] == "torch"
    assert sorted(result["got"]) == sorted(result["want"]) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for key, values in result["want"].items():
        np.testing.assert_allclose(result["got"][key], values, rtol=RTOL, err_msg=key)
    assert result["weights"] < 1e-4
    np.testing.assert_allclose(result["evaluated"], result["local_evaluate"], rtol=1e-4)
    assert result["predicted"] < 1e-5
