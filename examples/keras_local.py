"""A Keras 3 script as it runs on one machine: the starting point of ``keras_fit.py``.

``diff examples/keras_local.py examples/keras_fit.py`` shows what moves it
onto parameter servers (docs/user-guide/keras.md shows that diff).

    python examples/keras_local.py

Needs ``pip install ".[keras]"`` in the daskps checkout.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402


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
    x, y = data(4096, seed=0)
    x_val, y_val = data(1024, seed=1)
    model = make_model()
    callbacks = [keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
                 keras.callbacks.ModelCheckpoint("keras_example.keras")]
    history = model.fit(x, y, batch_size=64, epochs=6, validation_data=(x_val, y_val), callbacks=callbacks, verbose=2)
    loss, accuracy = model.evaluate(x_val, y_val, verbose=0)
    print(f"validation accuracy {accuracy:.3f} after {len(history.epoch)} epochs")
