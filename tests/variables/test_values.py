"""Values in this process (``daskps._core``): IndexedSlices, array checks and initializers, nested structures.

Expected values are numpy's, or follow from the definitions in the docstrings; expected messages are the
exact text a user sees. Nothing is compared with daskps' own output.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from daskps._core import arrays as A
from daskps._core import nest
from daskps._core.slices import IndexedSlices


# -- IndexedSlices ---------------------------------------------------------------------------------------
def test_indexed_slices_of_no_rows_has_integer_indices():
    s = IndexedSlices(np.zeros((0, 2)), [], dense_shape=(3, 2))
    assert s.indices.dtype == np.intp and np.asarray(s).tolist() == [[0, 0]] * 3


def test_indexed_slices_keeps_the_values_dtype_when_made_dense():
    s = IndexedSlices(np.array([[1, 2]], np.int32), [1], dense_shape=(2, 2))
    assert np.asarray(s).dtype == np.int32
    assert np.asarray(s, dtype=np.float16).dtype == np.float16


def test_indexed_slices_refusals_are_exact():
    with pytest.raises(TypeError) as info:
        IndexedSlices(np.zeros(2), np.array([0.0, 1.0]))
    assert str(info.value) == "indices must be integers, got dtype float64"
    with pytest.raises(ValueError) as info:
        IndexedSlices(np.zeros((2, 3)), [0, 1], dense_shape=(4, 2))
    assert str(info.value) == "values rows have shape (3,), which does not fit dense_shape (4, 2)"
    with pytest.raises(ValueError) as info:
        np.asarray(IndexedSlices(np.zeros((2, 3)), [0, 1]))
    assert str(info.value) == "only IndexedSlices with 1-D indices and a dense_shape convert to a dense array"


# -- arrays ----------------------------------------------------------------------------------------------
class _NoDtype:
    def __array__(self, dtype=None, copy=None):
        return np.array([1.0, 2.0])


class _Typed(_NoDtype):
    dtype = np.dtype("float64")


def test_only_things_with_a_dtype_keep_64_bits():
    assert A.default_array(_NoDtype()).dtype == np.float32
    assert A.default_array(_Typed()).dtype == np.float64
    assert A.materialize(_Typed(), None, None, "w").dtype == np.float64
    assert A.materialize(_NoDtype(), None, None, "w").dtype == np.float32


def test_default_array_refusals_are_exact():
    with pytest.raises(ValueError, match=r"^v must be an array-like of one shape: "):
        A.default_array([[1.0], [1.0, 2.0]], "v")
    with pytest.raises(TypeError) as info:
        A.default_array("abc")
    assert str(info.value) == "value must be numeric, got dtype <U3 from str"


def test_check_variable_args():
    assert A.check_variable_args(1.0, None, None, None) == ("Variable", None, None)
    assert A.check_variable_args(1.0, "w", "int8", [0, 3]) == ("w", np.dtype("int8"), (0, 3))
    for kwargs, error, message in [
        ((None, "w", None, None), ValueError, "initial_value must be given (an array-like or a callable), got None"),
        ((1.0, "", None, None), TypeError, "name must be a non-empty str, got ''"),
        ((1.0, "w", "nope", None), TypeError, "dtype must be a numpy dtype, got 'nope'"),
        ((1.0, "w", "U3", None), TypeError, "dtype must be numeric, got <U3"),
        ((1.0, "w", None, 3), TypeError, "shape must be a tuple of ints, got 3"),
        ((1.0, "w", None, (2, -1)), ValueError, "shape must not have negative dimensions, got (2, -1)"),
    ]:
        with pytest.raises(error) as info:
            A.check_variable_args(*kwargs)
        assert str(info.value) == message


def test_call_initializer_offers_what_is_named():
    seen = {}

    def part(shape, partition_shape, partition_offset):
        seen.update(shape=shape, partition_shape=partition_shape, partition_offset=partition_offset)

    A.call_initializer(part, (4, 3), np.dtype("float32"))
    assert seen == {"shape": (4, 3), "partition_shape": (4, 3), "partition_offset": (0, 0)}
    A.call_initializer(part, (4, 3), None, (2, 3), (2, 0))
    assert seen == {"shape": (4, 3), "partition_shape": (2, 3), "partition_offset": (2, 0)}
    got = A.call_initializer(lambda **kw: kw, (2,), np.dtype("int8"))
    assert got == {"shape": (2,), "dtype": np.dtype("int8"), "partition_shape": (2,), "partition_offset": (0,)}
    assert A.call_initializer(lambda **kw: kw, None, None) == {}
    assert A.call_initializer(lambda: 5, (2,), None) == 5


def test_build_part_cuts_the_part_from_a_whole_value():
    whole = np.arange(12).reshape(4, 3)
    got, built = A.build_part(whole, None, (4, 3), None, (2, 3), (2, 0))
    assert built and got.tolist() == whole[2:4].tolist()
    got, built = A.build_part(whole[2:4], None, (4, 3), None, (2, 3), (2, 0))
    assert not built and got.tolist() == whole[2:4].tolist()
    got, built = A.build_part(whole, None, (4, 3), None, (4, 3), (0, 0))
    assert not built and got is whole
    got, built = A.build_part(whole, None, (4, 3), None, None, None)
    assert not built and got is whole
    got, built = A.build_part(whole, None, (4, 3), None, (2, 3), None)
    assert not built and got is whole
    got, built = A.build_part(None, lambda shape: np.ones(shape), (4, 3), None, (1, 3), (3, 0))
    assert built and got.shape == (1, 3)


def test_materialize_copies_unless_the_value_is_a_fresh_array():
    base = np.arange(4.0)
    assert not np.shares_memory(A.materialize(base, None, None, "w"), base)
    assert A.materialize(base, None, None, "w", fresh=True) is base
    view = base[1:]
    assert not np.shares_memory(A.materialize(view, None, None, "w", fresh=True), base)


def test_materialize_defaults_and_refusals():
    assert A.materialize([True, False], None, None, "w").dtype == np.bool_
    assert A.materialize([1, 2], None, None, "w").dtype == np.int32
    with pytest.raises(TypeError, match=r"^initial_value of variable 'w' cannot be an array of dtype float32: "):
        A.materialize(["a"], np.dtype("float32"), None, "w")
    with pytest.raises(TypeError, match=r"^initial_value of variable 'w' cannot be an array of dtype numbers: "):
        A.materialize([[1.0], [1.0, 2.0]], None, None, "w")
    with pytest.raises(ValueError) as info:
        A.materialize([1.0], None, (2,), "w")
    assert str(info.value) == "initial_value of variable 'w' has shape (1,), expected shape (2,)"
    with pytest.raises(TypeError) as info:
        A.materialize(np.array(["a"]), None, None, "w")
    assert str(info.value) == "initial_value of variable 'w' must hold numbers, got dtype <U1"


# -- nest ------------------------------------------------------------------------------------------------
Pair = collections.namedtuple("Pair", "a b")


def test_map_structure_keeps_every_container_type():
    tree = {"x": [1, (2, 3)], "p": Pair(4, {"y": 5}), "o": collections.OrderedDict(z=6)}
    got = nest.map_structure(lambda v: v * 10, tree)
    assert got == {"x": [10, (20, 30)], "p": Pair(40, {"y": 50}), "o": collections.OrderedDict(z=60)}
    assert type(got["p"]) is Pair and type(got["x"][1]) is tuple and type(got["o"]) is collections.OrderedDict
    assert nest.flatten(tree) == [1, 2, 3, 4, 5, 6]
    assert nest.flatten(7) == [7] and nest.map_structure(str, []) == []
