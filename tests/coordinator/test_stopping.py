"""Interrupting join() or progress() (Ctrl-C, a notebook's stop button) stops the work too."""

import _thread
import io
import threading
import time

import numpy as np
import pytest

import daskps as dps
from daskps.errors import CancelledError
from tests.helpers.waiting import wait_until


class _Interrupter:
    """Interrupts the main thread once ``v`` has reached ``reached``, and again until told to stop.

    (An interrupt that lands while the main thread runs a finalizer is swallowed by Python:
    pressing Ctrl-C again is what a user would do.)
    """

    def __init__(self, v, reached: float):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(v, reached), daemon=True)
        self.thread.start()

    def _run(self, v, reached: float) -> None:
        while float(v.numpy()) < reached:
            time.sleep(0.05)
        while not self.stop.wait(0.3):
            _thread.interrupt_main()

    def close(self) -> None:
        self.stop.set()
        while True:  # take any interrupt still on its way
            try:
                self.thread.join()
                time.sleep(0.1)
                return
            except KeyboardInterrupt:
                pass


def _batches_running(dask_worker=None):
    return [k for k, ts in dask_worker.state.tasks.items()
            if str(k).startswith("daskps-batch") and ts.state in ("executing", "long-running", "cancelled")]


def _settled(v, client=None, pause: float = 0.5) -> float:
    """The value of ``v`` once no batch runs on any worker (with ``client``) and it stops changing."""
    wait_until(lambda: not (client is not None and any(client.run(_batches_running).values())), 30,
               failure=lambda: client.run(_batches_running), interval=0.05, collect=False)
    before = float(v.numpy())
    while True:
        time.sleep(pause)
        now = float(v.numpy())
        if now == before:
            return now
        before = now


@pytest.mark.parametrize("wait", ["join", "progress"])
def test_an_interrupt_cancels_every_pending_function(strategy, coordinator, client, wait):
    with strategy.scope():
        v = dps.Variable(0.0)

    def step():
        v.assign_add(1.0)
        time.sleep(0.02)

    remotes = [coordinator.schedule(step) for _ in range(400)]
    interrupter = _Interrupter(v, 5)
    try:
        with pytest.raises(KeyboardInterrupt):
            if wait == "join":
                coordinator.join()
            else:
                dps.progress(coordinator, interval=0.05, file=io.StringIO())
    finally:
        interrupter.close()
    ran = _settled(v, client)
    time.sleep(1.0)
    assert float(v.numpy()) == ran, "functions kept running after the interrupt"
    assert 0 < ran < 400
    done = cancelled = 0
    for r in remotes:
        try:
            r.fetch()
            done += 1
        except CancelledError:
            cancelled += 1
    assert done + cancelled == 400 and cancelled > 0
    assert done <= ran  # a function that ran to the end may still have been cancelled before it reported
    # Ready for new work, with no error left over.
    assert coordinator.done()
    more = [coordinator.schedule(step) for _ in range(10)]
    coordinator.join()
    assert [r.fetch() for r in more] == [None] * 10
    assert float(v.numpy()) == ran + 10


def test_cancel_returns_what_was_pending(strategy, coordinator):
    def slow():
        time.sleep(0.05)

    remotes = [coordinator.schedule(slow) for _ in range(100)]
    n = coordinator.cancel()
    assert 0 < n <= 100
    coordinator.join()  # nothing pending, nothing raised
    outcomes = []
    for r in remotes:
        try:
            outcomes.append(r.fetch())
        except CancelledError:
            outcomes.append("cancelled")
    assert outcomes.count("cancelled") == n
    np.testing.assert_equal(coordinator.schedule(lambda: 3).fetch(), 3)
