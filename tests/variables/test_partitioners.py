"""Partitioners give TensorFlow's numbers; create_partitioned_variables splits "div"-style."""

from __future__ import annotations

import json

import numpy as np
import pytest

import daskps as dps
from daskps import partitioners as P
from tests.helpers.paths import TESTS

CASES = json.loads((TESTS / "data" / "tf_partitioner_cases.json").read_text())


def _dtype(name: str) -> np.dtype:
    return np.dtype("U") if name == "string" else np.dtype(name)


def _ours(case: dict) -> list[int]:
    kind, args, shape, axis = case["kind"], case["args"], tuple(case["shape"]), case["axis"]
    dtype = _dtype(case["dtype"])
    if kind in ("FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"):
        return getattr(P, kind)(**args)(shape, dtype, axis=axis)
    return getattr(P, kind)(axis=axis, **args)(shape=shape, dtype=dtype)


def test_every_case_matches_tensorflow():
    """600 shapes x dtypes x arguments, answered by TensorFlow (see tests/data/make_tf_partitioner_cases.py)."""
    wrong = [(c, _ours(c)) for c in CASES["cases"] if _ours(c) != c["result"]]
    assert not wrong, wrong[:5]
    assert {c["kind"] for c in CASES["cases"]} == {
        "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner",
        "fixed_size_partitioner", "min_max_variable_partitioner", "variable_axis_size_partitioner",
    }


def test_documented_examples():
    assert P.FixedShardsPartitioner(num_shards=2)((10, 3), np.float32) == [2, 1]
    assert P.MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [2, 1]
    assert P.MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32) == [6, 1]
    assert P.MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32) == [6, 1]
    assert P.MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [2, 1]
    assert P.MaxSizePartitioner(max_shard_bytes=1024)((6, 1), np.float32) == [1, 1]
    assert P.min_max_variable_partitioner(max_partitions=16)((1024, 1024), np.float32) == [16, 1]
    assert P.min_max_variable_partitioner(max_partitions=8)((1024, 1024), np.float32) == [8, 1]


def test_strings_count_bytes_per_string():
    part = P.MinSizePartitioner(min_shard_bytes=10, max_shards=100, bytes_per_string=5)
    assert part((20,), np.dtype("U3")) == [10]  # 20 strings x 5 bytes / 10
    assert part((20,), np.dtype(object)) == [10]
    assert part((20,), np.float64) == [16]


def test_other_axis():
    assert P.FixedShardsPartitioner(3)((4, 10), np.float32, axis=1) == [1, 3]
    assert P.fixed_size_partitioner(3, axis=-1)(shape=(4, 10)) == [1, 3]


@pytest.mark.parametrize(
    "make",
    [
        lambda: P.FixedShardsPartitioner(0),
        lambda: P.MinSizePartitioner(min_shard_bytes=0),
        lambda: P.MinSizePartitioner(max_shards=0),
        lambda: P.MinSizePartitioner(bytes_per_string=0),
        lambda: P.MaxSizePartitioner(max_shard_bytes=0),
        lambda: P.MaxSizePartitioner(max_shard_bytes=10, max_shards=-1),
        lambda: P.MaxSizePartitioner(max_shard_bytes=10, bytes_per_string=0),
        lambda: P.fixed_size_partitioner(0),
        lambda: P.min_max_variable_partitioner(max_partitions=0),
        lambda: P.variable_axis_size_partitioner(max_shard_bytes=-5),
        lambda: P.FixedShardsPartitioner(2.5),
    ],
)
def test_invalid_arguments_raise_value_error(make):
    with pytest.raises(ValueError, match="must be a positive int"):
        make()


def test_invalid_call_arguments():
    with pytest.raises(ValueError, match="axis"):
        P.FixedShardsPartitioner(2)((3, 4), np.float32, axis=2)
    with pytest.raises(ValueError, match="fully defined"):
        P.MinSizePartitioner()((None, 4), np.float32)
    with pytest.raises(ValueError, match="dtype"):
        P.MaxSizePartitioner(10)((3,), "not-a-dtype")


def test_partitioner_base_class():
    with pytest.raises(NotImplementedError):
        P.Partitioner()((2,), np.float32)
    assert repr(P.FixedShardsPartitioner(3)) == "FixedShardsPartitioner(num_shards=3)"


def test_div_offsets_13_over_5():
    offsets = P.div_offsets(13, 5)
    rows = [list(range(a, b)) for a, b in zip(offsets, offsets[1:])]
    assert rows == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10], [11, 12]]


def test_create_partitioned_variables_locally():
    full = np.arange(26, dtype=np.float32).reshape(13, 2)
    parts = dps.create_partitioned_variables((13, 2), [5, 1], full, name="emb")
    assert [p.name for p in parts] == [f"emb/part_{i}" for i in range(5)]
    assert [p.shape for p in parts] == [(3, 2), (3, 2), (3, 2), (2, 2), (2, 2)]
    np.testing.assert_array_equal(np.concatenate([p.numpy() for p in parts]), full)


def test_create_partitioned_variables_along_axis_1_with_callable():
    seen = []

    def init(shape, dtype, partition_shape, partition_offset):
        seen.append((shape, partition_shape, partition_offset))
        return np.full(partition_shape, partition_offset[1], dtype)

    parts = dps.create_partitioned_variables((2, 5), [1, 2], init, dtype=np.int32)
    assert [p.shape for p in parts] == [(2, 3), (2, 2)]
    assert seen == [((2, 5), (2, 3), (0, 0)), ((2, 5), (2, 2), (0, 3))]
    np.testing.assert_array_equal(parts[1].numpy(), np.full((2, 2), 3))
    assert parts[0].name == "PartitionedVariable/part_0"


def test_create_partitioned_variables_slices_a_whole_value_initializer():
    parts = dps.create_partitioned_variables((4,), [2], lambda shape, dtype: np.arange(4, dtype=dtype))
    assert [p.numpy().tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0]]


@pytest.mark.parametrize(
    "shape, slicing, match",
    [
        ((4, 2), [2], "same length"),
        ((), [], "rank"),
        ((4, 4), [2, 2], "at most one"),
        ((4,), [0], "positive"),
        ((3,), [4], "3 rows"),
    ],
)
def test_create_partitioned_variables_errors(shape, slicing, match):
    with pytest.raises(ValueError, match=match):
        dps.create_partitioned_variables(shape, slicing, np.zeros(shape))


def test_create_partitioned_variables_checks_initializer_shape():
    with pytest.raises(ValueError, match="initializer has shape"):
        dps.create_partitioned_variables((4,), [2], np.zeros(5))
