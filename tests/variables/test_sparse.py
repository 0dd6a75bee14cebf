"""Sparse updates and reads: IndexedSlices, scatter_*, sparse_read, embedding_lookup."""

from __future__ import annotations

import json

import numpy as np
import pytest

import daskps as dps
from tests.helpers.paths import TESTS
from tests.helpers.variables import calls, sharded

TF = json.loads((TESTS / "data" / "tf_sparse_cases.json").read_text())
SCATTER_OPS = ["scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min", "scatter_max", "scatter_update"]


# -- IndexedSlices -------------------------------------------------------------
def test_indexed_slices_to_dense_sums_repeats():
    s = dps.IndexedSlices(np.array([[1.0], [2.0], [3.0]]), [1, 1, 0], dense_shape=(3, 1))
    np.testing.assert_array_equal(np.asarray(s), [[3.0], [3.0], [0.0]])
    assert s.dtype == np.float64 and s.shape == (3, 1)


def test_indexed_slices_validation():
    with pytest.raises(TypeError, match="indices must be integers"):
        dps.IndexedSlices(np.ones((2, 1)), [0.5, 1.0])
    with pytest.raises(ValueError, match="values must have shape"):
        dps.IndexedSlices(np.ones((3, 1)), [0, 1])
    with pytest.raises(ValueError, match="dense_shape"):
        dps.IndexedSlices(np.ones((2, 2)), [0, 1], dense_shape=(4, 3))


# -- scatter ops, against TensorFlow's own answers ---------------------------------
@pytest.mark.parametrize("kind", ["f", "i"])
@pytest.mark.parametrize("op", SCATTER_OPS[:-1])
def test_scatter_matches_tensorflow_locally(op, kind):
    base, vals = (np.array(a, np.float32 if kind == "f" else np.int32) for a in TF["inputs"][kind])
    v = dps.Variable(base)
    assert getattr(v, op)(dps.IndexedSlices(vals, TF["indices"])) is v
    np.testing.assert_allclose(v.numpy(), TF["scatter"][f"{op}/{kind}"], rtol=1e-6)


@pytest.mark.parametrize("kind", ["f", "i"])
def test_scatter_matches_tensorflow_on_servers(strategy, kind):
    """Every op, on a plain remote Variable and on a ShardedVariable split 2/3/1."""
    base, vals = (np.array(a, np.float32 if kind == "f" else np.int32) for a in TF["inputs"][kind])
    for op in SCATTER_OPS[:-1]:
        with strategy.scope():
            v = dps.Variable(base)
        sv = sharded(strategy, base, [2, 3, 1])
        delta = dps.IndexedSlices(vals, TF["indices"])
        getattr(v, op)(delta)
        assert getattr(sv, op)(delta) is sv
        want = TF["scatter"][f"{op}/{kind}"]
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-6, err_msg=op)
        np.testing.assert_allclose(sv.numpy(), want, rtol=1e-6, err_msg=op)


def test_scatter_add_duplicates_accumulate(strategy):
    sv = sharded(strategy, np.zeros((5, 1), np.float32), [3, 2])
    sv.scatter_add(dps.IndexedSlices(np.ones((4, 1), np.float32), [4, 4, 4, 0]))
    np.testing.assert_array_equal(sv.numpy()[:, 0], [1, 0, 0, 0, 3])


def test_scatter_update_uneven_layout_matches_dense(strategy):
    """TensorFlow refuses scatter on non-"div" layouts; any row layout works here."""
    full = np.zeros((32, 1), np.float32)
    sv = sharded(strategy, full, [5, 20, 7])  # not a "div" split
    delta = dps.IndexedSlices(np.arange(6, dtype=np.float32)[:, None], [0, 10, 11, 12, 30, 31])
    v = dps.Variable(full)
    for op in ("scatter_update", "scatter_add"):
        getattr(v, op)(delta)
        getattr(sv, op)(delta)
    np.testing.assert_array_equal(sv.numpy(), v.numpy())


def test_scatter_is_one_update_call_per_server(strategy):
    sv = sharded(strategy, np.zeros((12, 2), np.float32), [3, 3, 3, 3])  # servers hold 2 shards each
    before = calls(strategy, "update")
    sv.scatter_add(dps.IndexedSlices(np.ones((4, 2), np.float32), [0, 4, 7, 11]))
    assert [b - a for a, b in zip(before, calls(strategy, "update"))] == [1, 1]
    before = calls(strategy, "update")
    sv.scatter_add(dps.IndexedSlices(np.ones((1, 2), np.float32), [1]))  # only shard 0 touched
    assert [b - a for a, b in zip(before, calls(strategy, "update"))] == [1, 0]


def test_batch_scatter_update_matches_tensorflow(strategy):
    case = TF["batch"]
    local = dps.Variable(np.zeros((3, 4), np.float32))
    sv = sharded(strategy, np.zeros((3, 4), np.float32), [2, 1])
    delta = dps.IndexedSlices(np.array(case["values"], np.float32), case["indices"])
    local.batch_scatter_update(delta)
    sv.batch_scatter_update(delta)
    np.testing.assert_array_equal(local.numpy(), case["result"])
    np.testing.assert_array_equal(sv.numpy(), case["result"])


def test_batch_scatter_update_with_flat_indices_is_scatter_update(strategy):
    full = np.zeros((32, 1), np.float32)
    sv = sharded(strategy, full, [11, 11, 10])
    delta = dps.IndexedSlices(np.arange(6, dtype=np.float32)[:, None], np.arange(10, 16))
    sv.batch_scatter_update(delta)
    want = full.copy()
    want[10:16, 0] = np.arange(6)
    np.testing.assert_array_equal(sv.numpy(), want)


# -- errors leave every server unchanged -----------------------------------------------
@pytest.mark.parametrize(
    "delta, error, match",
    [
        (dps.IndexedSlices(np.ones((2, 2), np.float32), [0, 6]), IndexError, "out of range"),
        (dps.IndexedSlices(np.ones((1, 2), np.float32), [-1]), IndexError, "out of range"),
        (dps.IndexedSlices(np.ones((1, 1, 2), np.float32), [[0]]), ValueError, "1-D"),
        (dps.IndexedSlices(np.ones((2, 3), np.float32), [0, 1]), ValueError, r"shape \(2, 2\)"),
        (dps.IndexedSlices(np.ones((2, 2), np.complex64), [0, 1]), TypeError, "castable"),
    ],
)
def test_bad_sparse_delta_changes_nothing(strategy, delta, error, match):
    full = np.arange(12, dtype=np.float32).reshape(6, 2)
    sv = sharded(strategy, full, [3, 3])
    with strategy.scope():
        v = dps.Variable(full)
    for target in (sv, v):
        with pytest.raises(error, match=match):
            target.scatter_add(delta)
    np.testing.assert_array_equal(sv.numpy(), full)
    np.testing.assert_array_equal(v.numpy(), full)


def test_scatter_needs_indexed_slices(strategy):
    sv = sharded(strategy, np.zeros((4, 1), np.float32), [2, 2])
    with pytest.raises(TypeError, match="sparse_delta must be a daskps.IndexedSlices"):
        sv.scatter_add(([0], [[1.0]]))


def test_integer_scatter_div_by_zero_is_refused():
    v = dps.Variable(np.ones((2, 1), np.int32))
    with pytest.raises(ValueError, match="by zero"):
        v.scatter_div(dps.IndexedSlices(np.zeros((1, 1), np.int32), [0]))
    np.testing.assert_array_equal(v.numpy(), [[1], [1]])


def test_server_refuses_out_of_range_rows_too(strategy):
    with strategy.scope():
        v = dps.Variable(np.zeros((3, 1), np.float32))
    from daskps.client import protocol
    from daskps.server import ops

    bad = [(v.handle.key, "scatter_add", (np.array([0]), np.ones((1, 1), np.float32))),
           (v.handle.key, "scatter_add", (np.array([3]), np.ones((1, 1), np.float32)))]
    with pytest.raises(IndexError, match=r"index 3 is out of range \[0, 3\)"):
        protocol.call([(v.handle.server, ops.Update(bad))])
    np.testing.assert_array_equal(v.numpy(), np.zeros((3, 1)))


# -- reads -------------------------------------------------------------------------------
def test_sparse_read(strategy):
    full = np.arange(30, dtype=np.float32).reshape(30, 1)
    sv = sharded(strategy, full, [10, 10, 10])
    idx = [0, 10, 12, 21, 22, 12]
    np.testing.assert_array_equal(sv.sparse_read(idx), full[idx])
    with strategy.scope():
        v = dps.Variable(full)
    np.testing.assert_array_equal(v.sparse_read(idx), full[idx])
    with pytest.raises(ValueError, match="1-D"):
        sv.sparse_read([[0]])
    with pytest.raises(IndexError, match="out of range"):
        sv.sparse_read([30])


def test_embedding_lookup_tensorflow_example(strategy):
    rows = [[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]], [[9.0, 10.0]]]
    with strategy.scope():
        shards = [dps.Variable(np.array(r, np.float32)) for r in rows]
    sv = dps.ShardedVariable(shards)
    want = [[1.0, 2.0], [7.0, 8.0], [9.0, 10.0]]
    np.testing.assert_array_equal(dps.embedding_lookup(sv, [0, 3, 4]), want)
    np.testing.assert_array_equal(dps.embedding_lookup(shards, [0, 3, 4]), want)  # a list of shards, "div" ids


def test_embedding_lookup_any_id_shape(strategy):
    full = np.random.default_rng(0).normal(size=(50, 3, 2)).astype(np.float32)
    sv = sharded(strategy, full, [17, 17, 16])
    for ids in ([], 7, [[1, 2, 3], [49, 0, 1]], np.random.default_rng(1).integers(0, 50, size=(2, 3, 4))):
        got = dps.embedding_lookup(sv, ids)
        assert got.shape == np.shape(ids) + (3, 2)
        np.testing.assert_array_equal(got, full[np.asarray(ids, dtype=np.intp)])
    with pytest.raises(IndexError, match="out of range"):
        dps.embedding_lookup(sv, [[0, 50]])
    with pytest.raises(TypeError, match="integers"):
        dps.embedding_lookup(sv, [0.5])


def test_embedding_lookup_max_norm_matches_tensorflow(strategy):
    case = TF["max_norm"]
    sv = sharded(strategy, np.array(case["table"], np.float32), [3, 3])
    np.testing.assert_allclose(dps.embedding_lookup(sv, case["ids"], max_norm=3.0), case["result"], rtol=1e-6)


def test_embedding_lookup_moves_only_the_unique_rows(strategy):
    full = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    sv = sharded(strategy, full, [500, 500])
    ids = np.array([3, 3, 3, 7, 600, 600, 999])  # 4 distinct rows, 3 per server at most
    before_calls, before_bytes = calls(strategy), [s["bytes_read"] for s in strategy.ps_stats()]
    np.testing.assert_array_equal(dps.embedding_lookup(sv, ids), full[ids])
    stats = strategy.ps_stats()
    assert [s["calls"].get("read", 0) - b for s, b in zip(stats, before_calls)] == [1, 1]
    moved = sum(s["bytes_read"] - b for s, b in zip(stats, before_bytes))
    assert moved == 4 * 4 * 4  # 4 distinct rows of 4 float32


def test_embedding_lookup_skips_servers_with_no_rows(strategy):
    sv = sharded(strategy, np.zeros((10, 2), np.float32), [5, 5])
    before = calls(strategy)
    dps.embedding_lookup(sv, [1, 2])
    assert [b - a for a, b in zip(before, calls(strategy))] == [1, 0]


def test_embedding_lookup_on_plain_variable_and_array(strategy):
    full = np.arange(6, dtype=np.float32).reshape(3, 2)
    with strategy.scope():
        v = dps.Variable(full)
    np.testing.assert_array_equal(dps.embedding_lookup(v, [[2], [0]]), full[[[2], [0]]])
    np.testing.assert_array_equal(dps.embedding_lookup(full, [1]), full[[1]])
