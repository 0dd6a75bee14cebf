"""``dps.optimizers``: optimizers whose state lives beside the variables they train.

See :mod:`daskps.training.optimizers` (the base class) and
:mod:`daskps.training.builtin_optimizers`; the maths is in :mod:`daskps._core.transforms`,
the learning-rate schedules (``dps.optimizers.schedules``) in :mod:`daskps._core.schedules`.
"""

from __future__ import annotations

from daskps._core import schedules
from daskps.training.builtin_optimizers import SGD, Adagrad, Adam, Adamax, AdamW, Ftrl, Lion, Nadam, RMSprop
from daskps.training.optimizers import Optimizer

__all__ = ["Adagrad", "Adam", "AdamW", "Adamax", "Ftrl", "Lion", "Nadam", "Optimizer", "RMSprop", "SGD", "schedules"]
