"""Reading and writing checkpoint pieces, wherever the arrays live.

A checkpoint holds *tensors* (a variable, a sharded variable taken whole, an
optimizer slot, a metric's state), each stored as one or more *pieces*: the
rows ``[offset, offset + rows)`` of the tensor in one ``.npy`` file. Pieces
are written by the process that holds the rows (a parameter server, or the
coordinator for local variables) straight to the fsspec path, and read back
the same way, taking only the rows a shard needs (``.npy`` rows are
contiguous, so a read is one ranged request).

>>> import fsspec
>>> fs = fsspec.filesystem("memory")
>>> rec = write_piece(fs, "/doc", "w", 2, np.arange(6.0).reshape(3, 2))
>>> rec.piece["file"], rec.piece["offset"], rec.piece["rows"]
('w@2.npy', 2, 3)
>>> read_rows(fs, "/doc", 3, 5, [rec.piece], (2,), np.dtype("float64"))
array([[2., 3.],
       [4., 5.]])
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple
from urllib.parse import quote

import numpy as np

SLOT = ".OPTIMIZER_SLOT"
_PIECE_NAME = re.compile(r"[^/\\\x00]+\.npy")  # a file right inside the checkpoint directory


def piece_path(root: str, name: Any) -> str:
    """The path of piece file ``name`` in ``root``; refuses names that would lead elsewhere."""
    if not isinstance(name, str) or not _PIECE_NAME.fullmatch(name):
        raise ValueError(f"checkpoint piece file {name!r} is not a .npy file inside the checkpoint directory")
    return f"{root}/{name}"


def slot_tensor(tensor: str, optimizer_path: str, slot: str) -> str:
    """The name of ``optimizer_path``'s slot ``slot`` for ``tensor`` (TensorFlow's scheme)."""
    return f"{tensor}/{SLOT}/{optimizer_path}/{slot}"


class Written(NamedTuple):
    """What a server wrote for one piece: its tensor, dtype, the piece as the manifest lists it
    (``file``, ``offset``, ``rows``, ``shape``), and the optimizer step counts it holds: ``step``
    for a slot, ``steps`` (by optimizer path) for a variable trained by optimizers with state."""

    tensor: str
    dtype: str
    piece: dict[str, Any]
    step: int | None = None
    steps: dict[str, int] | None = None


class SavedSlots(NamedTuple):
    """What one optimizer saved for a tensor: its update count and each slot's pieces."""

    step: int
    pieces: dict[str, list[dict[str, Any]]]


class RestoreSpec(NamedTuple):
    """One restore target: rows ``[start, stop)`` of a saved tensor (its manifest ``pieces``), and
    for each optimizer key what it saved (``None``: nothing, its slots start afresh). With ``rows``,
    those rows of the saved tensor instead, in that order (a variable saved in another row layout)."""

    start: int
    stop: int
    pieces: list[dict[str, Any]]
    slots: dict[str, SavedSlots | None]
    rows: np.ndarray | None = None


def write_piece(fs: Any, root: str, tensor: str, offset: int, array: np.ndarray) -> Written:
    """Write ``array`` as rows from ``offset`` of ``tensor``; return its record."""
    # An empty shard starts where the next one does: its file gets a name of its own.
    name = f"{quote(tensor, safe='')}@{offset}{'-empty' if array.ndim and not array.shape[0] else ''}.npy"
    arr = array if array.flags.c_contiguous else np.array(array, order="C")  # ascontiguousarray turns 0-d into 1-d
    with fs.open(f"{root}/{name}", "wb") as f:
        np.lib.format.write_array_header_2_0(f, np.lib.format.header_data_from_array_1_0(arr))
        f.write(arr.reshape(-1).data.cast("B"))  # one write, no copy
    piece = {"file": name, "offset": int(offset), "rows": int(arr.shape[0]) if arr.ndim else 1,
             "shape": list(arr.shape)}
    return Written(tensor, arr.dtype.str, piece)


def write_with_slots(
    fs: Any, root: str, tensor: str, offset: int, array: np.ndarray,
    slot_states: list[tuple[str, int, dict[str, np.ndarray]]],
) -> list[Written]:
    """Write a variable piece and, for each ``(optimizer_path, count, slots)``, its slot pieces."""
    records = [write_piece(fs, root, tensor, offset, array)]
    if slot_states:  # the update counts, also of states with no slot arrays (SGD without momentum)
        records[0] = records[0]._replace(steps={opt_path: int(count) for opt_path, count, _ in slot_states})
    for opt_path, count, slots in slot_states:
        for slot, value in sorted(slots.items()):
            rec = write_piece(fs, root, slot_tensor(tensor, opt_path, slot), offset, value)
            records.append(rec._replace(step=int(count)))
    return records


def _read_npy_rows(fs: Any, path: str, start: int, stop: int, out: np.ndarray | None = None,
                   piece: dict | None = None) -> np.ndarray:
    """Rows ``[start, stop)`` of the ``.npy`` file at ``path`` (into ``out`` if it fits).

    ``piece``: its manifest record; the file must hold the shape (and dtype) it says.
    """
    try:
        return _read_npy_file(fs, path, start, stop, out, piece)
    except OSError as exc:  # raised on a server, an OSError would reach the caller as a lost connection
        raise ValueError(f"checkpoint piece {path} cannot be read: {type(exc).__name__}: {exc}") from exc


def _read_npy_file(fs: Any, path: str, start: int, stop: int, out: np.ndarray | None,
                   piece: dict | None) -> np.ndarray:
    with fs.open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
        except ValueError as exc:  # numpy's message does not say which file
            raise ValueError(f"{path} is not a readable .npy file: {exc}") from exc
        if fortran:
            raise ValueError(f"{path} is stored in Fortran order; daskps writes C order only")
        if piece is not None:
            want_dtype = np.dtype(piece["dtype"]) if "dtype" in piece else dtype
            if tuple(shape) != tuple(piece["shape"]) or dtype != want_dtype:
                raise ValueError(f"{path} holds {dtype} {tuple(shape)}; the manifest says "
                                 f"{want_dtype} {tuple(piece['shape'])}")
        header = f.tell()
        if not shape:
            return np.frombuffer(_read_exactly(f, dtype.itemsize, path), dtype).reshape(())
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        f.seek(header + start * row_bytes)
        if out is None or out.dtype != dtype or not out.flags.c_contiguous:
            data = _read_exactly(f, (stop - start) * row_bytes, path)
            return np.frombuffer(data, dtype).reshape((stop - start,) + tuple(shape[1:]))
        view = out.reshape(-1).data.cast("B")
        done = 0
        while done < len(view):  # straight into the destination
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{path} is shorter than its header says")
            done += n
    return out


def _read_exactly(f: Any, size: int, path: str) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise ValueError(f"{path} is shorter than its header says")
    return data


def read_rows(
    fs: Any, root: str, start: int, stop: int, pieces: list[dict], row_shape: tuple, dtype: np.dtype
) -> np.ndarray:
    """Rows ``[start, stop)`` of a tensor stored as ``pieces`` (any split)."""
    if not row_shape and len(pieces) == 1 and pieces[0]["shape"] == []:
        return _read_npy_rows(fs, piece_path(root, pieces[0]["file"]), 0, 1, piece=pieces[0]).astype(dtype)
    out = np.empty((stop - start,) + tuple(row_shape), dtype)
    filled = 0
    for p in sorted(pieces, key=lambda p: p["offset"]):
        lo, hi = max(start, p["offset"]), min(stop, p["offset"] + p["rows"])
        if hi > lo:
            dest = out[lo - start : hi - start]
            got = _read_npy_rows(fs, piece_path(root, p["file"]), lo - p["offset"], hi - p["offset"], dest, piece=p)
            if got is not dest:
                dest[...] = got
            filled += hi - lo
    if filled != stop - start:
        files = [p["file"] for p in pieces]
        raise ValueError(f"checkpoint pieces {files} cover {filled} of rows {start}:{stop}, not all")
    return out


def read_rows_at(fs: Any, root: str, rows: np.ndarray, pieces: list[dict], row_shape: tuple,
                 dtype: np.dtype) -> np.ndarray:
    """Rows ``rows`` (any order) of a tensor stored as ``pieces``: from each piece, the span it must
    read to cover the rows it holds."""
    out = np.empty((len(rows),) + tuple(row_shape), dtype)
    covered = np.zeros(len(rows), bool)
    for p in pieces:
        mine = (rows >= p["offset"]) & (rows < p["offset"] + p["rows"])
        if mine.any():
            local = rows[mine] - p["offset"]
            lo, hi = int(local.min()), int(local.max()) + 1
            block = _read_npy_rows(fs, piece_path(root, p["file"]), lo, hi, piece=p)
            out[mine] = block[local - lo]
            covered |= mine
    if not covered.all():
        raise ValueError(f"checkpoint pieces do not hold rows {rows[~covered][:5].tolist()}")
    return out


def load_target(fs: Any, root: str, spec: RestoreSpec, shape: tuple,
                dtype: np.dtype) -> tuple[np.ndarray, dict[str, tuple[int, dict[str, np.ndarray]] | None]]:
    """Read one restore target: its rows, and the slots of each optimizer named in ``spec``.

    Returns the value (of ``shape``) and ``{opt_key: (count, {slot: array}) or None}``.
    """
    def read(pieces: list[dict]) -> np.ndarray:
        if spec.rows is not None:
            return read_rows_at(fs, root, np.asarray(spec.rows), pieces, shape[1:], dtype).reshape(shape)
        return read_rows(fs, root, spec.start, spec.stop, pieces, shape[1:], dtype).reshape(shape)

    value = read(spec.pieces)
    slots: dict[str, tuple[int, dict[str, np.ndarray]] | None] = {}
    for opt_key, saved in spec.slots.items():
        if saved is None:
            slots[opt_key] = None
            continue
        arrays = {slot: read(pieces) for slot, pieces in saved.pieces.items()}
        slots[opt_key] = (int(saved.step), arrays)
    return value, slots
