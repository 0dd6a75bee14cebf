"""Pickle a scheduled function once, unpickle it once per process, and say what could not be pickled."""

from __future__ import annotations

import collections
import inspect
import linecache
import os
import pickle
import threading
import types
from typing import Any

import cloudpickle


def dumps_or_explain(obj: Any, what: str) -> bytes:
    """``cloudpickle.dumps(obj)``, or a ``TypeError`` naming the part that failed."""
    try:
        return cloudpickle.dumps(obj)
    except Exception as exc:
        culprit = _find_culprit(obj, what, depth=0)
        # pickle's own traceback (chained) would add only pickle's frames to what the message says
        raise TypeError(f"cannot pickle {culprit or what}: {exc.__class__.__name__}: {exc}") from None


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

    def keys(self) -> list[bytes]:
        """The pickled bytes of the functions kept, the least recently used first."""
        with self._lock:
            return list(self._functions)


# -- where a scheduled function's code came from ----------------------------------------------------
_MAX_SOURCE = 64 << 10  # bytes of a function's source sent along at most


class Located:
    """A function pickled with where its code came from.

    cloudpickle names the file of the code it pickles ``<dynamic-code>``, so
    a traceback from a trainer would say ``File "<dynamic-code>", line 13``.
    Unpickled, this is the function itself, its code (nested functions'
    too) naming the file it was written in again, and that file's lines in
    ``linecache`` where the file is not there (another machine): tracebacks
    show the user's file, line and source.
    """

    def __init__(self, fn: types.FunctionType):
        self.fn = fn
        self.origins: dict[tuple[str, int], str] = {}
        for code in _codes(fn.__code__):
            if not code.co_filename.startswith("<"):
                self.origins[code.co_name, code.co_firstlineno] = code.co_filename
        # The lines of the function's own code (not the whole file: this travels with every batch).
        self.sources: dict[str, list[str]] = {}
        spans: dict[str, list[int]] = {}
        for code in _codes(fn.__code__):
            if not code.co_filename.startswith("<"):
                numbers = [line for _, _, line in code.co_lines() if line is not None] + [code.co_firstlineno]
                span = spans.setdefault(code.co_filename, [min(numbers), max(numbers)])
                span[:] = [min(span[0], *numbers), max(span[1], *numbers)]
        for filename, (first, last) in spans.items():
            lines = linecache.getlines(filename)[first - 1:last]
            if lines and sum(map(len, lines)) <= _MAX_SOURCE:
                self.sources[filename] = [""] * (first - 1) + lines

    def __reduce__(self) -> Any:
        return _relocated, (self.fn, self.origins, self.sources)


def located(fn: Any) -> Any:
    """``fn`` wrapped to travel with its file and lines (a plain Python function), else ``fn`` itself."""
    return Located(fn) if isinstance(fn, types.FunctionType) and not fn.__code__.co_filename.startswith("<") else fn


def _codes(code: types.CodeType) -> list[types.CodeType]:
    found = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += _codes(const)
    return found


def _renamed(code: types.CodeType, origins: dict[tuple[str, int], str]) -> types.CodeType:
    consts = tuple(_renamed(c, origins) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    filename = origins.get((code.co_name, code.co_firstlineno), code.co_filename)
    return code.replace(co_filename=filename, co_consts=consts)


def _relocated(fn: Any, origins: dict[tuple[str, int], str], sources: dict[str, list[str]]) -> Any:
    """``fn`` (unpickled), its code naming its files again; their lines known to ``linecache`` here."""
    if isinstance(fn, types.FunctionType) and fn.__code__.co_filename == "<dynamic-code>":  # pickled by value
        fn.__code__ = _renamed(fn.__code__, origins)
    for filename, lines in sources.items():
        if not os.path.exists(filename):  # on another machine: the lines that came along
            linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return fn
