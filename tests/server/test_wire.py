"""The wire format (``daskps._core.wire``) and pickling with explanations (``daskps._core.pickling``).

The frame layout is the documented one: buffers of at least ``OUT_OF_BAND``
(64 KiB) travel apart, smaller ones inside the header; in the grouped format
small numeric arrays (and only those) are listed in the table.
"""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

from daskps._core import pickling, wire

LIMIT = 64 << 10


def test_a_buffer_of_exactly_64_kib_travels_apart_and_one_byte_less_does_not():
    assert wire.OUT_OF_BAND == LIMIT
    exact, small = np.zeros(LIMIT, np.uint8), np.zeros(LIMIT - 1, np.uint8)
    msg = wire.pack([exact, small])
    assert len(msg) == 2 and msg[1].nbytes == LIMIT
    assert LIMIT - 1 < len(msg[0]) < LIMIT + 1024  # the small one inside the header, the large one not
    a, b = wire.unpack(msg)
    assert a.shape == (LIMIT,) and b.shape == (LIMIT - 1,)


def test_pack_uses_plain_pickle_unless_by_value():
    def local():
        return 1

    with pytest.raises((pickle.PicklingError, AttributeError)):
        wire.pack(local)
    assert wire.unpack(wire.pack(local, by_value=True))() == 1
    with pytest.raises((pickle.PicklingError, AttributeError)):
        wire.pack_grouped(local)
    assert wire.unpack_grouped(wire.pack_grouped(local, by_value=True))() == 1


def _table(msg):
    return pickle.loads(msg[1])


def test_only_small_numeric_arrays_are_grouped():
    small = [np.arange(3, dtype=np.int16), np.array([True, False]), np.arange(2, dtype=np.uint8),
             np.ones(2, np.float32), np.ones(1, np.complex64)]
    other = [np.array(["a"]), np.array([None], object), np.zeros(LIMIT, np.uint8), np.zeros(LIMIT - 1, np.uint8)]
    msg = wire.pack_grouped(small + other)
    assert _table(msg) == [(a.dtype.str, a.shape) for a in small + other[3:]]
    assert len(msg) == 4 and msg[3].nbytes == LIMIT
    assert len(msg[0]) < LIMIT  # the large buffer is not in the header too
    got = wire.unpack_grouped(msg)
    for a, b in zip(small + other, got):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()


def test_one_array_sent_twice_is_one_array():
    x = np.arange(3.0)
    msg = wire.pack_grouped([x, x, np.arange(2)])
    assert len(_table(msg)) == 2
    a, b, c = wire.unpack_grouped(msg)
    assert a is b and a.tolist() == [0.0, 1.0, 2.0] and c.tolist() == [0, 1]


def test_grouped_arrays_start_aligned():
    arrays = [np.arange(3, dtype=np.uint8), np.arange(5, dtype=np.float64), np.zeros((2, 0)), np.arange(1, dtype=np.int32)]
    msg = wire.pack_grouped(arrays)
    got = wire.unpack_grouped(msg)
    base = np.frombuffer(msg[2], np.uint8).__array_interface__["data"][0]
    assert [(g.__array_interface__["data"][0] - base) % wire.ALIGN for g in got if g.size] == [0, 0, 0]
    assert [g.tolist() for g in got] == [a.tolist() for a in arrays]


def test_a_message_with_no_arrays():
    msg = wire.pack_grouped({"x": "y"})
    assert len(msg[2]) == 0 and wire.unpack_grouped(msg) == {"x": "y"}


# -- pickling with explanations ---------------------------------------------------------------------------
LOCK = threading.Lock()


class Holder:
    def __init__(self):
        self.fine = 1
        self.lock = threading.Lock()


def _message(obj, what="fn"):
    with pytest.raises(TypeError) as info:
        pickling.dumps_or_explain(obj, what)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # pickle's frames are not chained on
    return str(info.value)


def test_the_culprit_is_named_by_where_it_is():
    lock = threading.Lock()

    def captures():
        return lock

    def default(x=lock):
        return x

    def uses_global():
        return LOCK

    prefix = "cannot pickle "
    suffix = " (a _thread.lock): TypeError: cannot pickle '_thread.lock' object"
    qual = "test_the_culprit_is_named_by_where_it_is.<locals>"
    assert _message(captures) == f"{prefix}variable 'lock' captured by {qual}.captures{suffix}"
    assert _message(default) == f"{prefix}default argument 0 of {qual}.default{suffix}"
    assert _message(uses_global) == f"{prefix}global 'LOCK' used by {qual}.uses_global{suffix}"
    assert _message(Holder(), "obj") == f"{prefix}attribute 'lock' of obj{suffix}"
    assert _message({"a": 1, "b": [0, lock]}, "args") == f"{prefix}args['b'][1]{suffix}"
    assert _message((lock,), "args") == f"{prefix}args[0]{suffix}"


def test_the_search_stops_six_levels_down():
    lock = threading.Lock()
    deep = [[[[[[[[lock]]]]]]]]
    # levels 0..6 are described; the list found at depth 7 is the deepest named
    assert _message(deep, "a") == ("cannot pickle a[0][0][0][0][0][0][0] (a builtins.list): "
                                   "TypeError: cannot pickle '_thread.lock' object")


def test_an_unpicklable_thing_with_no_parts_is_named_as_a_whole():
    assert _message(threading.Lock(), "the lock") == "cannot pickle the lock: TypeError: cannot pickle '_thread.lock' object"


def test_the_function_cache_evicts_the_least_recently_used():
    import cloudpickle

    cache = pickling.FunctionCache(size=2)
    blobs = [cloudpickle.dumps(lambda i=i: i) for i in range(3)]
    a = cache.load(blobs[0])
    b = cache.load(blobs[1])
    cache.load(blobs[0])
    c = cache.load(blobs[2])
    assert len(cache) == 2
    assert cache.load(blobs[2]) is c and cache.load(blobs[0]) is a
    assert cache.load(blobs[1]) is not b  # evicted, so unpickled again


def test_picklable_things_pickle():
    assert pickle.loads(pickling.dumps_or_explain({"a": [1, 2]}, "x")) == {"a": [1, 2]}
