"""``dps.keras``: a compiled Keras 3 model trained, evaluated and used on the parameter servers.

Build and ``compile`` the model as usual (inside ``strategy.scope()``, or
not), then call ``dps.keras.fit(model, ...)`` where you called
``model.fit(...)``. While it trains, the model's variables (trainable and
not) live on the parameter servers under their Keras paths and its
optimizer runs there (the daskps optimizer of the same class and config);
each step is Keras' own (loss, compiled metrics, sample weights,
non-trainable updates) run on some trainer; callbacks run here, in Keras'
order, and before each ``on_epoch_end`` the local model holds the servers'
weights. Afterwards the local model holds the trained weights:
``model.save``, ``model.predict`` work as after ``model.fit``.

Keras is imported only when one of these functions is first called, so
``import daskps`` does not pick a Keras backend. The JAX backend is the
one supported (``KERAS_BACKEND=jax``, set before Keras is first imported,
and in the workers' environment).

>>> import daskps as dps                                         # doctest: +SKIP
>>> with strategy.scope():                                       # doctest: +SKIP
...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
...     model.compile(optimizer="adam", loss="mse")
>>> history = dps.keras.fit(model, x, y, epochs=3)               # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

__all__ = ["EmbeddingTable", "TensorBoard", "evaluate", "fit", "predict"]


def __getattr__(name: str) -> Any:
    """``dps.keras.EmbeddingTable`` and ``dps.keras.TensorBoard``, imported (with Keras) on first use."""
    if name == "EmbeddingTable":
        from daskps.keras.layers import EmbeddingTable

        return EmbeddingTable
    if name == "TensorBoard":
        from daskps.keras.tensorboard import TensorBoard

        return TensorBoard
    raise AttributeError(f"module 'daskps.keras' has no attribute {name!r}")


def fit(model: Any, x: Any = None, y: Any = None, *, batch_size: int | None = None, epochs: int = 1,
        verbose: Any = "auto", callbacks: Any = None, validation_data: Any = None, shuffle: Any = True,
        initial_epoch: int = 0, steps_per_epoch: int | None = None, validation_steps: int | None = None,
        validation_freq: Any = 1, steps_per_execution: int = 1, coordinator: Any = None,
        staleness: int | None = None, sample_weight: Any = None, class_weight: Any = None) -> Any:
    """Train a compiled Keras model on the parameter servers, as ``model.fit`` trains it locally.

    Parameters
    ----------
    model : keras.Model
        Built and compiled (optimizer: Keras' SGD, Adagrad, Adam, AdamW,
        RMSprop, Ftrl, Adamax, Nadam or Lion, by name or object, with a
        number or one of Keras' schedules as learning rate).
    x, y : numpy arrays (or dicts, lists, tuples of them), or ``x`` a per-worker ``dataset_fn``
        Arrays reach each trainer once; each epoch's batches are handed out
        exactly once across the trainers (in order with ``shuffle=False``).
        A ``dataset_fn()`` (or ``dataset_fn(input_context)``) is built on
        each trainer and yields ``(x, y)`` or ``(x, y, sample_weight)``
        batches; then ``steps_per_epoch`` is required.
    batch_size, epochs, verbose, callbacks, validation_data, shuffle, initial_epoch, steps_per_epoch,
    validation_steps, validation_freq, sample_weight, class_weight
        Keras' meanings. Callbacks run in this process.
    steps_per_execution : int
        Batches per scheduled function (Keras' meaning: batch hooks are
        called once per execution).
    coordinator : dps.ClusterCoordinator, optional
        Default: the coordinator of the strategy whose ``scope()`` is entered.
    staleness : int, optional
        Bounded staleness of each step (see ``ClusterCoordinator.schedule``).

    Returns
    -------
    keras.callbacks.History
    """
    import daskps.keras.loop as loop

    return loop.fit(model, x, y, batch_size=batch_size, epochs=epochs, verbose=verbose, callbacks=callbacks,
                    validation_data=validation_data, shuffle=shuffle, initial_epoch=initial_epoch,
                    steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                    validation_freq=validation_freq, steps_per_execution=steps_per_execution,
                    coordinator=coordinator, staleness=staleness, sample_weight=sample_weight,
                    class_weight=class_weight)


def evaluate(model: Any, x: Any = None, y: Any = None, *, batch_size: int | None = None, verbose: Any = "auto",
             steps: int | None = None, callbacks: Any = None, return_dict: bool = False, coordinator: Any = None,
             sample_weight: Any = None) -> Any:
    """Evaluate a compiled Keras model on the trainers with the servers' weights, as ``model.evaluate``.

    Every batch is evaluated exactly once; the numbers are Keras' (the
    metrics' state is added up over all trainers, then ``result()``).
    Returns the loss and metrics as ``model.evaluate`` does (a dict with
    ``return_dict=True``).
    """
    import daskps.keras.loop as loop

    return loop.evaluate(model, x, y, batch_size=batch_size, verbose=verbose, steps=steps, callbacks=callbacks,
                         return_dict=return_dict, coordinator=coordinator, sample_weight=sample_weight)


def predict(model: Any, x: Any, *, batch_size: int | None = None, verbose: Any = "auto",
            coordinator: Any = None, steps: int | None = None, callbacks: Any = None) -> Any:
    """Predict on the trainers with the servers' weights, as ``model.predict``: numpy, in the order of ``x``."""
    import daskps.keras.loop as loop

    return loop.predict(model, x, batch_size=batch_size, verbose=verbose, coordinator=coordinator, steps=steps,
                        callbacks=callbacks)
