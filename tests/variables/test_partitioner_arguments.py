"""Partitioners' defaults, edges and exact refusals (``daskps.distribute.partitioners``).

The numbers are TensorFlow's formulas from ``partitioned_variables.py``
(``/work/shared/reference/partitioned_variables.py.txt``), written out here
for the cases ``tests/data/tf_partitioner_cases.json`` does not reach:
default arguments, string dtypes at their default size, negative axes and
empty variables.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from daskps import partitioners as P


def test_min_max_defaults_are_one_partition_and_16_byte_strings():
    # TF: max_partitions=1 -> one partition however large
    assert P.min_max_variable_partitioner()((1 << 20, 4), np.float32) == [1, 1]
    # 4096 strings x 16 bytes = 64 KiB over min_slice_size 1 KiB -> 64 partitions
    assert P.min_max_variable_partitioner(max_partitions=1000, min_slice_size=1024)((4096,), np.str_) == [64]
    assert P.MinSizePartitioner()((1 << 20, 4), np.float32) == [1, 1]
    assert P.MinSizePartitioner(min_shard_bytes=1024, max_shards=1000)((4096,), np.bytes_) == [64]


def test_max_size_strings_count_16_bytes_by_default():
    # TF: bytes_per_slice = 16 * 3 = 48; slices_per_shard = floor(100 / 48) = 2; ceil(10 / 2) = 5
    assert P.variable_axis_size_partitioner(100)((10, 3), np.object_) == [5, 1]
    assert P.MaxSizePartitioner(100)((10, 3), np.str_) == [5, 1]
    # float32: 12 bytes a slice, 8 slices a shard, ceil(10 / 8) = 2
    assert P.MaxSizePartitioner(100)((10, 3), np.float32) == [2, 1]


@pytest.mark.parametrize("shape", [(0, 3), (4, 0), (0,)])
def test_an_empty_variable_is_one_shard(shape):
    assert P.variable_axis_size_partitioner(8)(shape, np.float32) == [1] * len(shape)
    assert P.MaxSizePartitioner(8, max_shards=3)(shape, np.float32) == [1] * len(shape)


def test_a_single_element_is_one_shard_by_the_formula():
    assert P.MaxSizePartitioner(1)((1, 1), np.float64) == [1, 1]


@pytest.mark.parametrize("axis, want", [(-2, [3, 1]), (-1, [1, 3]), (0, [3, 1]), (1, [1, 3])])
def test_every_axis_in_minus_rank_to_rank_is_accepted(axis, want):
    assert P.FixedShardsPartitioner(3)((6, 6), np.float32, axis=axis) == want
    assert P.fixed_size_partitioner(3, axis=axis)((6, 6)) == want


def test_fixed_size_partitioner_splits_axis_0_by_default():
    assert P.fixed_size_partitioner(3)((6, 6)) == [3, 1]


@pytest.mark.parametrize(
    "make",
    [lambda: P.fixed_size_partitioner(2, axis=3), lambda: P.min_max_variable_partitioner(2, axis=3),
     lambda: P.variable_axis_size_partitioner(8, axis=3)],
    ids=["fixed", "min_max", "axis_size"],
)
def test_each_partition_function_names_the_shape_with_a_bad_axis(make):
    with pytest.raises(ValueError) as info:
        make()((6, 6), np.float32)
    assert str(info.value) == "axis must be an int in [-2, 2) for shape (6, 6), got 3"


@pytest.mark.parametrize("axis", [2, -3, 1.0, True, "0", None])
def test_an_axis_out_of_range_is_refused_with_the_shape(axis):
    with pytest.raises(ValueError) as info:
        P.MinSizePartitioner()((6, 6), np.float32, axis=axis)
    assert str(info.value) == f"axis must be an int in [-2, 2) for shape (6, 6), got {axis!r}"


@pytest.mark.parametrize(
    "make, arg, value",
    [
        (lambda v: P.fixed_size_partitioner(v), "num_shards", 0),
        (lambda v: P.FixedShardsPartitioner(v), "num_shards", -1),
        (lambda v: P.FixedShardsPartitioner(v), "num_shards", True),
        (lambda v: P.min_max_variable_partitioner(max_partitions=v), "max_partitions", 0),
        (lambda v: P.min_max_variable_partitioner(min_slice_size=v), "min_slice_size", 0.5),
        (lambda v: P.min_max_variable_partitioner(bytes_per_string_element=v), "bytes_per_string_element", 0),
        (lambda v: P.variable_axis_size_partitioner(v), "max_shard_bytes", 0),
        (lambda v: P.variable_axis_size_partitioner(8, bytes_per_string_element=v), "bytes_per_string_element", -2),
        (lambda v: P.variable_axis_size_partitioner(8, max_shards=v), "max_shards", 0),
        (lambda v: P.MinSizePartitioner(min_shard_bytes=v), "min_shard_bytes", "1"),
        (lambda v: P.MinSizePartitioner(max_shards=v), "max_shards", None),
        (lambda v: P.MinSizePartitioner(bytes_per_string=v), "bytes_per_string", 0),
        (lambda v: P.MaxSizePartitioner(v), "max_shard_bytes", 0),
        (lambda v: P.MaxSizePartitioner(8, max_shards=v), "max_shards", 0),
        (lambda v: P.MaxSizePartitioner(8, bytes_per_string=v), "bytes_per_string", 0),
    ],
)
def test_a_bad_argument_is_refused_by_name(make, arg, value):
    with pytest.raises(ValueError) as info:
        make(value)
    assert str(info.value) == f"{arg} must be a positive int, got {value!r}"


def test_numpy_ints_are_accepted_and_none_means_no_limit():
    assert P.FixedShardsPartitioner(np.int64(2))((4,), np.float32) == [2]
    assert P.MaxSizePartitioner(4, max_shards=None)((6, 1), np.float32) == [6, 1]


@pytest.mark.parametrize("shape", [5, "ab", (2, "x"), (2, 2.5j)])
def test_a_shape_that_is_not_ints_is_refused(shape):
    with pytest.raises(ValueError) as info:
        P.FixedShardsPartitioner(2)(shape)
    assert str(info.value) == f"shape must be a tuple of ints, got {shape!r}"


def test_a_shape_with_none_is_refused():
    with pytest.raises(ValueError) as info:
        P.MaxSizePartitioner(8)((None, 2), np.float32)
    assert str(info.value) == "shape must be fully defined, got (None, 2)"


def test_a_dtype_that_is_not_one_is_refused():
    with pytest.raises(ValueError) as info:
        P.MinSizePartitioner()((2,), "not-a-dtype")
    assert str(info.value) == "dtype must be a numpy dtype, got 'not-a-dtype'"


def test_the_base_class_says_what_to_implement():
    with pytest.raises(NotImplementedError) as info:
        P.Partitioner()((2,), np.float32)
    assert str(info.value) == "Partitioner subclasses must implement __call__(shape, dtype, axis=0)"


def test_repr_lists_every_argument():
    assert repr(P.MinSizePartitioner(1024, 4, 8)) == "MinSizePartitioner(min_shard_bytes=1024, max_shards=4, bytes_per_string=8)"
    assert repr(P.MaxSizePartitioner(64)) == "MaxSizePartitioner(max_shard_bytes=64, max_shards=None, bytes_per_string=16)"


@pytest.mark.parametrize("rows, n", [(13, 5), (4, 4), (3, 5), (0, 2), (10, 1), (7, 3)])
def test_div_offsets_are_tensorflows_div_split(rows, n):
    # TF's "div" strategy: the first rows % n shards get ceil(rows / n) rows, the rest floor(rows / n)
    sizes = [math.ceil(rows / n) if i < rows % n else rows // n for i in range(n)]
    assert P.div_offsets(rows, n) == [sum(sizes[:i]) for i in range(n + 1)]
