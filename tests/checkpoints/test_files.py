"""Checkpoint pieces (``daskps._core.ckpt_io``) on fsspec's memory filesystem, in this process.

Files written are read back with numpy's own ``np.load``; files read are
written with ``np.save`` / ``np.lib.format.write_array`` (format 1.0 and
2.0), so neither side is checked against itself.
"""

from __future__ import annotations

import io
import itertools

import fsspec
import numpy as np
import pytest

from daskps._core import ckpt_io as C

_root_ids = itertools.count()


@pytest.fixture
def fs_root():
    fs = fsspec.filesystem("memory")
    root = f"/units_ckpt_{next(_root_ids)}"
    fs.mkdir(root)
    yield fs, root
    fs.rm(root, recursive=True)


def _load(fs, path):
    with fs.open(path, "rb") as f:
        return np.load(io.BytesIO(f.read()))


def _save(fs, path, array, version=(1, 0)):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(array), version=version)
    with fs.open(path, "wb") as f:
        f.write(buf.getvalue())


def _piece(file, offset, array):
    a = np.asarray(array)
    return {"file": file, "offset": offset, "rows": a.shape[0] if a.ndim else 1, "shape": list(a.shape)}


@pytest.mark.parametrize(
    "name", ["../w.npy", "a/b.npy", "a\\b.npy", "w.txt", "w\x00.npy", ".npy", 3, None],
)
def test_piece_path_refuses_a_file_outside_the_directory(name):
    with pytest.raises(ValueError) as info:
        C.piece_path("/r", name)
    assert str(info.value) == f"checkpoint piece file {name!r} is not a .npy file inside the checkpoint directory"


def test_piece_path_joins_a_plain_name():
    assert C.piece_path("/r/ckpt-3", "w%2Fx@0.npy") == "/r/ckpt-3/w%2Fx@0.npy"


def test_slot_tensor_is_tensorflows_name():
    assert C.slot_tensor("dense/kernel", "optimizer", "m") == "dense/kernel/.OPTIMIZER_SLOT/optimizer/m"


def test_write_piece_names_the_file_by_tensor_and_offset_and_numpy_reads_it(fs_root):
    fs, root = fs_root
    a = np.arange(12, dtype=np.int16).reshape(4, 3)
    rec = C.write_piece(fs, root, "emb/part 0:x", 8, a)
    assert rec == C.Written("emb/part 0:x", "<i2", {"file": "emb%2Fpart%200%3Ax@8.npy", "offset": 8, "rows": 4,
                                                    "shape": [4, 3]})
    got = _load(fs, f"{root}/emb%2Fpart%200%3Ax@8.npy")
    assert got.dtype == np.int16 and got.tolist() == a.tolist()


def test_write_piece_of_a_transposed_array_writes_its_values_in_c_order(fs_root):
    fs, root = fs_root
    a = np.arange(6.0).reshape(2, 3).T
    rec = C.write_piece(fs, root, "t", 0, a)
    assert rec.piece["shape"] == [3, 2] and rec.piece["rows"] == 3
    np.testing.assert_array_equal(_load(fs, f"{root}/t@0.npy"), a)


def test_write_piece_of_a_scalar_is_one_row_of_shape_empty(fs_root):
    fs, root = fs_root
    rec = C.write_piece(fs, root, "step", 0, np.array(7, np.int64))
    assert rec.piece == {"file": "step@0.npy", "offset": 0, "rows": 1, "shape": []}
    assert rec.dtype == "<i8"
    assert _load(fs, f"{root}/step@0.npy").shape == ()
    got = C.read_rows(fs, root, 0, 1, [rec.piece], (), np.dtype("int64"))
    assert got.shape == () and got.dtype == np.int64 and int(got) == 7
    got = C.read_rows(fs, root, 0, 1, [rec.piece], (), np.dtype("float32"))
    assert got.shape == () and got.dtype == np.float32 and float(got) == 7.0


def test_a_scalar_piece_is_checked_against_the_manifest(fs_root):
    fs, root = fs_root
    _save(fs, f"{root}/s.npy", np.array([7.0]))
    with pytest.raises(ValueError) as info:
        C.read_rows(fs, root, 0, 1, [{"file": "s.npy", "offset": 0, "rows": 1, "shape": []}], (), np.dtype("f8"))
    assert str(info.value) == f"{root}/s.npy holds float64 (1,); the manifest says float64 ()"


def test_a_one_dimensional_tensor_in_pieces_is_read_row_by_row(fs_root):
    fs, root = fs_root
    _save(fs, f"{root}/a.npy", np.array([1.0, 2.0]))
    _save(fs, f"{root}/b.npy", np.array([3.0]))
    pieces = [_piece("a.npy", 0, np.zeros(2)), _piece("b.npy", 2, np.zeros(1))]
    assert C.read_rows(fs, root, 0, 3, pieces, (), np.dtype("float64")).tolist() == [1.0, 2.0, 3.0]
    assert C.read_rows(fs, root, 1, 3, pieces[1:] + pieces[:1], (), np.dtype("float32")).tolist() == [2.0, 3.0]


class _ShortReads:
    """A filesystem whose files hand out at most 5 bytes per ``readinto`` (as sockets and some remote stores do)."""

    def __init__(self, fs):
        self.fs = fs

    def open(self, path, mode="rb"):
        f = self.fs.open(path, mode)
        real = f.readinto

        def readinto(view):
            return real(memoryview(view)[:5])

        f.readinto = readinto
        return f


def test_reading_into_place_keeps_going_after_short_reads(fs_root):
    fs, root = fs_root
    whole = np.arange(12.0).reshape(6, 2)
    _save(fs, f"{root}/a.npy", whole)
    got = C.read_rows(_ShortReads(fs), root, 1, 5, [_piece("a.npy", 0, whole)], (2,), np.dtype("float64"))
    np.testing.assert_array_equal(got, whole[1:5])


def test_write_with_slots_records_each_slot_and_the_step_counts(fs_root):
    fs, root = fs_root
    value = np.ones((2, 2), np.float32)
    slots = [("opt", 5, {"v": np.full((2, 2), 2.0, np.float32), "m": np.full((2, 2), 3.0, np.float32)}),
             ("opt2", 9, {})]
    recs = C.write_with_slots(fs, root, "w", 4, value, slots)
    assert [(r.tensor, r.piece["file"], r.step, r.steps) for r in recs] == [
        ("w", "w@4.npy", None, {"opt": 5, "opt2": 9}),
        ("w/.OPTIMIZER_SLOT/opt/m", "w%2F.OPTIMIZER_SLOT%2Fopt%2Fm@4.npy", 5, None),
        ("w/.OPTIMIZER_SLOT/opt/v", "w%2F.OPTIMIZER_SLOT%2Fopt%2Fv@4.npy", 5, None),
    ]
    assert _load(fs, f"{root}/w%2F.OPTIMIZER_SLOT%2Fopt%2Fm@4.npy").tolist() == [[3.0, 3.0], [3.0, 3.0]]
    assert _load(fs, f"{root}/w@4.npy").tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert all(r.piece["offset"] == 4 for r in recs)


def test_write_with_no_optimizer_has_no_steps(fs_root):
    fs, root = fs_root
    (rec,) = C.write_with_slots(fs, root, "w", 0, np.zeros(3), [])
    assert rec.steps is None and rec.step is None


@pytest.mark.parametrize("version", [(1, 0), (2, 0)])
def test_read_rows_spans_pieces_of_any_split_from_numpys_files(fs_root, version):
    fs, root = fs_root
    whole = np.arange(10 * 3, dtype=np.float64).reshape(10, 3)
    pieces = []
    for a, b in [(6, 10), (0, 2), (2, 6)]:  # listed out of order
        _save(fs, f"{root}/p{a}.npy", whole[a:b], version)
        pieces.append(_piece(f"p{a}.npy", a, whole[a:b]))
    for start, stop in [(0, 10), (1, 9), (2, 6), (5, 7), (9, 10), (3, 3)]:
        got = C.read_rows(fs, root, start, stop, pieces, (3,), np.dtype("float64"))
        np.testing.assert_array_equal(got, whole[start:stop])


def test_read_rows_converts_to_the_dtype_asked_for(fs_root):
    fs, root = fs_root
    whole = np.arange(8, dtype=np.int32).reshape(4, 2)
    _save(fs, f"{root}/a.npy", whole[:2])
    _save(fs, f"{root}/b.npy", whole[2:])
    pieces = [_piece("a.npy", 0, whole[:2]), _piece("b.npy", 2, whole[2:])]
    got = C.read_rows(fs, root, 1, 4, pieces, (2,), np.dtype("float32"))
    assert got.dtype == np.float32 and got.tolist() == whole[1:4].tolist()


def test_read_rows_names_the_pieces_that_miss_rows(fs_root):
    fs, root = fs_root
    _save(fs, f"{root}/a.npy", np.zeros((3, 1)))
    _save(fs, f"{root}/b.npy", np.zeros((2, 1)))
    pieces = [_piece("a.npy", 0, np.zeros((3, 1))), _piece("b.npy", 5, np.zeros((2, 1)))]
    with pytest.raises(ValueError) as info:
        C.read_rows(fs, root, 0, 7, pieces, (1,), np.dtype("float64"))
    assert str(info.value) == "checkpoint pieces ['a.npy', 'b.npy'] cover 5 of rows 0:7, not all"


def test_read_rows_checks_the_file_against_the_manifest(fs_root):
    fs, root = fs_root
    _save(fs, f"{root}/a.npy", np.zeros((3, 2), np.float32))
    bad_shape = {"file": "a.npy", "offset": 0, "rows": 3, "shape": [3, 4]}
    with pytest.raises(ValueError) as info:
        C.read_rows(fs, root, 0, 3, [bad_shape], (4,), np.dtype("float32"))
    assert str(info.value) == f"{root}/a.npy holds float32 (3, 2); the manifest says float32 (3, 4)"
    bad_dtype = {"file": "a.npy", "offset": 0, "rows": 3, "shape": [3, 2], "dtype": "<f8"}
    with pytest.raises(ValueError) as info:
        C.read_rows(fs, root, 0, 3, [bad_dtype], (2,), np.dtype("float32"))
    assert str(info.value) == f"{root}/a.npy holds float32 (3, 2); the manifest says float64 (3, 2)"
    good = dict(bad_dtype, dtype="<f4")
    assert C.read_rows(fs, root, 0, 3, [good], (2,), np.dtype("float32")).shape == (3, 2)


def test_a_fortran_ordered_file_is_refused(fs_root):
    fs, root = fs_root
    a = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    _save(fs, f"{root}/f.npy", a)
    with pytest.raises(ValueError) as info:
        C.read_rows(fs, root, 0, 2, [_piece("f.npy", 0, a)], (3,), np.dtype("float64"))
    assert str(info.value) == f"{root}/f.npy is stored in Fortran order; daskps writes C order only"


def test_a_file_that_is_not_npy_is_named(fs_root):
    fs, root = fs_root
    with fs.open(f"{root}/x.npy", "wb") as f:
        f.write(b"not an npy file at all")
    with pytest.raises(ValueError, match=rf"^{root}/x.npy is not a readable .npy file: "):
        C.read_rows(fs, root, 0, 1, [{"file": "x.npy", "offset": 0, "rows": 1, "shape": [1]}], (), np.dtype("f8"))


@pytest.mark.parametrize("shape, into", [((4, 2), True), ((4, 2), False), ((), False)])
def test_a_truncated_file_is_named(fs_root, shape, into):
    fs, root = fs_root
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ones(shape, np.float64))
    with fs.open(f"{root}/t.npy", "wb") as f:
        f.write(buf.getvalue()[:-4])
    piece = {"file": "t.npy", "offset": 0, "rows": shape[0] if shape else 1, "shape": list(shape)}
    with pytest.raises(ValueError) as info:
        C.read_rows(fs, root, 0, piece["rows"], [piece], shape[1:], np.dtype("float64" if into else "float32"))
    assert str(info.value) == f"{root}/t.npy is shorter than its header says"


def test_a_missing_file_is_a_value_error_naming_it(fs_root):
    fs, root = fs_root
    with pytest.raises(ValueError, match=rf"^checkpoint piece {root}/gone.npy cannot be read: FileNotFoundError: "):
        C.read_rows(fs, root, 0, 1, [{"file": "gone.npy", "offset": 0, "rows": 1, "shape": [1]}], (), np.dtype("f8"))


def test_read_rows_at_reads_rows_in_any_order_across_pieces(fs_root):
    fs, root = fs_root
    whole = np.arange(9 * 2, dtype=np.float32).reshape(9, 2)
    pieces = []
    for a, b in [(0, 4), (4, 5), (5, 9)]:
        _save(fs, f"{root}/p{a}.npy", whole[a:b])
        pieces.append(_piece(f"p{a}.npy", a, whole[a:b]))
    rows = np.array([8, 0, 4, 3, 3, 6])
    got = C.read_rows_at(fs, root, rows, pieces, (2,), np.dtype("float32"))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, whole[rows])
    with pytest.raises(ValueError) as info:
        C.read_rows_at(fs, root, np.array([1, 9, 12, 4]), pieces, (2,), np.dtype("float32"))
    assert str(info.value) == "checkpoint pieces do not hold rows [9, 12]"
    with pytest.raises(ValueError) as info:  # at most five named
        C.read_rows_at(fs, root, np.arange(9, 16), pieces, (2,), np.dtype("float32"))
    assert str(info.value) == "checkpoint pieces do not hold rows [9, 10, 11, 12, 13]"
    wrong = [dict(p, shape=[p["rows"], 3]) for p in pieces]
    with pytest.raises(ValueError, match=r"holds float32 \(4, 2\); the manifest says float32 \(4, 3\)$"):
        C.read_rows_at(fs, root, np.array([1]), wrong, (3,), np.dtype("float32"))


def test_load_target_reads_the_value_and_each_optimizers_slots(fs_root):
    fs, root = fs_root
    whole = np.arange(12.0).reshape(6, 2)
    slot = whole * 10
    _save(fs, f"{root}/v.npy", whole)
    _save(fs, f"{root}/m.npy", slot)
    spec = C.RestoreSpec(2, 5, [_piece("v.npy", 0, whole)],
                         {"fresh": None, "adam": C.SavedSlots(7, {"m": [_piece("m.npy", 0, slot)]})})
    value, slots = C.load_target(fs, root, spec, (3, 2), np.dtype("float32"))
    assert value.dtype == np.float32 and slots["adam"][1]["m"].dtype == np.float32
    np.testing.assert_array_equal(value, whole[2:5])
    assert slots["fresh"] is None and slots["adam"][0] == 7
    np.testing.assert_array_equal(slots["adam"][1]["m"], slot[2:5])


def test_load_target_with_rows_reads_those_rows(fs_root):
    fs, root = fs_root
    whole = np.arange(6.0).reshape(3, 2)
    _save(fs, f"{root}/v.npy", whole)
    _save(fs, f"{root}/m.npy", -whole)
    spec = C.RestoreSpec(0, 0, [_piece("v.npy", 0, whole)], {"o": C.SavedSlots(2, {"m": [_piece("m.npy", 0, whole)]})},
                         rows=[2, 0])
    value, slots = C.load_target(fs, root, spec, (2, 2), np.dtype("float32"))
    assert value.dtype == np.float32
    np.testing.assert_array_equal(value, whole[[2, 0]])
    np.testing.assert_array_equal(slots["o"][1]["m"], -whole[[2, 0]])
