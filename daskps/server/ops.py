"""The operations a parameter server runs, and the records it answers with.

A message to a server is a list of these; the server runs them in order
(:meth:`daskps.server.parameter_server.ParameterServer.execute`) and answers with one
result each. They are NamedTuples: cheap to build on the hot path, cheap to
pickle, and their fields name what used to be positions in a tuple.

This module is shared by both ends and imports only numpy and the table
specs: a server and a client agree on it and on nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import EllipsisType
from typing import Any, NamedTuple, Union

import numpy as np

from daskps._core import ckpt_io
from daskps._core.ckpt_io import RestoreSpec
from daskps._core.transforms import Transform

# What a read takes from a value: the whole value (Ellipsis), a row number,
# rows by number, a slice, or a tuple of those (numpy's basic indexing).
Index = Union[EllipsisType, int, slice, np.ndarray, tuple]
# An update or gradient after the client checked it: an array, or ``(indices, values)``.
Payload = Union[np.ndarray, tuple[np.ndarray, np.ndarray], float, int]


# -- what a Create carries: the kind of table and how to fill it (the server builds it) --------------


class DenseSpec(NamedTuple):
    """A dense table: from ``value``, or from ``init_fn(shape, dtype)``.

    With ``partition_shape``/``partition_offset`` the table is one part of a
    variable of ``shape``: ``init_fn`` is offered the part's shape and
    offset, and a result of the full ``shape`` is sliced.
    """

    value: object = None
    init_fn: Callable[..., object] | None = None
    shape: tuple | None = None
    dtype: str | None = None
    partition_shape: tuple | None = None
    partition_offset: tuple | None = None


class HashSpec(NamedTuple):
    """One server's part of an embedding table: part ``part`` of ``parts``."""

    dim: int
    dtype: str
    initializer: Callable[..., Any] | None
    admit_after: int
    evict_after_steps: int | None
    capacity: int | None  # this part's share
    part: int
    parts: int
    key_dtype: str = "<i8"


# What a hash table's TableCommand asks for, and the counts its stats give.
KEYS, ROWS, STATS, EVICT = "keys", "rows", "stats", "evict"
STAT_FIELDS = ("rows", "admitted", "evicted", "dropped", "pending", "steps")


class HashRestoreSpec(NamedTuple):
    """What a part reads to restore: the pieces of each saved tensor (by suffix: ``""`` for the rows)
    and, per optimizer key, what it saved."""

    pieces: dict[str, list[dict[str, Any]]]
    slots: dict[str, ckpt_io.SavedSlots | None]


# The tensors a hash table saves beside its rows (``<name>`` itself) and its slots.
KEYS_TENSOR, UPDATED_TENSOR, USED_TENSOR, CLOCKS_TENSOR = "/.KEYS", "/.LAST_UPDATED", "/.LAST_USED", "/.CLOCKS"
SAVED_TENSORS = ("", KEYS_TENSOR, UPDATED_TENSOR, USED_TENSOR, CLOCKS_TENSOR)

# What a Create carries: one of these, or another kind's spec with build(name) -> (table, sliced).
TableSpec = Union[DenseSpec, HashSpec, Any]


class Create(NamedTuple):
    """Make table ``key`` from ``spec``, held by ``holder``. Also the recipe to make it again."""

    key: str
    name: str
    spec: TableSpec
    holder: str


class Read(NamedTuple):
    """The values of ``keys``, or ``value[index]`` for each index."""

    keys: list[str]
    indices: list[Index] | None = None


class Update(NamedTuple):
    """``(key, op, payload)`` updates (see :mod:`daskps._core.updates`), all checked before any runs."""

    updates: list[tuple[str, str, Payload]]


class AddOptimizer(NamedTuple):
    """Configure optimizer ``key``; ``holder`` is ``None`` to change an existing one (slots are kept)."""

    key: str
    transform: Transform
    lazy_sparse: bool
    name: str
    holder: str | None


class ApplyGradients(NamedTuple):
    """``(key, kind, gradient)`` through optimizer ``opt_key``; ``bump`` names a counter to add ``times`` to.

    ``times`` > 1: each gradient is the sum of that many steps' gradients
    (pushes a trainer merged under bounded staleness, see
    :meth:`daskps.client.pipeline.Pipeline.defer`); counts advance by ``times``.
    """

    opt_key: str
    items: list[tuple[str, str, Payload]]
    bump: str | None = None
    times: int = 1


class PutBlob(NamedTuple):
    """Keep ``blob`` (a pickled dataset function) under ``key``. Also the recipe to keep it again."""

    key: str
    blob: bytes
    holder: str


class GetBlob(NamedTuple):
    key: str


class Acquire(NamedTuple):
    """Count one more handle of ``holder`` for each key (all must exist)."""

    keys: list[str]
    holder: str


class Release(NamedTuple):
    """Count one handle of ``holder`` less for each key; drop what nobody holds."""

    keys: list[str]
    holder: str


class ForgetPlace(NamedTuple):
    """The worker at ``address`` is gone: drop what its holders held."""

    address: str


class SavePiece(NamedTuple):
    """One table's part of a checkpoint: its tensor name, its offset in it, and its optimizers' slots."""

    key: str
    tensor: str
    offset: int
    optimizers: list[tuple[str, str]]  # (optimizer's path in the checkpoint, optimizer key)


class Save(NamedTuple):
    """Write the pieces straight to ``base``; the answer is a list of :class:`Written` records."""

    base: str
    pieces: list[SavePiece]


class StageRestore(NamedTuple):
    """Read the ``(key, spec)`` targets of a restore; nothing changes until :class:`CommitRestore`."""

    token: str
    base: str
    targets: list[tuple[str, RestoreSpec]]


class CommitRestore(NamedTuple):
    token: str


class AbortRestore(NamedTuple):
    token: str


class Stats(NamedTuple):
    """Counters and sizes (answered with :class:`ServerStats`)."""


class TableCommand(NamedTuple):
    """Run ``command`` on each table of ``keys`` (an embedding table's ``"keys"``, ``"rows"``, ``"stats"``,
    ``"evict"``): answered with an array each. Not a read: it is counted as a command, and may change the
    table (an eviction)."""

    keys: list[str]
    command: str


class Isolate(NamedTuple):
    """First in a message: the next ``size`` operations (held-back pushes) each succeed or fail alone."""

    size: int


Op = Union[Create, Read, Update, AddOptimizer, ApplyGradients, PutBlob, GetBlob, Acquire, Release,
           ForgetPlace, Save, StageRestore, CommitRestore, AbortRestore, Stats, TableCommand, Isolate]
# Operations whose fields may hold functions (initializers, optimizer transforms): pickled by value.
CARRY_CODE = (Create, AddOptimizer)


def carries_code(ops: Sequence[Op]) -> bool:
    return any(isinstance(op, CARRY_CODE) for op in ops)


# -- answers -------------------------------------------------------------------------------
class Created(NamedTuple):
    """What :class:`Create` made: its shape and dtype, and whether the initializer built the
    whole variable to cut this part out of it."""

    shape: tuple[int, ...]
    dtype: str
    sliced: bool


class TableInfo(NamedTuple):
    """One table in :class:`ServerStats`."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class ServerStats(NamedTuple):
    """A server's counters and sizes, for reprs and the dashboard."""

    task_id: int | None
    num_variables: int
    nbytes: int
    slot_nbytes: int
    num_optimizers: int
    blob_nbytes: int
    reads: int
    bytes_read: int
    updates: int
    messages: int
    uptime: float
    calls: dict[str, int]
    variables: dict[str, TableInfo]
    counts: dict[str, dict[str, int]]  # per table with counters of its own (hash tables): rows, admitted...
    bytes_received: int = 0  # in read indices (ids, bags), updates and gradients
    table_reads: dict[str, int] = {}  # by table key: reads of each table (a shard is one)
    table_updates: dict[str, int] = {}  # updates and gradients applied to each

    def as_dict(self) -> dict[str, object]:
        """As ``strategy.ps_stats()`` shows it: a dict, each table as ``(name, shape, dtype)``."""
        out = self._asdict()
        out["variables"] = {k: tuple(v) for k, v in self.variables.items()}
        return out
