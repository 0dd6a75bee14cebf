"""Which Keras backend a trainer runs: set it before Keras' first import there, or say what to set."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

__all__ = ["all_layers", "build_from", "check_backend", "shapes_only"]


def all_layers(layer: Any) -> list[Any]:
    """``layer`` and every layer inside it (nested models included), in a stable order."""
    found = [layer]
    for inner in getattr(layer, "layers", None) or []:
        found.extend(all_layers(inner))
    return found


def build_from(model: Any, batch: Any) -> None:
    """Keras' build from a batch (compiled metrics, optimizer), hash-table layers reading nothing."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, _ = data_adapter_utils.unpack_x_y_sample_weight(batch)
    with shapes_only():
        model._symbolic_build(data_batch=(x, y))


def shapes_only() -> Any:
    """While Keras builds a model from a batch: hash-table layers return zeros instead of reading rows."""
    module = sys.modules.get("daskps.keras.layers")  # loaded once a model has such a layer
    return contextlib.nullcontext() if module is None else module.no_lookups()


def check_backend(wanted: str) -> None:
    """Make sure Keras runs on ``wanted`` in this process, or say what to set where."""
    loaded = "keras" in sys.modules
    env = os.environ.get("KERAS_BACKEND")
    if not loaded and env in (None, wanted):
        os.environ["KERAS_BACKEND"] = wanted  # Keras reads it at its first import, just below
        env = wanted
    import keras

    have = keras.backend.backend()
    if have != wanted:
        where = f"KERAS_BACKEND={env!r}" if env else "KERAS_BACKEND is not set"
        raise RuntimeError(
            f"Keras runs on the {have!r} backend on this trainer ({where}), but the model was built on "
            f"{wanted!r}: start the workers with KERAS_BACKEND={wanted} in their environment (a LocalPSCluster "
            "made after setting it in os.environ inherits it)"
        )
