"""Pickle a scheduled function once, unpickle it once per process, and say what could not be pickled."""

from __future__ import annotations

import collections
import inspect
import pickle
import threading
from typing import Any

import cloudpickle


def dumps_or_explain(obj: Any, what: str) -> bytes:
    """``cloudpickle.dumps(obj)``, or a ``TypeError`` naming the part that failed."""
    try:
        return cloudpickle.dumps(obj)
    except Exception as exc:
        culprit = _find_culprit(obj, what, depth=0)
        raise TypeError(f"cannot pickle {culprit or what}: {exc.__class__.__name__}: {exc}") from exc


def _picklable(obj: Any) -> bool:
    try:
        cloudpickle.dumps(obj)
    except Exception:
        return False
    return True


def _children(obj: Any, where: str) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"{where}[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
    if inspect.isfunction(obj):
        found = inspect.getclosurevars(obj)
        name = getattr(obj, "__qualname__", "function")
        parts = [(f"variable {k!r} captured by {name}", v) for k, v in found.nonlocals.items()]
        parts += [(f"global {k!r} used by {name}", v) for k, v in found.globals.items()]
        parts += [(f"default argument {i} of {name}", v) for i, v in enumerate(obj.__defaults__ or ())]
        return parts
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        return [(f"attribute {k!r} of {where}", v) for k, v in state.items()]
    return []


def _find_culprit(obj: Any, where: str, depth: int) -> str | None:
    """The deepest described part of ``obj`` that does not pickle."""
    if depth > 6:
        return None
    for label, child in _children(obj, where):
        if not _picklable(child):
            deeper = _find_culprit(child, label, depth + 1)
            return deeper or f"{label} (a {type(child).__module__}.{type(child).__qualname__})"
    return None


class FunctionCache:
    """Unpickled functions by their pickled bytes: each is unpickled once per process.

    A scheduled function arrives pickled with every batch. Unpickling it each
    time would rebuild whatever it captured, so a captured ``jax.jit``
    function would compile again on every call (Dask's workers used to keep
    such a cache too). The pickled bytes are the key: the coordinator pickles
    a function once, so every call of one function object sends the same
    bytes. At most ``size`` functions are kept, the least recently used going
    first.

    >>> cache = FunctionCache(size=2)
    >>> blob = cloudpickle.dumps(len)
    >>> cache.load(blob) is cache.load(blob)
    True
    """

    def __init__(self, size: int):
        self.size = size
        self._functions: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def load(self, blob: bytes) -> Any:
        """The function pickled in ``blob``: the one unpickled before, if kept."""
        with self._lock:
            fn = self._functions.get(blob)
            if fn is not None:
                self._functions.move_to_end(blob)
                return fn
        fn = pickle.loads(blob)  # outside the lock: unpickling may take long
        with self._lock:
            fn = self._functions.setdefault(blob, fn)  # another thread may have stored it first
            while len(self._functions) > self.size:
                self._functions.popitem(last=False)
        return fn

    def __len__(self) -> int:
        return len(self._functions)
