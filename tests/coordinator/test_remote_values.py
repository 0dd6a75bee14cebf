"""RemoteValue and its Outcome in this process: states, waiting, errors, caching, and to_numpy."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import daskps as dps
from daskps.coordinator.remote import Outcome, RemoteValue, to_numpy


class Waiter:
    """The coordinator's wait, as an Outcome sees it: settles the outcome with ``settle`` when called."""

    def __init__(self, settle):
        self.settle, self.calls = settle, 0

    def __call__(self, outcome):
        self.calls += 1
        self.settle(outcome)


def test_a_pending_value_waits_once_then_gives_the_unpickled_result_and_keeps_it():
    wait = Waiter(lambda o: o.finish(pickle.dumps({"loss": 0.5})))
    outcome = Outcome(wait)
    value = RemoteValue(outcome)
    assert value.status == "pending" and repr(value) == "<RemoteValue pending>"
    assert value.fetch() == {"loss": 0.5} and wait.calls == 1
    assert value.status == "finished" and repr(value) == "<RemoteValue finished>"
    assert outcome.payload is None and outcome.raw is None  # the pickled copy is let go
    first = value.fetch()
    assert value.get() is first and wait.calls == 1  # kept: not unpickled or waited for again


def test_a_finished_value_does_not_wait_and_a_raw_result_is_used_as_it_is():
    outcome = Outcome(Waiter(lambda o: pytest.fail("waited for a finished value")))
    result = [np.arange(3)]
    outcome.finish(None, raw=result)
    value = RemoteValue(outcome)
    assert value.fetch() is not None and value.fetch()[0] is result[0]
    none = Outcome(Waiter(lambda o: None))
    none.finish(pickle.dumps(None))
    assert RemoteValue(none).fetch() is None


def test_a_failed_function_raises_its_own_error_every_time():
    error = ValueError("bad batch")
    outcome = Outcome(Waiter(lambda o: o.fail(error)))
    value = RemoteValue(outcome)
    for _ in range(2):
        with pytest.raises(ValueError) as info:
            value.fetch()
        assert info.value is error
    assert value.status == "error" and repr(value) == "<RemoteValue error>"


def test_a_cancelled_function_raises_cancelled_error_and_cancel_does_not_undo_a_result():
    outcome = Outcome(Waiter(lambda o: o.cancel()))
    value = RemoteValue(outcome)
    with pytest.raises(dps.errors.CancelledError) as info:
        value.get()
    assert str(info.value) == ("the scheduled function was cancelled (another scheduled function failed, the wait "
                               "was interrupted, or the strategy was closed); schedule it again")
    assert value.status == "cancelled"
    done = Outcome(Waiter(lambda o: None))
    done.finish(pickle.dumps(7))
    done.cancel()
    assert done.state == "finished" and RemoteValue(done).fetch() == 7
    failed = Outcome(Waiter(lambda o: None))
    failed.fail(KeyError("k"))
    failed.cancel()
    assert failed.state == "error"


def test_a_remote_value_cannot_be_pickled():
    with pytest.raises(TypeError) as info:
        pickle.dumps(RemoteValue(Outcome(Waiter(lambda o: None))))
    assert str(info.value) == "a RemoteValue cannot be sent to a worker; fetch() it first"


def test_variables_in_a_result_are_read_when_fetched():
    w = dps.Variable(np.array([1.0, 2.0], np.float32))
    outcome = Outcome(Waiter(lambda o: None))
    outcome.finish(None, raw={"w": w, "n": 3})
    got = RemoteValue(outcome).fetch()
    assert isinstance(got["w"], np.ndarray) and got["w"].tolist() == [1.0, 2.0] and got["n"] == 3


def test_to_numpy_fetches_remote_values_and_reads_variables_keeping_the_nesting():
    done = Outcome(Waiter(lambda o: None))
    done.finish(pickle.dumps(np.float32(2.5)))
    pending = Outcome(Waiter(lambda o: o.finish(pickle.dumps("later"))))
    w = dps.Variable(np.eye(2, dtype=np.float32))
    got = to_numpy({"a": [RemoteValue(done), (RemoteValue(pending), w)], "b": "text"})
    assert got["a"][0] == np.float32(2.5) and got["a"][1][0] == "later"
    assert isinstance(got["a"][1], tuple) and isinstance(got["a"][1][1], np.ndarray)
    np.testing.assert_array_equal(got["a"][1][1], np.eye(2))
    assert got["b"] == "text"
