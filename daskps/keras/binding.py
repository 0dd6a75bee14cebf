"""A Keras model's state on the parameter servers: its variables, its optimizer, its copy on each trainer.

Made at a model's first ``dps.keras`` call on a strategy and kept with the
model (weakly), so a second ``fit`` goes on with the servers' optimizer
state, as a second ``model.fit`` goes on with Keras'. Between calls the local
model is the truth: each call first writes the local weights to the servers
(a callback such as ``EarlyStopping(restore_best_weights=True)``, or the
user, may have changed them), and ``fit`` writes the servers' weights back
into the local model before every ``on_epoch_end`` and when it returns.
"""

from __future__ import annotations

import pickle
import uuid
import weakref
from typing import Any

import numpy as np

from daskps.coordinator.coordinator import ClusterCoordinator
from daskps.keras.backend import all_layers
from daskps.keras.data import Repeat
from daskps.keras.optimizer import keras_config, uses_schedule
from daskps.keras.program import ModelBlob, PredictStep, TestStep, TrainStep
from daskps.variables.variable import Variable, read_values

__all__ = ["Binding", "binding_for"]

_BINDINGS: weakref.WeakKeyDictionary[Any, Binding] = weakref.WeakKeyDictionary()


def _value(variable: Any) -> np.ndarray:
    return np.asarray(variable.numpy())  # any backend (a torch parameter refuses np.asarray)


class Binding:
    """One model's variables and optimizer on one strategy's servers, and the steps that use them."""

    def __init__(self, model: Any, coordinator: ClusterCoordinator):
        import keras

        self.coordinator = coordinator
        self.strategy = coordinator.strategy
        self.backend = keras.backend.backend()
        self.keras_optimizer = model.optimizer
        self.compiled_as = _compile_key(model)
        # Checked before anything is made on a server: a refused optimizer leaves nothing behind.
        optimizer_class, optimizer_config = keras_config(model.optimizer)
        with self.strategy.scope():
            self.trainable = [Variable(_value(v), trainable=True, name=v.path) for v in model.trainable_variables]
            self.non_trainable = [Variable(_value(v), trainable=False, name=v.path)
                                  for v in model.non_trainable_variables]
            self.tables = _make_tables(model)
            self.optimizer = optimizer_class(**optimizer_config)
        self.pooling = {layer.name: layer.combiner for layer in _table_layers(model) if layer.combiner is not None}
        self.train_step = TrainStep(self.trainable, self.non_trainable, self.optimizer, _embedding_positions(model),
                                    tables=self.tables, pooling=self.pooling)
        self.test_step = TestStep(self.trainable, self.non_trainable, tables=self.tables, pooling=self.pooling)
        self.predict_step = PredictStep(self.trainable, self.non_trainable, tables=self.tables, pooling=self.pooling)
        self._model_iterator: Any = None
        self._blob: ModelBlob | None = None
        self._model_dataset: Any = None
        self._lr = self._local_rate()
        self.fresh = True  # the servers hold the local weights: nothing to write before the first call

    def model_blob(self, model: Any) -> ModelBlob:
        """The model as the trainers get it (made once: the trainers key their copy by its id)."""
        if self._blob is None:
            built = all(getattr(m, "built", True) for m in model.metrics)  # not before a first batch was seen
            shapes = tuple(tuple(v.shape) for v in model.metrics_variables) if built else ()
            self._blob = ModelBlob(uuid.uuid4().hex, self.backend, pickle.dumps(model), shapes,
                                   tuple(sorted(self.tables)))
        return self._blob

    def model_iterator(self, model: Any) -> Any:
        """An iterator that gives each trainer its copy of the model (sent once, at the first call)."""
        if self._model_iterator is None:
            self._model_dataset = self.coordinator.create_per_worker_dataset(Repeat(self.model_blob(model)))
            self._model_iterator = iter(self._model_dataset)
        return self._model_iterator

    def matches(self, model: Any, coordinator: ClusterCoordinator) -> bool:
        return (coordinator is self.coordinator and not self.strategy.closed
                and model.optimizer is self.keras_optimizer and _compile_key(model) == self.compiled_as
                and len(model.trainable_variables) == len(self.trainable)
                and len(model.non_trainable_variables) == len(self.non_trainable))

    # -- weights between the model and the servers -----------------------------------
    def push(self, model: Any, force: bool = False) -> None:
        """Write the local model's weights to the servers (skipped right after they were made from them,
        unless ``force``: a callback may have changed them since)."""
        if self.fresh and not force:
            self.fresh = False
            return
        self.fresh = False
        for var, local in zip(self.trainable + self.non_trainable,
                              list(model.trainable_variables) + list(model.non_trainable_variables)):
            var.assign(_value(local))

    def pull(self, model: Any) -> None:
        """Give the local model the servers' weights and the optimizer's step count."""
        values = read_values(self.trainable + self.non_trainable + [self.optimizer.iterations])
        local = list(model.trainable_variables) + list(model.non_trainable_variables)
        for var, value in zip(local, values):
            var.assign(value)
        model.optimizer.iterations.assign(values[-1])

    # -- what BackupAndRestore keeps: the servers' side of the model ----------------------------
    def checkpoint(self) -> Any:
        """A ``dps.Checkpoint`` of everything the servers hold for the model: variables, tables, optimizer."""
        from daskps.training.checkpoint import Checkpoint

        return Checkpoint(trainable=list(self.trainable), non_trainable=list(self.non_trainable),
                          tables=dict(self.tables), optimizer=self.optimizer)

    # -- the learning rate, which callbacks set on the local optimizer ---------------------
    def _local_rate(self) -> float | None:
        if uses_schedule(self.keras_optimizer):
            return None  # a schedule follows the servers' step count; Keras lets no callback replace it
        return float(np.asarray(self.keras_optimizer.learning_rate))

    def sync_learning_rate(self) -> None:
        """Send a learning rate a callback set on the local optimizer (``ReduceLROnPlateau``, ...) to the servers."""
        rate = self._local_rate()
        if rate is not None and rate != self._lr:
            self.optimizer.learning_rate = rate
            self._lr = rate


def _compile_key(model: Any) -> str:
    """What ``compile`` was given (loss, metrics, weights...): a recompile makes a new binding."""
    try:
        return repr(model.get_compile_config())
    except Exception:  # a loss or metric Keras cannot serialize: the objects themselves
        return repr((id(model.loss), id(getattr(model, "compiled_metrics", None))))


def _make_tables(model: Any) -> dict[str, Any]:
    """A ``dps.EmbeddingTable`` on the servers for each ``dps.keras.EmbeddingTable`` layer, by layer name."""
    layers = _table_layers(model)
    if not layers:
        return {}
    import keras

    from daskps.variables.hashed import EmbeddingTable

    if keras.backend.backend() != "jax":
        raise ValueError("dps.keras.EmbeddingTable layers train on Keras' JAX backend only, this model runs on "
                         f"{keras.backend.backend()!r}")
    tables = {}
    for layer in layers:
        tables[layer.name] = layer.table = EmbeddingTable(layer.dim, name=f"{model.name}/{layer.name}",
                                                          **layer.table_kwargs())
    return tables


def _table_layers(model: Any) -> list[Any]:
    import sys

    module = sys.modules.get("daskps.keras.layers")  # imported by whoever made such a layer
    return [] if module is None else module.table_layers(model)


def _embedding_positions(model: Any) -> tuple[int, ...]:
    """Where the matrices of ``keras.layers.Embedding`` layers are among the model's trainable variables."""
    import keras

    tables = {id(layer.embeddings) for layer in all_layers(model) if isinstance(layer, keras.layers.Embedding)
              and getattr(layer, "embeddings", None) is not None}
    return tuple(i for i, v in enumerate(model.trainable_variables) if id(v) in tables)


def binding_for(model: Any, coordinator: ClusterCoordinator) -> Binding:
    """The model's binding to ``coordinator``'s strategy, made (variables and optimizer on the servers) if needed."""
    found = _BINDINGS.get(model)
    if found is not None and found.matches(model, coordinator):
        return found
    made = Binding(model, coordinator)
    _BINDINGS[model] = made
    return made
