"""``dps.summary``: TensorBoard scalars of training, written from the coordinator's process.

See :mod:`daskps.ui.tensorboard`.
"""

from __future__ import annotations

from daskps.ui.tensorboard import ScalarLogger, create_file_writer

__all__ = ["ScalarLogger", "create_file_writer"]
