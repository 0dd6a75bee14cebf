"""Pipelined pushes inside scheduled functions keep TensorFlow's read semantics; values are taken at the call,
channels opened once, reports not held behind other work."""

import time

import numpy as np
import pytest

import daskps as dps
from tests.helpers.waiting import in_thread


def test_a_function_reads_its_own_earlier_updates(strategy, coordinator):
    with strategy.scope():
        v = dps.Variable([0.0, 0.0])
        w = dps.Variable([1.0, 1.0])
        opt = dps.optimizers.SGD(learning_rate=0.5)

    def step():
        seen = []
        for _ in range(3):
            v.assign_add([1.0, 2.0])
            seen.append(v.numpy())
            opt.apply_gradients([(np.array([1.0, 1.0], np.float32), w)])
            seen.append(dps.read_values([w])[0])
        v.scatter_update(dps.IndexedSlices(np.array([9.0], np.float32), np.array([1])))
        seen.append(np.asarray(v))
        return seen

    seen = coordinator.schedule(step).fetch()
    np.testing.assert_array_equal(seen[0], [1, 2])
    np.testing.assert_array_equal(seen[1], [0.5, 0.5])
    np.testing.assert_array_equal(seen[4], [3, 6])
    np.testing.assert_array_equal(seen[5], [-0.5, -0.5])
    np.testing.assert_array_equal(seen[6], [3, 9])


def _sleep():
    time.sleep(0.05)


def test_a_reported_function_s_updates_are_applied(strategy, coordinator):
    """A RemoteValue is ready only once its function's updates are on the server.

    The functions behind it never talk to that server, so nothing else would
    carry its held-back push there before the batch ends.
    """
    with strategy.scope():
        v = dps.Variable(0.0)
    for i in range(1, 4):
        first = coordinator.schedule(v.assign_add, args=(1.0,))
        for _ in range(30):
            coordinator.schedule(_sleep)
        first.fetch()
        assert float(v.numpy()) == i
        coordinator.join()


def test_reports_wait_at_most_one_function_for_their_pushes(strategy, coordinator):
    with strategy.scope():
        v = dps.Variable(0.0)
    # Holding the (reentrant) lock keeps the pump off until all are queued: with 2 trainers and no
    # durations known yet, the batches are [first, sleeps 0-19] and [sleeps 20-39].
    with coordinator.hold():
        first = coordinator.schedule(v.assign_add, args=(1.0,))
        sleeps = [coordinator.schedule(_sleep) for _ in range(40)]
    start = time.monotonic()
    first.fetch()
    waited = time.monotonic() - start
    done_then = sum(r.status == "finished" for r in sleeps[:20])
    coordinator.join()
    # Reported long before the 20 sleeps of its batch ended (counted, not timed).
    assert done_then < 20, (done_then, waited)


def test_a_failed_push_fails_the_function_that_made_it(strategy, coordinator):
    with strategy.scope():
        v = dps.Variable(np.zeros((4, 2), np.float32))

    def bad():
        v.scatter_add(dps.IndexedSlices(np.ones((1, 2), np.float32), np.array([7])))
        return "pushed"

    def good():
        v.assign_add(np.ones((4, 2), np.float32))
        return float(np.asarray(v).sum())

    # Reported before the failure: a function not yet reported when join() raises is cancelled (as in TF).
    assert coordinator.schedule(good).fetch() == 8.0
    failing = coordinator.schedule(bad)
    refused = r"^sparse_delta.indices for variable 'Variable': index 7 is out of range \[0, 4\)\n"  # README, Bad input
    with pytest.raises(IndexError, match=refused):
        coordinator.join()
    with pytest.raises(IndexError, match=refused):
        failing.fetch()
    np.testing.assert_array_equal(v.numpy(), np.ones((4, 2)))  # the bad push changed nothing
    assert coordinator.schedule(good).fetch() == 16.0  # and the coordinator works on


def test_a_push_the_server_refuses_fails_its_own_function(strategy, coordinator):
    """An error only the server sees (here: the variable was released under a live handle)
    comes back with a later message; it is reported as the error of the function that pushed."""
    from daskps.client import protocol
    from daskps.client.routing import HOLDER
    from daskps.server import ops

    with strategy.scope():
        gone = dps.Variable(0.0, name="gone")
        other = dps.Variable(5.0, name="other")
    if gone.handle.server != other.handle.server:  # round robin: put both on one server
        with strategy.scope():
            other = dps.Variable(5.0, name="other")
    assert gone.handle.server == other.handle.server
    protocol.call([(gone.handle.server, ops.Release([gone.handle.key], HOLDER))])

    def push():
        gone.assign_add(1.0)  # held back: no error here
        return "pushed"

    def read():
        return float(other.numpy())

    pushed = coordinator.schedule(push)
    after = [coordinator.schedule(read) for _ in range(3)]
    with pytest.raises(LookupError, match="released"):
        coordinator.join()
    with pytest.raises(LookupError, match="released"):
        pushed.fetch()
    coordinator.join()  # raised once
    outcomes = [in_thread(r.fetch, 30) for r in after]  # ran on the other trainer, shared the failed message,
    for state, value in outcomes:                         # or was cancelled by the raised error
        assert (state, value) == ("ok", 5.0) or (
            state == "raised" and (isinstance(value, dps.errors.CancelledError)
                                   or (type(value) is LookupError and "released" in str(value)))), outcomes
    assert coordinator.schedule(read).fetch() == 5.0

def test_a_held_push_sends_the_values_at_the_call(strategy, coordinator):
    with strategy.scope():
        v = dps.Variable(np.zeros(3, np.float32), name="alias_v")
        w = dps.Variable(np.zeros(3, np.float32), name="alias_w")
        opt = dps.optimizers.SGD(learning_rate=1.0)

    def step():
        buf = np.ones(3, np.float32)
        v.assign_add(buf)  # returns at once: the push is held back
        grad = np.ones(3, np.float32)
        opt.apply_gradients([(grad, w)])
        buf[:] = 100.0  # the caller reuses its buffers after the calls returned
        grad[:] = 100.0

    coordinator.schedule(step)
    coordinator.join()
    got = {"assign_add": v.numpy().tolist(), "apply_gradients": w.numpy().tolist()}
    assert got == {"assign_add": [1.0] * 3, "apply_gradients": [-1.0] * 3}, f"applied {got}"


def test_channels_to_two_new_servers_are_opened_once(strategy, monkeypatch):
    """Opening channels to two new servers in one call: the second must not prune the first
    (it is not connected yet, which is not dead)."""
    from daskps.client import channel

    made = []
    real_init = channel.Channel.__init__

    def counting_init(self, address, *args, **kwargs):
        made.append(address)
        real_init(self, address, *args, **kwargs)

    monkeypatch.setattr(channel.Channel, "__init__", counting_init)
    with strategy.scope():
        a = dps.Variable(np.zeros(2, np.float32), name="churn_a")
        b = dps.Variable(np.zeros(2, np.float32), name="churn_b")
    assert a.handle.server.channel != b.handle.server.channel
    for _ in range(5):
        dps.read_values([a, b])
    per_address = {addr: made.count(addr) for addr in set(made)}
    # one channel to each of the two servers (made here: a fresh strategy's servers are new), none again
    want = {a.handle.server.channel: 1, b.handle.server.channel: 1}
    assert per_address == want, f"channels opened per server: {per_address}, want {want}"


def test_a_functions_result_does_not_wait_for_other_work_in_its_batch(strategy, coordinator, client):
    """Held pushes are sent when other work follows in the batch (it may take long, or wait for this result)."""
    from distributed import Event

    with strategy.scope():
        v = dps.Variable(0.0, name="held_v")

    def push():
        v.assign_add(1.0)
        return "pushed"

    def wait(gate):
        Event(gate).wait()
        return "released"

    gate = Event("edges-held-gate", client=client)
    with coordinator.hold():  # batches [push, wait], [wait, wait]
        first = coordinator.schedule(push)
        for _ in range(3):
            coordinator.schedule(wait, args=("edges-held-gate",))
    try:
        state = in_thread(first.fetch, 15)
        assert state == ("ok", "pushed"), (
            f"push() finished long ago but its RemoteValue is {first!r} while the next function of its batch runs"
        )
    finally:
        gate.set()
        coordinator.join()
