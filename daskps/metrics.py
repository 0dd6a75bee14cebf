"""``dps.metrics``: metrics whose state lives on a parameter server.

See :mod:`daskps.training.metrics`.
"""

from __future__ import annotations

from daskps.training.metrics import Accuracy, Mean, Metric, SparseCategoricalAccuracy, Sum

__all__ = ["Accuracy", "Mean", "Metric", "SparseCategoricalAccuracy", "Sum"]
