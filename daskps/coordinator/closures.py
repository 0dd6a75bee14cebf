"""What ``schedule`` makes of a call: its arguments checked, the function and arguments pickled, one closure.

Functions are pickled once, at their first schedule (as Dask does with the
functions it submits: what a function captures is read then); the arguments
at every call. Pickling also collects the handles the call refers to, kept
alive until it has run.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle

from daskps._core.arrays import is_int
from daskps._core.pickling import dumps_or_explain, located
from daskps.client import refs
from daskps.coordinator.remote import Outcome, RemoteValue
from daskps.trainer.datasets import PerWorkerDataset


class Closure:
    """One scheduled function: its pickle, what it keeps alive, what became of it (its RemoteValue's outcome)."""

    __slots__ = ("id", "blob", "kept", "outcome", "reruns", "batch", "generation", "staleness", "trainer")

    def __init__(self, cid: int, blob: tuple[bytes, bytes], kept: list[Any], outcome: Outcome, staleness: int):
        self.id, self.blob, self.kept, self.outcome, self.staleness = cid, blob, kept, outcome, staleness
        self.reruns = 0
        self.batch: str | None = None  # the key of the batch it is in; None while queued
        self.generation = 0  # of the servers its trainer knew as it started (see generation_known)
        self.trainer = ""  # the name of the trainer whose report settled it last ("" before any)


def checked_staleness(k: Any) -> int:
    if not is_int(k) or k < 0:
        raise ValueError(f"staleness must be a whole number of steps >= 0 (0: none), got {k!r}")
    return int(k)


def checked(value: Any, kinds: Any, arg: str, expected: str, default: Any) -> Any:
    """``value``, or ``default`` for None; a TypeError naming ``arg`` unless it is one of ``kinds``."""
    if value is None:
        return default
    if not isinstance(value, kinds):
        raise TypeError(f"{arg} must be {expected}, got {type(value).__name__}")
    return value


def refuse_bad_arguments(structure: Any, arg: str) -> None:
    """One walk over ``args`` or ``kwargs`` (nested lists, tuples and dicts): a ``RemoteValue`` is refused
    (fetch it first), and so is a ``PerWorkerDataset`` (pass ``iter(dataset)``: a dataset does not pickle)."""
    def walk(value: Any, where: str) -> None:
        if isinstance(value, RemoteValue):
            raise ValueError(
                f"{arg} contains a RemoteValue; using the output of one scheduled "
                "function as input of another is not supported: fetch() it first"
            )
        if isinstance(value, PerWorkerDataset):
            raise TypeError(
                f"{where} is a PerWorkerDataset; pass iter(dataset) instead: a scheduled function takes "
                "its iterator, and next(iterator) inside the function gives that trainer's next element"
            )
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
        for key, item in items:
            walk(item, f"{where}[{key!r}]")

    walk(structure, arg)


# Functions are pickled once, at their first schedule (as Dask does with the functions it
# submits): pickling a closure scans sys.modules for every module it uses, per call.
_PICKLED_FUNCTIONS: weakref.WeakKeyDictionary[Any, tuple[bytes, list[Any]]] = weakref.WeakKeyDictionary()


def _pickle(obj: Any, what: str) -> tuple[bytes, list[Any]]:
    """``obj`` pickled, and what it refers to that must stay alive until it has run."""
    with refs.collecting() as kept:
        try:
            return cloudpickle.dumps(obj), kept
        except ValueError:
            raise  # a variable of this process only: its message says what to do
        except Exception:
            if what.startswith("the arguments of "):  # name the argument as the call would: args[1], kwargs['k']
                for label, part in zip(("args", "kwargs"), obj):
                    try:
                        dumps_or_explain(part, label)
                    except TypeError as exc:
                        raise TypeError(f"{exc.args[0]} (in {what})") from exc.__cause__
            dumps_or_explain(obj, what)
            raise


def pickle_closure(fn: Callable[..., Any], args: tuple, kwargs: dict, name: str) -> tuple[tuple[bytes, bytes], list]:
    """``(pickled fn, pickled (args, kwargs))`` and what must stay alive until the function has run."""
    cached = None
    with contextlib.suppress(TypeError):  # not weak-referenceable: then not cached
        cached = _PICKLED_FUNCTIONS.get(fn)
    if cached is not None:
        fn_blob, fn_kept = cached
    else:  # not seen yet (pickled outside any handler: an error it raises carries no lookup's KeyError)
        fn_blob, fn_kept = _pickle(located(fn), f"the function {name!r}")  # tracebacks name its file
        with contextlib.suppress(TypeError):
            _PICKLED_FUNCTIONS[fn] = (fn_blob, fn_kept)
    if not args and not kwargs:  # the common step without arguments: nothing to pickle
        return (fn_blob, _NO_ARGUMENTS), fn_kept
    args_blob, args_kept = _pickle((args, kwargs), f"the arguments of {name!r}")
    return (fn_blob, args_blob), fn_kept + args_kept


_NO_ARGUMENTS = cloudpickle.dumps(((), {}))
