"""A compact encoding of a training step's messages on a direct channel, beside pickle.

Most messages of a training step look alike: the pushes held from the step
before (``Isolate``, ``ApplyGradients`` of dense gradients) and the reads of
whole values, answered by lists of arrays. Pickled, each costs tens of
microseconds at each end in pickle's machinery, numpy's reconstruction of
every array and the operations' classes; run between other work, with cold
caches, that is a fair part of a step's CPU. Here such a message is a few
integers (:mod:`struct`), its arrays' bytes, and the strings (keys, dtypes)
it names: each string travels once per connection and is named by its
number afterwards. Anything else (other operations, sparse gradients,
errors, functions) is pickled as before (:func:`daskps._core.wire.pack_grouped`);
the reading end tells the two apart by the first byte (pickle's is ``0x80``).

A message is ``[integers, new names, small arrays' bytes, *large arrays]``.
Each connection keeps one :class:`Names` per direction at each end; a
message that cannot be encoded registers no name.

>>> out, inn = Names(), Names()
>>> from daskps.server import ops
>>> msg = [ops.Isolate(1), ops.ApplyGradients("opt", [("w", "dense", np.ones(3, "f4"))], None), ops.Read(["w"])]
>>> back = decode(encode_request(msg, out), inn)
>>> back[1].items[0][2], back[2]
(array([1., 1., 1.], dtype=float32), Read(keys=['w'], indices=None))
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from daskps._core.wire import ALIGN  # each small array starts at a multiple of it in the shared frame
from daskps.server import ops

REQUEST, ANSWER = 1, 2
_ISOLATE, _APPLY, _READ = 1, 2, 3
LARGE = 64 << 10  # arrays this big travel as frames of their own (through shared memory, where there is some)


class Names:
    """The strings one end has named to the other on one connection, by number (one direction)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.dtypes: dict[int, np.dtype] = {}


class _NotCompact(Exception):
    """The message holds something only pickle carries."""


class _Encoder:
    def __init__(self, names: Names):
        self.names = names
        self.new: dict[str, int] = {}
        self.ints: list[int] = []
        self.small: list[Any] = []
        self.small_size = 0
        self.large: list[np.ndarray] = []

    def name(self, s: Any) -> int:
        if type(s) is not str:
            raise _NotCompact
        i = self.names.ids.get(s)
        if i is None:
            i = self.new.get(s)
            if i is None:
                i = self.new[s] = len(self.names.ids) + len(self.new)
        return i

    def array(self, a: Any) -> None:
        if type(a) is not np.ndarray or a.dtype.kind not in "biufc" or not a.flags.c_contiguous:
            raise _NotCompact
        self.ints += (self.name(a.dtype.str), a.ndim, *a.shape)
        if a.nbytes >= LARGE:
            self.ints.append(-1 - len(self.large))
            self.large.append(a)
            return
        self.ints.append(self.small_size)
        self.small.append(a.tobytes())  # a copy now: the caller may change the array once this returns
        pad = -a.nbytes % ALIGN
        if pad:
            self.small.append(bytes(pad))
        self.small_size += a.nbytes + pad

    def frames(self, kind: int, count: int) -> list[Any]:
        ints = (kind, count, *self.ints)
        for s in self.new:  # committed only now: a message that fell back to pickle named nothing
            self.names.ids[s] = len(self.names.ids)
        return [struct.pack(f"!{len(ints)}q", *ints), "\0".join(self.new).encode(), b"".join(self.small),
                *self.large]


def encode_request(message: Any, names: Names) -> list[Any] | None:
    """``message`` (a list of operations) as compact frames, or ``None`` when pickle must carry it."""
    if type(message) is not list:
        return None
    enc = _Encoder(names)
    try:
        for op in message:
            kind = type(op)
            if kind is ops.Isolate:
                enc.ints += (_ISOLATE, int(op.size))
            elif kind is ops.ApplyGradients:
                enc.ints += (_APPLY, enc.name(op.opt_key), -1 if op.bump is None else enc.name(op.bump),
                             int(op.times), len(op.items))
                for key, how, grad in op.items:
                    if how != "dense":
                        raise _NotCompact
                    enc.ints.append(enc.name(key))
                    enc.array(grad)
            elif kind is ops.Read and op.indices is None:
                enc.ints += (_READ, len(op.keys), *(enc.name(k) for k in op.keys))
            else:
                raise _NotCompact
    except _NotCompact:
        return None
    return enc.frames(REQUEST, len(message))


def encode_answer(answer: tuple, names: Names) -> list[Any] | None:
    """An ``("ok", results)`` answer whose results are each ``None`` or a list of arrays, as compact
    frames; ``None`` for any other answer."""
    status, results = answer
    if status != "ok" or type(results) is not list:
        return None
    enc = _Encoder(names)
    try:
        for result in results:
            if result is None:
                enc.ints.append(-1)
            elif type(result) is list:
                enc.ints.append(len(result))
                for a in result:
                    enc.array(a)
            else:
                raise _NotCompact
    except _NotCompact:
        return None
    return enc.frames(ANSWER, len(results))


def is_compact(frames: Sequence[Any]) -> bool:
    """Whether a message's frames are this encoding's (pickle's first byte is 0x80)."""
    return len(frames) >= 3 and is_lead(frames[0])


def is_lead(first: Any) -> bool:
    """Whether ``first`` is the first frame of a compact message.

    A compact request's only arrays are dense gradients, which a server
    applies and lets go before it answers (every optimizer makes new arrays
    from a gradient; none keeps it): its frames may be read where they lie.
    """
    return len(first) >= 16 and first[0] == 0


def decode(frames: Sequence[Any], names: Names) -> Any:
    """The message (a list of operations) or answer (``("ok", results)``) that ``frames`` encode."""
    first = frames[0]
    ints = struct.unpack(f"!{len(first) // 8}q", first)
    if len(frames[1]):
        names.names.extend(bytes(frames[1]).decode().split("\0"))
    table, small, large = names.names, frames[2], frames[3:]
    dtypes = names.dtypes
    at = 2

    def array() -> np.ndarray:
        nonlocal at
        code, ndim = ints[at], ints[at + 1]
        shape = ints[at + 2:at + 2 + ndim]
        where = ints[at + 2 + ndim]
        at += 3 + ndim
        dtype = dtypes.get(code)
        if dtype is None:
            dtype = dtypes[code] = np.dtype(table[code])
        count = 1
        for d in shape:
            count *= d
        if where < 0:
            flat = np.frombuffer(large[-1 - where], dtype, count)
        else:
            flat = np.frombuffer(small, dtype, count, where)
        return flat.reshape(shape)

    kind, count = ints[0], ints[1]
    out: list[Any] = []
    if kind == ANSWER:
        for _ in range(count):
            k = ints[at]
            at += 1
            out.append(None if k < 0 else [array() for _ in range(k)])
        return "ok", out
    if kind != REQUEST:
        raise ValueError(f"not a compact message (kind {kind})")
    for _ in range(count):
        code = ints[at]
        if code == _ISOLATE:
            out.append(ops.Isolate(ints[at + 1]))
            at += 2
        elif code == _APPLY:
            opt, bump, times, n = ints[at + 1:at + 5]
            at += 5
            items: list[tuple[str, str, ops.Payload]] = []
            for _ in range(n):
                key = table[ints[at]]
                at += 1
                items.append((key, "dense", array()))
            out.append(ops.ApplyGradients(table[opt], items, None if bump < 0 else table[bump], times))
        elif code == _READ:
            n = ints[at + 1]
            out.append(ops.Read([table[i] for i in ints[at + 2:at + 2 + n]]))
            at += 2 + n
        else:
            raise ValueError(f"unknown compact operation {code}")
    return out
