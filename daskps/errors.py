"""Exceptions raised by daskps.

The hierarchy::

    DaskPSError
    ├── PSUnavailableError      a parameter server cannot be reached, or lost its state
    ├── ClosedError             the strategy (or the Dask client) was closed
    ├── CancelledError          a scheduled function was cancelled
    ├── OutOfRangeError         a per-worker iterator is exhausted
    ├── NotScheduledError       a worker-only API used outside a scheduled function
    └── RollbackWarning         a warning (UserWarning too): a lost server was rolled back to a checkpoint

Bad arguments raise the built-in ``ValueError``, ``TypeError`` or
``IndexError`` with a message naming the argument; those are not listed here.
"""

from __future__ import annotations

__all__ = [
    "CancelledError",
    "ClosedError",
    "DaskPSError",
    "NotScheduledError",
    "OutOfRangeError",
    "PSUnavailableError",
    "RollbackWarning",
]


class DaskPSError(Exception):
    """Base class of every error that daskps itself raises."""


class PSUnavailableError(DaskPSError, ConnectionError):
    """A parameter server could not be reached or has lost its state.

    Raised when the worker holding a parameter-server actor has died or
    restarted. The message says which, and names the variables that server
    held: they are gone; restore them from a checkpoint.
    """


class ClosedError(DaskPSError, RuntimeError):
    """Something was used after ``strategy.close()`` or ``client.close()``.

    Closing a ``ParameterServerStrategy`` releases its parameter servers, and
    with them every variable, optimizer slot and dataset made through it.
    """


class CancelledError(DaskPSError):
    """A scheduled function was cancelled before it ran to completion.

    ``ClusterCoordinator`` cancels the functions still pending when an error
    from another function is raised; reschedule them to run them again.
    """


class OutOfRangeError(DaskPSError):
    """A per-worker iterator has no more elements."""


class NotScheduledError(DaskPSError, RuntimeError):
    """A worker-side API was used outside a function run by a worker."""


class RollbackWarning(DaskPSError, UserWarning):
    """A lost parameter server was re-created and its variables restored from a checkpoint.

    Given by a ``ClusterCoordinator`` that has a checkpoint manager. The
    message names the variables rolled back, the checkpoint, and how many
    finished functions' updates to them were lost.
    """
