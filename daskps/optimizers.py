"""``dps.optimizers``: optimizers whose state lives beside the variables they train.

See :mod:`daskps.training.optimizers`; the maths is in :mod:`daskps._core.transforms`.
"""

from __future__ import annotations

from daskps.training.optimizers import SGD, Adagrad, Adam, Optimizer

__all__ = ["SGD", "Adagrad", "Adam", "Optimizer"]
