"""Reading rows of a sharded variable (``daskps.variables.rows``), in this process.

The shards are local variables, so every read runs here. The reference is
numpy itself: ``sv[index]`` must equal ``whole[index]`` for every index in
the table, for "div" shards of uneven sizes and for "mod" shards; and a read
must ask each shard only for the rows it holds that the index touches.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskps as dps
from daskps.client import protocol
from daskps.variables import rows

WHOLE = np.arange(8 * 2 * 3, dtype=np.float32).reshape(8, 2, 3)
SIZES = (3, 1, 4)  # div: rows 0-2, 3, 4-7


def _div() -> dps.ShardedVariable:
    bounds = np.cumsum((0,) + SIZES)
    parts = [dps.Variable(WHOLE[a:b], name=f"t/part_{i}") for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return dps.ShardedVariable(parts, name="t")


def _mod() -> dps.ShardedVariable:
    return dps.ShardedVariable([dps.Variable(WHOLE[i::3], name=f"t/part_{i}") for i in range(3)], name="t", layout="mod")


B = np.array([True, False, True, True, False, False, False, True])
INDICES = [
    0, 3, 7, -1, -8, np.int64(4), np.array(5),
    slice(None), slice(1, 6), slice(2, 4), slice(3, 4), slice(None, None, 2), slice(1, None, 3),
    slice(None, None, -1), slice(6, 0, -2), slice(7, 2, -1), slice(5, None, -3), slice(4, 4), slice(-3, None),
    slice(0, 3), slice(4, 8), slice(None, 1, -1),
    [0, 7, 3, 3], [], [-1, -8, 2], np.array([[1, 4], [7, 1]]), np.array([3]), np.array([2, 2, 2]),
    B, np.zeros(8, bool),
    (slice(None), 1), (2, 1, 2), (slice(1, 7, 2), slice(None), 0), (-2, 0), ([1, 6], 1), ([5, 0], slice(None), [2, 0]),
    (Ellipsis, 1), (Ellipsis, 0, 2), (1, Ellipsis), (slice(2, 6), Ellipsis, 1), (None, 3), (None, slice(1, 5)),
    (slice(2, 7), None, 1), (None, None, [4, 0]), (None, Ellipsis, 2),
    (B, 1), (B, slice(None), 2), (np.ones((8, 2), bool),), (True,), (True, 3), (False,), (Ellipsis,), (),
    (0, [1, 0]), (slice(0, 5), [1, 1], slice(None)), (slice(None), [True, False]), (slice(1, 4), [0, 1], [2, 0]),
    (slice(3, None, -1), 0, [2, 0]), (np.array(6), 1),
    (Ellipsis, 5, 1, 2), (Ellipsis, -1, 0, slice(None)), (Ellipsis, np.array([[[0, 2]]])), (2, None, Ellipsis),
]


@pytest.mark.parametrize("index", INDICES, ids=[f"index{i}" for i in range(len(INDICES))])
@pytest.mark.parametrize("make", [_div, _mod], ids=["div", "mod"])
def test_every_index_reads_what_numpy_does(make, index):
    got = make()[index]
    want = WHOLE[index]
    assert got.dtype == want.dtype and got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(got, want)


def test_an_index_that_is_a_variable_is_read_first():
    sv = _div()
    ids = dps.Variable(np.array([6, 1], np.int64))
    np.testing.assert_array_equal(sv[ids], WHOLE[[6, 1]])
    np.testing.assert_array_equal(sv[ids, 1], WHOLE[[6, 1], 1])
    np.testing.assert_array_equal(_mod()[ids], WHOLE[[6, 1]])


@pytest.mark.parametrize("index", [8, -9, [0, 8], (0, 2), (slice(None), 0, 3), [1.5], np.array(1.5)],
                         ids=["8", "-9", "list", "axis1", "axis2", "float_list", "float_0d"])
@pytest.mark.parametrize("make", [_div, _mod], ids=["div", "mod"])
def test_out_of_range_is_numpys_index_error(make, index):
    with pytest.raises(IndexError):
        WHOLE[index]
    with pytest.raises(IndexError):
        make()[index]


@pytest.fixture
def reads(monkeypatch):
    """Every ``(shard name, index)`` the reads ask for."""
    seen: list = []
    real = protocol.read

    def spy(items):
        seen.extend((_name(t), i) for t, i in items)
        return real(items)

    monkeypatch.setattr(protocol, "read", spy)
    return seen


def _name(target):
    return next(v.name for v in SHARDS if v.handle is target)


SHARDS: list = []


def _spied_div():
    sv = _div()
    SHARDS[:] = sv.variables
    return sv


def _rows_asked(seen):
    return {name: np.asarray(index).tolist() for name, index in seen}


def test_an_int_reads_one_row_of_one_shard(reads):
    _spied_div()[5, 1]
    assert reads == [("t/part_2", (1, 1))]


def test_an_array_reads_each_distinct_row_once_from_its_shard(reads):
    _spied_div()[[7, 0, 7, 2, 5]]
    assert _rows_asked(reads) == {"t/part_0": [0, 2], "t/part_2": [1, 3]}


def _sliced(seen):
    """``(shard, local rows its slice selects)`` for each read, in order."""
    return [(name, np.arange(SIZES[int(name[-1])])[index[0]].tolist()) for name, index in seen]


def test_a_slice_asks_each_shard_it_crosses_for_its_own_part(reads):
    _spied_div()[2:7:2]  # rows 2, 4, 6
    assert _sliced(reads) == [("t/part_0", [2]), ("t/part_2", [0, 2])]


def test_a_reversed_slice_asks_the_shards_last_first(reads):
    _spied_div()[7:1:-2]  # rows 7, 5, 3
    assert _sliced(reads) == [("t/part_2", [3, 1]), ("t/part_1", [0])]


def test_a_basic_index_is_applied_by_each_shard_so_only_the_result_travels(reads):
    _spied_div()[2:7:2, 1, None]  # rows 2, 4, 6
    assert [(n, i[1:]) for n, i in reads] == [("t/part_0", (1, None)), ("t/part_2", (1, None))]
    assert _sliced(reads) == [("t/part_0", [2]), ("t/part_2", [0, 2])]


def _spied_mod():
    sv = _mod()
    SHARDS[:] = sv.variables
    return sv


@pytest.mark.parametrize(
    "index, want",
    [
        (5, {"t/part_2": [1]}),  # row r is on shard r % 3 at local row r // 3
        ((5, 1), {"t/part_2": [1]}),
        ([7, 1, 7], {"t/part_1": [0, 2]}),
        (slice(2, 6), {"t/part_0": [1], "t/part_1": [1], "t/part_2": [0, 1]}),
        ((slice(2, 6), 0, slice(1, 3)), {"t/part_0": [1], "t/part_1": [1], "t/part_2": [0, 1]}),
        (B, {"t/part_0": [0, 1], "t/part_1": [2], "t/part_2": [0]}),
    ],
    ids=["int", "int_int", "list", "slice", "slice_basic", "mask"],
)
def test_mod_shards_are_asked_only_for_the_rows_named(reads, index, want):
    got = _spied_mod()[index]
    np.testing.assert_array_equal(got, WHOLE[index])
    assert _rows_asked(reads) == want


def test_mod_with_an_advanced_index_past_axis_0_reads_the_whole(reads):
    got = _spied_mod()[[1, 4], [0, 1]]
    np.testing.assert_array_equal(got, WHOLE[[1, 4], [0, 1]])
    assert sorted(n for n, i in reads) == ["t/part_0", "t/part_1", "t/part_2"] and all(i is None for _, i in reads)


def test_plan_rows_names_indices_by_default():
    sv = _div()
    with pytest.raises(IndexError) as info:
        rows.plan_rows(sv.variables, sv.row_offsets, [9], "t")
    assert str(info.value) == "indices for variable 't': index 9 is out of range [0, 8)"


def test_plan_rows_of_no_ids_on_one_shard():
    v = dps.Variable(np.ones((3, 2), np.float16), name="one")
    items, assemble = rows.plan_rows([v], (0, 3), np.zeros(0, np.int64), "one")
    got = assemble([])
    assert items == [] and got.shape == (0, 2) and got.dtype == np.float16


def test_a_mask_reads_only_its_true_rows(reads):
    _spied_div()[B]  # rows 0, 2, 3, 7
    assert _rows_asked(reads) == {"t/part_0": [0, 2], "t/part_1": [0], "t/part_2": [3]}


OFFSETS = [[0, 4, 10], [0, 1, 2, 10], [0, 3, 3, 7, 10], [0, 10]]


@pytest.mark.parametrize("offsets", OFFSETS, ids=[f"offsets{i}" for i in range(len(OFFSETS))])
def test_split_range_gives_each_shard_the_rows_of_r_it_holds_in_rs_order(offsets):
    n = offsets[-1]
    for start in range(-1, n + 1):
        for stop in range(-1, n + 2):
            for step in (1, 2, 3, 5, 11, -1, -2, -3, -7):
                r = range(*slice(start if start >= 0 else None, stop if stop >= 0 else None, step).indices(n))
                got = rows.split_range(r, offsets)
                # brute force: the shards in r's order, and the local rows of each, in r's order
                want: list = []
                for row in r:
                    s = int(np.searchsorted(offsets, row, side="right")) - 1
                    if not want or want[-1][0] != s:
                        want.append((s, []))
                    want[-1][1].append(row - offsets[s])
                local = [(s, np.arange(offsets[s + 1] - offsets[s])[sl].tolist()) for s, sl in got]
                assert local == want, (r, offsets, got)
                assert all(sl.step == step for _, sl in got)


def test_split_rows_gives_each_shard_its_local_rows_in_order():
    idx = np.array([9, 0, 4, 3, 4])
    vals = np.arange(5) * 10
    got = rows.split_rows([0, 4, 5, 10], idx, vals)
    assert [(i.tolist(), v.tolist()) for i, v in got] == [([0, 3], [10, 30]), ([0, 0], [20, 40]), ([4], [0])]


def test_split_rows_leaves_an_untouched_shard_empty():
    got = rows.split_rows([0, 2, 4, 6], np.array([5, 0]), np.array([1.0, 2.0]))
    assert [(i.tolist(), v.tolist()) for i, v in got] == [([0], [2.0]), ([], []), ([1], [1.0])]


def test_plan_rows_reads_each_row_once_and_assembles_the_ids_shape():
    sv = _div()
    ids = np.array([[7, 3], [0, 7]])
    items, assemble = rows.plan_rows(sv.variables, sv.row_offsets, ids, "t")
    assert [(v.name, r.tolist()) for v, r in items] == [("t/part_0", [0]), ("t/part_1", [0]), ("t/part_2", [3])]
    np.testing.assert_array_equal(rows.read_plan(items, assemble), WHOLE[ids])


def test_plan_rows_of_no_ids_reads_nothing():
    sv = _div()
    items, assemble = rows.plan_rows(sv.variables, sv.row_offsets, np.zeros((0, 2), np.int64), "t")
    assert items == []
    got = assemble([])
    assert got.shape == (0, 2, 2, 3) and got.dtype == np.float32


def test_gather_rows_checks_the_ids_and_names_the_argument():
    sv = _div()
    np.testing.assert_array_equal(rows.gather_rows(sv.variables, sv.row_offsets, [[2], [6]], "t"), WHOLE[[[2], [6]]])
    with pytest.raises(IndexError, match=r"^ids for variable 't': index 8 is out of range \[0, 8\)$"):
        rows.gather_rows(sv.variables, sv.row_offsets, [8], "t", arg="ids")
    with pytest.raises(ValueError, match=r"^indices for variable 't' must be 1-D, got shape \(1, 1\)$"):
        rows.gather_rows(sv.variables, sv.row_offsets, [[1]], "t", one_d=True)


def _clip_reference(found, id_rank, max_norm):
    """TensorFlow's ``embedding_lookup(max_norm=...)``: each embedding ``clip_by_norm``-ed over its own axes."""
    out = np.array(found, dtype=np.float64)
    for pos in np.ndindex(*found.shape[:id_rank]):
        row = out[pos]
        norm = np.sqrt(np.sum(row.astype(np.float64) ** 2))
        if norm > max_norm:
            out[pos] = row * max_norm / norm
    return out


@pytest.mark.parametrize("id_rank", [0, 1, 2])
def test_clip_rows_is_clip_by_norm_per_embedding(id_rank):
    found = np.array([[[3.0, 4.0], [0.3, 0.4]], [[0.0, 0.0], [-6.0, 8.0]]], np.float32)
    got = rows.clip_rows(found, id_rank, 1.0)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _clip_reference(found, id_rank, 1.0), rtol=1e-6)


def test_clip_rows_of_scalars_clips_their_absolute_value():
    got = rows.clip_rows(np.array([-3.0, 0.5, 2.0], np.float32), 1, 1.0)
    np.testing.assert_array_equal(got, [-1.0, 0.5, 1.0])


def test_clip_rows_leaves_a_row_at_the_norm_alone():
    row = np.array([[0.6, 0.8]], np.float64)
    assert rows.clip_rows(row, 1, 1.0).tolist() == row.tolist()


def test_clip_rows_measures_norms_in_float64():
    # The rule, row * max_norm / ||row||, gives [0.6, 0.8]; a float16 sum of squares would overflow (to inf,
    # and TF's float16 clip_by_norm then gives zeros): daskps measures norms in float64
    got = rows.clip_rows(np.array([[300.0, 400.0]], np.float16), 1, 1.0)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), [[0.6, 0.8]], rtol=1e-3)


@pytest.mark.parametrize("max_norm", [1.0, 0.0])
def test_clip_rows_of_zero_rows_warns_nothing(max_norm):
    import warnings

    found = np.array([[0.0, 0.0], [3.0, 4.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = rows.clip_rows(found, 1, max_norm)
    np.testing.assert_allclose(got, _clip_reference(found, 1, max_norm))
