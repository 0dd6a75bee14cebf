"""Progress bars for long actions, in a terminal or a Jupyter notebook.

:class:`ProgressBar` shows how much of something is done and the rate;
``dps.progress(coordinator, metrics)`` (:mod:`daskps.coordinator.progress`)
uses it for training, and large checkpoint saves (:func:`watch`) for the
bytes written. In a notebook the bar is an HTML display updated in
place (no widget library needed); elsewhere it is one line on stderr
rewritten with ``\\r``.
"""

from __future__ import annotations

import html
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ProgressBar", "watch"]


def in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class ProgressBar:
    """A bar from 0 to ``total`` with a label and extra text.

    Parameters
    ----------
    label : str
    total : float
    unit : str
        Shown after the counts (``"steps"``, ``"MiB"``).
    file : file-like, optional
        Where the terminal bar goes (default ``sys.stderr``).
    notebook : bool, optional
        Force the notebook (HTML) or terminal form; default: detect.
    """

    width = 30

    def __init__(self, label: str, total: float, unit: str = "", file: Any = None, notebook: bool | None = None):
        self.label, self.total, self.unit = label, float(total), unit
        self._file = file or sys.stderr
        self._notebook = in_notebook() if notebook is None else notebook
        self._handle: Any = None
        self._started = time.monotonic()
        self.last = ""

    def text(self, done: float, extra: str = "") -> str:
        frac = min(1.0, done / self.total) if self.total else 1.0
        filled = int(frac * self.width)
        rate = done / max(time.monotonic() - self._started, 1e-9)
        bar = "#" * filled + "." * (self.width - filled)
        return f"{self.label} [{bar}] {done:,.0f}/{self.total:,.0f} {self.unit} {rate:,.1f}/s {extra}".rstrip()

    def html(self, done: float, extra: str = "") -> str:
        pct = 100 * min(1.0, done / self.total) if self.total else 100
        return (
            f"<div><progress value='{pct:.1f}' max='100' style='width:20em'></progress> "
            f"{html.escape(self.text(done, extra).split('] ', 1)[-1])} <em>{html.escape(self.label)}</em></div>"
        )

    def update(self, done: float, extra: str = "") -> None:
        self.last = self.text(done, extra)
        if self._notebook:
            from IPython.display import HTML, display

            if self._handle is None:
                self._handle = display(HTML(self.html(done, extra)), display_id=True)
            else:
                self._handle.update(HTML(self.html(done, extra)))
        else:
            self._file.write("\r" + self.last)
            self._file.flush()

    def close(self) -> None:
        if not self._notebook:
            self._file.write("\n")
            self._file.flush()


def watch(label: str, total_bytes: int, measure: Callable[[], float], stop: Callable[[], bool],
          interval: float = 0.5, file: Any = None) -> ProgressBar:
    """Show ``measure()`` bytes out of ``total_bytes`` in MiB until ``stop()`` is true."""
    bar = ProgressBar(label, total_bytes / 2**20, "MiB", file=file)
    try:
        while not stop():
            bar.update(measure() / 2**20)
            time.sleep(interval)
        bar.update(bar.total)
    finally:
        bar.close()
    return bar
