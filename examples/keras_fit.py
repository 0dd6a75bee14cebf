"""The Keras 3 script of ``keras_local.py``, trained on parameter servers with ``dps.keras.fit``.

Three lines differ besides starting the cluster: the model is built and
compiled inside ``strategy.scope()``, and ``dps.keras.fit(model, ...)``
replaces ``model.fit(...)``. Its variables and Adam run on the two parameter
servers, the steps on the two trainers; the callbacks (EarlyStopping,
ModelCheckpoint) run here and see the servers' weights; afterwards the local
model holds the trained weights, so ``model.evaluate`` works as before.

    python examples/keras_fit.py

Needs ``pip install ".[keras]"`` in the daskps checkout.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import daskps as dps  # noqa: E402


def data(rows, seed):
    """Features, and labels from a fixed rule plus noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 20)).astype("float32")
    y = (x[:, :5].sum(axis=1) + 0.5 * rng.normal(size=rows) > 0).astype("float32")
    return x, y


def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.1),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy", metrics=["accuracy"])
    return model


if __name__ == "__main__":
    cluster = dps.LocalPSCluster(num_ps=2, num_workers=2)  # or dps.ParameterServerStrategy("tcp://scheduler:8786")
    strategy = dps.ParameterServerStrategy(cluster)
    x, y = data(4096, seed=0)
    x_val, y_val = data(1024, seed=1)
    with strategy.scope():
        model = make_model()
    callbacks = [keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
                 keras.callbacks.ModelCheckpoint("keras_example.keras")]
    history = dps.keras.fit(model, x, y, batch_size=64, epochs=6, validation_data=(x_val, y_val), callbacks=callbacks, verbose=2)
    loss, accuracy = model.evaluate(x_val, y_val, verbose=0)
    print(f"validation accuracy {accuracy:.3f} after {len(history.epoch)} epochs")
    strategy.close()
    cluster.close()
