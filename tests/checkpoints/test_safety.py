"""Restores read only what belongs to the checkpoint, and refuse edited or broken ones unchanged."""

from __future__ import annotations

import json

import fsspec
import numpy as np
import pytest

import daskps as dps
from daskps._core import ckpt_io
from tests.helpers.checkpoints import build, train, values


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _put(path, manifest):
    (path / "manifest.json").write_text(json.dumps(manifest))


def _piece(manifest, tensor, i=0):
    return manifest["tensors"][tensor]["pieces"][i]


def _outside_piece(path):
    m = _manifest(path)
    np.save(path.parent / "outside.npy", np.zeros((6, 3), np.float32))
    _piece(m, "table")["file"] = "../outside.npy"
    _put(path, m)
    return "not a .npy file inside the checkpoint directory"


def _absolute_piece(path):
    m = _manifest(path)
    _piece(m, "table")["file"] = str(path / _piece(m, "table")["file"])
    _put(path, m)
    return "not a .npy file inside the checkpoint directory"


def _wrong_dtype(path):
    m = _manifest(path)
    name = _piece(m, "table")["file"]
    data = np.load(path / name)
    with open(path / name, "wb") as f:
        np.lib.format.write_array(f, data.astype(np.float64))
    return r"holds float64 \(6, 3\); the manifest says float32 \(6, 3\)"


def _wrong_shape(path):
    m = _manifest(path)
    name = _piece(m, "table")["file"]
    with open(path / name, "wb") as f:
        np.lib.format.write_array(f, np.zeros((5, 3), np.float32))
    return r"holds float32 \(5, 3\); the manifest says float32 \(6, 3\)"


def _not_json(path):
    (path / "manifest.json").write_text('{"tensors": {')
    return "malformed checkpoint manifest .*manifest.json: not JSON"


def _no_pieces(path):
    m = _manifest(path)
    del m["tensors"]["dense"]["pieces"]
    _put(path, m)
    return "tensor 'dense' lacks dtype, shape or pieces"


def _gap(path):
    m = _manifest(path)
    _piece(m, "table", 1)["offset"] += 1
    _put(path, m)
    return "does not follow on at row 6"


def _bad_dtype_name(path):
    m = _manifest(path)
    m["tensors"]["dense"]["dtype"] = "no-such-dtype"
    _put(path, m)
    return "dtype 'no-such-dtype' is not a numpy dtype"


def _no_tensors(path):
    _put(path, {"format": "daskps-checkpoint/1"})
    return "no 'tensors' mapping"


@pytest.mark.parametrize("edit", [_outside_piece, _absolute_piece, _wrong_dtype, _wrong_shape, _not_json,
                                  _no_pieces, _gap, _bad_dtype_name, _no_tensors])
def test_an_edited_or_broken_checkpoint_is_refused_and_nothing_changes(client, tmp_path, edit):
    strategy, *model = build(client, 2)
    table, dense, opt, loss = model
    ckpt = dps.Checkpoint(table=table, dense=dense, opt=opt, loss=loss)
    path = tmp_path / "c"
    ckpt.write(str(path))
    train(*model, steps=2)
    before = values(*model)
    stats_before = [s["updates"] for s in strategy.ps_stats()]
    match = edit(path)
    with pytest.raises(ValueError, match=match) as info:
        ckpt.restore(str(path))
    assert str(path) in str(info.value)  # names the file
    after = values(*model)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert after[2:] == before[2:]
    assert [s["updates"] for s in strategy.ps_stats()] == stats_before


@pytest.mark.parametrize("name", ["../escaped", "a/b", "..", "", "x\\y"])
def test_checkpoint_name_cannot_leave_the_directory(tmp_path, name):
    ckpt = dps.Checkpoint(v=dps.Variable([1.0]))
    with pytest.raises(ValueError, match="checkpoint_name"):
        dps.CheckpointManager(ckpt, str(tmp_path / "d"), checkpoint_name=name)


@pytest.mark.parametrize("number", ["../x", -1, 1.5, True])
def test_checkpoint_number_must_be_a_count(tmp_path, number):
    manager = dps.CheckpointManager(dps.Checkpoint(v=dps.Variable([1.0])), str(tmp_path / "d"))
    with pytest.raises(ValueError, match="checkpoint_number"):
        manager.save(checkpoint_number=number)
    assert list(tmp_path.rglob("*")) == []  # nothing written anywhere


def test_pieces_covering_fewer_rows_than_the_tensor_are_refused_exactly(client, tmp_path):
    """The table's last piece dropped from the manifest: the ValueError the README documents, not a KeyError
    from the servers, and nothing restored."""
    strategy, *model = build(client, 2)
    table, dense, opt, loss = model
    ckpt = dps.Checkpoint(table=table, dense=dense, opt=opt, loss=loss)
    path = tmp_path / "c"
    ckpt.write(str(path))
    m = _manifest(path)
    pieces = m["tensors"]["table"]["pieces"]
    assert m["tensors"]["table"]["shape"] == [12, 3] and [p["rows"] for p in pieces] == [6, 6]
    pieces.pop()  # rows 6..11 are in no piece
    _put(path, m)
    train(*model, steps=2)
    before = values(*model)
    stats_before = [s["updates"] for s in strategy.ps_stats()]
    with pytest.raises(ValueError) as info:
        ckpt.restore(str(path))
    assert type(info.value) is ValueError
    assert str(info.value) == (f"malformed checkpoint manifest {path}/manifest.json: tensor 'table': its pieces "
                               "cover 6 of 12 rows; nothing was changed")
    after = values(*model)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert after[2:] == before[2:]
    assert [s["updates"] for s in strategy.ps_stats()] == stats_before


def test_a_server_reading_pieces_that_miss_rows_names_them():
    """The second line, where a server reads its rows: a ValueError naming the pieces, not a KeyError."""
    fs = fsspec.filesystem("memory")
    rec = ckpt_io.write_piece(fs, "/missing-rows", "t", 0, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError) as info:
        ckpt_io.read_rows(fs, "/missing-rows", 1, 5, [rec.piece], (2,), np.dtype(np.float32))
    assert str(info.value) == "checkpoint pieces ['t@0.npy'] cover 2 of rows 1:5, not all"
