"""The compact encoding of a step's messages (pushes of dense gradients, whole reads, their answers).

Each message is checked against what went in (numpy's own arrays, compared
exactly); what only pickle carries is left to pickle (``None``), naming
nothing; names travel once per connection; and on a real cluster, large
dense gradients pushed this way (through shared memory, applied where they
lie) train to the numbers of the optimizers' published rules.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskps as dps
from daskps._core import wire
from daskps.server import compact, ops


def _round_trip(message, out: compact.Names, inn: compact.Names, answer: bool = False):
    frames = (compact.encode_answer if answer else compact.encode_request)(message, out)
    assert frames is not None, f"not encoded: {message!r}"
    # As the other end gets them: writable buffers of their own.
    got = [bytearray(memoryview(f).cast("B")) for f in frames]
    assert compact.is_compact(got)
    return compact.decode(got, inn), frames


def test_pushes_and_reads_come_back_with_every_array_exact():
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(300, 100)).astype(np.float32),  # 120 KB: a frame of its own
             rng.normal(size=7),  # float64, small
             np.array(2.5, np.float32),  # 0-d
             np.zeros((0, 3), np.float16),  # empty
             rng.integers(-5, 5, size=(2, 3, 4)).astype(np.int8),
             (rng.normal(size=5) + 1j * rng.normal(size=5)).astype(np.complex64),
             np.arange(6, dtype=">i4").reshape(2, 3)]  # another byte order
    message = [ops.Isolate(2),
               ops.ApplyGradients("opt", [(f"k{i}", "dense", g) for i, g in enumerate(grads)], "opt/iterations"),
               ops.ApplyGradients("opt2", [("k0", "dense", grads[0])], None, 3),
               ops.Read(["k0", "k3", "k1"])]
    back, _ = _round_trip(message, compact.Names(), compact.Names())
    assert [type(op) for op in back] == [ops.Isolate, ops.ApplyGradients, ops.ApplyGradients, ops.Read]
    assert back[0] == ops.Isolate(2) and back[3] == ops.Read(["k0", "k3", "k1"])
    assert (back[1].opt_key, back[1].bump, back[1].times) == ("opt", "opt/iterations", 1)
    assert (back[2].opt_key, back[2].bump, back[2].times) == ("opt2", None, 3)
    for (key, kind, got), sent, i in zip(back[1].items, grads, range(len(grads))):
        assert (key, kind) == (f"k{i}", "dense")
        assert got.dtype == sent.dtype and got.shape == sent.shape, (got.dtype, got.shape)
        np.testing.assert_array_equal(got, sent)
        assert got.flags.writeable and not np.shares_memory(got, sent)
    np.testing.assert_array_equal(back[2].items[0][2], grads[0])


def test_answers_of_reads_come_back_exact():
    rng = np.random.default_rng(1)
    values = [rng.normal(size=(200, 100)).astype(np.float32), np.arange(3, dtype=np.int64)]
    back, _ = _round_trip(("ok", [None, None, values, [values[1]], []]), compact.Names(), compact.Names(), answer=True)
    status, results = back
    assert status == "ok" and results[:2] == [None, None] and results[4] == []
    for got, sent in zip(results[2] + results[3], values + [values[1]]):
        assert got.dtype == sent.dtype
        np.testing.assert_array_equal(got, sent)


def test_a_name_travels_once_per_connection_and_a_refused_message_names_nothing():
    out, inn = compact.Names(), compact.Names()
    g = np.ones(4, np.float32)
    push = [ops.ApplyGradients("opt", [("w", "dense", g)], None), ops.Read(["w"])]
    _, first = _round_trip(push, out, inn)
    assert set(bytes(first[1]).decode().split("\0")) == {"opt", "w", "<f4"}
    _, second = _round_trip(push, out, inn)
    assert bytes(second[1]) == b""  # all named already
    # Pickle's: a sparse gradient. Its new names must not be taken as sent.
    rows = [ops.ApplyGradients("opt", [("v", "dense", g), ("t", "rows", (np.array([1]), np.ones((1, 4))))], None)]
    assert compact.encode_request(rows, out) is None
    third = [ops.ApplyGradients("opt", [("v", "dense", g)], None)]
    back, frames = _round_trip(third, out, inn)
    assert bytes(frames[1]).decode() == "v" and back[0].items[0][0] == "v"


@pytest.mark.parametrize("message", [
    [ops.Read(["w"], [np.array([1, 2])])],  # rows of a table
    [ops.ApplyGradients("opt", [("t", "rows", (np.array([1]), np.ones((1, 4))))], None)],
    [ops.ApplyGradients("opt", [("w", "dense", np.ones((4, 4))[:, ::2])], None)],  # not contiguous
    [ops.ApplyGradients("opt", [("w", "dense", [1.0, 2.0])], None)],  # a list, not an array
    [ops.ApplyGradients("opt", [("w", "dense", np.array(["a"]))], None)],  # not numbers
    [ops.Update([("w", "assign", np.ones(2))])],
    [ops.Stats()],
    (ops.Read(["w"]),),  # a tuple, not a list
    [("read",)],
], ids=["row read", "sparse", "strided", "list", "strings", "update", "stats", "tuple", "foreign"])
def test_what_only_pickle_carries_is_left_to_it(message):
    names = compact.Names()
    assert compact.encode_request(message, names) is None
    assert names.ids == {}
    assert not compact.is_compact(wire.pack_grouped(message))


@pytest.mark.parametrize("answer", [("error", ValueError("x")), ("ok", ["answered"]), ("ok", [[np.ones(2), "x"]]),
                                    ("ok", {"a": 1}), ("ok", [ops.Created((2,), "<f4", False)])])
def test_answers_only_pickle_carries_are_left_to_it(answer):
    assert compact.encode_answer(answer, compact.Names()) is None


def _adam(start, grads, lr, b1=0.9, b2=0.999, eps=1e-7):
    """Keras' Adam, written out in float64."""
    p, m, v = start.astype(np.float64), 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        m = m + (g - m) * (1 - b1)
        v = v + (g * g - v) * (1 - b2)
        p = p - m * (lr * np.sqrt(1 - b2**t) / (1 - b1**t)) / (np.sqrt(v) + eps)
    return p


def _momentum(start, grads, lr, mu):
    """Keras' SGD with momentum, written out in float64."""
    p, m = start.astype(np.float64), 0.0
    for g in grads:
        m = mu * m - lr * g.astype(np.float64)
        p = p + m
    return p


@pytest.mark.cluster
@pytest.mark.parametrize("make, reference", [
    (lambda: dps.optimizers.Adam(0.01), lambda w0, gs: _adam(w0, gs, 0.01)),
    (lambda: dps.optimizers.SGD(0.05, momentum=0.9), lambda w0, gs: _momentum(w0, gs, 0.05, 0.9)),
], ids=["adam", "momentum"])
def test_large_gradients_pushed_compactly_train_to_the_published_rules(strategy, make, reference):
    """Gradients of 480 KB, pushed from a trainer (held, then sent with the next read: compact frames
    through shared memory, which the server applies where they lie) over five steps, one at a time."""
    rng = np.random.default_rng(3)
    w0 = rng.normal(size=(300, 400)).astype(np.float32)
    grads = [rng.normal(size=w0.shape).astype(np.float32) for _ in range(5)]
    with strategy.scope():
        w = dps.Variable(w0, name="compact_w")
        opt = make()
    coordinator = dps.ClusterCoordinator(strategy)

    def step(g):
        before = w.numpy()  # a read: the push of the step before rides with it
        opt.apply_gradients([(g, w)])
        g *= 0  # the caller's array changes once the push is held: the push must not
        return before[:2, :2]

    seen = []
    for g in grads:
        seen.append(coordinator.schedule(step, args=(g.copy(),)))
        coordinator.join()
    np.testing.assert_allclose(w.numpy(), reference(w0, grads), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(seen[2].fetch(), reference(w0, grads[:2])[:2, :2], rtol=2e-5, atol=2e-6)
