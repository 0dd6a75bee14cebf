"""Progress bars for long actions, in a terminal or a Jupyter notebook.

:class:`ProgressBar` shows how much of something is done and the rate;
``dps.progress(coordinator, metrics)`` (:mod:`daskps.ui.training_progress`)
uses it for training, and large checkpoint saves (:func:`watch`) for the
bytes written. Where ``tqdm`` is installed (``pip install ".[progress]"`` in the checkout)
the bar is drawn by tqdm (the bar ``tqdm.auto`` would pick), as Dask users know it: a text bar in a
terminal, a widget in a notebook (where ``ipywidgets`` is installed).
Otherwise, or with ``daskps.progress-bar: builtin``, daskps draws its own: in a
notebook an HTML display updated in place (no widget library needed),
elsewhere one line on stderr rewritten with ``\\r``.
"""

from __future__ import annotations

import html
import sys
import time
from collections.abc import Callable
from typing import Any

from daskps._core import views
from daskps._core.config import setting

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
        self._tqdm = _tqdm_bar(label, self.total, unit, self._file, self._notebook)

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
        if self._tqdm is not None:
            self._tqdm.total = self.total
            self._tqdm.n = done
            self._tqdm.set_postfix_str(extra, refresh=False)
            self._tqdm.refresh()
        elif self._notebook:
            from IPython.display import HTML, display

            if self._handle is None:
                self._handle = display(HTML(self.html(done, extra)), display_id=True)
            else:
                self._handle.update(HTML(self.html(done, extra)))
        else:
            self._file.write("\r" + self.last)
            self._file.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif not self._notebook:
            self._file.write("\n")
            self._file.flush()


# Whole numbers, the unit after them, and the metrics (tqdm's postfix) at the end.
_TQDM_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n:,.0f}/{total:,.0f} {unit} [{elapsed}<{remaining}, {rate_fmt}]{postfix}"


def _tqdm_bar(label: str, total: float, unit: str, file: Any, notebook: bool) -> Any:
    """A ``tqdm.auto`` bar, or None where daskps draws its own.

    Its own: with ``daskps.progress-bar: builtin``, without tqdm, and in a
    notebook without ipywidgets (where tqdm would fall back to plain text).
    """
    choice = setting("progress_bar")
    if choice == "builtin":
        return None
    try:
        if notebook:
            import ipywidgets  # noqa: F401  (tqdm's notebook bar is a widget)
            from tqdm.notebook import tqdm
        else:
            from tqdm.std import tqdm
    except ImportError:
        return None
    kwargs = {} if notebook else {"file": file}
    return tqdm(total=total, desc=label, unit=unit, bar_format=_TQDM_FORMAT, **kwargs)


def watch(label: str, total_bytes: int, measure: Callable[[], float], stop: Callable[[], bool],
          interval: float = 0.5, file: Any = None) -> ProgressBar:
    """Show ``measure()`` bytes out of ``total_bytes`` in MiB until ``stop()`` is true.

    What ``measure()`` finds may pass the total (files hold headers too): the bar stops at its end.
    """
    bar = ProgressBar(label, total_bytes / 2**20, "MiB", file=file)
    try:
        while not stop():
            bar.update(min(measure(), total_bytes) / 2**20)
            time.sleep(interval)
        bar.update(bar.total)
    finally:
        bar.close()
    return bar


views.watch_with(watch)  # a large checkpoint's save shows its bytes with this bar
