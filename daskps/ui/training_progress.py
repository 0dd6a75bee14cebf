"""``dps.progress(coordinator, metrics)``: wait for training like ``join()``, with a progress bar.

It shows how many of the scheduled functions have finished, the rate, and
the latest values of the given metrics (the bar itself is
:class:`daskps.ui.progress.ProgressBar`: terminal or notebook).
"""

from __future__ import annotations

import time
from typing import Any

from daskps.coordinator.coordinator import ClusterCoordinator
from daskps.ui.progress import ProgressBar

__all__ = ["progress"]


def metric_text(metrics: dict[str, Any] | None) -> str:
    """``name=value`` of each metric (4 significant digits), or ``name=<Error>`` for one that cannot be read."""
    if not metrics:
        return ""
    parts = []
    for name, m in metrics.items():
        try:
            parts.append(f"{name}={float(m.result() if hasattr(m, 'result') else m()):.4g}")
        except Exception as exc:  # a display must not break training
            parts.append(f"{name}=<{type(exc).__name__}>")
    return " ".join(parts)


def progress(coordinator: ClusterCoordinator, metrics: dict[str, Any] | None = None, interval: float = 0.5,
             label: str = "training", file: Any = None, notebook: bool | None = None) -> ProgressBar:
    """Wait for everything ``coordinator`` has scheduled, showing a progress bar.

    The bar counts the functions scheduled since the last ``join()`` (or
    ``progress()``), including those already finished.

    ``metrics`` maps names to ``dps.metrics`` objects (or zero-argument
    callables) shown with their latest values. Raises what ``join()``
    raises; interrupted, it cancels every pending function, as ``join()``
    does. Returns the bar (``.last`` is its final line).

    >>> dps.progress(coordinator, {"loss": train_loss})        # doctest: +SKIP
    training [##############################] 240/240 steps 31.5/s loss=0.5072
    """
    bar = ProgressBar(label, coordinator.summary()["since_join"], "steps", file=file, notebook=notebook)
    try:
        while True:
            s = coordinator.summary()
            bar.total = s["since_join"]  # everything scheduled since the last join(), done or not
            bar.update(bar.total - s["in_flight"], metric_text(metrics))
            if s["in_flight"] == 0:
                break
            time.sleep(interval)
    except KeyboardInterrupt:  # as join(): the pending functions are cancelled
        coordinator.cancel()
        raise
    finally:
        bar.close()
    coordinator.join()
    return bar


