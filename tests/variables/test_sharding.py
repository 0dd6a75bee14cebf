"""ShardedVariable and partitioned creation under ParameterServerStrategy."""

from __future__ import annotations

import gc
import os
import pickle
import warnings

import dask.config
import numpy as np
import psutil
import pytest
from distributed import get_worker

import daskps as dps
from tests.helpers.variables import calls, sharded

SLICE_FULL = np.arange(1, 17).reshape(8, 2)


# -- the container ---------------------------------------------------------------------
def test_simple_properties():
    v0, v1 = dps.Variable([0]), dps.Variable([1])
    s = dps.ShardedVariable([v0, v1], name="s")
    assert s.variables == [v0, v1] and list(s) == [v0, v1]
    assert s.shape == (2,) and s.dtype == v0.dtype and s.name == "s"
    assert dps.ShardedVariable([v0]).name == "ShardedVariable"
    assert isinstance(s.numpy(), np.ndarray)
    np.testing.assert_array_equal(np.asarray(s), [0, 1])


@pytest.mark.parametrize("bad", [None, [], [dps.Variable([0]), "not-a-variable"], "ab", dps.Variable([0])])
def test_constructor_needs_non_empty_list_of_variables(bad):
    with pytest.raises(TypeError, match="non-empty list"):
        dps.ShardedVariable(bad)


def test_constructor_checks_dtypes_and_shapes():
    with pytest.raises(ValueError, match="same dtype"):
        dps.ShardedVariable([dps.Variable([0], dtype="int64"), dps.Variable([1], dtype="int32")])
    with pytest.raises(ValueError, match="equal shapes past axis 0"):
        dps.ShardedVariable([dps.Variable(np.ones((5, 10))), dps.Variable(np.ones((5, 20)))])
    with pytest.raises(ValueError, match="rank >= 1"):
        dps.ShardedVariable([dps.Variable(1.0)])


def test_operators_and_ufuncs():
    sv1 = dps.ShardedVariable([dps.Variable([1.0]), dps.Variable([2.0])])
    sv2 = dps.ShardedVariable([dps.Variable([1.0]), dps.Variable([2.0])])
    np.testing.assert_array_equal(sv1 == sv2, [True, True])
    np.testing.assert_array_equal(sv1 + sv2, [2.0, 4.0])
    np.testing.assert_array_equal(10 - sv1, [9.0, 8.0])
    np.testing.assert_array_equal(np.exp(sv1), np.exp(np.array([1.0, 2.0], np.float32)))
    # ref(): hashable, equal for the same variable, different for an equal-valued other one
    assert sv1.ref() == sv1.ref() and hash(sv1.ref()) == hash(sv1.ref()) and sv1.ref() != sv2.ref()
    assert len({sv1.ref(), sv1.ref(), sv2.ref()}) == 2
    assert {sv1.ref(): "one"}[sv1.ref()] == "one" and sv1.ref().deref() is sv1
    with pytest.raises(TypeError):
        hash(sv1)


@pytest.mark.parametrize("op, value, want", [
    ("assign", [[4, 4], [5, 5], [6, 6], [7, 7]], [[4, 4], [5, 5], [6, 6], [7, 7]]),
    ("assign_add", [[1, 1], [1, 1], [2, 2], [2, 2]], [[1, 1], [2, 2], [4, 4], [5, 5]]),
    ("assign_sub", [[0, 0], [1, 1], [1, 1], [3, 3]], [[0, 0], [0, 0], [1, 1], [0, 0]]),
])
def test_dense_updates_split_by_rows(strategy, op, value, want):
    sv = sharded(strategy, np.array([[0, 0], [1, 1], [2, 2], [3, 3]], np.int32), [1, 2, 1])
    before = calls(strategy, "update")
    assert getattr(sv, op)(value) is sv
    assert [b - a for a, b in zip(before, calls(strategy, "update"))] == [1, 1]  # both servers, once each
    np.testing.assert_array_equal(sv.variables[0].numpy(), want[:1])
    np.testing.assert_array_equal(sv.variables[1].numpy(), want[1:3])
    np.testing.assert_array_equal(sv.variables[2].numpy(), want[3:])


def test_dense_update_errors_change_nothing(strategy):
    full = np.arange(8, dtype=np.float32).reshape(4, 2)
    sv = sharded(strategy, full, [2, 2])
    with pytest.raises(ValueError, match=r"shape \(4, 2\)"):
        sv.assign(np.zeros((3, 2)))
    with pytest.raises(TypeError, match="numeric"):
        sv.assign_add(np.full((4, 2), "x"))
    np.testing.assert_array_equal(sv.numpy(), full)


def test_handle_pickles_small(strategy):
    sv = sharded(strategy, np.zeros((1000, 8), np.float32), [500, 500])
    blob = pickle.dumps(sv)
    assert len(blob) < 1500
    back = pickle.loads(blob)
    assert back.shape == (1000, 8) and back.name == "sv"
    np.testing.assert_array_equal(back[999], np.zeros(8))


# -- slicing -----------------------------------------------------------------------------
TF_SLICES = [
    np.s_[:], np.s_[:2], np.s_[-8:2], np.s_[-10:2], np.s_[5:], np.s_[5:-1], np.s_[::3], np.s_[::5],
    np.s_[1::6], np.s_[1:5:6], np.s_[1::7], np.s_[2:7], np.s_[2:7:2], np.s_[2:7:3],
    np.s_[::-1], np.s_[2::-1], np.s_[2:-8:-1], np.s_[2:-10:-1], np.s_[4::-1], np.s_[-1:-3:-1],
    np.s_[::-5], np.s_[6::-6], np.s_[6:5:-6], np.s_[6::-7], np.s_[7:1:-1], np.s_[7:1:-2], np.s_[7:1:-4],
    np.s_[0:0], np.s_[5:3], np.s_[3:5:-1], np.s_[-1:0], np.s_[2:-1:-1],
    np.s_[:, 0], np.s_[:, 0:1], np.s_[2], np.s_[6], np.s_[2, 1], np.s_[-2],
    np.s_[...], np.s_[..., 0], np.s_[0:1, ...], np.s_[np.newaxis, ...],
    SLICE_FULL > 10, np.s_[[0, 7, 0]], np.s_[[True] * 3 + [False] * 5], np.s_[3, [1, 0]],
]


@pytest.fixture
def slice_target(strategy):
    return sharded(strategy, SLICE_FULL.astype(np.int32), [3, 3, 2])


@pytest.mark.parametrize("index", TF_SLICES, ids=[str(i) for i in range(len(TF_SLICES))])
def test_tensorflow_slicing_cases(slice_target, index):
    got = slice_target[index]
    want = SLICE_FULL[index]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_out_of_bounds_and_zero_step(slice_target):
    for index in (100, -100, np.s_[:, 2], np.s_[[0, 8]]):
        with pytest.raises(IndexError):
            slice_target[index]
    with pytest.raises(ValueError, match="step"):
        slice_target[::0]


def test_reference_bug_first_row_of_a_shard(slice_target):
    """TensorFlow's integer lookup picks the wrong shard for a shard's first row; numpy's answer is kept."""
    for row in (0, 3, 6, -2, -5):
        np.testing.assert_array_equal(slice_target[row], SLICE_FULL[row])


def test_reads_only_the_shards_an_index_touches(strategy):
    sv = sharded(strategy, np.zeros((10, 4), np.float32), [5, 5])
    before, before_bytes = calls(strategy), [s["bytes_read"] for s in strategy.ps_stats()]
    sv[7, 1:3]
    stats = strategy.ps_stats()
    assert [s["calls"].get("read", 0) - b for s, b in zip(stats, before)] == [0, 1]
    assert sum(s["bytes_read"] - b for s, b in zip(stats, before_bytes)) == 2 * 4  # only the two elements
    before = calls(strategy)
    sv[1:4]
    assert [b - a for a, b in zip(before, calls(strategy))] == [1, 0]


def _random_index(r: np.random.Generator, n: int):
    def bound():
        return None if r.integers(0, 3) == 0 else int(r.integers(-n - 3, n + 3))

    def component(size: int):
        k = r.integers(0, 9)
        if k == 0:
            return int(r.integers(-size - 1, size + 1))
        if k <= 3:
            return slice(bound(), bound(), None if r.integers(0, 3) == 0 else int(r.choice([-3, -2, -1, 1, 2, 3])))
        if k == 4:
            return None
        if k == 5:
            return Ellipsis
        if k == 6:
            return [int(x) for x in r.integers(-size, size, size=r.integers(0, 5))]
        if k == 7:
            return r.integers(0, 2, size=size).astype(bool)
        return r.integers(-size, size, size=(2, 2))

    index = tuple(component(n if i == 0 else 3) for i in range(r.integers(1, 4)))
    return index[0] if len(index) == 1 and r.integers(0, 2) else index


def _compare(sv, full, index):
    try:
        want = full[index]
    except (IndexError, ValueError, TypeError) as exc:
        with pytest.raises(type(exc)):
            sv[index]
        return
    got = sv[index]
    assert got.shape == want.shape and got.dtype == want.dtype, index
    np.testing.assert_array_equal(got, want, err_msg=str(index))


def test_random_slicing_matches_numpy_locally():
    """3000 random index expressions on random row layouts (local shards)."""
    for seed in range(3000):
        r = np.random.default_rng(seed)
        sizes = [int(x) for x in r.integers(0, 5, size=r.integers(1, 5))]
        sizes[0] = max(sizes[0], 1)
        full = np.arange(sum(sizes) * 9, dtype=np.float32).reshape(sum(sizes), 3, 3)
        offsets = np.cumsum([0] + sizes)
        sv = dps.ShardedVariable([dps.Variable(full[a:b]) for a, b in zip(offsets, offsets[1:])])
        _compare(sv, full, _random_index(r, full.shape[0]))


def test_random_slicing_matches_numpy_on_servers(strategy):
    full = np.arange(13 * 3 * 3, dtype=np.float32).reshape(13, 3, 3)
    sv = sharded(strategy, full, [3, 3, 3, 2, 2])
    for seed in range(150):
        _compare(sv, full, _random_index(np.random.default_rng(10_000 + seed), 13))


# -- partitioned creation ---------------------------------------------------------------
@pytest.fixture
def partitioned(client):
    def make(partitioner):
        return dps.ParameterServerStrategy(client, variable_partitioner=partitioner)

    return make


def test_13_rows_over_5_shards(partitioned):
    strategy = partitioned(dps.partitioners.FixedShardsPartitioner(5))
    full = np.arange(13 * 2, dtype=np.float32).reshape(13, 2)
    with strategy.scope():
        v = dps.Variable(full, name="emb")
    assert isinstance(v, dps.ShardedVariable) and v.name == "emb"
    assert [s.shape[0] for s in v.variables] == [3, 3, 3, 2, 2]
    assert [s.name for s in v.variables] == [f"emb/part_{i}" for i in range(5)]
    assert [s.device[-len("task:0/device:CPU:0"):][:6] for s in v.variables] == ["task:0", "task:1"] * 2 + ["task:0"]
    np.testing.assert_array_equal(v.numpy(), full)
    assert strategy.extended.variable_created_in_scope(v)


def test_round_robin_counter_is_shared_with_unsplit_variables(partitioned):
    strategy = partitioned(dps.partitioners.FixedShardsPartitioner(4))
    with strategy.scope():
        v = dps.Variable(np.arange(10))
        w = dps.Variable(np.arange(3))  # 3 shards: at most shape[0]
        s = dps.Variable(5.0)  # rank 0: never split
    assert [len(v.variables), len(w.variables)] == [4, 3]
    assert [x.numpy().tolist() for x in v.variables] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    devices = [x.device for x in v.variables + w.variables] + [s.device]
    assert [d.split("/")[3] for d in devices] == ["task:0", "task:1"] * 4


def test_one_partition_gives_a_plain_variable(partitioned):
    strategy = partitioned(dps.partitioners.MinSizePartitioner(min_shard_bytes=64 << 20, max_shards=2))
    with strategy.scope():
        v = dps.Variable(lambda shape, dtype: np.zeros(shape, dtype), shape=(10,), dtype=np.int64)
    assert isinstance(v, dps.Variable) and v.dtype == np.int64


def test_colocated_variables_are_never_split(partitioned):
    strategy = partitioned(dps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        v1 = dps.Variable([0, 1, 2, 3])
        with strategy.extended.colocate_vars_with(v1.variables[0]):
            v2 = dps.Variable([4, 5])
    assert isinstance(v1, dps.ShardedVariable) and isinstance(v2, dps.Variable)
    assert v2.device == v1.variables[0].device


@pytest.mark.parametrize("result", [None, [], [0, 1, 1], [2, 2, 1], [-1, 1, 1], 3])
def test_bad_partitioner_result_names_variable_partitioner(partitioned, result):
    strategy = partitioned(lambda shape, dtype: result)
    with strategy.scope():
        with pytest.raises(ValueError, match="variable_partitioner"):
            dps.Variable(np.zeros((2, 2, 2)))


def test_missing_initial_value(partitioned):
    strategy = partitioned(dps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        with pytest.raises(ValueError, match="initial_value"):
            dps.Variable(shape=(4,), dtype=np.float32)


def test_partition_without_shape_or_dtype_builds_the_value_here(partitioned):
    strategy = partitioned(dps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        vs = [
            dps.Variable(lambda: np.arange(4, dtype=np.int64), dtype=np.int64),
            dps.Variable(lambda: np.arange(4, dtype=np.int64), shape=(4,)),
            dps.Variable(lambda: np.arange(4, dtype=np.int64)),
        ]
    for v in vs:
        assert [s.numpy().tolist() for s in v.variables] == [[0, 1], [2, 3]]


def _partition_aware(shape, dtype, partition_shape, partition_offset):
    get_worker()  # only on a parameter server
    rows = np.arange(partition_offset[0], partition_offset[0] + partition_shape[0])
    return np.eye(shape[0], shape[1], dtype=dtype)[rows]


def test_partition_aware_initializer_runs_per_shard_on_the_servers(partitioned):
    strategy = partitioned(dps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        v = dps.Variable(_partition_aware, shape=(4, 4), dtype=np.int64)
    assert v.variables[0].numpy().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0]]
    assert v.variables[1].numpy().tolist() == [[0, 0, 1, 0], [0, 0, 0, 1]]


def _whole_value(shape, dtype):
    return np.arange(np.prod(shape), dtype=dtype).reshape(shape)


def test_whole_value_initializer_is_sliced_with_a_warning_when_large(partitioned):
    strategy = partitioned(dps.partitioners.FixedShardsPartitioner(3))
    with strategy.scope():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            small = dps.Variable(_whole_value, shape=(6, 2), dtype=np.float32)  # no warning
        with dask.config.set({"daskps.large-variable-elements": 10}):
            with pytest.warns(ResourceWarning, match="partition_shape"):
                big = dps.Variable(_whole_value, shape=(6, 2), dtype=np.float32)
    for v in (small, big):
        np.testing.assert_array_equal(v.numpy(), _whole_value((6, 2), np.float32))


def test_create_partitioned_variables_under_the_strategy(strategy):
    with strategy.scope():
        parts = dps.create_partitioned_variables((5, 4), [1, 2], _partition_slice, dtype=np.float32, name="p")
    assert [p.shape for p in parts] == [(5, 2), (5, 2)]
    assert parts[0].device != parts[1].device
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in parts], axis=1), _whole_value((5, 4), np.float32))


def _partition_slice(shape, dtype, partition_shape, partition_offset):
    get_worker()
    index = tuple(slice(o, o + n) for o, n in zip(partition_offset, partition_shape))
    return _whole_value(shape, dtype)[index]


def _ones_part(partition_shape, dtype):
    return np.ones(partition_shape, dtype)


def test_large_variable_never_exists_on_the_coordinator(partitioned):
    """768 MB, built shard by shard on the servers: the coordinator grows by far less than 64 MB."""
    strategy = partitioned(dps.partitioners.MaxSizePartitioner(max_shard_bytes=400 << 20))
    proc = psutil.Process(os.getpid())
    gc.collect()
    before = proc.memory_info().rss
    with strategy.scope():
        v = dps.Variable(_ones_part, shape=(196_608, 1024), dtype=np.float32, name="huge")
    grown = proc.memory_info().rss - before
    assert v.nbytes == 768 << 20 and len(v.variables) == 2
    assert grown < 64 << 20, f"coordinator grew by {grown / 2**20:.1f} MB"
    np.testing.assert_array_equal(v[196_607, :3], np.ones(3, np.float32))
    assert sum(s["nbytes"] for s in strategy.ps_stats()) >= 768 << 20


# -- on the workers ----------------------------------------------------------------------
def test_training_code_reads_shards_from_the_worker(partitioned, client):
    strategy = partitioned(dps.partitioners.FixedShardsPartitioner(2))
    coordinator = dps.ClusterCoordinator(strategy)
    full = np.arange(40, dtype=np.float32).reshape(20, 2)
    with strategy.scope():
        table = dps.Variable(full, name="table")

    def step(ids):
        from daskps.client import protocol

        assert protocol.transport_here().pool is get_worker().rpc  # the worker's own connections
        rows = strategy.run(lambda: dps.embedding_lookup(table, ids))
        table.scatter_add(dps.IndexedSlices(np.ones((len(ids), 2), np.float32), ids))
        return rows.sum(), table[ids[0]]

    results = [coordinator.schedule(step, args=(np.array([i, 19 - i]),)) for i in range(4)]
    coordinator.join()
    fetched = coordinator.fetch(results)
    assert fetched[0][0] == full[[0, 19]].sum()
    want = full.copy()
    for i in range(4):
        want[[i, 19 - i]] += 1
    np.testing.assert_array_equal(table.numpy(), want)


def test_read_values_mixes_sharded_and_plain_variables(strategy):
    full = np.arange(12, dtype=np.float32).reshape(6, 2)
    sv = sharded(strategy, full, [2, 2, 2])
    with strategy.scope():
        v = dps.Variable([1.0, 2.0])
    before = calls(strategy)
    got = dps.read_values([sv, v])
    assert [b - a for a, b in zip(before, calls(strategy))] == [1, 1]
    np.testing.assert_array_equal(got[0], full)
    np.testing.assert_array_equal(got[1], [1.0, 2.0])


def _fails_on_the_second_shard(shape, dtype, partition_shape, partition_offset):
    if partition_offset[0] > 0:
        raise RuntimeError("initializer failed on shard 1")
    return np.zeros(partition_shape, dtype)


def test_a_failed_partitioned_create_leaves_nothing(partitioned):
    strategy = partitioned(dps.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        first = dps.Variable(np.zeros(4, np.float32), name="before")  # the rotation: ps 0, ps 1
        before = [sorted(n for n, _, _ in s["variables"].values()) for s in strategy.ps_stats()]
        with pytest.raises(RuntimeError, match="shard 1"):
            dps.Variable(_fails_on_the_second_shard, shape=(6, 2), dtype=np.float32, name="doomed")
        assert [sorted(n for n, _, _ in s["variables"].values()) for s in strategy.ps_stats()] == before
        after = dps.Variable(np.zeros(4, np.float32), name="after")  # takes the places the failure did not
    assert [v.device for v in after.variables] == [v.device for v in first.variables]
