"""Exceptions raised by daskps.

The hierarchy::

    DaskPSError
    ├── PSUnavailableError      a parameter server cannot be reached, or lost its state
    ├── PartlyAppliedError      (internal) a message failed after its held-back pushes ran
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
    "PartlyAppliedError",
    "RollbackWarning",
]


class DaskPSError(Exception):
    """Base class of every error that daskps itself raises."""


class PSUnavailableError(DaskPSError, ConnectionError):
    """A parameter server could not be reached or has lost its state.

    Raised when the worker holding a parameter-server actor has died or
    restarted. The message says which, and names the variables that server
    held: they are gone; restore them from a checkpoint.

    ``server_key`` is the lost server's actor key and ``what`` the sentence
    saying what happened to it (without the variables), so that a process
    that holds other handles there can name them (both ``None`` when not
    known). Both travel with the error by pickle.
    """

    def __init__(self, message: str, server_key: str | None = None, what: str | None = None):
        super().__init__(message)
        self.server_key = server_key
        self.what = what

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.server_key, self.what))


class PartlyAppliedError(DaskPSError):
    """A message to a parameter server failed after the pushes held back at its front ran.

    Internal: the protocol takes it apart before anything reaches the user.
    ``error`` is what failed, ``outcomes`` has, for each held-back push, ``None``
    or the ``Refused`` record of why it was refused.
    """

    def __init__(self, error: BaseException, outcomes: list):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error
        self.outcomes = outcomes

    def __reduce__(self) -> tuple:
        return (type(self), (self.error, self.outcomes))


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
