"""Checkpoints written by the parameter servers themselves, committed by a manifest.

``Checkpoint(**objects)`` names every tensor by its path among the objects
(``model/w``, ``opt/iterations``, ``w/.OPTIMIZER_SLOT/opt/m``). On save each
server writes the pieces it holds, straight to the fsspec path, all servers
at once; the coordinator then writes ``manifest.json`` (to a temporary name,
then renamed), which is the commit point: a save that dies before it leaves
no checkpoint, and the previous one untouched.

Dict keys are escaped as TensorFlow does (``.`` -> ``..``, ``/`` -> ``.S``),
so ``{"dense/kernel": w}`` is one tensor, not a nesting.

A sharded variable is one tensor stored in pieces; a restore reads, for each
shard, just the rows it needs, so it works into any number of shards (or a
plain variable), and optimizer slots follow their variable. A restore first
checks every name, shape and dtype, then has every server read its part,
and only when all reads succeeded do they put the values in place.

>>> import daskps as dps, tempfile
>>> w = dps.Variable([1.0, 2.0])
>>> ckpt = dps.Checkpoint(model={"w": w})
>>> path = ckpt.save(tempfile.mkdtemp() + "/ckpt")
>>> _ = w.assign([0.0, 0.0])
>>> _ = ckpt.restore(path)
>>> w.numpy()
array([1., 2.], dtype=float32)
"""

from __future__ import annotations

import contextlib
import inspect
import json
import numbers
import os
import re
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import distributed
import fsspec
import numpy as np

from daskps._core import ckpt_io, views
from daskps._core.arrays import is_int
from daskps._core.config import setting
from daskps.client import protocol
from daskps.scheduler.messages import CHECKPOINT_TOPIC
from daskps.server.ops import SAVED_TENSORS, HashRestoreSpec
from daskps.training.metrics import Metric
from daskps.training.optimizers import Optimizer
from daskps.variables.hashed import EmbeddingTable
from daskps.variables.variable import ShardedVariable, Variable

__all__ = ["Checkpoint", "CheckpointManager"]

MANIFEST = "manifest.json"
PRESERVED = "PRESERVED"  # in a checkpoint kept for good by keep_checkpoint_every_n_hours


class _Tensor:
    def __init__(self, parts: list[tuple[Variable, int]], slotted: bool, layout: str = "div"):
        self.parts = parts
        self.slotted = slotted
        self.layout = layout  # "mod": the pieces (at offsets in shard order) hold rows i, i + n, ...
        first = parts[0][0]
        self.dtype = first.dtype
        rows = sum(v.shape[0] for v, _ in parts) if first.shape else None
        self.shape = first.shape if rows is None else (rows,) + first.shape[1:]


class _Part:
    """One server's part of an embedding table, as a checkpoint sees it."""

    nbytes = 0  # not known before the server writes it

    def __init__(self, handle: Any):
        self.handle = handle


class _Table:
    """An :class:`EmbeddingTable`: one piece per server, saved at ``part << 40`` (which names its files);
    the manifest then numbers the parts' rows one after another."""

    slotted = True

    def __init__(self, table: EmbeddingTable):
        self.table = table
        self.dtype = table.dtype
        self.parts = [(_Part(h), i << 40) for i, h in enumerate(table.handles)]


def _renumber(saved: dict[str, dict], tables: list[str]) -> None:
    """Give the pieces of each table's tensors (rows, keys, clocks, slots) consecutive offsets."""
    for name, entry in saved.items():
        if any(name == t or name.startswith(t + "/") for t in tables):
            at = 0
            for piece in entry["pieces"]:  # sorted by the offsets the servers were given
                piece["offset"] = at
                at += piece["rows"]


def _saved_rows(t: _Tensor, part: int, start: int, stop: int, entry: dict) -> np.ndarray | None:
    """Where part ``part``'s rows (``start:stop`` in shard order) lie in the saved tensor's pieces,
    when the layouts differ; ``None`` when they are the same rows ``start:stop``."""
    saved_layout = entry.get("layout", ["div"])
    if t.layout == "div" and saved_layout[0] == "div":
        return None
    rows = (np.arange(start, stop) if t.layout == "div"
            else np.arange(part, t.shape[0], len(t.parts)))  # the part's rows of the whole
    if saved_layout[0] == "mod":
        n = saved_layout[1]
        offsets = np.cumsum([0] + [t.shape[0] // n + (i < t.shape[0] % n) for i in range(n)])
        rows = offsets[rows % n] + rows // n
    if len(rows) and rows[0] == start and np.array_equal(rows, np.arange(start, start + len(rows))):
        return None
    return rows


def _table_problems(name: str, t: _Table, saved: dict, slots_of: dict) -> list[str]:
    missing = [name + s for s in SAVED_TENSORS if name + s not in saved]
    if missing:
        return [f"{name}: the checkpoint lacks {', '.join(missing)} (not saved from an EmbeddingTable)"]
    entry, problems = saved[name], []
    if entry.get("kind") != "hash":
        return [f"{name}: the checkpoint holds a variable there, not an EmbeddingTable"]
    if entry["shape"][1:] != [t.table.dim]:
        problems.append(f"{name}: checkpoint has rows of {entry['shape'][1:]}, embedding table has dim {t.table.dim}")
    if np.dtype(entry["dtype"]) != t.dtype:
        problems.append(f"{name}: checkpoint has dtype {np.dtype(entry['dtype'])}, embedding table has {t.dtype}")
    for per_slot in slots_of.get(name, {}).values():
        for slot_name, slot in per_slot.values():
            if slot["shape"] != entry["shape"]:
                problems.append(f"{slot_name}: checkpoint has shape {tuple(slot['shape'])}, rows have "
                                f"{tuple(entry['shape'])}")
    return problems


def escape(name: str) -> str:
    """One path component, with ``/`` escaped as TensorFlow escapes it (``.`` -> ``..``, ``/`` -> ``.S``)."""
    return name.replace(".", "..").replace("/", ".S")


def _collect(objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Optimizer]]:
    tensors: dict[str, Any] = {}  # _Tensor or _Table
    optimizers: dict[str, Optimizer] = {}

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, EmbeddingTable):
            tensors[path] = _Table(obj)  # type: ignore[assignment]
        elif isinstance(obj, ShardedVariable):
            tensors[path] = _Tensor(list(zip(obj.variables, obj.row_offsets)), slotted=True, layout=obj.layout)
        elif isinstance(obj, Variable):
            tensors[path] = _Tensor([(obj, 0)], slotted=True)
        elif isinstance(obj, Optimizer):
            optimizers[path] = obj
            tensors[f"{path}/iterations"] = _Tensor([(obj.iterations, 0)], slotted=False)
        elif isinstance(obj, Metric):
            for v in obj.variables:
                tensors[f"{path}/{v.name.rsplit('/', 1)[-1]}"] = _Tensor([(v, 0)], slotted=False)
        elif isinstance(obj, dict):
            for key in sorted(obj):
                if not isinstance(key, str) or not key:
                    raise TypeError(f"checkpoint keys must be non-empty str, got {key!r} in {path!r}")
                walk(obj[key], f"{path}/{escape(key)}")
        elif isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                walk(item, f"{path}/{i}")
        else:
            raise TypeError(
                f"checkpoint object {path!r} is a {type(obj).__name__}; expected a Variable, ShardedVariable, "
                "EmbeddingTable, optimizer, metric, or a dict/list/tuple of them"
            )

    for name, obj in objects.items():
        walk(obj, escape(name))
    return tensors, optimizers


class _LoadStatus:
    """What ``restore`` returns; a restore that returns has matched everything."""

    def assert_consumed(self) -> _LoadStatus:
        return self

    assert_existing_objects_matched = expect_partial = assert_consumed


class Checkpoint:
    """Save and restore variables, sharded variables, optimizers and metrics.

    Parameters
    ----------
    **objects
        Named objects, or dicts/lists/tuples of them, nested as you like.
    """

    def __init__(self, **objects: Any):
        _collect(objects)  # refuse unsupported objects now
        self._objects = objects
        self.save_counter = 0

    # -- saving -----------------------------------------------------------------
    def save(self, file_prefix: str, progress: bool | None = None) -> str:
        """Write to ``f"{file_prefix}-{n}"`` with ``n = save_counter + 1``; return that path."""
        path = f"{file_prefix}-{self.save_counter + 1}"
        self.save_counter += 1
        return self.write(path, progress)

    def write(self, path: str, progress: bool | None = None) -> str:
        """Write a checkpoint to ``path`` (an fsspec URL or local directory); return it.

        ``progress`` shows the bytes written as the servers write them;
        ``None`` shows it for models of ``daskps.progress-bytes`` (256 MiB) or more.
        """
        started = time.monotonic()
        fs, root = fsspec.core.url_to_fs(path)
        _clear(fs, root, path)
        tensors, optimizers = _collect(self._objects)
        items = []
        for name, t in tensors.items():
            opts = [(p, o.server_key) for p, o in optimizers.items()] if t.slotted else []
            items += [(v.handle, name, offset, opts) for v, offset in t.parts]
        nbytes = sum(v.nbytes for t in tensors.values() for v, _ in t.parts)
        show = progress if progress is not None else nbytes >= setting("progress_bytes")
        run = lambda: protocol.save(path, items)  # noqa: E731
        records = _with_progress(run, f"saving {path}", nbytes, fs, root) if show else run()
        saved = _tensors(records)
        tables = [name for name, t in tensors.items() if isinstance(t, _Table)]
        _renumber(saved, tables)
        for name in tables:
            saved[name]["kind"] = "hash"  # rows by key: not a dense variable's rows
        for name, t in tensors.items():
            if isinstance(t, _Tensor) and t.layout == "mod":  # the variable's pieces and its slots'
                for tensor, entry in saved.items():
                    if tensor == name or tensor.startswith(f"{name}/{ckpt_io.SLOT}/"):
                        entry["layout"] = ["mod", len(t.parts)]
        manifest = {"format": "daskps-checkpoint/1", "save_counter": self.save_counter, "time": time.time(),
                    "tensors": saved}
        fs.pipe_file(f"{root}/{MANIFEST}.tmp", json.dumps(manifest, indent=1).encode())
        fs.mv(f"{root}/{MANIFEST}.tmp", f"{root}/{MANIFEST}")  # the commit point
        owner = next((v.handle.owner for t in tensors.values() for v, _ in t.parts if v.handle.owner is not None),
                     None)
        _tell_scheduler(getattr(owner, "client", None), path, time.monotonic() - started, nbytes)
        return path

    # -- restoring --------------------------------------------------------------
    def restore(self, save_path: str) -> _LoadStatus:
        """Restore every object (and ``save_counter``) from ``save_path``, or change nothing."""
        manifest = self.restore_on(save_path)
        self.save_counter = int(manifest.get("save_counter", self.save_counter))
        return _LoadStatus()

    def read(self, save_path: str) -> _LoadStatus:
        """Like :meth:`restore`, leaving ``save_counter`` alone."""
        self.restore_on(save_path)
        return _LoadStatus()

    def restore_on(self, path: str, servers: Any = None) -> dict:
        """Restore from ``path``; return its manifest.

        With ``servers``, only the parts held on those servers are restored
        (a server re-created after a loss), and the tensors among them the
        checkpoint lacks are left as they are; the manifest then also has
        ``"restored"``: the tensors restored, by name.
        """
        fs, root = fsspec.core.url_to_fs(path)
        try:
            raw = fs.cat_file(f"{root}/{MANIFEST}")
        except FileNotFoundError:
            raise ValueError(f"no checkpoint at {path!r}: no {MANIFEST} (never written, or its save did not finish)") from None
        manifest = _checked_manifest(raw, f"{path.rstrip('/')}/{MANIFEST}")
        tensors, optimizers = _collect(self._objects)
        saved = manifest["tensors"]
        if servers is not None:
            tensors = {name: t for name, t in tensors.items() if name in saved
                       and any(v.handle.server in servers for v, _ in t.parts)}
        slots_of = _slot_index(saved)
        _check_match(tensors, saved, slots_of, path)
        _check_optimizers_reach(tensors, optimizers, slots_of, path)
        items: list[tuple[Any, Any]] = []
        for name, t in tensors.items():
            if isinstance(t, _Table):  # every part reads the rows whose keys are now its own
                slots = {o.server_key: _saved_slots(slots_of, saved[name], name, p) for p, o in optimizers.items()}
                spec = HashRestoreSpec({s: saved[name + s]["pieces"] for s in SAVED_TENSORS}, slots)
                items += [(part.handle, spec) for part, _ in t.parts
                          if servers is None or part.handle.server in servers]
                continue
            for i, (v, offset) in enumerate(t.parts):
                if servers is not None and v.handle.server not in servers:
                    continue
                stop = offset + (v.shape[0] if v.shape else 1)
                slots = ({o.server_key: _saved_slots(slots_of, saved[name], name, p) for p, o in optimizers.items()}
                         if t.slotted else {})
                at = _saved_rows(t, i, offset, stop, saved[name])
                items.append((v.handle, ckpt_io.RestoreSpec(offset, stop, saved[name]["pieces"], slots, at)))
        protocol.restore(path, items)
        manifest["restored"] = {name: [v.handle.key for v, _ in t.parts] for name, t in tensors.items()}
        return manifest

    def __repr__(self) -> str:
        return f"<daskps.Checkpoint {sorted(self._objects)} save_counter={self.save_counter}>"


def _with_progress(run: Callable[[], Any], label: str, nbytes: int, fs: Any, root: str) -> Any:
    """``run()`` in a thread while a bar shows the bytes that have reached ``root``."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = run()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=target, name="daskps-save", daemon=True)
    thread.start()
    views.watch_bytes(label, nbytes, lambda: fs.du(root), lambda: not thread.is_alive())
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def _clear(fs: Any, root: str, path: str) -> None:
    """Empty ``root`` for a new checkpoint; refuse to touch anything that is not one."""
    if not fs.exists(root):
        fs.makedirs(root, exist_ok=True)
        return
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    if any(not (n.endswith(".npy") or n.startswith(MANIFEST)) for n in names):
        raise ValueError(f"{path!r} exists and is not a daskps checkpoint; refusing to overwrite it")
    fs.rm(root, recursive=True)
    fs.makedirs(root, exist_ok=True)


def _checked_manifest(raw: bytes, where: str) -> dict:
    """The manifest in ``raw``, checked whole: a ``ValueError`` naming ``where`` and the fault otherwise.

    Each piece must be a ``.npy`` file inside the checkpoint directory, and
    each tensor's pieces must cover its rows exactly once. Each piece's dtype
    is added to it, so the server reading it can check the file holds that.
    """
    def bad(what: str) -> ValueError:
        return ValueError(f"malformed checkpoint manifest {where}: {what}; nothing was changed")

    def count(value: Any) -> bool:
        return type(value) is int and value >= 0

    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tensors"), dict):
        raise bad("no 'tensors' mapping")
    if "save_counter" in manifest and not count(manifest["save_counter"]):
        raise bad(f"save_counter {manifest['save_counter']!r} is not a non-negative int")
    for name, entry in manifest["tensors"].items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "pieces"} <= entry.keys():
            raise bad(f"tensor {name!r} lacks dtype, shape or pieces")
        try:
            dtype = np.dtype(entry["dtype"])
        except (TypeError, ValueError):
            raise bad(f"tensor {name!r}: dtype {entry['dtype']!r} is not a numpy dtype") from None
        shape, pieces = entry["shape"], entry["pieces"]
        if dtype.hasobject or not isinstance(shape, list) or not all(count(d) for d in shape):
            raise bad(f"tensor {name!r}: dtype {dtype} / shape {shape!r} cannot be a variable's")
        layout = entry.get("layout", ["div"])
        if not (layout == ["div"] or (isinstance(layout, list) and len(layout) == 2 and layout[0] == "mod"
                                      and count(layout[1]) and layout[1] >= 1)):
            raise bad(f"tensor {name!r}: layout {layout!r} is not ['div'] or ['mod', shards]")
        if entry.get("step") is not None and not count(entry["step"]):
            raise bad(f"tensor {name!r}: step {entry['step']!r} is not a non-negative int")
        steps = entry.get("steps", {})
        if not isinstance(steps, dict) or not all(isinstance(k, str) and count(n) for k, n in steps.items()):
            raise bad(f"tensor {name!r}: steps {steps!r} is not a mapping of optimizer paths to non-negative ints")
        if not isinstance(pieces, list) or not pieces:
            raise bad(f"tensor {name!r} has no pieces")
        covered = 0
        for piece in sorted(pieces, key=_piece_order):
            if not isinstance(piece, dict) or not all(k in piece for k in ("file", "offset", "rows", "shape")):
                raise bad(f"tensor {name!r}: a piece lacks file, offset, rows or shape")
            try:
                ckpt_io.piece_path("", piece["file"])
            except ValueError as exc:
                raise bad(f"tensor {name!r}: {exc}") from None
            p_shape = piece["shape"]
            if not isinstance(p_shape, list) or not all(count(d) for d in p_shape):
                raise bad(f"tensor {name!r}: piece {piece['file']!r} has shape {p_shape!r}")
            if not shape:
                if p_shape or len(pieces) != 1:
                    raise bad(f"tensor {name!r} is a scalar but its pieces are {pieces!r}")
                covered = 1
            elif (piece["offset"] != covered or not count(piece["rows"]) or p_shape[1:] != shape[1:]
                  or p_shape[:1] != [piece["rows"]]):
                raise bad(f"tensor {name!r}: piece {piece['file']!r} (offset {piece['offset']!r}, rows "
                          f"{piece['rows']!r}, shape {p_shape!r}) does not follow on at row {covered} of {shape}")
            else:
                covered += piece["rows"]
            piece["dtype"] = dtype.str
        if covered != (shape[0] if shape else 1):
            raise bad(f"tensor {name!r}: its pieces cover {covered} of {shape[0] if shape else 1} rows")
    return manifest


def _tensors(records: list[ckpt_io.Written]) -> dict[str, dict]:
    """The manifest's ``tensors`` (its on-disk JSON form) from what the servers wrote."""
    out: dict[str, dict] = {}
    for rec in records:
        t = out.setdefault(rec.tensor, {"dtype": rec.dtype, "pieces": [], "step": None})
        t["pieces"].append(rec.piece)
        if rec.step is not None:
            t["step"] = max(t["step"] or 0, rec.step)
        for opt_path, n in (rec.steps or {}).items():
            steps = t.setdefault("steps", {})
            steps[opt_path] = max(steps.get(opt_path, 0), n)
    for t in out.values():
        t["pieces"].sort(key=lambda p: p["offset"])
        first = t["pieces"][0]["shape"]
        t["shape"] = first if not first else [sum(p["rows"] for p in t["pieces"])] + first[1:]
    return out


def _slot_index(saved: dict) -> dict[str, dict[str, dict[str, tuple[str, dict]]]]:
    """Slot tensors by variable, optimizer and slot: ``{tensor: {opt_path: {slot: (name, entry)}}}``."""
    index: dict[str, dict[str, dict[str, tuple[str, dict]]]] = {}
    marker = f"/{ckpt_io.SLOT}/"
    for name, entry in saved.items():
        if marker in name:
            tensor, rest = name.split(marker, 1)
            opt_path, slot = rest.rsplit("/", 1)
            index.setdefault(tensor, {}).setdefault(opt_path, {})[slot] = (name, entry)
    return index


def _check_match(tensors: dict[str, Any], saved: dict, slots_of: dict, path: str) -> None:
    problems = []
    for name, t in tensors.items():
        entry = saved.get(name)
        if isinstance(t, _Table):
            problems += _table_problems(name, t, saved, slots_of)
        elif entry is not None and entry.get("kind") == "hash":
            problems.append(f"{name}: the checkpoint holds an EmbeddingTable's rows (by key) there, not a variable")
        elif entry is None:
            problems.append(f"{name}: not in the checkpoint")
        elif tuple(entry["shape"]) != t.shape:
            problems.append(f"{name}: checkpoint has shape {tuple(entry['shape'])}, object has {t.shape}")
        elif np.dtype(entry["dtype"]) != t.dtype:  # as TensorFlow: no silent cast, not even to float64
            problems.append(f"{name}: checkpoint has dtype {np.dtype(entry['dtype'])}, object has {t.dtype}")
        for per_slot in slots_of.get(name, {}).values() if isinstance(t, _Tensor) and t.slotted else ():
            for slot_name, slot in per_slot.values():
                if tuple(slot["shape"]) != t.shape:
                    problems.append(f"{slot_name}: checkpoint has shape {tuple(slot['shape'])}, variable has {t.shape}")
    if problems:
        # A table's keys and clocks belong to it: they are asked for with it.
        asked = set(tensors) | {name + s for name, t in tensors.items() if isinstance(t, _Table) for s in SAVED_TENSORS}
        unused = sorted(n for n in saved if n not in asked and f"/{ckpt_io.SLOT}/" not in n)
        hint = f"\n  (in the checkpoint but not asked for: {', '.join(unused)})" if unused else ""
        raise ValueError(f"cannot restore from {path!r}; nothing was changed:\n  " + "\n  ".join(problems) + hint)


def _check_optimizers_reach(tensors: dict[str, _Tensor], optimizers: dict[str, Optimizer], slots_of: dict,
                            path: str) -> None:
    """Refuse, before any server reads, slots for a variable on a server its optimizer is not on.

    That is an optimizer made outside ``strategy.scope()`` restored with
    variables made inside it: it keeps its state in this process only.
    """
    for name, t in tensors.items():
        if not t.slotted:
            continue
        for opt_path, opt in optimizers.items():
            if opt_path not in slots_of.get(name, {}):
                continue
            reach = {h.server for h in opt.handles}
            for v, _ in t.parts:
                if v.handle.server not in reach:
                    raise ValueError(
                        f"cannot restore from {path!r}; nothing was changed: optimizer {opt_path!r} "
                        f"({opt.name!r}) has slots for {name!r}, which lives on {v.handle.server.label}, but the "
                        "optimizer was created outside strategy.scope() and keeps its state in this process "
                        "only; create it inside the scope"
                    )


def _saved_slots(slots_of: dict, entry: dict, tensor: str, opt_path: str) -> ckpt_io.SavedSlots | None:
    """What ``opt_path`` saved for ``tensor``: its update count and slot pieces (``None``: nothing)."""
    found = {slot: entry for slot, (_, entry) in slots_of.get(tensor, {}).get(opt_path, {}).items()}
    if not found:
        step = entry.get("steps", {}).get(opt_path)  # a state without slot arrays: its count alone
        return None if step is None else ckpt_io.SavedSlots(step, {})
    return ckpt_io.SavedSlots(max(t["step"] or 0 for t in found.values()),
                              {s: t["pieces"] for s, t in found.items()})


def _written_at(fs: Any, root: str) -> float:
    """When the checkpoint at ``root`` was committed (its manifest's time; 0 if it has none)."""
    try:
        return float(json.loads(fs.cat_file(f"{root}/{MANIFEST}")).get("time", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def _step_of(counter: Any) -> int:
    value = np.asarray(counter.numpy() if hasattr(counter, "numpy") else counter)
    if value.shape != () or value.dtype.kind not in "iu":
        raise ValueError(f"step_counter must be a scalar int variable (such as optimizer.iterations), "
                         f"got {value.dtype} {value.shape}")
    return int(value)


def committed_numbers(fs: Any, root: str, name: str = "ckpt", marker: str = MANIFEST) -> list[int]:
    """Numbers ``n`` of the checkpoints ``root/{name}-{n}`` holding ``marker`` (committed: a manifest), ascending."""
    pattern = re.compile(rf"{re.escape(name)}-(\d+)/{re.escape(marker)}$")
    found = fs.glob(f"{root}/{name}-*/{marker}")
    return sorted(int(m.group(1)) for p in found if (m := pattern.search(p)))


def _positive_int_or_none(value: Any, arg: str) -> int | None:
    """``value`` if it is None or an int >= 1: ``TypeError`` for another type, ``ValueError`` below 1."""
    if value is None:
        return None
    if not is_int(value):
        raise TypeError(f"{arg} must be a positive int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{arg} must be a positive int or None, got {value!r}")
    return int(value)


class CheckpointManager:
    """Numbered checkpoints in ``directory``, keeping the newest ``max_to_keep``.

    Parameters
    ----------
    checkpoint : Checkpoint
    directory : str or path-like
        A local directory or any fsspec URL.
    max_to_keep : int or None
        At least 1 (as in TensorFlow); ``None`` keeps every checkpoint.
    keep_checkpoint_every_n_hours : float or None
        A checkpoint leaving the newest ``max_to_keep`` is kept for good
        (marked ``PRESERVED``, no longer managed) when at least this many
        hours passed since the last one kept that way, as in TensorFlow.
    checkpoint_name : str
        Checkpoints are ``directory/{checkpoint_name}-{n}``.
    step_counter : Variable or None
        A scalar int variable (``optimizer.iterations``, say): with
        ``checkpoint_interval``, the step count :meth:`save` looks at.
    checkpoint_interval : int or None
        ``save()`` writes only once ``step_counter`` moved on by at least this
        many steps since the last save, so a loop may call it after every
        ``join()``. Needs ``step_counter``.
    init_fn : callable, optional
        Called by :meth:`restore_or_initialize` when there is nothing to restore.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int | None = 5,
                 keep_checkpoint_every_n_hours: float | None = None, checkpoint_name: str = "ckpt",
                 step_counter: Any = None, checkpoint_interval: int | None = None,
                 init_fn: Callable[[], Any] | None = None):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"checkpoint must be a daskps.Checkpoint, got {type(checkpoint).__name__}")
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a str (a path or an fsspec URL), got {type(directory).__name__}")
        directory = os.fspath(directory)
        max_to_keep = _positive_int_or_none(max_to_keep, "max_to_keep")  # TensorFlow refuses 0 and below too
        if not isinstance(checkpoint_name, str):
            raise TypeError(f"checkpoint_name must be a str, got {type(checkpoint_name).__name__}")
        if not re.fullmatch(r"[^/\\\x00]+", checkpoint_name) or checkpoint_name in (".", ".."):
            raise ValueError(f"checkpoint_name must be a file name inside the directory (no '/', not '..'), "
                             f"got {checkpoint_name!r}")
        hours = keep_checkpoint_every_n_hours
        if hours is not None:
            if isinstance(hours, (bool, np.bool_)) or not isinstance(hours, numbers.Real):
                raise TypeError(f"keep_checkpoint_every_n_hours must be a positive number or None, "
                                f"got {type(hours).__name__}")
            if not float(hours) > 0:  # NaN too
                raise ValueError(f"keep_checkpoint_every_n_hours must be a positive number or None, got {hours!r}")
        checkpoint_interval = _positive_int_or_none(checkpoint_interval, "checkpoint_interval")
        if checkpoint_interval is not None:
            if step_counter is None:
                raise ValueError("checkpoint_interval needs step_counter (a scalar int variable, such as "
                                 "optimizer.iterations) to count steps by")
            _step_of(step_counter)  # refuses what is not a scalar int
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be callable or None, got {type(init_fn).__name__}")
        self._checkpoint = checkpoint
        self._fs, self._root = fsspec.core.url_to_fs(directory)
        self._url = directory.rstrip("/")
        self._name = checkpoint_name
        self._max_to_keep = max_to_keep
        self._keep_hours: float | None = None if hours is None else float(hours)
        self._step_counter = step_counter
        self._interval = checkpoint_interval
        self._last_step: int | None = None
        self._init_fn = init_fn
        # checkpoint path -> the functions its coordinator had finished when it was saved (see recovery)
        self._done_at: dict[str, Counter[int]] = {}
        # Counts the functions finished so far (handed down by ClusterCoordinator(checkpoint_manager=...)),
        # held weakly: a manager must not keep its coordinator alive.
        self._finished: Callable[[], Callable[[], Counter[int]] | None] = lambda: None
        preserved = [_written_at(self._fs, self._checkpoint_root(n)) for n in self._preserved()]
        self._last_preserved = max(preserved) if preserved else time.time() - 1.0

    @property
    def directory(self) -> str:
        return self._url

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint this manager saves and restores."""
        return self._checkpoint

    def _checkpoint_root(self, n: int) -> str:
        return f"{self._root}/{self._name}-{n}"

    def _preserved(self) -> list[int]:
        return committed_numbers(self._fs, self._root, self._name, marker=PRESERVED)

    def _numbers(self) -> list[int]:
        """The managed checkpoints: committed ones, less those preserved for good."""
        kept = set(self._preserved()) if self._keep_hours is not None else set()
        return [n for n in committed_numbers(self._fs, self._root, self._name) if n not in kept]

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the committed checkpoints, oldest first."""
        return [f"{self._url}/{self._name}-{n}" for n in self._numbers()]

    @property
    def latest_checkpoint(self) -> str | None:
        paths = self.checkpoints
        return paths[-1] if paths else None

    def save(self, checkpoint_number: int | None = None, check_interval: bool = True) -> str | None:
        """Write the next checkpoint, drop the oldest beyond ``max_to_keep``; return its path.

        With ``checkpoint_interval``: returns ``None`` without writing when
        ``step_counter`` has not moved since the last save, or (with
        ``check_interval``) moved by less than the interval.
        """
        if checkpoint_number is not None and (isinstance(checkpoint_number, bool) or not isinstance(
                checkpoint_number, (int, np.integer)) or checkpoint_number < 0):
            raise ValueError(f"checkpoint_number must be a non-negative int or None, got {checkpoint_number!r}")
        if self._interval is not None:
            step = _step_of(self._step_counter)
            if self._last_step is not None and (
                    step == self._last_step or (check_interval and step < self._last_step + self._interval)):
                return None
            self._last_step = step
        numbers = self._numbers()
        if checkpoint_number is None:
            checkpoint_number = max([self._checkpoint.save_counter, *numbers]) + 1
        self._checkpoint.save_counter = int(checkpoint_number)
        count = self._finished()
        done = None if count is None else count()
        path = self._checkpoint.write(f"{self._url}/{self._name}-{checkpoint_number}")
        if done is not None:
            self._done_at[path] = done
        if self._max_to_keep is not None:
            for n in self._numbers()[: -self._max_to_keep]:
                written = _written_at(self._fs, self._checkpoint_root(n))
                if self._keep_hours is not None and written - self._last_preserved >= 3600 * self._keep_hours:
                    self._fs.pipe_file(f"{self._checkpoint_root(n)}/{PRESERVED}", b"")  # kept for good
                    self._last_preserved = written
                else:
                    self._fs.rm(self._checkpoint_root(n), recursive=True)
        if len(self._done_at) > 1:
            kept = set(self.checkpoints)
            self._done_at = {p: n for p, n in self._done_at.items() if p in kept}
        return path

    def count_finished_with(self, count: Callable[[], Counter[int]]) -> None:
        """Note at each save what ``count()`` says has finished (a coordinator's functions, by the
        generation of servers their trainer knew); a recovery reads it back with :meth:`finished_at`.

        ``count`` is held weakly if it is a bound method.
        """
        if inspect.ismethod(count):
            ref = weakref.WeakMethod(count)
            self._finished = ref
        else:
            self._finished = lambda: count

    def finished_at(self, path: str) -> Counter[int] | None:
        """What the counter handed to :meth:`count_finished_with` said when ``path`` was saved."""
        return self._done_at.get(path)

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its path; else call ``init_fn`` and return None."""
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def __repr__(self) -> str:
        return f"<daskps.CheckpointManager {self._url!r} checkpoints={len(self._numbers())}>"


def _piece_order(piece: Any) -> tuple[int, int]:
    """Pieces by offset, an empty one before the piece that starts where it is (malformed ones first:
    the check names them)."""
    if not isinstance(piece, dict):
        return (-1, 0)
    offset, rows = piece.get("offset"), piece.get("rows")
    return (offset if type(offset) is int else -1, rows if type(rows) is int else 0)


def _tell_scheduler(client: Any, path: str, seconds: float, nbytes: int) -> None:
    """Tell the scheduler that a checkpoint was written (its /metrics counts them): the scheduler of
    ``client`` (the strategy's that holds the variables), else of this process's default client."""
    if client is None:
        try:
            client = distributed.default_client()
        except ValueError:  # no client in this process: nobody to tell
            return
    msg = {"path": path, "seconds": seconds, "bytes": int(nbytes)}
    with contextlib.suppress(Exception):  # sent on the client's loop, not waited for: a count must not slow a save
        client.loop.add_callback(_send_event, client, CHECKPOINT_TOPIC, msg)


async def _send_event(client: Any, topic: str, msg: dict) -> None:
    with contextlib.suppress(Exception):
        await client.scheduler.log_event(topic=topic, msg=msg)
