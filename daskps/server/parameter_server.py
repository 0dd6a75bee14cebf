"""The parameter server: tables, optimizers and blobs, kept by key.

One ``ParameterServer`` lives on each ps-tagged worker as a Dask actor, and
one in every process that has local variables. It has a single entry point,
:meth:`ParameterServer.execute`, which runs a list of typed operations
(:mod:`daskps.server.ops`) in order; :mod:`daskps.client.protocol` is the only code
that builds those lists. Dask runs the synchronous methods of all actors on
a worker one at a time, so each operation sees and leaves a consistent state
without locks.

Every operation validates all of its input before it changes anything: one
that raises leaves the server as it was.

Objects live while some process holds them: each key has a count per
holder (a process; on a worker, ``process@worker-address``), set by ``Create``/``AddOptimizer``/``PutBlob`` and
changed by ``Acquire``/``Release``; when the counts reach zero the object,
and for an optimizer its slots in every table, are dropped.

A variable's values are a :class:`daskps.server.tables.Table`: the server
holds tables without knowing their kind. This module imports only the numpy
core: the server knows nothing of the client side.
"""

from __future__ import annotations

import pickle
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, cast

import fsspec
import numpy as np

from daskps._core import heap, transforms
from daskps._core.bags import BagGrad, BagMemory, BagRead, check_bags, check_max_norm, unclip
from daskps._core.ckpt_io import Written
from daskps._core.updates import Refused
from daskps.errors import PartlyAppliedError
from daskps.server import ops
from daskps.server.hash_table import HashTable
from daskps.server.tables import DenseTable, Staged, Table


def sendable(exc: Exception) -> Exception:
    """``exc``, or a RuntimeError saying what it was if it would not travel back by pickle."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class ParameterServer:
    """Holds the tables (variables and variable shards) of one parameter-server task.

    Parameters
    ----------
    task_id : int or None
        This server's index among the parameter servers (``/job:ps/task:K``);
        ``None`` for the server of local variables.

    Examples
    --------
    Dask hosts it as an actor, but it is plain Python:

    >>> import numpy as np
    >>> from daskps.server.ops import DenseSpec
    >>> ps = ParameterServer(0)
    >>> ps.execute([ops.Create("k1", "w", DenseSpec([1.0, 2.0], dtype="float32"), "me")])
    [Created(shape=(2,), dtype='<f4', sliced=False)]
    >>> ps.execute([ops.Update([("k1", "add", np.ones(2, "float32"))]), ops.Read(["k1"])])
    [None, [array([2., 3.], dtype=float32)]]
    >>> ps.execute([ops.Release(["k1"], "me")])[0], ps.stats(ops.Stats()).num_variables
    (1, 0)
    """

    def __init__(self, task_id: int | None):
        self.task_id = task_id
        self._tables: dict[str, Table] = {}
        self._holders: dict[str, Counter[str]] = {}
        self._optimizers: dict[str, ops.AddOptimizer] = {}
        self._blobs: dict[str, bytes] = {}
        self._staged: dict[str, list[tuple[Table, Staged]]] = {}  # restores read but not yet committed
        self._bags = BagMemory()  # recent pooled lookups' bags, for their gradients
        self.reads = self.bytes_read = self.updates = self.messages = self.bytes_received = 0
        self.table_reads: Counter[str] = Counter()  # by table key: reads and updates of each shard
        self.table_updates: Counter[str] = Counter()
        self._shared_reads = False
        self._dropped = 0  # bytes dropped since the heap was last trimmed
        self.trim_due = False  # set once another heap.TRIM_AFTER bytes are dropped: see trim_if_due
        self.calls: Counter[str] = Counter()
        self.started = time.time()

    def execute(self, message: Sequence[ops.Op], shared_reads: bool = False) -> list[Any]:
        """Run the operations of ``message`` in order; return their results.

        ``shared_reads``: whole-value reads may return the stored arrays
        themselves, for a caller that copies them before any other operation
        can run (the channel does).

        A message that starts with ``Isolate(n)`` runs its next ``n``
        operations (held-back pushes) each on its own: one refused is
        answered with a ``Refused`` and the others go on. If a later
        operation fails, :class:`PartlyAppliedError` says how those went.
        """
        self.messages += 1
        self._shared_reads = shared_reads
        results: list[Any] = []
        isolated = outcomes = 0
        try:
            for op in message:
                handler = _HANDLERS.get(type(op))
                if handler is None:
                    if isinstance(op, ops.Isolate) and not results:
                        isolated = outcomes = int(op.size)
                        results.append(None)
                        continue
                    raise ValueError(f"unknown parameter-server operation {op!r}")
                self.calls[handler.__name__] += 1
                if isolated:
                    isolated -= 1
                    try:
                        results.append(handler(self, op))
                    except Exception as exc:  # that one changed nothing; the others go on
                        results.append(Refused(sendable(exc)))
                else:
                    results.append(handler(self, op))
        except Exception as exc:
            if outcomes and len(results) > outcomes:  # the isolated operations ran: say how each went
                raise PartlyAppliedError(sendable(exc), results[1 : 1 + outcomes]) from None
            raise
        return results

    def trim_if_due(self) -> None:
        """Give the heap's free pages back if enough was dropped since the last time
        (:mod:`daskps._core.heap`). Callers that hold a lock around :meth:`execute` call this once they
        have let it go: a trim after a large drop takes tens of milliseconds."""
        if self.trim_due:
            self.trim_due = False
            heap.trim()

    def _where(self) -> str:
        return "this process" if self.task_id is None else f"ps task {self.task_id}"

    @property
    def tables(self) -> dict[str, Table]:
        """The tables held here, by key (a new dict; the tables themselves, not copies)."""
        return dict(self._tables)

    def holders(self, key: str) -> dict[str, int]:
        """Who holds ``key`` here and how many handles each (empty when nothing by that key is held)."""
        return {holder: n for holder, n in self._holders.get(key, {}).items() if n > 0}

    # -- lifetimes ------------------------------------------------------------------
    def _new(self, key: str, holder: str) -> None:
        if key in self._holders:
            raise ValueError(f"key {key!r} already exists on {self._where()}")
        self._holders[key] = Counter({holder: 1})

    def acquire(self, op: ops.Acquire) -> None:
        missing = [k for k in op.keys if k not in self._holders]
        if missing:
            raise LookupError(f"{self._where()} no longer holds {missing}")
        for key in op.keys:
            self._holders[key][op.holder] += 1

    def forget_place(self, op: ops.ForgetPlace) -> int:
        """Drop what the holders of the worker at ``op.address`` (``...@address``) held."""
        suffix = f"@{op.address}"
        dropped = 0
        for key, counts in list(self._holders.items()):
            for holder in [h for h in counts if h.endswith(suffix)]:
                counts[holder] = 0
            if not +counts:
                self._drop(key)
                dropped += 1
        self._bags.drop_lanes(suffix)
        return dropped

    def release(self, op: ops.Release) -> int:
        """Returns how many objects were dropped."""
        dropped = 0
        for key in op.keys:
            counts = self._holders.get(key)
            if counts is None or counts[op.holder] <= 0:
                continue
            counts[op.holder] -= 1
            if not +counts:  # no positive count left
                self._drop(key)
                dropped += 1
        return dropped

    def _drop(self, key: str) -> None:
        del self._holders[key]
        blob = self._blobs.pop(key, None)
        freed = 0 if blob is None else len(blob)
        table = self._tables.pop(key, None)
        if table is not None:
            freed += table.nbytes() + table.slot_nbytes()
            self._bags.drop_table(key)
        if self._optimizers.pop(key, None) is not None:
            for table in self._tables.values():
                slots = table.slots.pop(key, None)
                if slots is not None:
                    freed += sum(a.nbytes for a in transforms.slot_arrays(slots).values())
        # Freed blocks in the middle of the heap stay with the process (:mod:`daskps._core.heap`): after a
        # large drop (a model deleted, a trainer's tables gone with it), give their pages back.
        self._dropped += freed
        if self._dropped >= heap.TRIM_AFTER:
            self._dropped = 0
            self.trim_due = True

    # -- creation -------------------------------------------------------------------
    def create(self, op: ops.Create) -> ops.Created:
        if op.key in self._holders:
            raise ValueError(f"key {op.key!r} already exists on {self._where()}")
        table, sliced = _build(op.spec, op.name)
        self._new(op.key, op.holder)
        self._tables[op.key] = table
        _, shape, dtype = table.info()
        return ops.Created(shape, dtype, sliced)

    def add_optimizer(self, op: ops.AddOptimizer) -> None:
        """Configure an optimizer (again, with ``holder`` None, to change its settings: slots are kept)."""
        if op.holder is not None:
            self._new(op.key, op.holder)
        elif op.key not in self._optimizers:
            raise LookupError(f"no optimizer {op.name!r} on {self._where()}")
        self._optimizers[op.key] = op

    def put_blob(self, op: ops.PutBlob) -> None:
        self._new(op.key, op.holder)
        self._blobs[op.key] = op.blob

    def get_blob(self, op: ops.GetBlob) -> bytes:
        try:
            return self._blobs[op.key]
        except KeyError:
            raise LookupError(f"no blob {op.key!r} on {self._where()} (it was released)") from None

    # -- reads and updates ----------------------------------------------------------
    def _get(self, key: str) -> Table:
        try:
            return self._tables[key]
        except KeyError:
            raise LookupError(f"no variable with key {key!r} on {self._where()} (it was released)") from None

    def _optimizer(self, key: str) -> ops.AddOptimizer:
        try:
            return self._optimizers[key]
        except KeyError:
            raise LookupError(f"optimizer {key!r} is not configured on {self._where()}") from None

    def read(self, op: ops.Read) -> list[Any]:
        """Copies of the values (Dask sends them after this returns, while later updates may run)."""
        tables = [self._get(k) for k in op.keys]
        if op.indices is None:
            out = [t.read(None, self._shared_reads) for t in tables]
        else:
            out = []
            for key, t, index in zip(op.keys, tables, op.indices, strict=True):
                if type(index) is BagRead:
                    what = f"lookup of {t.name!r}"
                    bags = check_bags(index.ids, index.lengths, index.weights, what)
                    out.append(t.pool(*bags, check_max_norm(index.max_norm, what)))
                    self._bags.keep(key, index, bags)
                else:
                    out.append(t.read(index, False))
                if type(index) is np.ndarray:
                    self.bytes_received += index.nbytes
                elif type(index) is BagRead:
                    self.bytes_received += _nbytes(tuple(index[:3]))
        self.reads += len(out)
        self.bytes_read += sum(a.nbytes for a in out)
        self.table_reads.update(op.keys)
        return out

    def table_command(self, op: ops.TableCommand) -> list[np.ndarray]:
        """Each table's answer to ``op.command`` (tables that take none refuse it, naming it)."""
        return [self._get(k).command(op.command) for k in op.keys]

    def update(self, op: ops.Update) -> None:
        checked = []
        for key, kind, payload in op.updates:
            table = self._get(key)
            checked.append((table, kind, table.check_update(kind, payload)))
        for table, kind, accepted in checked:
            table.apply_update(kind, accepted)
        self.updates += len(checked)
        self.table_updates.update([key for key, _, _ in op.updates])
        self.bytes_received += sum(_nbytes(payload) for _, _, payload in op.updates)

    def apply_gradients(self, op: ops.ApplyGradients) -> None:
        """Every gradient is checked first; the optimizer's slots stay in the tables."""
        optimizer = self._optimizer(op.opt_key)
        checked = []
        for key, kind, grad in op.items:
            table = self._get(key)
            if kind == "bags":
                kind, grad = "rows", self._spread(key, table, cast(BagGrad, grad))
            checked.append((key, table, table.check_gradient(kind, grad, optimizer.name)))
        counter = None if op.bump is None else self._get(op.bump)
        per_table, nbytes = self.table_updates, 0
        for (key, table, gradient), (_, _, grad) in zip(checked, op.items):
            here = transforms.for_variable(optimizer.transform, key, table.name)  # exclude_from_weight_decay
            table.apply_gradient(op.opt_key, here, gradient, optimizer.lazy_sparse, op.times)
            per_table[key] += 1
            nbytes += grad.nbytes if type(grad) is np.ndarray else _nbytes(grad)
        if counter is not None:
            counter.apply_update("add", op.times)
        for key, kind, grad in op.items:
            if kind == "bags":
                self._bags.forget(key, cast(BagGrad, grad))
        self.updates += len(checked)
        self.bytes_received += nbytes

    def _spread(self, key: str, table: Table, grad: BagGrad) -> tuple[np.ndarray, np.ndarray]:
        """A pooled gradient as ``(distinct ids, summed rows)``: each bag's vector times each id's weight."""
        if type(grad) is not BagGrad:
            raise TypeError(f"a pooled gradient for {table.name!r} must be a BagGrad, got {type(grad).__name__}")
        values = np.asarray(grad.values)
        if values.dtype.kind != "f":
            raise TypeError(f"a pooled gradient for {table.name!r} must hold floats, got {values.dtype}")
        max_norm = check_max_norm(grad.max_norm, f"pooled gradient for {table.name!r}")
        found = self._bags.find(key, grad)
        if found is None:  # the lookup was made before this server was restored: nothing left to train
            self.calls["pooled_gradient_from_before_a_restore"] += 1
            return np.zeros(0, np.int64), np.zeros((0,) + values.shape[1:], values.dtype)
        ids, lengths, weights = found
        if values.ndim < 2 or len(values) != len(lengths):
            raise ValueError(f"a pooled gradient for {table.name!r} must have a row per bag ({len(lengths)}), "
                             f"got shape {values.shape}")
        # Each id's row is its bag's: sort the ids, take their bags' rows in that order, add up repeats.
        order = np.argsort(ids)
        bag_of = np.repeat(np.arange(len(lengths)), lengths.astype(np.intp, copy=False))
        rows = np.take(values, bag_of[order], axis=0)
        if weights is not None:
            rows *= weights[order].astype(rows.dtype, copy=False).reshape((-1,) + (1,) * (rows.ndim - 1))
        if max_norm is not None:  # the lookup clipped the rows: through the clipping, row by row
            rows = unclip(rows, table.peek(ids[order]), max_norm)
        return transforms.sum_sorted(ids[order], rows)

    # -- checkpoints ----------------------------------------------------------------
    def save(self, op: ops.Save) -> list[Written]:
        fs, root = fsspec.core.url_to_fs(op.base)
        fs.makedirs(root, exist_ok=True)
        records = []
        for piece in op.pieces:
            records += self._get(piece.key).save(fs, root, piece.tensor, piece.offset, piece.optimizers)
        return records

    def stage_restore(self, op: ops.StageRestore) -> None:
        fs, root = fsspec.core.url_to_fs(op.base)
        staged = []
        for key, spec in op.targets:
            table = self._get(key)
            for opt_key in spec.slots:
                self._optimizer(opt_key)
            staged.append((table, table.stage(fs, root, spec)))
        self._staged[op.token] = staged

    def commit_restore(self, op: ops.CommitRestore) -> None:
        """Put staged values and slots in place (nothing here fails on what staging accepted)."""
        optimizers = {k: o.transform for k, o in self._optimizers.items()}
        for table, staged in self._staged.pop(op.token):
            table.commit(staged, optimizers)

    def abort_restore(self, op: ops.AbortRestore) -> None:
        self._staged.pop(op.token, None)

    # -- introspection --------------------------------------------------------------
    def stats(self, op: ops.Stats) -> ops.ServerStats:
        tables = self._tables.values()
        return ops.ServerStats(
            task_id=self.task_id,
            num_variables=len(self._tables),
            nbytes=sum(t.nbytes() for t in tables),
            slot_nbytes=sum(t.slot_nbytes() for t in tables),
            num_optimizers=len(self._optimizers),
            blob_nbytes=sum(len(b) for b in self._blobs.values()),
            reads=self.reads,
            bytes_read=self.bytes_read,
            updates=self.updates,
            messages=self.messages,
            bytes_received=self.bytes_received,
            table_reads=dict(self.table_reads),
            table_updates=dict(self.table_updates),
            uptime=time.time() - self.started,
            calls=dict(self.calls),
            variables={k: ops.TableInfo(*t.info()) for k, t in self._tables.items()},
            counts={k: c for k, t in self._tables.items() if (c := t.counts())},
        )


# Which method runs each operation (``Isolate`` is read by ``execute`` itself). Plain functions,
# not bound methods: a server holding its own bound methods would live until a garbage collection.
_HANDLERS: dict[type, Callable[[ParameterServer, Any], Any]] = {
    ops.Create: ParameterServer.create, ops.Read: ParameterServer.read, ops.Update: ParameterServer.update,
    ops.AddOptimizer: ParameterServer.add_optimizer, ops.ApplyGradients: ParameterServer.apply_gradients,
    ops.PutBlob: ParameterServer.put_blob, ops.GetBlob: ParameterServer.get_blob,
    ops.Acquire: ParameterServer.acquire, ops.Release: ParameterServer.release,
    ops.ForgetPlace: ParameterServer.forget_place, ops.Save: ParameterServer.save,
    ops.StageRestore: ParameterServer.stage_restore, ops.CommitRestore: ParameterServer.commit_restore,
    ops.AbortRestore: ParameterServer.abort_restore, ops.Stats: ParameterServer.stats,
    ops.TableCommand: ParameterServer.table_command,
}


def _nbytes(payload: Any) -> int:
    """Bytes of the arrays in an update's or a gradient's payload (an array, or a tuple of them)."""
    if isinstance(payload, np.ndarray):
        return int(payload.nbytes)
    if isinstance(payload, (tuple, list)):
        return sum(_nbytes(p) for p in payload)
    return 0


def _build(spec: Any, name: str) -> tuple[Table, bool]:
    """The table a ``Create`` makes from ``spec``, and whether its initializer built more than this part.

    The two kinds daskps has are built here; another kind's spec builds its own table (``spec.build(name)``),
    so that a new kind is one class and its spec, and nothing here changes.
    """
    if isinstance(spec, ops.HashSpec):
        return HashTable(name, spec), False
    if isinstance(spec, ops.DenseSpec):
        return DenseTable.build(spec, name)
    return spec.build(name)
