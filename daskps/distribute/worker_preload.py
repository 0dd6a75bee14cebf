"""Preloaded into every worker process a ``LocalPSCluster`` starts (Dask's ``preload``).

Ctrl-C in a terminal sends SIGINT to every process of the foreground group:
the user's script and each worker process its nannies spawned. The script's
``KeyboardInterrupt`` is the one that means something (it closes the cluster,
which stops the workers); in each worker it would only print a traceback of
Dask's event loop. So worker processes ignore SIGINT, and stop when their
cluster closes them, as before.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


def dask_setup(worker: Any) -> None:
    """Ignore SIGINT in this worker process (a preload runs in its main thread, where handlers are set)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
