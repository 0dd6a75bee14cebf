"""What a parameter server keeps under a variable's key: a table, behind one interface.

The server (:mod:`daskps.server.parameter_server`) knows tables only through
:class:`Table`: reading, checking and applying updates and gradients,
optimizer slots, checkpoint pieces, sizes. Today there is one kind,
:class:`DenseTable` (a numpy array: a variable or one shard of it). Another
kind of table is one class here with its :class:`TableSpec` (what a
:class:`daskps.server.ops.Create` carries to make it), plus its handle on the
client; the server, the protocol, checkpoints, recovery and reprs reach it
through the same seams.

Every ``check_*`` method validates without changing anything and returns
what the matching ``apply_*`` needs: the server checks every item of a
message before it applies any, so a refused message leaves it as it was.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from fsspec import AbstractFileSystem

from daskps._core import bags, ckpt_io, transforms
from daskps._core.arrays import build_part, materialize
from daskps._core.transforms import Transform
from daskps._core.updates import apply_update, check_gradient_of_kind, check_update
from daskps.server.ops import DenseSpec


class Staged(NamedTuple):
    """A restore read from a checkpoint, not yet put in place: the value and each optimizer's slots.

    ``value`` is what the table kind needs (a dense table: its array).
    """

    value: Any
    slots: dict[str, tuple[int, dict[str, np.ndarray]] | None]


class Table(abc.ABC):
    """One table on a server: its values and, per optimizer key, the optimizer's state for it."""

    name: str
    slots: dict[str, Any]  # optimizer key -> that optimizer's state for this table

    @abc.abstractmethod
    def read(self, index: object, shared: bool) -> np.ndarray:
        """The whole value (``index`` None) or ``value[index]``: a copy, unless ``shared`` allows the stored array."""

    def pool(self, ids: np.ndarray, lengths: np.ndarray, weights: np.ndarray | None,
             max_norm: float | None) -> np.ndarray:
        """``sum(weight * row)`` of rows ``ids`` over consecutive bags of ``lengths`` (see :mod:`daskps._core.bags`)."""
        raise TypeError(f"table {self.name!r} cannot pool rows")

    def peek(self, ids: np.ndarray) -> np.ndarray:
        """The rows ``ids`` (valid ones), changing nothing (no clock, no sighting): for a gradient's maths."""
        raise TypeError(f"table {self.name!r} has no rows to peek at")

    @abc.abstractmethod
    def check_update(self, op: str, payload: object) -> object:
        """``payload`` checked for update ``op`` (see :mod:`daskps._core.updates`), ready to apply."""

    @abc.abstractmethod
    def apply_update(self, op: str, checked: object) -> None:
        """Apply an update :meth:`check_update` accepted."""

    @abc.abstractmethod
    def check_gradient(self, kind: str, gradient: object, optimizer: str) -> tuple[str, object]:
        """A gradient of ``kind`` (``"dense"`` or ``"rows"``) checked for optimizer ``optimizer``."""

    @abc.abstractmethod
    def apply_gradient(self, opt_key: str, transform: Transform, checked: tuple[str, object], lazy_sparse: bool,
                       times: int = 1) -> None:
        """Apply a gradient :meth:`check_gradient` accepted, keeping the optimizer's state in ``slots``.

        ``times``: how many steps' gradients it adds up (the optimizer's count advances by that many).
        """

    @abc.abstractmethod
    def info(self) -> tuple[str, tuple[int, ...], str]:
        """``(name, shape, dtype string)`` for stats and reprs."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of the values."""

    def counts(self) -> dict[str, int]:
        """Counters of this table's own for stats and the dashboard (none for a dense table)."""
        return {}

    def command(self, what: str) -> np.ndarray:
        """A :class:`~daskps.server.ops.TableCommand`'s answer; a dense table takes none."""
        raise ValueError(f"{self.name!r} is a dense variable: it takes no command {what!r}")

    def slot_nbytes(self) -> int:
        """Bytes of the optimizers' slots."""
        return sum(a.nbytes for s in self.slots.values() for a in transforms.slot_arrays(s).values())

    @abc.abstractmethod
    def save(self, fs: AbstractFileSystem, root: str, tensor: str, offset: int,
             optimizers: Sequence[tuple[str, str]]) -> list[ckpt_io.Written]:
        """Write this table (and each ``(optimizer path, optimizer key)``'s slots); return manifest records."""

    @abc.abstractmethod
    def stage(self, fs: AbstractFileSystem, root: str, spec: ckpt_io.RestoreSpec) -> Staged:
        """Read this table's part of a checkpoint, changing nothing."""

    @abc.abstractmethod
    def commit(self, staged: Staged, optimizers: dict[str, Transform]) -> None:
        """Put a staged restore in place (``optimizers``: transform by optimizer key)."""


def _take(array: np.ndarray, index: Any) -> np.ndarray:
    """``array[index]`` as a new array (rows by number without copying twice)."""
    if isinstance(index, np.ndarray) and index.dtype.kind in "iu" and index.ndim == 1:
        return np.take(array, index, axis=0)
    return np.array(array[index])


class DenseTable(Table):
    """A numpy array, updated in place.

    >>> t, _ = DenseTable.build(DenseSpec([1.0, 2.0], dtype="float32"), "w")
    >>> t.apply_update("add", t.check_update("add", np.ones(2, "float32")))
    >>> t.read(None, shared=False), t.read(np.array([1]), shared=False)
    (array([2., 3.], dtype=float32), array([3.], dtype=float32))
    """

    @classmethod
    def build(cls, spec: DenseSpec, name: str) -> tuple[DenseTable, bool]:
        """The table a ``Create`` with ``spec`` makes, and whether its initializer built more than this part."""
        np_dtype = None if spec.dtype is None else np.dtype(spec.dtype)
        value, sliced = build_part(spec.value, spec.init_fn, spec.shape, np_dtype, spec.partition_shape,
                                   spec.partition_offset)
        part = spec.partition_shape if spec.partition_shape is not None else spec.shape
        fresh = spec.init_fn is not None and not sliced
        return cls(name, materialize(value, np_dtype, None if part is None else tuple(part), name, fresh)), sliced

    def __init__(self, name: str, value: np.ndarray):
        self.name = name
        self.value = value
        self.slots = {}

    def read(self, index: object, shared: bool) -> np.ndarray:
        if index is None:
            return self.value if shared else self.value.copy()
        return _take(self.value, index)

    def pool(self, ids: np.ndarray, lengths: np.ndarray, weights: np.ndarray | None,
             max_norm: float | None) -> np.ndarray:
        n = len(self.value) if self.value.ndim else 0
        if len(ids) and (ids.min() < 0 or ids.max() >= n):
            raise IndexError(f"ids for variable {self.name!r}: id {ids.max() if ids.max() >= n else ids.min()} "
                             f"is out of range [0, {n})")
        return bags.pool(np.take(self.value, ids, axis=0), lengths, weights, max_norm)

    def peek(self, ids: np.ndarray) -> np.ndarray:
        return np.take(self.value, ids, axis=0)

    def check_update(self, op: str, payload: object) -> object:
        return check_update(self.value.shape, self.value.dtype, self.name, op, payload)

    def apply_update(self, op: str, checked: object) -> None:
        apply_update(self.value, op, checked)

    def check_gradient(self, kind: str, gradient: object, optimizer: str) -> tuple[str, object]:
        transforms.check_trainable(self.value.dtype, self.name, optimizer)
        return check_gradient_of_kind(self.value.shape, self.value.dtype, self.name, kind, gradient)

    def apply_gradient(self, opt_key: str, transform: Transform, checked: tuple[str, object], lazy_sparse: bool,
                       times: int = 1) -> None:
        kind, payload = checked
        self.slots[opt_key] = transforms.apply_gradient(transform, self.value, self.slots.get(opt_key), kind,
                                                        payload, lazy_sparse, times)

    def info(self) -> tuple[str, tuple[int, ...], str]:
        return self.name, self.value.shape, self.value.dtype.str

    def nbytes(self) -> int:
        return int(self.value.nbytes)

    def save(self, fs: AbstractFileSystem, root: str, tensor: str, offset: int,
             optimizers: Sequence[tuple[str, str]]) -> list[ckpt_io.Written]:
        states = []
        for opt_path, opt_key in optimizers:
            state = self.slots.get(opt_key)
            if state is not None:
                states.append((opt_path, state.count, transforms.slot_arrays(state)))
        return ckpt_io.write_with_slots(fs, root, tensor, offset, self.value, states)

    def stage(self, fs: AbstractFileSystem, root: str, spec: ckpt_io.RestoreSpec) -> Staged:
        return Staged(*ckpt_io.load_target(fs, root, spec, self.value.shape, self.value.dtype))

    def commit(self, staged: Staged, optimizers: dict[str, Transform]) -> None:
        # The staged array replaces the old one instead of being copied in: reads hand out
        # copies, so nobody else holds the old array.
        self.value = staged.value
        for opt_key, saved in staged.slots.items():
            if saved is None:
                self.slots.pop(opt_key, None)
            else:
                self.slots[opt_key] = transforms.state_from_slots(optimizers[opt_key], staged.value, *saved)
