"""``dps.keras.TensorBoard``: Keras' epoch scalars for TensorBoard, written without TensorFlow.

Keras' own ``TensorBoard`` callback needs TensorFlow to write event files.
This one writes the scalars it writes at each epoch's end, under the same
names and folders (``<log_dir>/train`` and ``<log_dir>/validation``, tags
``epoch_loss``, ``epoch_<metric>``, ``epoch_learning_rate``), with
tensorboardX (``pip install ".[tensorboard]"``), as :mod:`daskps.summary`
does. With TensorFlow installed, Keras' callback works with
``dps.keras.fit`` as it is.
"""

from __future__ import annotations

import os
from typing import Any

import keras

__all__ = ["TensorBoard"]


class TensorBoard(keras.callbacks.Callback):
    """Epoch scalars as Keras' ``TensorBoard(log_dir)`` writes them, through tensorboardX.

    Parameters
    ----------
    log_dir : str
        Where the ``train`` and ``validation`` event files go.
    """

    def __init__(self, log_dir: str = "logs"):
        super().__init__()
        try:
            import tensorboardX  # noqa: F401
        except ImportError as exc:
            raise ImportError('dps.keras.TensorBoard writes event files with tensorboardX: pip install '
                              '".[tensorboard]" in the daskps checkout, or pip install tensorboardX') from exc
        self.log_dir = str(log_dir)
        self._writers: dict[str, Any] = {}

    def _writer(self, part: str) -> Any:
        if part not in self._writers:
            from tensorboardX import SummaryWriter

            self._writers[part] = SummaryWriter(os.path.join(self.log_dir, part))
        return self._writers[part]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = dict(logs or {})
        if "learning_rate" not in logs and self.model is not None and self.model.optimizer is not None:
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        for name, value in logs.items():
            part, tag = ("validation", name[4:]) if name.startswith("val_") else ("train", name)
            self._writer(part).add_scalar(f"epoch_{tag}", float(value), epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
