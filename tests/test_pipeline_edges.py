"""Pipelined pushes: values taken at the call, channels opened once, reports not held behind other work."""

import numpy as np

import daskps as dps


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

    def counting_init(self, address, timeout):
        made.append(address)
        real_init(self, address, timeout)

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

    from .helpers.waiting import in_thread

    with strategy.scope():
        v = dps.Variable(0.0, name="held_v")

    def push():
        v.assign_add(1.0)
        return "pushed"

    def wait(gate):
        Event(gate).wait()
        return "released"

    gate = Event("edges-held-gate", client=client)
    with coordinator._cond:  # batches [push, wait], [wait, wait]
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
