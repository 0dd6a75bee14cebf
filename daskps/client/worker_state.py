"""What daskps keeps per Dask worker, held by a Dask ``WorkerPlugin``.

A worker process keeps a few things of daskps' for as long as it runs: its
transport to the parameter servers (:mod:`daskps.client.transport`) and its
trainers' datasets (:mod:`daskps.trainer.datasets`). They live in one
:class:`DaskPSWorkerPlugin`, registered on every worker of the cluster when
a strategy connects (``client.register_plugin``, idempotent, so that
workers that join later get it too), and closed with the worker
(``teardown``). Each part is made on first use by the code that needs it.

Setting up, it also sets the worker's ``malloc`` mmap threshold
(``daskps.worker-mmap-threshold``, 32 MiB) and a trim threshold of twice
that: Dask's nanny starts workers with ``MALLOC_TRIM_THRESHOLD_`` at 64 KiB,
which stops glibc from raising the mmap threshold as it would, so every
array above 128 KiB (a gradient, a value read, a message buffer) was a
fresh ``mmap``, faulted in page by page and unmapped when freed: a step of
the dense benchmark spent about a third of its trainer's time outside the
model that way. A worker keeps up to 64 MiB of freed heap instead
(:mod:`daskps._core.heap`; a parameter server trims it after large drops).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin

from daskps._core import heap
from daskps._core.config import checked, setting

WORKER_PLUGIN_NAME = "daskps-worker"

T = TypeVar("T")


class DaskPSWorkerPlugin(WorkerPlugin):
    """daskps' state on one worker: named parts, each made once."""

    idempotent = True  # a second strategy on the same cluster keeps the workers' state

    def __init__(self) -> None:
        self.worker: Any = None
        self.parts: dict[str, Any] = {}

    def setup(self, worker: Any) -> None:
        self.worker = worker
        set_mmap_threshold(setting("worker_mmap_threshold"))
        logging.getLogger("distributed.worker").addFilter(_QUIET)  # once: a logger keeps a filter only once
        _QUIET.workers.add(worker)

    def teardown(self, worker: Any) -> None:
        for part in list(self.parts.values()):
            close = getattr(part, "close", None)
            if close is not None:
                close()
        self.parts.clear()

    def part(self, name: str, make: Callable[[Any], T]) -> T:
        """The part called ``name``, made by ``make(worker)`` on first use."""
        found = self.parts.get(name)
        if found is None:
            found = self.parts.setdefault(name, make(self.worker))
        return found


class QuietHeartbeatAtClose(logging.Filter):
    """Drops Dask's "failed to communicate with scheduler during heartbeat" once the workers are closing.

    A worker closing with its cluster stops its heartbeat timer and then its
    connections, while a heartbeat sent just before may still wait for the
    scheduler's answer: that one fails, and Dask logs the ``CommClosedError``
    with its traceback, although nothing is wrong. The message goes through
    as Dask wrote it while any daskps worker of this process still runs (a
    record does not say which worker logged it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.workers: weakref.WeakSet[Any] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != HEARTBEAT_FAILED:
            return True
        workers = list(self.workers)
        return not workers or any(w.status not in _CLOSING for w in workers)


HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat."
_CLOSING = frozenset({Status.closing, Status.closed, Status.closing_gracefully, Status.failed})
_QUIET = QuietHeartbeatAtClose()  # on Dask's worker logger from the first worker plugin's setup (not at import)


def mmap_threshold(threshold: object) -> int:
    """``daskps.worker-mmap-threshold`` in bytes (0: leave malloc alone), or a ``ValueError`` naming the key."""
    return int(checked("worker_mmap_threshold", threshold))


def set_mmap_threshold(threshold: object) -> bool:
    """Have this process's ``malloc`` serve blocks below ``threshold`` from its heap (glibc only).

    The heap keeps up to twice that free at its top (the trim threshold),
    or a freed block would go back to the system at once, to be faulted in
    afresh at the next step. Every thread allocates from that one heap (one
    arena): a parameter server's channels run in threads of their own, and
    the blocks of variables dropped there would otherwise stay with their
    threads' arenas, never given back. Returns whether it was set: not for
    ``0``, nor where the C library is not glibc.
    """
    return heap.tune(mmap_threshold(threshold))


def plugin_of(worker: Any) -> DaskPSWorkerPlugin:
    """``worker``'s daskps plugin; installed here if the worker has none yet.

    A worker of a cluster no strategy has connected to yet (a task that
    uses daskps on its own) gets it the way ``Worker.plugin_add`` installs
    one: set in ``worker.plugins`` and set up (its setup is synchronous).
    """
    found = worker.plugins.get(WORKER_PLUGIN_NAME)
    if found is None:
        plugin = DaskPSWorkerPlugin()
        plugin.setup(worker)
        found = worker.plugins.setdefault(WORKER_PLUGIN_NAME, plugin)
    return found


def part_on(worker: Any, name: str, make: Callable[[Any], T]) -> T:
    """Part ``name`` of ``worker``'s daskps state, made by ``make(worker)`` on first use."""
    return plugin_of(worker).part(name, make)


def existing_part(worker: Any, name: str) -> Any:
    """Part ``name`` of ``worker``'s daskps state, or ``None`` if it was never made."""
    found = worker.plugins.get(WORKER_PLUGIN_NAME)
    return None if found is None else found.parts.get(name)


def register(client: Any) -> None:
    """Have every worker of ``client``'s cluster, and every one that joins, hold daskps' state."""
    client.register_plugin(DaskPSWorkerPlugin(), name=WORKER_PLUGIN_NAME)
