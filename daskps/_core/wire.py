"""The wire format between the protocol and the servers: pickle 5, big buffers apart.

A message is ``[header, *buffers]``: ``header`` is the pickle of the
payload, with small arrays inside it, and every buffer of at least
``OUT_OF_BAND`` bytes (a large array's data) travels as a separate frame,
without a copy. One message costs one pickle, however many arrays it holds
(Dask's own serialization walks nested lists and makes a frame per array:
some ten times slower for a step of 32 small variables). It is also Dask's
own "pickle" layout, so the protocol hands Dask these frames ready-made.

>>> msg = pack([("read", (["k"],)), np.arange(3.0), np.zeros(20_000)])
>>> len(msg), unpack(msg)[1]
(2, array([0., 1., 2.]))
"""

from __future__ import annotations

import io
import pickle
import socket
import struct
from typing import Any

import cloudpickle
import numpy as np

OUT_OF_BAND = 64 << 10


def pack(obj: Any, by_value: bool = False) -> list:
    """``obj`` as ``[header, *large buffers]``.

    ``by_value`` pickles functions by value (cloudpickle), as those defined in
    a notebook or script must be; plain pickle is faster for data.
    """
    buffers: list = []

    def keep_apart(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND:
            return True  # in the header
        buffers.append(raw)
        return False

    dumps = cloudpickle.dumps if by_value else pickle.dumps
    return [dumps(obj, protocol=5, buffer_callback=keep_apart), *buffers]


def unpack(message: list) -> Any:
    """The object :func:`pack` made ``message`` from."""
    return pickle.loads(message[0], buffers=message[1:])


# -- grouped: the direct channel's format -------------------------------------------------------
ALIGN = 16  # each array of a grouped frame starts at a multiple of this: no unaligned views
_PADDING = bytes(ALIGN)


class _Grouping:
    """Pickles small numeric arrays as references to one shared buffer (see :func:`pack_grouped`).

    Through ``reducer_override``, which pickle consults for objects of types
    it has no fast path for (not for the strings, numbers, lists and tuples a
    message is mostly made of): an array becomes ``_slot(place)``, which the
    reading end resolves to the array at ``place`` of the shared buffer.
    """

    def __init__(self, file: io.BytesIO, buffer_callback: Any):
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)  # type: ignore[call-arg]
        self.arrays: list[np.ndarray] = []

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and obj.dtype.kind in "biufc" and obj.nbytes < OUT_OF_BAND:
            # One array sent twice is one array: pickle's memo finds it the second time.
            self.arrays.append(obj)
            return _slot, (len(self.arrays) - 1,)
        return self._otherwise(obj)

    def _otherwise(self, obj: Any) -> Any:
        return NotImplemented


def _slot(place: int) -> np.ndarray:
    """Stands for a grouped array in a header: only :func:`unpack_grouped` knows which."""
    raise pickle.UnpicklingError("a grouped message's header read without its arrays: use unpack_grouped")


class _GroupingPickler(_Grouping, pickle.Pickler):
    pass


class _GroupingCloudPickler(_Grouping, cloudpickle.Pickler):
    def _otherwise(self, obj: Any) -> Any:
        return cloudpickle.Pickler.reducer_override(self, obj)  # functions and classes by value


class _GroupedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buffers: list, arrays: list[np.ndarray]):
        super().__init__(file, buffers=buffers)
        self.arrays = arrays

    def find_class(self, module: str, name: str) -> Any:
        if name == "_slot" and module.endswith("_core.wire"):  # (daskps vendored under another name too)
            return self.arrays.__getitem__
        return super().find_class(module, name)


def pack_grouped(obj: Any, by_value: bool = False) -> list:
    """``obj`` as ``[header, table, data, *large buffers]``: small numeric arrays share one frame.

    Pickling an array costs a few microseconds however small it is, and a
    step of many small variables sends dozens: here each small array of a
    plain numeric dtype is a reference in ``header``, its dtype and shape in
    ``table`` and its bytes in ``data`` (one frame for all of them). Large
    buffers travel apart as in :func:`pack`. Dask's comms do not know this
    format: only the direct channel uses it.

    >>> msg = pack_grouped([np.arange(3.0), np.float32(1), np.zeros(20_000), "x"])
    >>> len(msg), [type(x).__name__ for x in unpack_grouped(msg)]
    (4, ['ndarray', 'float32', 'ndarray', 'str'])
    """
    buffers: list = []

    def keep_apart(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < OUT_OF_BAND:
            return True
        buffers.append(raw)
        return False

    file = io.BytesIO()
    pickler = (_GroupingCloudPickler if by_value else _GroupingPickler)(file, keep_apart)
    pickler.dump(obj)
    arrays = pickler.arrays
    table = pickle.dumps([(a.dtype.str, a.shape) for a in arrays], protocol=5)
    parts = []
    for a in arrays:
        parts.append(a.tobytes())
        if a.nbytes % ALIGN:
            parts.append(_PADDING[: ALIGN - a.nbytes % ALIGN])
    return [file.getbuffer(), table, b"".join(parts), *buffers]


def unpack_grouped(message: list) -> Any:
    """The object :func:`pack_grouped` made ``message`` from; its small arrays are views of one
    buffer (writable when the frames are, as those read from a socket)."""
    data = np.frombuffer(message[2], np.uint8) if len(message[2]) else np.empty(0, np.uint8)
    arrays, offset = [], 0
    for dtype_str, shape in pickle.loads(message[1]):
        dtype = np.dtype(dtype_str)
        n = dtype.itemsize
        for d in shape:
            n *= d
        arrays.append(data[offset:offset + n].view(dtype).reshape(shape))
        offset += n + (-n) % ALIGN
    return _GroupedUnpickler(io.BytesIO(message[0]), message[3:], arrays).load()


# -- a direct channel's messages: [8-byte count][8-byte length per frame][frames] ---------------------
COUNT = struct.Struct("!Q")
# A direct channel's address: ``host:port``, then this and the name of the server's local (Unix) socket
# where it has one (:mod:`daskps.server.serving`, :mod:`daskps.client.channel`).
LOCAL_SEP = "|"


def pack_answer(answer: tuple) -> list:
    try:
        return pack_grouped(answer)
    except Exception as exc:  # an exception that does not pickle
        return pack_grouped(("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}; ({exc})")))


def receive_exactly(sock: socket.socket, n: int) -> bytearray:
    """The next ``n`` bytes from ``sock`` (a writable buffer), waiting for all of them; ``ConnectionResetError``
    if it closes first. Both ends of a direct channel read with it."""
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)  # one call, unless a signal cuts it short
        if not k:
            raise ConnectionResetError("the parameter server closed the channel")  # (a caller closing, on the server's end)
        got += k
    return buffer
