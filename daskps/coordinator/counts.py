"""A coordinator's counts, and how they reach the scheduler: what ``summary()``, the dashboard and ``/metrics`` show.

:class:`Counts` keeps the functions scheduled, done, failed (for good),
cancelled and re-run, in all and per trainer (by worker name: each function
is counted where its report came from). The coordinator changes them under
its book's lock, and :class:`Publisher` sends a snapshot to the scheduler's
plugin (its ``daskps_coordinator_stats`` handler) at most every
``PUBLISH_INTERVAL`` seconds through :class:`RateLimited`: counts held back by
the limit go once the interval has passed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from typing import Any

# The counts go to the scheduler's plugin at most this often (seconds).
PUBLISH_INTERVAL = 0.5


class Counts:
    """Functions scheduled, done, failed, cancelled and re-run: in all (``totals``) and per trainer."""

    def __init__(self) -> None:
        self.totals = {"scheduled": 0, "done": 0, "failed": 0, "cancelled": 0, "rerun": 0}
        self.by_trainer: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def add(self, what: str, trainer: str | None = None, n: int = 1) -> None:
        """``n`` more functions ``what``; on ``trainer`` too, where it is known (done, failed, rerun)."""
        self.totals[what] += n
        if trainer:
            self.by_trainer[trainer][what] += n

    def snapshot(self, **more: Any) -> dict[str, Any]:
        """The totals, ``more`` and ``"trainers"``: what the scheduler's plugin keeps (see ``scheduler.quantities``)."""
        return dict(self.totals, **more, trainers={name: dict(c) for name, c in self.by_trainer.items()})


class RateLimited:
    """``call()`` runs ``fn`` on ``loop`` at most every ``interval`` seconds; a call in between runs it later, once."""

    def __init__(self, loop: Any, fn: Callable[[], None], interval: float = PUBLISH_INTERVAL):
        self.loop, self.fn, self.interval = loop, fn, interval
        self._at = 0.0  # when fn last ran
        self._later = False  # a deferred run is on the loop

    def call(self, now: bool = False) -> None:
        """On ``loop``: run ``fn`` now if the interval has passed (or ``now``), else once it has."""
        wait = self.interval - (time.monotonic() - self._at)
        if wait > 0 and not now:
            if not self._later:
                self._later = True
                self.loop.call_later(wait, self.call, True)
            return
        self._later = False
        self._at = time.monotonic()
        self.fn()


class Publisher:
    """A book's counts, sent to the scheduler's plugin at most every ``PUBLISH_INTERVAL`` seconds."""

    def __init__(self, book: Any, client: Any, token: str) -> None:
        self._book, self._client, self._token = book, client, token
        self._limit = RateLimited(client.loop, self._send)

    def publish(self) -> None:
        """On the client's event loop: send the counts now, or once the interval has passed."""
        self._limit.call()

    def _send(self) -> None:
        book = self._book
        with book.lock:
            stats = book.counts.snapshot(recoveries=len(book.recoveries), in_flight=len(book.pending))
        asyncio.ensure_future(self._send_stats(stats))

    async def _send_stats(self, stats: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # an older scheduler plugin, or the client closing: nothing lost
            await self._client.scheduler.daskps_coordinator_stats(token=self._token, stats=stats)
