"""A timeline of the hot path's hops, for ``benchmarks/profile_step.py --trace``; off unless ``DASKPS_TRACE`` is set.

When on, each process keeps its last ``LIMIT`` spans ``(hop, start, end)``
(``time.perf_counter`` seconds: on Linux one clock for every process of the
machine, so spans of a trainer and a server line up). The hops:

- trainer: ``batch`` (a batch task), ``function`` (one scheduled function),
  ``send`` (packing and writing one message per server), ``wait`` (from the
  last write until an answer starts to arrive), ``receive`` (reading and
  unpacking the answers), ``hold`` (copying a push to hold it back), ``report``
  (a report event handed to the worker's loop);
- server: ``read in`` (a message arriving, from its first bytes), ``execute``
  (running its operations), ``write`` (writing the answer);
- coordinator: ``events`` (handling the reports of one event).

Spans are appended without a lock (``deque.append`` is atomic); when off,
each place costs one test of a module-level flag.
"""

from __future__ import annotations

import collections
import os
import time

ON = bool(os.environ.get("DASKPS_TRACE"))
LIMIT = 500_000

_SPANS: collections.deque[tuple[str, float, float]] = collections.deque(maxlen=LIMIT)
now = time.perf_counter


def span(hop: str, start: float, end: float | None = None) -> None:
    """Record ``hop`` from ``start`` to ``end`` (now when ``None``)."""
    _SPANS.append((hop, start, now() if end is None else end))


def collect(clear: bool = True) -> list[tuple[str, float, float]]:
    """This process's spans so far (and forget them, with ``clear``)."""
    out = list(_SPANS)
    if clear:
        _SPANS.clear()
    return out
