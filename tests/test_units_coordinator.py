"""The coordinator's pieces that need no cluster: counting ``next`` calls per running function, errors
carried from a worker, per-worker values (mutation testing's fast killers for ``daskps/coordinator/``)."""

from __future__ import annotations

import pickle
import sys
import traceback
import types

import pytest

from daskps.coordinator.batches import _pickled_error, load_error
from daskps.coordinator.datasets import PerWorkerValues, call_position, running_function


def test_call_position_counts_each_iterators_next_calls_within_the_running_function():
    a, b = object(), object()
    assert call_position(a) == (None, 0) and call_position(a) == (None, 0)  # outside a function: nothing counted
    with running_function(7):
        assert [call_position(a) for _ in range(3)] == [(7, 0), (7, 1), (7, 2)]
        assert call_position(b) == (7, 0)  # counted per iterator
        assert call_position(a) == (7, 3)
    assert call_position(a) == (None, 0)
    with running_function(8):  # the next function counts from 0 again
        assert call_position(a) == (8, 0) and call_position(b) == (8, 0)


def _fails_deep():
    raise ValueError("bad row 7")


def test_an_error_carries_the_workers_traceback_as_a_note():
    try:
        _fails_deep()
    except ValueError as exc:
        caught = exc
        expected = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    error = load_error(_pickled_error(caught))
    assert type(error) is ValueError and str(error) == "bad row 7"
    assert error.__notes__ == [f"raised in a scheduled function on a worker:\n{expected}"]
    assert "in _fails_deep" in expected and expected.endswith("ValueError: bad row 7\n")


class _NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def test_an_error_that_cannot_be_rebuilt_arrives_as_runtime_error_with_its_text():
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(_NeedsTwo(1, 2)))  # pickles, but does not unpickle
    try:
        raise _NeedsTwo(1, 2)
    except _NeedsTwo as exc:
        caught = exc
        expected = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    error = load_error(_pickled_error(caught))
    assert type(error) is RuntimeError and str(error) == "_NeedsTwo: 1 and 2"
    assert error.__notes__ == [f"raised in a scheduled function on a worker:\n{expected}"]  # the worker's own


def test_an_error_whose_class_only_the_worker_has_arrives_as_runtime_error_saying_why():
    """The worker could rebuild it (its module is there); the coordinator cannot (it is not here)."""
    module = types.ModuleType("daskps_test_only_on_workers")
    exec("class WorkerOnlyError(Exception):\n    pass\n", module.__dict__)
    module.WorkerOnlyError.__module__ = module.__name__
    sys.modules[module.__name__] = module
    try:
        try:
            raise module.WorkerOnlyError("shard 3 is gone")
        except Exception as exc:
            payload = _pickled_error(exc)  # on the worker: pickles and unpickles
            where = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    finally:
        del sys.modules[module.__name__]
    error = load_error(payload)  # here: no such module
    assert type(error) is RuntimeError and str(error) == "WorkerOnlyError: shard 3 is gone"
    assert error.__notes__ == [
        f"raised in a scheduled function on a worker:\n{where}(it cannot be rebuilt here: ModuleNotFoundError: "
        "No module named 'daskps_test_only_on_workers')\n"]


def test_per_worker_values_refuse_none_and_non_sequences_by_name():
    with pytest.raises(ValueError) as err:
        PerWorkerValues([])
    assert str(err.value) == "values must hold one value per training worker, got none"
    for bad in ("ab", {"a": 1}, {1, 2}, 3):
        with pytest.raises(TypeError) as err:
            PerWorkerValues(bad)
        assert str(err.value) == ("values must be a list or tuple of one value per training worker, "
                                  f"got {type(bad).__name__}")
    values = PerWorkerValues(iter(["a", "b"]))
    assert values.values == ("a", "b") and repr(values) == "PerWorkerValues(2 values)"
    with pytest.raises(ValueError) as err:
        values.on_worker(2)
    assert str(err.value) == ("values of PerWorkerValues hold 2 value(s), one per training worker, but this "
                              "function runs on the trainer with index 2: give one value per training worker")
    with pytest.raises(ValueError):
        values.on_worker(-1)
