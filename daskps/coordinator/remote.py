"""``RemoteValue``: the result of one scheduled function, once it has run."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

from daskps._core.nest import map_structure
from daskps.errors import CancelledError
from daskps.variables.variable import ShardedVariable, Variable

__all__ = ["Outcome", "RemoteValue", "to_numpy"]

_MISSING = object()
PENDING, DONE, FAILED, CANCELLED = "pending", "finished", "error", "cancelled"


class Outcome:
    """What became of one scheduled function: settled by the coordinator (under its lock), read by its RemoteValue.

    ``state`` is ``PENDING`` until :meth:`finish`, :meth:`fail` or
    :meth:`cancel`; ``wait`` blocks until it is not (the coordinator's wait).
    """

    __slots__ = ("state", "payload", "raw", "error", "wait")

    def __init__(self, wait: Callable[[Outcome], None]):
        self.state = PENDING
        self.payload: bytes | None = None  # the pickled result, unpickled on first fetch
        self.raw: Any = _MISSING  # or the result itself
        self.error: BaseException | None = None
        self.wait = wait

    def finish(self, payload: bytes | None, raw: Any = _MISSING) -> None:
        self.payload, self.raw, self.state = payload, raw, DONE

    def fail(self, error: BaseException) -> None:
        self.error, self.state = error, FAILED

    def cancel(self) -> None:
        if self.state == PENDING:
            self.state = CANCELLED


class RemoteValue:
    """The result of a scheduled function, available once it has run.

    ``fetch()`` (or ``get()``) waits for it and returns it, with variables
    replaced by their numpy values; it raises the function's error, or
    :class:`~daskps.errors.CancelledError` if the function was cancelled.
    """

    __slots__ = ("_outcome", "_value", "__weakref__")

    def __init__(self, outcome: Outcome):
        self._outcome = outcome
        self._value: Any = _MISSING  # the result as fetch() gives it

    # -- for users -------------------------------------------------------------------------
    def fetch(self) -> Any:
        """Wait for the value and return it; re-raises the function's error."""
        outcome = self._outcome
        if outcome.state == PENDING:
            outcome.wait(outcome)
        if outcome.state == CANCELLED:
            raise CancelledError(
                "the scheduled function was cancelled (another scheduled function failed, the wait "
                "was interrupted, or the strategy was closed); schedule it again"
            )
        if outcome.state == FAILED:
            raise outcome.error  # type: ignore[misc]
        if self._value is _MISSING:
            raw = pickle.loads(outcome.payload) if outcome.raw is _MISSING else outcome.raw  # type: ignore[arg-type]
            self._value = to_numpy(raw)  # variables are read here, not on the event loop
            outcome.payload = outcome.raw = None
        return self._value

    @property
    def status(self) -> str:
        """``"pending"``, ``"finished"``, ``"error"`` or ``"cancelled"`` (as a Dask future's ``status``), without waiting."""
        return self._outcome.state

    def get(self) -> Any:
        """Same as :meth:`fetch`."""
        return self.fetch()

    def __reduce__(self) -> Any:
        raise TypeError("a RemoteValue cannot be sent to a worker; fetch() it first")

    def __repr__(self) -> str:
        return f"<RemoteValue {self._outcome.state}>"


def to_numpy(structure: Any) -> Any:
    """``structure`` with RemoteValues fetched and variables read, nesting kept."""
    def convert(x: Any) -> Any:
        if isinstance(x, RemoteValue):
            return x.fetch()
        if isinstance(x, (Variable, ShardedVariable)):
            return x.numpy()
        return x

    return map_structure(convert, structure)
