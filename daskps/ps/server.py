"""The parameter server: arrays, optimizer state and blobs, kept by key.

One ``ParameterServer`` lives on each ps-tagged worker as a Dask actor, and
one in every process that has local variables. It has a single entry point,
:meth:`ParameterServer.execute`, which runs a list of operations in order;
:mod:`daskps.ps.protocol` is the only code that builds those lists. Dask
runs the synchronous methods of all actors on a worker one at a time, so
each operation sees and leaves a consistent state without locks.

Every operation validates all of its input before it changes anything: one
that raises leaves the server as it was.

Objects live while some process holds them: each key has a count per
holder (a process; on a worker, ``process@worker-address``), set by ``create``/``add_optimizer``/``put_blob`` and
changed by ``acquire``/``release``; when the counts reach zero the object,
and for a variable its optimizer slots, are dropped.

This module imports only the numpy core: the server knows nothing of the
client side.
"""

from __future__ import annotations

import pickle
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import fsspec
import numpy as np

from daskps._core import ckpt_io, transforms
from daskps._core.arrays import build_part, materialize
from daskps._core.updates import Refused, apply_update, check_gradient_of_kind, check_update

OPS = frozenset({
    "create", "read", "update", "add_optimizer", "apply_gradients", "put_blob", "get_blob",
    "acquire", "release", "forget_place", "save", "stage_restore", "commit_restore", "abort_restore", "stats",
})


def _sendable(exc: Exception) -> Exception:
    """``exc``, or a RuntimeError saying what it was if it would not travel back by pickle."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _take(array: np.ndarray, index: Any) -> np.ndarray:
    """``array[index]`` as a new array (rows by number without copying twice)."""
    if isinstance(index, np.ndarray) and index.dtype.kind in "iu" and index.ndim == 1:
        return np.take(array, index, axis=0)
    return np.array(array[index])


class ParameterServer:
    """Holds variables (and variable shards) of one parameter-server task.

    Parameters
    ----------
    task_id : int or None
        This server's index among the parameter servers (``/job:ps/task:K``);
        ``None`` for the server of local variables.

    Examples
    --------
    Dask hosts it as an actor, but it is plain Python:

    >>> ps = ParameterServer(0)
    >>> ps.execute([("create", ("k1", "w", [1.0, 2.0], None, None, "float32", None, None, "me"))])
    [((2,), '<f4', False)]
    >>> ps.execute([("update", ([("k1", "add", np.ones(2, "float32"))],)), ("read", (["k1"],))])
    [None, [array([2., 3.], dtype=float32)]]
    >>> ps.execute([("release", (["k1"], "me"))])[0], ps.stats()["num_variables"]
    (1, 0)
    """

    def __init__(self, task_id: int | None):
        self.task_id = task_id
        self._values: dict[str, np.ndarray] = {}
        self._names: dict[str, str] = {}
        self._holders: dict[str, Counter[str]] = {}
        self._optimizers: dict[str, tuple[Any, bool, str]] = {}  # key -> (transform, lazy_sparse, name)
        self._slots: dict[str, dict[str, Any]] = {}  # optimizer key -> variable key -> state
        self._blobs: dict[str, bytes] = {}
        self._staged: dict[str, list] = {}  # restores read but not yet committed
        self.reads = self.bytes_read = self.updates = self.messages = 0
        self._shared_reads = False
        self.calls: Counter[str] = Counter()
        self.started = time.time()

    def execute(self, ops: Sequence[tuple[str, tuple]], shared_reads: bool = False) -> list[Any]:
        """Run ``(operation, args)`` pairs in order; return their results.

        ``shared_reads``: whole-value reads may return the stored arrays
        themselves, for a caller that copies them before any other operation
        can run (the channel does).
        """
        self.messages += 1
        self._shared_reads = shared_reads
        results: list[Any] = []
        isolated = 0  # how many of the next operations run on their own: ("isolate", (n,))
        outcomes = 0
        try:
            for op, args in ops:
                if op == "isolate" and not results:
                    isolated = outcomes = int(args[0])
                    results.append(None)
                    continue
                if op not in OPS:
                    raise ValueError(f"unknown parameter-server operation {op!r}")
                self.calls[op] += 1
                if isolated:
                    isolated -= 1
                    try:
                        results.append(getattr(self, op)(*args))
                    except Exception as exc:  # that one changed nothing; the others go on
                        results.append(Refused(_sendable(exc)))
                else:
                    results.append(getattr(self, op)(*args))
        except Exception as exc:  # the isolated operations ran: say how each went
            if outcomes and len(results) > outcomes:
                exc.daskps_isolated = results[1 : 1 + outcomes]  # type: ignore[attr-defined]
            raise
        return results

    def _where(self) -> str:
        return "this process" if self.task_id is None else f"ps task {self.task_id}"

    # -- lifetimes ------------------------------------------------------------------
    def _new(self, key: str, holder: str) -> None:
        if key in self._holders:
            raise ValueError(f"key {key!r} already exists on {self._where()}")
        self._holders[key] = Counter({holder: 1})

    def acquire(self, keys: Sequence[str], holder: str) -> None:
        """Count one more handle of ``holder`` for each key (all must exist)."""
        missing = [k for k in keys if k not in self._holders]
        if missing:
            raise LookupError(f"{self._where()} no longer holds {missing}")
        for key in keys:
            self._holders[key][holder] += 1

    def forget_place(self, address: str) -> int:
        """The worker at ``address`` is gone: drop what its holders (``...@address``) held."""
        suffix = f"@{address}"
        dropped = 0
        for key, counts in list(self._holders.items()):
            for holder in [h for h in counts if h.endswith(suffix)]:
                counts[holder] = 0
            if not +counts:
                self._drop(key)
                dropped += 1
        return dropped

    def release(self, keys: Sequence[str], holder: str) -> int:
        """Count one handle of ``holder`` less; drop what nobody holds. Returns how many were dropped."""
        dropped = 0
        for key in keys:
            counts = self._holders.get(key)
            if counts is None or counts[holder] <= 0:
                continue
            counts[holder] -= 1
            if not +counts:  # no positive count left
                self._drop(key)
                dropped += 1
        return dropped

    def _drop(self, key: str) -> None:
        del self._holders[key]
        self._names.pop(key, None)
        self._blobs.pop(key, None)
        if self._values.pop(key, None) is not None:
            for per_var in self._slots.values():
                per_var.pop(key, None)
        if self._optimizers.pop(key, None) is not None:
            self._slots.pop(key, None)

    # -- creation -------------------------------------------------------------------
    def create(
        self, key: str, name: str, value: Any, init_fn: Callable[..., Any] | None, shape: Sequence[int] | None,
        dtype: str | None, partition_shape: Sequence[int] | None, partition_offset: Sequence[int] | None, holder: str,
    ) -> tuple[tuple[int, ...], str, bool]:
        """Create variable ``key``; return its shape, dtype string, and whether
        the initializer built the whole variable to cut this part out of it.

        With ``partition_shape``/``partition_offset`` this server holds one
        part of a variable of ``shape``: ``init_fn`` is offered the part's
        shape and offset, and a result of the full ``shape`` is sliced.
        """
        if key in self._holders:
            raise ValueError(f"key {key!r} already exists on {self._where()}")
        np_dtype = None if dtype is None else np.dtype(dtype)
        value, sliced = build_part(value, init_fn, shape, np_dtype, partition_shape, partition_offset)
        part = partition_shape if partition_shape is not None else shape
        fresh = init_fn is not None and not sliced
        arr = materialize(value, np_dtype, None if part is None else tuple(part), name, fresh)
        self._new(key, holder)
        self._values[key] = arr
        self._names[key] = name
        return arr.shape, arr.dtype.str, sliced

    def add_optimizer(self, key: str, transform: Any, lazy_sparse: bool, name: str, holder: str | None) -> None:
        """Configure optimizer ``key`` here (again, to change its settings: slots are kept)."""
        if holder is not None:
            self._new(key, holder)
        elif key not in self._optimizers:
            raise LookupError(f"no optimizer {name!r} on {self._where()}")
        self._optimizers[key] = (transform, bool(lazy_sparse), name)
        self._slots.setdefault(key, {})

    def put_blob(self, key: str, blob: bytes, holder: str) -> None:
        self._new(key, holder)
        self._blobs[key] = blob

    def get_blob(self, key: str) -> bytes:
        try:
            return self._blobs[key]
        except KeyError:
            raise LookupError(f"no blob {key!r} on {self._where()} (it was released)") from None

    # -- reads and updates ----------------------------------------------------------
    def _get(self, key: str) -> np.ndarray:
        try:
            return self._values[key]
        except KeyError:
            raise LookupError(f"no variable with key {key!r} on {self._where()} (it was released)") from None

    def read(self, keys: Sequence[str], indices: Sequence[Any] | None = None) -> list[np.ndarray]:
        """Copies of the values of ``keys`` (or of ``value[index]`` for each).

        Updates write in place, so what is returned must be a copy: Dask
        sends it after this method returns, while later calls may run.
        """
        arrays = [self._get(k) for k in keys]
        if indices is None:
            out = arrays if self._shared_reads else [a.copy() for a in arrays]
        else:
            out = [_take(a, index) for a, index in zip(arrays, indices, strict=True)]
        self.reads += len(out)
        self.bytes_read += sum(a.nbytes for a in out)
        return out

    def update(self, updates: Sequence[tuple[str, str, Any]]) -> None:
        """Apply ``(key, op, payload)`` updates (see :mod:`daskps._core.updates`), all checked first."""
        checked = []
        for key, op, payload in updates:
            arr = self._get(key)
            checked.append((arr, op, check_update(arr.shape, arr.dtype, self._names[key], op, payload)))
        for arr, op, payload in checked:
            apply_update(arr, op, payload)
        self.updates += len(checked)

    def apply_gradients(self, opt_key: str, items: Sequence[tuple[str, str, Any]], bump: str | None) -> None:
        """Apply ``(key, kind, gradient)`` with optimizer ``opt_key``; slots stay here.

        ``kind`` is ``"dense"`` or ``"rows"`` (``(indices, values)``). Every
        gradient is checked first; ``bump`` names a counter to add 1 to.
        """
        try:
            transform, lazy, opt_name = self._optimizers[opt_key]
        except KeyError:
            raise LookupError(f"optimizer {opt_key!r} is not configured on {self._where()}") from None
        checked = []
        for key, kind, grad in items:
            arr = self._get(key)
            transforms.check_trainable(arr.dtype, self._names[key], opt_name)
            checked.append((key, arr, *check_gradient_of_kind(arr.shape, arr.dtype, self._names[key], kind, grad)))
        if bump is not None:
            self._get(bump)
        slots = self._slots[opt_key]
        for key, arr, kind, payload in checked:
            here = transforms.for_variable(transform, key, self._names[key])  # exclude_from_weight_decay
            slots[key] = transforms.apply_gradient(here, arr, slots.get(key), kind, payload, lazy)
        if bump is not None:
            self._values[bump] += 1
        self.updates += len(checked)

    # -- checkpoints ----------------------------------------------------------------
    def save(self, base: str, specs: list) -> list[dict]:
        """Write ``(key, tensor, offset, [(optimizer_path, opt_key)])`` pieces straight to ``base``."""
        fs, root = fsspec.core.url_to_fs(base)
        fs.makedirs(root, exist_ok=True)
        records = []
        for key, tensor, offset, opts in specs:
            states = []
            for opt_path, opt_key in opts:
                state = self._slots.get(opt_key, {}).get(key)
                if state is not None:
                    states.append((opt_path, state.count, transforms.slot_arrays(state)))
            records += ckpt_io.write_with_slots(fs, root, tensor, offset, self._get(key), states)
        return records

    def stage_restore(self, token: str, base: str, specs: list) -> None:
        """Read the ``(key, spec)`` targets of a restore; nothing changes until :meth:`commit_restore`."""
        fs, root = fsspec.core.url_to_fs(base)
        staged = []
        for key, spec in specs:
            arr = self._get(key)
            for opt_key in spec["slots"]:
                if opt_key not in self._optimizers:
                    raise LookupError(f"optimizer {opt_key!r} is not configured on {self._where()}")
            value, slots = ckpt_io.load_target(fs, root, spec, arr.shape, arr.dtype)
            staged.append((key, value, slots))
        self._staged[token] = staged

    def commit_restore(self, token: str) -> None:
        """Put staged values and slots in place (nothing here fails on what staging accepted).

        The staged arrays replace the old ones instead of being copied into
        them: reads hand out copies, so nobody else holds the old arrays.
        """
        for key, value, slots in self._staged.pop(token):
            self._values[key] = value
            for opt_key, saved in slots.items():
                per_var = self._slots[opt_key]
                if saved is None:
                    per_var.pop(key, None)
                else:
                    transform = self._optimizers[opt_key][0]
                    per_var[key] = transforms.state_from_slots(transform, value, *saved)

    def abort_restore(self, token: str) -> None:
        self._staged.pop(token, None)

    # -- introspection --------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and sizes, for reprs and the dashboard."""
        slot_bytes = sum(a.nbytes for per in self._slots.values() for s in per.values()
                         for a in transforms.slot_arrays(s).values())
        return {
            "task_id": self.task_id,
            "num_variables": len(self._values),
            "nbytes": int(sum(v.nbytes for v in self._values.values())),
            "slot_nbytes": int(slot_bytes),
            "num_optimizers": len(self._optimizers),
            "blob_nbytes": sum(len(b) for b in self._blobs.values()),
            "reads": self.reads,
            "bytes_read": self.bytes_read,
            "updates": self.updates,
            "messages": self.messages,
            "uptime": time.time() - self.started,
            "calls": dict(self.calls),
            "variables": {k: (self._names[k], v.shape, v.dtype.str) for k, v in self._values.items()},
        }
