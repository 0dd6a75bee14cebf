"""``dps.summary``: TensorBoard scalars of training, written from the coordinator's process.

See :mod:`daskps.coordinator.summary`.
"""

from __future__ import annotations

from daskps.coordinator.summary import ScalarLogger, create_file_writer

__all__ = ["ScalarLogger", "create_file_writer"]
