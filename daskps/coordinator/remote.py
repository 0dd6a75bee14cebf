"""``RemoteValue``: the result of one scheduled function, once it has run."""

from __future__ import annotations

import pickle
from typing import Any

from daskps._core.nest import map_structure
from daskps.errors import CancelledError
from daskps.variables.variable import ShardedVariable, Variable

__all__ = ["RemoteValue", "to_numpy"]

_MISSING = object()
PENDING, DONE, FAILED, CANCELLED = "pending", "finished", "error", "cancelled"


class RemoteValue:
    """The result of a scheduled function, available once it has run.

    ``fetch()`` (or ``get()``) waits for it and returns it, with variables
    replaced by their numpy values; it raises the function's error, or
    :class:`~daskps.errors.CancelledError` if the function was cancelled.
    """

    __slots__ = ("_coordinator", "_state", "_payload", "_raw", "_value", "_error", "__weakref__")

    def __init__(self, coordinator: Any):
        self._coordinator = coordinator
        self._state = PENDING
        self._payload: Any = None  # the pickled result, unpickled on first fetch
        self._raw: Any = _MISSING  # or the result itself
        self._value: Any = _MISSING  # the result as fetch() gives it
        self._error: BaseException | None = None

    # -- set by the coordinator (under its lock) ---------------------------------------
    def _finish(self, payload: bytes | None, raw: Any = _MISSING) -> None:
        self._payload, self._raw, self._state = payload, raw, DONE

    def _fail(self, error: BaseException) -> None:
        self._error, self._state = error, FAILED

    def _cancel(self) -> None:
        if self._state == PENDING:
            self._state = CANCELLED

    # -- for users -------------------------------------------------------------------------
    def fetch(self) -> Any:
        """Wait for the value and return it; re-raises the function's error."""
        if self._state == PENDING:
            self._coordinator._wait_for(self)
        if self._state == CANCELLED:
            raise CancelledError(
                "the scheduled function was cancelled (another scheduled function failed, the wait "
                "was interrupted, or the strategy was closed); schedule it again"
            )
        if self._state == FAILED:
            raise self._error  # type: ignore[misc]
        if self._value is _MISSING:
            raw = pickle.loads(self._payload) if self._raw is _MISSING else self._raw
            self._value = to_numpy(raw)  # variables are read here, not on the event loop
            self._payload = self._raw = None
        return self._value

    def get(self) -> Any:
        """Same as :meth:`fetch`."""
        return self.fetch()

    def __reduce__(self) -> Any:
        raise TypeError("a RemoteValue cannot be sent to a worker; fetch() it first")

    def __repr__(self) -> str:
        return f"<RemoteValue {self._state}>"


def to_numpy(structure: Any) -> Any:
    """``structure`` with RemoteValues fetched and variables read, nesting kept."""
    def convert(x: Any) -> Any:
        if isinstance(x, RemoteValue):
            return x.fetch()
        if isinstance(x, (Variable, ShardedVariable)):
            return x.numpy()
        return x

    return map_structure(convert, structure)
