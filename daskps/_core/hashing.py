"""Hashing int64 keys: which server holds a key, and a vectorised open-addressing index.

:func:`mix` is the splitmix64 finaliser (Steele, Lea and Flood, 2014): it
spreads any int64 keys, consecutive ones included, evenly over 64 bits, and
gives the same answer in every process (Python's ``hash`` of an int is the
int itself). A key lives on server ``mix(key) % num_servers``.

:class:`KeyIndex` maps keys to row numbers with linear probing over numpy
arrays, a whole batch of keys per probe step, so a lookup of a few thousand
keys costs a few numpy passes rather than a Python loop. Memory: 12 bytes per
position, at most half the positions used (it grows, and sweeps out deleted
positions, as needed).

>>> stored = np.array([7, -3, 2**40])  # the key of each row
>>> index = KeyIndex(stored.__getitem__)
>>> index.insert(stored, np.array([0, 1, 2]))
>>> index.find(np.array([2**40, 5, 7])).tolist()
[2, -1, 0]
>>> index.delete(np.array([7])); index.find(np.array([7, -3])).tolist(), len(index)
([-1, 1], 2)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)
_EMPTY, _DELETED = -1, -2
_WINDOW = 8  # positions after a key's home read at once when its chain goes on
_STEPS = np.arange(1, _WINDOW + 1)


def mix(keys: np.ndarray) -> np.ndarray:
    """splitmix64 of int64 ``keys`` (any shape), as uint64."""
    z = np.asarray(keys, dtype=np.int64).view(np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def server_of(keys: np.ndarray, num_servers: int) -> np.ndarray:
    """The server (``0 .. num_servers - 1``) that holds each key."""
    return (mix(keys) % np.uint64(num_servers)).astype(np.int64)


_REBUILD_CHUNK = 1 << 13  # live rows put back at a time when the index is rebuilt


class KeyIndex:
    """int64 key -> row number (>= 0), for batches of keys at a time.

    The keys themselves live with their rows: ``key_at(rows)`` gives them
    (an embedding table keeps each row's key anyway), so a position costs 4
    bytes: the row number, or empty, or deleted.
    """

    def __init__(self, key_at: Callable[[np.ndarray], np.ndarray], positions: int = 1024):
        self._key_at = key_at
        self._rows = np.full(positions, _EMPTY, np.int32)
        self._used = 0  # live keys
        self._deleted = 0

    def __len__(self) -> int:
        return self._used

    def nbytes(self) -> int:
        return int(self._rows.nbytes)

    def _home(self, keys: np.ndarray, mixed: np.ndarray | None = None) -> np.ndarray:
        # Bits above those that pick the server, so keys of one server still spread here.
        mixed = mix(keys) if mixed is None else mixed
        return ((mixed >> np.uint64(20)) & np.uint64(len(self._rows) - 1)).astype(np.int64)

    def _probe(self, keys: np.ndarray, mixed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """For each key: its position (or -1) and its row (or -1).

        Every key's home position first; then, for the few keys whose chains
        go on (at most half the positions are used), the next ``_WINDOW``
        positions at once; the rare chains longer than that step by step.
        """
        mask = len(self._rows) - 1
        pos = self._home(keys, mixed)
        rows = self._rows[pos]
        hit = rows >= 0
        hit[hit] = self._key_at(rows[hit]) == keys[hit]
        where = np.where(hit, pos, -1)
        todo = np.flatnonzero(~hit & (rows != _EMPTY))
        if todo.size:
            window = (pos[todo, None] + _STEPS) & mask
            rows = self._rows[window]
            match = rows >= 0
            match[match] = self._key_at(rows[match]) == np.broadcast_to(keys[todo, None], rows.shape)[match]
            ended = rows == _EMPTY
            first_match = np.where(match.any(axis=1), match.argmax(axis=1), _WINDOW)
            first_end = np.where(ended.any(axis=1), ended.argmax(axis=1), _WINDOW)
            found = first_match < first_end
            where[todo[found]] = window[found, first_match[found]]
            longer = (first_match == _WINDOW) & (first_end == _WINDOW)
            todo, pos = todo[longer], (window[longer, -1] + 1) & mask
            while todo.size:
                rows = self._rows[pos]
                hit = rows >= 0
                hit[hit] = self._key_at(rows[hit]) == keys[todo[hit]]
                where[todo[hit]] = pos[hit]
                go_on = ~hit & (rows != _EMPTY)
                todo, pos = todo[go_on], (pos[go_on] + 1) & mask
        found_rows = np.where(where >= 0, self._rows[np.maximum(where, 0)], -1)
        return where, found_rows.astype(np.int64)

    def find(self, keys: np.ndarray, mixed: np.ndarray | None = None) -> np.ndarray:
        """The row of each key, -1 where absent (``mixed``: ``mix(keys)``, if already at hand)."""
        return self._probe(np.asarray(keys, np.int64), mixed)[1]

    def insert(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Add distinct ``keys``, none of them present, at ``rows`` (where ``key_at`` already finds them)."""
        keys, rows = np.asarray(keys, np.int64), np.asarray(rows, np.int64)
        if 2 * (self._used + self._deleted + len(keys)) > len(self._rows):
            self._rebuild(self._used + len(keys))
        mask = len(self._rows) - 1
        pos = self._home(keys)
        todo = np.arange(len(keys))
        while todo.size:
            p = pos[todo]
            free = self._rows[p] < 0
            # Several keys may want one free position: the first of them takes it.
            taken, first = np.unique(p[free], return_index=True)
            winners = todo[free][first]
            self._deleted -= int(np.count_nonzero(self._rows[taken] == _DELETED))
            self._rows[taken] = rows[winners]
            placed = np.zeros(len(todo), bool)
            placed[np.flatnonzero(free)[first]] = True
            todo = todo[~placed]
            pos[todo] = (p[~placed] + 1) & mask
        self._used += len(keys)

    def delete(self, keys: np.ndarray) -> None:
        """Remove ``keys`` (absent ones are ignored)."""
        where, _ = self._probe(np.asarray(keys, np.int64))
        where = where[where >= 0]
        self._rows[where] = _DELETED
        self._used -= len(where)
        self._deleted += len(where)

    def rows(self) -> np.ndarray:
        """Every row held."""
        return self._rows[self._rows >= 0].astype(np.int64)

    def reserve(self, keys: int) -> None:
        """Make room for ``keys`` keys now, so that growing to them later needs no rebuild."""
        if len(self._rows) < 3 * keys:
            self._rebuild(keys)

    def _rebuild(self, need: int) -> None:
        size = 1024
        while size < 3 * need:
            size *= 2
        if size > np.iinfo(np.int32).max:
            raise MemoryError(f"an index of {size} positions is too large")
        # A table that churns through keys rebuilds often, at the same size: the live rows are kept
        # apart (4 bytes each) and put back a slice at a time into the same array, so no temporary
        # as large as the index is made (malloc would keep its memory once freed).
        live, n = np.empty(self._used, np.int32), 0
        for start in range(0, len(self._rows), 8 * _REBUILD_CHUNK):
            part = self._rows[start:start + 8 * _REBUILD_CHUNK]
            part = part[part >= 0]
            live[n:n + len(part)] = part
            n += len(part)
        if size == len(self._rows):
            self._rows.fill(_EMPTY)
        else:
            self._rows = np.full(size, _EMPTY, np.int32)
        self._used = self._deleted = 0
        for start in range(0, len(live), _REBUILD_CHUNK):
            rows = live[start:start + _REBUILD_CHUNK].astype(np.int64)
            self.insert(self._key_at(rows), rows)
