"""A trainer's program for a Keras model on the PyTorch backend: Keras' own ``train_step``, with torch autograd.

Keras' torch trainer is stateful: a step reads the model's variables and
writes them. So a step here first gives the trainer's copy of the model the
weights read from the servers, resets its metrics, and runs Keras'
``train_step`` (forward, ``compute_loss``, the loss tracker, ``backward``,
``compute_metrics``) with the model's optimizer replaced by one that keeps
the gradients instead of applying them: the servers apply them. What it
returns is what the JAX program returns: gradients, the non-trainable
variables' new values and the metrics' state.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import numpy as np

from daskps.keras.backend import build_from, check_backend

__all__ = ["TorchProgram"]


class _KeepGradients:
    """Stands in for the model's optimizer in Keras' ``train_step``: keeps the gradients it is given."""

    def __init__(self) -> None:
        self.gradients: list[Any] = []

    def scale_loss(self, loss: Any) -> Any:
        return loss

    def apply(self, gradients: list[Any], variables: list[Any]) -> None:
        self.gradients = list(gradients)


def _numpy(value: Any) -> np.ndarray:
    import keras

    return np.asarray(keras.ops.convert_to_numpy(value))


class TorchProgram:
    """The model on one trainer (Keras' torch backend) and its train, test and predict steps."""

    def __init__(self, blob: Any):
        check_backend(blob.backend)
        with warnings.catch_warnings():  # the unbuilt optimizer's slots are not loaded: none are needed
            warnings.simplefilter("ignore", UserWarning)
            self.model = pickle.loads(blob.model)
        self.blob = blob
        self.built = False
        self.has_train_step = False
        self.keep = _KeepGradients()

    def build(self, batch: Any) -> None:
        if self.built:
            return
        build_from(self.model, batch)
        self.model.optimizer = self.keep  # the servers run the optimizer: keep the gradients instead
        self.model.reset_metrics()
        self.metrics_start = [_numpy(v.value) for v in self.model.metrics_variables]
        self.built = True

    def _load(self, trainable: list[Any], non_trainable: list[Any]) -> None:
        for var, value in zip(self.model.trainable_variables, trainable):
            var.assign(value)
        for var, value in zip(self.model.non_trainable_variables, non_trainable):
            var.assign(value)

    def _tensors(self, batch: Any) -> Any:
        import keras

        return keras.tree.map_structure(lambda a: None if a is None else keras.ops.convert_to_tensor(a), batch)

    def table_ids(self, batch: Any) -> dict[str, np.ndarray]:
        return {}  # EmbeddingTable layers are refused on this backend when the model is bound

    def train(self, trainable: list[Any], non_trainable: list[Any], batch: Any,
              rows: dict[str, Any] | None = None) -> tuple[list, dict, list, list]:
        self._load(trainable, non_trainable)
        self.model.reset_metrics()
        self.model.train_step(self._tensors(batch))  # Keras' own step; the gradients land in self.keep
        self.has_train_step = True
        grads = [None if g is None else g.detach().cpu().numpy() for g in self.keep.gradients]
        return (grads, {}, [_numpy(v.value) for v in self.model.non_trainable_variables],
                [_numpy(v.value) for v in self.model.metrics_variables])

    def test(self, trainable: list[Any], non_trainable: list[Any], batch: Any,
             rows: dict[str, Any] | None = None) -> list[Any]:
        import torch

        self._load(trainable, non_trainable)
        self.model.reset_metrics()
        with torch.no_grad():
            self.model.test_step(self._tensors(batch))
        return [_numpy(v.value) for v in self.model.metrics_variables]

    def predict(self, trainable: list[Any], non_trainable: list[Any], batch: Any,
                rows: dict[str, Any] | None = None) -> Any:
        import keras
        import torch

        self._load(trainable, non_trainable)
        with torch.no_grad():
            out = self.model.predict_step(self._tensors(batch))
        return keras.tree.map_structure(_numpy, out)
