"""What the domain hands to ``daskps.ui``, and the hooks through which ``ui`` shows it.

``ui/`` sits on top of every other layer: a variable, a strategy or a
checkpoint never imports it. Each builds a plain *view* of itself (the
named tuples below: numbers and strings, asked of the servers by the domain
code that owns them) and hands it to :func:`html` or :func:`text`; ``ui``
registers how each kind of view is drawn when it is imported, which
``import daskps`` always does. The same goes for a large checkpoint's
progress (:func:`watch_bytes`), the scheduler plugin's extras (the
``/metrics`` collector: :data:`SCHEDULER_EXTRAS`) and the dashboard page a
``LocalPSCluster`` adds (:data:`CLUSTER_EXTRAS`). Without a registered
drawer a view shows as its ``repr`` and a watch just waits.
"""

from __future__ import annotations

import html as _html
import time
from collections.abc import Callable
from typing import Any, NamedTuple


class ServerRow(NamedTuple):
    """One parameter server as a strategy's displays show it."""

    task: int | None
    device: str
    address: str
    status: str  # "ok", "closed" or "unreachable: <why>"
    stats: dict[str, Any] | None  # ServerStats.as_dict() where status is "ok"


class StrategyView(NamedTuple):
    title: str  # the strategy's repr
    servers: list[ServerRow]
    trainers: list[tuple[str, str]]  # (name, address or "gone") of each trainer, by index
    dashboard_link: str


class VariableView(NamedTuple):
    name: str
    shape: tuple
    dtype: Any
    nbytes: int
    device: str
    address: str  # "this process" for a local variable


class ShardedView(NamedTuple):
    name: str
    shape: tuple
    dtype: Any
    nbytes: int
    shards: list[tuple[VariableView, str]]  # each shard and its rows ("0:5" or "1::2")


class EmbeddingTableView(NamedTuple):
    name: str
    dim: int
    dtype: Any
    rules: str  # admit_after=... evict_after_steps=... capacity=...
    parts: list[tuple[str, str, dict[str, int]]]  # (device, address, counts) per server


class CoordinatorView(NamedTuple):
    summary: dict[str, Any]  # the coordinator's summary()


_HTML: dict[type, Callable[[Any], str]] = {}
_TEXT: dict[type, Callable[[Any], str]] = {}
_WATCH: list[Callable[[str, int, Callable[[], float], Callable[[], bool]], Any]] = []



class SchedulerExtra:
    """Something the scheduler plugin starts and closes with itself (``ui``: the ``/metrics`` collector)."""

    def start(self, plugin: Any) -> None:
        """The plugin started on its scheduler."""

    def close(self, plugin: Any) -> None:
        """The plugin closed, or was removed from its scheduler."""


class ClusterExtra:
    """Something a ``LocalPSCluster`` adds around its scheduler's start (``ui``: the dashboard page)."""

    def before_start(self) -> None:
        """The scheduler is about to start."""

    def started(self, scheduler: Any) -> None:
        """The scheduler started."""


SCHEDULER_EXTRAS: list[SchedulerExtra] = []
CLUSTER_EXTRAS: list[ClusterExtra] = []


def draw(view_type: type, html: Callable[[Any], str] | None = None, text: Callable[[Any], str] | None = None) -> None:
    """Register how views of ``view_type`` are drawn (``ui`` does, when imported)."""
    if html is not None:
        _HTML[view_type] = html
    if text is not None:
        _TEXT[view_type] = text


def html(view: Any) -> str:
    drawer = _HTML.get(type(view))
    return drawer(view) if drawer is not None else f"<pre>{_html.escape(repr(view))}</pre>"


def text(view: Any) -> str:
    drawer = _TEXT.get(type(view))
    return drawer(view) if drawer is not None else repr(view)


def watch_with(watcher: Callable[[str, int, Callable[[], float], Callable[[], bool]], Any]) -> None:
    """Register what shows a long write's bytes (``ui.progress.watch``)."""
    _WATCH[:] = [watcher]


def watch_bytes(label: str, total_bytes: int, measure: Callable[[], float], stop: Callable[[], bool]) -> None:
    """Show ``measure()`` of ``total_bytes`` until ``stop()``; without a watcher, only wait."""
    if _WATCH:
        _WATCH[0](label, total_bytes, measure, stop)
        return
    while not stop():
        time.sleep(0.05)
