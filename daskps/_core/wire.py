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

import pickle
from typing import Any

import cloudpickle
import numpy as np  # noqa: F401  (the doctest)

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
