"""The coordinator raises the first error of its scheduled functions, not the last (TensorFlow's contract).

Two functions fail in a certain order, both before anything asks: the
second waits on a gate that opens only once the coordinator has recorded
the first failure. ``join()``, ``done()`` or ``schedule()`` must then raise
the first error, exactly, once.
"""

from __future__ import annotations

import time
import uuid

import pytest
from distributed import Event

from tests.helpers.waiting import wait_until

FIRST = "first failure: batch 3 had a NaN loss"
SECOND = "second failure: a later step"


def _fail_first():
    raise ValueError(FIRST)


def _fail_when_opened(started: str, gate: str):
    Event(started).set()
    if not Event(gate).wait(60):
        raise RuntimeError("the gate never opened")
    raise TypeError(SECOND)


def _wait_for_failures(coordinator, n: int, timeout: float = 60) -> None:
    """Wait until ``n`` functions have failed (``summary()`` raises nothing, unlike join/done/schedule)."""
    wait_until(lambda: coordinator.summary()['failed'] >= n, timeout,
               failure=lambda: coordinator.summary(), interval=0.02, collect=False)


def _surface(coordinator, how: str) -> None:
    if how == "join":
        coordinator.join()
    elif how == "done":
        coordinator.done()
    else:
        coordinator.schedule(time.sleep, args=(0.0,))


@pytest.mark.parametrize("how", ["join", "done", "schedule"])
def test_the_first_of_two_errors_is_raised(client, coordinator, how):
    started, gate = (f"daskps-first-error-{what}-{uuid.uuid4().hex}" for what in ("started", "gate"))
    late = coordinator.schedule(_fail_when_opened, args=(started, gate))
    assert Event(started, client=client).wait(60), "the late function never started"  # it holds a trainer
    early = coordinator.schedule(_fail_first)
    _wait_for_failures(coordinator, 1)
    assert isinstance(coordinator.last_error, ValueError)  # the early one failed first...
    Event(gate, client=client).set()
    _wait_for_failures(coordinator, 2)
    assert isinstance(coordinator.last_error, TypeError)  # ...and the late one after it, before any join
    assert coordinator.summary()["last_error"] == repr(TypeError(SECOND))

    with pytest.raises(ValueError) as info:
        _surface(coordinator, how)
    assert type(info.value) is ValueError and str(info.value) == FIRST
    coordinator.join()  # raised once: the second error is not raised after it
    assert coordinator.done()
    # Each RemoteValue keeps its own function's error (the worker's traceback is a note on it).
    with pytest.raises(ValueError) as first:
        early.fetch()
    with pytest.raises(TypeError) as second:
        late.fetch()
    assert (str(first.value), str(second.value)) == (FIRST, SECOND)


def test_a_failed_recovery_after_a_function_error_leaves_the_first_error_to_raise(fresh_cluster, tmp_path):
    """A function fails; then every parameter server is lost for good and the recovery fails too. join()
    raises the function's error, the first one; the recovery's is ``last_error``."""
    import dask.config

    from daskps.errors import PSUnavailableError
    from tests.helpers.cluster import kill_for_good, one_checkpointed_variable

    cluster, client = fresh_cluster
    coordinator = one_checkpointed_variable(client, tmp_path)[3]
    coordinator.schedule(_fail_first)
    _wait_for_failures(coordinator, 1)
    assert isinstance(coordinator.last_error, ValueError)
    with dask.config.set({"daskps.recovery-timeout": "2s"}):
        for name in ("ps-0", "ps-1"):  # gone for good: the nanny does not start them again
            kill_for_good(cluster, client, name)
        # the recovery failed, after the error
        wait_until(lambda: isinstance(coordinator.last_error, PSUnavailableError), 60,
                   failure=lambda: f"no failed recovery: {coordinator.last_error!r}", interval=0.05, collect=False)
    with pytest.raises(ValueError) as info:
        coordinator.join()
    assert type(info.value) is ValueError and str(info.value) == FIRST
    assert not coordinator.recoveries
