"""A checkpoint's names and manifest: what is saved under which name, and whether a checkpoint fits.

``Checkpoint(**objects)`` names every tensor by its path among the objects
(:func:`collect`: ``model/w``, ``opt/iterations``, ``w/.OPTIMIZER_SLOT/opt/m``;
dict keys escaped as TensorFlow does, :func:`escape`). The manifest
(``manifest.json``, the commit point of a save) lists each tensor's shape,
dtype, layout and pieces; :func:`checked_manifest` refuses one that does not
hold together, and :func:`check_match` / :func:`check_optimizers_reach` a
checkpoint that does not fit the objects it is restored into, naming every
mismatch before any server changes. Writing and reading are
:mod:`daskps.training.checkpoint`; which checkpoints are kept,
:mod:`daskps.training.checkpoint_manager`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from daskps._core import ckpt_io
from daskps.server.ops import SAVED_TENSORS
from daskps.training.metrics import Metric
from daskps.training.optimizers import Optimizer
from daskps.variables.hashed import EmbeddingTable
from daskps.variables.variable import ShardedVariable, Variable

MANIFEST = "manifest.json"
PRESERVED = "PRESERVED"  # in a checkpoint kept for good by keep_checkpoint_every_n_hours


class Tensor:
    def __init__(self, parts: list[tuple[Variable, int]], slotted: bool, layout: str = "div"):
        self.parts = parts
        self.slotted = slotted
        self.layout = layout  # "mod": the pieces (at offsets in shard order) hold rows i, i + n, ...
        first = parts[0][0]
        self.dtype = first.dtype
        rows = sum(v.shape[0] for v, _ in parts) if first.shape else None
        self.shape = first.shape if rows is None else (rows,) + first.shape[1:]


class TablePart:
    """One server's part of an embedding table, as a checkpoint sees it."""

    nbytes = 0  # not known before the server writes it

    def __init__(self, handle: Any):
        self.handle = handle


class TableTensor:
    """An :class:`EmbeddingTable`: one piece per server, saved at ``part << 40`` (which names its files);
    the manifest then numbers the parts' rows one after another."""

    slotted = True

    def __init__(self, table: EmbeddingTable):
        self.table = table
        self.dtype = table.dtype
        self.parts = [(TablePart(h), i << 40) for i, h in enumerate(table.handles)]


def escape(name: str) -> str:
    """One path component, with ``/`` escaped as TensorFlow escapes it (``.`` -> ``..``, ``/`` -> ``.S``)."""
    return name.replace(".", "..").replace("/", ".S")


def collect(objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Optimizer]]:
    tensors: dict[str, Any] = {}  # Tensor or TableTensor
    optimizers: dict[str, Optimizer] = {}

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, EmbeddingTable):
            tensors[path] = TableTensor(obj)  # type: ignore[assignment]
        elif isinstance(obj, ShardedVariable):
            tensors[path] = Tensor(list(zip(obj.variables, obj.row_offsets)), slotted=True, layout=obj.layout)
        elif isinstance(obj, Variable):
            tensors[path] = Tensor([(obj, 0)], slotted=True)
        elif isinstance(obj, Optimizer):
            optimizers[path] = obj
            tensors[f"{path}/iterations"] = Tensor([(obj.iterations, 0)], slotted=False)
        elif isinstance(obj, Metric):
            for v in obj.variables:
                tensors[f"{path}/{v.name.rsplit('/', 1)[-1]}"] = Tensor([(v, 0)], slotted=False)
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


def renumber(saved: dict[str, dict], tables: list[str]) -> None:
    """Give the pieces of each table's tensors (rows, keys, clocks, slots) consecutive offsets."""
    for name, entry in saved.items():
        if any(name == t or name.startswith(t + "/") for t in tables):
            at = 0
            for piece in entry["pieces"]:  # sorted by the offsets the servers were given
                piece["offset"] = at
                at += piece["rows"]


def checked_manifest(raw: bytes, where: str) -> dict:
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


def _piece_order(piece: Any) -> tuple[int, int]:
    """Pieces by offset, an empty one before the piece that starts where it is (malformed ones first:
    the check names them)."""
    if not isinstance(piece, dict):
        return (-1, 0)
    offset, rows = piece.get("offset"), piece.get("rows")
    return (offset if type(offset) is int else -1, rows if type(rows) is int else 0)


def tensors_of(records: list[ckpt_io.Written]) -> dict[str, dict]:
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


def slot_index(saved: dict) -> dict[str, dict[str, dict[str, tuple[str, dict]]]]:
    """Slot tensors by variable, optimizer and slot: ``{tensor: {opt_path: {slot: (name, entry)}}}``."""
    index: dict[str, dict[str, dict[str, tuple[str, dict]]]] = {}
    marker = f"/{ckpt_io.SLOT}/"
    for name, entry in saved.items():
        if marker in name:
            tensor, rest = name.split(marker, 1)
            opt_path, slot = rest.rsplit("/", 1)
            index.setdefault(tensor, {}).setdefault(opt_path, {})[slot] = (name, entry)
    return index


def saved_rows(t: Tensor, part: int, start: int, stop: int, entry: dict) -> np.ndarray | None:
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


def _table_problems(name: str, t: TableTensor, saved: dict, slots_of: dict) -> list[str]:
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


def check_match(tensors: dict[str, Any], saved: dict, slots_of: dict, path: str) -> None:
    problems = []
    for name, t in tensors.items():
        entry = saved.get(name)
        if isinstance(t, TableTensor):
            problems += _table_problems(name, t, saved, slots_of)
        elif entry is not None and entry.get("kind") == "hash":
            problems.append(f"{name}: the checkpoint holds an EmbeddingTable's rows (by key) there, not a variable")
        elif entry is None:
            problems.append(f"{name}: not in the checkpoint")
        elif tuple(entry["shape"]) != t.shape:
            problems.append(f"{name}: checkpoint has shape {tuple(entry['shape'])}, object has {t.shape}")
        elif np.dtype(entry["dtype"]) != t.dtype:  # as TensorFlow: no silent cast, not even to float64
            problems.append(f"{name}: checkpoint has dtype {np.dtype(entry['dtype'])}, object has {t.dtype}")
        for per_slot in slots_of.get(name, {}).values() if isinstance(t, Tensor) and t.slotted else ():
            for slot_name, slot in per_slot.values():
                if tuple(slot["shape"]) != t.shape:
                    problems.append(f"{slot_name}: checkpoint has shape {tuple(slot['shape'])}, variable has {t.shape}")
    if problems:
        # A table's keys and clocks belong to it: they are asked for with it.
        asked = set(tensors) | {name + s for name, t in tensors.items() if isinstance(t, TableTensor) for s in SAVED_TENSORS}
        unused = sorted(n for n in saved if n not in asked and f"/{ckpt_io.SLOT}/" not in n)
        hint = f"\n  (in the checkpoint but not asked for: {', '.join(unused)})" if unused else ""
        raise ValueError(f"cannot restore from {path!r}; nothing was changed:\n  " + "\n  ".join(problems) + hint)


def check_optimizers_reach(tensors: dict[str, Tensor], optimizers: dict[str, Optimizer], slots_of: dict,
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


def saved_slots(slots_of: dict, entry: dict, tensor: str, opt_path: str) -> ckpt_io.SavedSlots | None:
    """What ``opt_path`` saved for ``tensor``: its update count and slot pieces (``None``: nothing)."""
    found = {slot: entry for slot, (_, entry) in slots_of.get(tensor, {}).get(opt_path, {}).items()}
    if not found:
        step = entry.get("steps", {}).get(opt_path)  # a state without slot arrays: its count alone
        return None if step is None else ckpt_io.SavedSlots(step, {})
    return ckpt_io.SavedSlots(max(t["step"] or 0 for t in found.values()),
                              {s: t["pieces"] for s, t in found.items()})


def committed_numbers(fs: Any, root: str, name: str = "ckpt", marker: str = MANIFEST) -> list[int]:
    """Numbers ``n`` of the checkpoints ``root/{name}-{n}`` holding ``marker`` (committed: a manifest), ascending."""
    pattern = re.compile(rf"{re.escape(name)}-(\d+)/{re.escape(marker)}$")
    found = fs.glob(f"{root}/{name}-*/{marker}")
    return sorted(int(m.group(1)) for p in found if (m := pattern.search(p)))
