"""The "mod" row layout (TensorFlow 1's ``partition_strategy="mod"``): row r on shard r % n.

Every answer is compared with numpy on the whole array (the reference), and
the shards' own contents with ``whole[i::n]`` (the layout's definition).
"""

from __future__ import annotations

import numpy as np
import pytest

import daskps as dps

ROWS, COLS, SHARDS = 13, 3, 5


def _whole(seed=0):
    return np.random.default_rng(seed).normal(size=(ROWS, COLS)).astype(np.float32)


def _mod_variable(strategy, value, shards=SHARDS, name="m"):
    with strategy.scope():
        parts = dps.create_partitioned_variables((ROWS, COLS), [shards, 1], value, name=name, layout="mod")
    return dps.ShardedVariable(parts, name=name, layout="mod")


def test_each_shard_holds_rows_i_mod_n_and_reads_match_numpy(strategy):
    whole = _whole()
    sv = _mod_variable(strategy, whole)
    assert [v.shape[0] for v in sv.variables] == [3, 3, 3, 2, 2]
    for i, v in enumerate(sv.variables):
        np.testing.assert_array_equal(v.numpy(), whole[i::SHARDS])
    assert len({v.device for v in sv.variables}) == 2  # spread over both servers
    np.testing.assert_array_equal(sv.numpy(), whole)
    rng = np.random.default_rng(1)
    indexes = [0, 12, -1, -13, slice(None), slice(2, 11, 3), slice(None, None, -2), slice(20, 30),
               np.array([12, 0, 5, 5]), rng.integers(-ROWS, ROWS, (2, 3)), whole[:, 0] > 0,
               (slice(1, 9), 1), (np.array([2, 7]), slice(0, 2)), (4, slice(None, None, -1)), (Ellipsis, 0),
               (None, 2), (np.array([1, 2]), np.array([0, 2])), np.array([], np.int64)]
    for index in indexes:
        got, want = sv[index], whole[index]
        assert got.shape == want.shape, index
        np.testing.assert_array_equal(got, want)
    ids = rng.integers(0, ROWS, (4, 2))
    np.testing.assert_array_equal(dps.embedding_lookup(sv, ids), whole[ids])
    np.testing.assert_array_equal(sv.sparse_read([11, 2]), whole[[11, 2]])
    got = dps.read_values([sv, (sv, ids)])
    np.testing.assert_array_equal(got[0], whole)
    np.testing.assert_array_equal(got[1], whole[ids])
    with pytest.raises(IndexError):
        sv[13]
    with pytest.raises(IndexError):
        dps.embedding_lookup(sv, np.array([13]))
    assert "layout='mod'" in repr(sv) and "2::5" in sv._repr_html_()


def test_updates_and_optimizers_land_on_the_right_rows(strategy, coordinator):
    whole = _whole(2)
    sv = _mod_variable(strategy, whole)
    with strategy.scope():
        opt = dps.optimizers.SGD(0.5)
    sv.scatter_add(dps.IndexedSlices(np.ones((3, COLS), np.float32), np.array([12, 12, 3])))
    whole[12] += 2
    whole[3] += 1
    sv.assign_sub(np.full((ROWS, COLS), 0.25, np.float32))
    whole -= 0.25
    sv.scatter_update(dps.IndexedSlices(np.zeros((1, COLS), np.float32), np.array([6])))
    whole[6] = 0
    np.testing.assert_array_equal(sv.numpy(), whole)
    g = np.random.default_rng(3).normal(size=(ROWS, COLS)).astype(np.float32)

    def step():  # on a trainer: a dense and a sparse gradient
        opt.apply_gradients([(g, sv)])
        opt.apply_gradients([(dps.IndexedSlices(np.ones((2, COLS), np.float32), np.array([4, 9])), sv)])

    coordinator.schedule(step)
    coordinator.join()
    whole -= 0.5 * g
    whole[[4, 9]] -= 0.5
    np.testing.assert_allclose(sv.numpy(), whole, rtol=1e-6)
    for i, v in enumerate(sv.variables):
        np.testing.assert_allclose(v.numpy(), whole[i::SHARDS], rtol=1e-6)


@pytest.mark.parametrize("target", ["div-2", "mod-2", "whole", "mod-5"])
def test_checkpoints_move_between_layouts_with_their_slots(strategy, tmp_path, target):
    whole = _whole(4)
    sv = _mod_variable(strategy, whole, name="emb")
    with strategy.scope():
        opt = dps.optimizers.Adagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-7)
    g = np.random.default_rng(5).normal(size=(ROWS, COLS)).astype(np.float32)
    opt.apply_gradients([(g, sv)])
    acc = 0.1 + g * g
    whole = whole - 0.1 * g / np.sqrt(acc + 1e-7)
    path = dps.Checkpoint(emb=sv, opt=opt).write(str(tmp_path / "ck"))

    zeros = np.zeros((ROWS, COLS), np.float32)
    with strategy.scope():
        if target == "whole":
            again = dps.Variable(zeros, name="emb")
        else:
            kind, n = target.split("-")
            parts = dps.create_partitioned_variables((ROWS, COLS), [int(n), 1], zeros, name="emb", layout=kind)
            again = dps.ShardedVariable(parts, name="emb", layout=kind)
        opt2 = dps.optimizers.Adagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-7)
    dps.Checkpoint(emb=again, opt=opt2).restore(path)
    np.testing.assert_allclose(again.numpy(), whole, rtol=1e-6)
    opt2.apply_gradients([(g, again)])  # the accumulators came along, on the right rows
    np.testing.assert_allclose(again.numpy(), whole - 0.1 * g / np.sqrt(acc + g * g + 1e-7), rtol=1e-5)


def test_a_div_checkpoint_restores_into_mod(strategy, tmp_path):
    whole = _whole(6)
    with strategy.scope():
        div = dps.ShardedVariable(dps.create_partitioned_variables((ROWS, COLS), [2, 1], whole, name="w"), name="w")
    path = dps.Checkpoint(w=div).write(str(tmp_path / "ck"))
    sv = _mod_variable(strategy, np.zeros((ROWS, COLS), np.float32), shards=3, name="w")
    dps.Checkpoint(w=sv).restore(path)
    np.testing.assert_array_equal(sv.numpy(), whole)
    np.testing.assert_array_equal(sv.variables[1].numpy(), whole[1::3])


def test_bad_layouts_are_refused(strategy):
    v = [dps.Variable(np.zeros((2, 1), np.float32)), dps.Variable(np.zeros((3, 1), np.float32))]
    with pytest.raises(ValueError, match=r"need shards of \[3, 2\] rows, got \[2, 3\]"):
        dps.ShardedVariable(v, layout="mod")
    with pytest.raises(ValueError, match="layout must be 'div' or 'mod'"):
        dps.ShardedVariable(v, layout="hash")
    with pytest.raises(ValueError, match="layout must be 'div' or 'mod'"):
        dps.create_partitioned_variables((4, 2), [2, 1], np.zeros((4, 2)), layout="rows")
    with pytest.raises(ValueError, match="splits axis 0 only"):
        dps.create_partitioned_variables((4, 2), [1, 2], np.zeros((4, 2)), layout="mod")


def _mod(strategy, whole: np.ndarray, shards: int = 3, name: str = "m") -> dps.ShardedVariable:
    with strategy.scope():
        parts = dps.create_partitioned_variables(whole.shape, [shards] + [1] * (whole.ndim - 1), whole,
                                                 layout="mod", name=name)
    return dps.ShardedVariable(parts, name=name, layout="mod")


# -- the "mod" layout ----------------------------------------------------------------


def test_mod_getitem_empty_tuple_is_the_whole_value(strategy):
    # numpy: whole[()] is the whole array; a "div" ShardedVariable gives it too.
    whole = np.arange(21, dtype=np.float32).reshape(7, 3)
    sv = _mod(strategy, whole)
    np.testing.assert_array_equal(sv[()], whole[()])  # IndexError: list index out of range


def test_mod_getitem_boolean_mask_of_the_full_shape(strategy):
    # README "Slicing": boolean masks have numpy's semantics ("tested against numpy"); the
    # mod layout fails on a mask covering both axes (the "div" layout gives numpy's answer).
    whole = np.arange(21, dtype=np.float32).reshape(7, 3)
    sv = _mod(strategy, whole)
    mask = whole > 10
    np.testing.assert_array_equal(sv[mask], whole[mask])  # IndexError: too many indices for array


def test_mod_partition_aware_initializer_from_readme_gives_distinct_parts(strategy):
    # The README's partition-aware initializer (seeded by partition_offset) and "Everything above
    # works the same on a 'mod' variable": every mod part is handed partition_offset (0, 0) and
    # shape = the part's shape, so both parts come out identical.
    def init(shape, dtype, partition_shape, partition_offset):
        rng = np.random.default_rng(partition_offset[0])
        return rng.normal(0, 0.01, size=partition_shape).astype(dtype)

    with strategy.scope():
        parts = dps.create_partitioned_variables((6, 2), [2, 1], init, layout="mod", name="readme_init")
    a, b = parts[0].numpy(), parts[1].numpy()
    assert not np.array_equal(a, b), "rows 0, 2, 4 and rows 1, 3, 5 were given the same values"
