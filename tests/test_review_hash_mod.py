"""Defects a hostile review of the hash embedding tables and the "mod" row layout found, one test each (all fixed).

Expected numbers come from numpy (and a numpy splitmix64, as the README states
the placement), never from daskps itself.
"""

from __future__ import annotations

import numpy as np
import pytest

import daskps as dps

_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _server(keys, n: int) -> np.ndarray:
    """splitmix64(key) % n, as the README says keys are placed."""
    with np.errstate(over="ignore"):
        z = np.asarray(keys, np.int64).view(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(n)).astype(np.int64)


def _keys_on(server: int, n: int, count: int) -> list[int]:
    keys = np.arange(1000)
    return keys[_server(keys, n) == server][:count].tolist()


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


# -- hash embedding tables -----------------------------------------------------------


def test_a_lookup_whose_initializer_fails_on_one_server_leaves_that_server_unchanged(strategy):
    # An initializer that ignores `shape` (always 2 rows): the server asked for 2 new rows
    # makes them, the one asked for 1 refuses, and the lookup raises. A lookup reaches each
    # server on its own (README): the refusing server is unchanged, the other keeps its rows.
    two, one = _keys_on(0, 2, 2), _keys_on(1, 2, 1)
    with strategy.scope():
        table = dps.EmbeddingTable(4, name="fixed_init",
                                   initializer=lambda shape, dtype: np.zeros((2, 4), dtype))
    with pytest.raises(ValueError, match="initializer .* returned shape"):
        dps.embedding_lookup(table, np.array(two + one))
    after = table.stats()
    assert (after[0]["rows"], after[0]["admitted"]) == (2, 2)
    assert (after[1]["rows"], after[1]["admitted"], after[1]["pending"]) == (0, 0, 0)
    assert sorted(table.export()[0].tolist()) == sorted(two)


def test_hash_restore_into_fewer_servers_keeps_least_recently_used_order(strategy, tmp_path):
    # Saved from 2 servers, restored into one part (a local table) with capacity 3; then a new key
    # needs a row. README: "the least recently used rows (by the last lookup or gradient naming
    # them) go". Use order: x (server 0), then a (server 0) 9 times, then b (server 1) last:
    # x is the least recently used and must go. The restored rows keep their old servers' own
    # use clocks (b's server saw 1 lookup, x's saw 2), so b, the most recent, is evicted instead.
    a, x = _keys_on(0, 2, 2)
    b, = _keys_on(1, 2, 1)
    new = 10_000
    with strategy.scope():
        table = dps.EmbeddingTable(2, name="lru")
    dps.embedding_lookup(table, [a])
    dps.embedding_lookup(table, [x])
    for _ in range(8):
        dps.embedding_lookup(table, [a])
    dps.embedding_lookup(table, [b])
    dps.Checkpoint(emb=table).write(str(tmp_path / "ckpt"))

    local = dps.EmbeddingTable(2, name="lru", capacity=3)  # outside any scope: one part
    dps.Checkpoint(emb=local).restore(str(tmp_path / "ckpt"))
    assert sorted(local.export()[0].tolist()) == sorted([a, x, b])
    dps.embedding_lookup(local, [new])
    assert local.export()[0].tolist() == sorted([a, b, new])  # got [a, x, new]: b evicted


def test_hash_checkpoint_does_not_restore_into_a_plain_variable(strategy, tmp_path):
    # A table's checkpoint holds rows by key; restoring it into a dense Variable of the same shape
    # silently fills the variable with rows in the servers' order, keys dropped. The reverse
    # (a Variable's checkpoint into a table) is refused with a clear ValueError.
    keys = np.array([5, 2**40, -7])
    with strategy.scope():
        table = dps.EmbeddingTable(2, name="emb", initializer=lambda shape, dtype: np.ones(shape, dtype))
        v = dps.Variable(np.zeros((3, 2), np.float32), name="v")
    dps.embedding_lookup(table, keys)
    dps.Checkpoint(emb=table).write(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError):
        dps.Checkpoint(emb=v).restore(str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(v.numpy(), np.zeros((3, 2), np.float32))


def test_hash_restore_refuses_keys_outside_key_dtype_int32(strategy, tmp_path):
    # A table with key_dtype=np.int32 refuses every id outside int32 (README: "int32 overflow
    # with key_dtype=np.int32"), but a restore fills it with int64 keys it can never look up.
    with strategy.scope():
        wide = dps.EmbeddingTable(2, name="emb")
        narrow = dps.EmbeddingTable(2, name="emb", key_dtype=np.int32)
    dps.embedding_lookup(wide, [2**40, 3])
    dps.Checkpoint(emb=wide).write(str(tmp_path / "ckpt"))
    try:
        dps.Checkpoint(emb=narrow).restore(str(tmp_path / "ckpt"))
    except ValueError:
        pass  # refusing is fine
    keys = narrow.export()[0]
    info = np.iinfo(np.int32)
    assert ((keys >= info.min) & (keys <= info.max)).all(), keys  # holds 1099511627776
