"""Checking and applying updates (``daskps._core.updates``), in this process.

References: numpy loops written from TensorFlow's documented rules
(``tf.compat.v1.scatter_*``: repeated indices apply one after another;
integer ``scatter_div`` truncates toward zero, as C++ integer division;
``batch_scatter_update``: ``var[i..., indices[i..., j]] = updates[i..., j]``).
Every refusal is checked by its exact message.
"""

from __future__ import annotations

import numpy as np
import pytest

from daskps._core import updates as U
from daskps._core.slices import IndexedSlices


def _loop(arr, op, idx, vals):
    out = arr.copy()
    for i, v in zip(idx, vals):
        if op == "scatter_add":
            out[i] = out[i] + v
        elif op == "scatter_sub":
            out[i] = out[i] - v
        elif op == "scatter_mul":
            out[i] = out[i] * v
        elif op == "scatter_min":
            out[i] = np.minimum(out[i], v)
        elif op == "scatter_max":
            out[i] = np.maximum(out[i], v)
        elif op == "scatter_update":
            out[i] = v
        elif op == "scatter_div":
            if out.dtype.kind in "iu":
                a, b = np.asarray(out[i]).astype(np.int64), np.asarray(v).astype(np.int64)
                out[i] = np.array([int(x / y) if abs(x) < 2**52 else 0 for x, y in
                                   zip(np.ravel(a), np.ravel(np.broadcast_to(b, a.shape)))]).reshape(np.shape(a))
            else:
                out[i] = out[i] / v
    return out


@pytest.mark.parametrize("op", U.SCATTER_OPS)
@pytest.mark.parametrize("dtype", ["float64", "int32"])
def test_scatter_with_repeated_indices_applies_one_after_another(op, dtype):
    rng = np.random.default_rng(3)
    arr = rng.integers(-20, 20, size=(5, 2)).astype(dtype)
    idx = np.array([4, 0, 4, 2, 4, 0])
    vals = rng.integers(1, 6, size=(6, 2)) * rng.choice([-1, 1], size=(6, 2))
    vals = vals.astype(dtype)
    payload = U.check_update(arr.shape, arr.dtype, "w", op, (idx, vals))
    want = _loop(arr, op, idx, vals)
    U.apply_update(arr, op, payload)
    np.testing.assert_array_equal(arr, want)


def test_integer_scatter_div_truncates_toward_zero_for_every_sign():
    arr = np.array([7, -7, 7, -7, 9], np.int64)
    idx = np.array([0, 1, 2, 3, 4, 4])
    vals = np.array([2, 2, -2, -2, 2, -2], np.int64)
    U.apply_update(arr, "scatter_div", U.check_update(arr.shape, arr.dtype, "w", "scatter_div", (idx, vals)))
    assert arr.tolist() == [3, -3, -3, 3, -2]  # 9 / 2 = 4, then 4 / -2 = -2


def test_integer_scatter_div_is_exact_beyond_float_precision():
    arr = np.array([2**62 + 1, -(2**62) - 3, 7], np.int64)
    payload = U.check_update(arr.shape, arr.dtype, "w", "scatter_div", ([0, 1, 2], np.array([1, 2, -7], np.int64)))
    U.apply_update(arr, "scatter_div", payload)
    assert arr.tolist() == [2**62 + 1, -(2**61) - 1, -1]


@pytest.mark.parametrize("op, vals", [("scatter_div", [0.0, 0.0]), ("scatter_mul", [1e308, 1e308]),
                                      ("scatter_add", [1e308, 1e308])])
def test_float_scatter_overflow_and_division_by_zero_are_silent(op, vals):
    import warnings

    arr = np.array([1.0, 1e308, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        U.apply_update(arr, op, U.check_update(arr.shape, arr.dtype, "w", op, ([0, 1], vals)))
    assert np.isinf(arr[1])


def test_a_float_variable_into_an_integer_one_is_refused_as_a_cast():
    sl = IndexedSlices(np.ones((1, 2)), [1], dense_shape=(3, 2))  # whole numbers, but float64
    with pytest.raises(TypeError) as info:
        U.coerce_values(sl, np.dtype(np.int32), "w", "v")
    assert str(info.value) == "v for variable 'w' must have a dtype castable to int32, got float64"


def test_check_gradient_names_the_variable():
    with pytest.raises(ValueError) as info:
        U.check_gradient((3,), np.dtype(np.float32), "w", [1.0])
    assert str(info.value) == "gradient for variable 'w' must have shape (3,), got (1,)"
    with pytest.raises(IndexError) as info:
        U.check_gradient((3,), np.dtype(np.float32), "w", IndexedSlices(np.ones(1), [5]))
    assert str(info.value) == "gradient indices for variable 'w': index 5 is out of range [0, 3)"


def test_dense_ops():
    arr = np.arange(4.0)
    U.apply_update(arr, "add", U.check_update((4,), np.float64, "w", "add", [1, 1, 1, 1]))
    U.apply_update(arr, "sub", U.check_update((4,), np.float64, "w", "sub", np.array([0.5, 0, 0, 0])))
    assert arr.tolist() == [0.5, 2.0, 3.0, 4.0]
    U.apply_update(arr, "assign", U.check_update((4,), np.float64, "w", "assign", [9, 8, 7, 6]))
    assert arr.tolist() == [9.0, 8.0, 7.0, 6.0]


@pytest.mark.parametrize("shape, idx_shape", [((3, 4), (3, 2)), ((2, 3, 4), (2, 3, 2)), ((5, 2), (3,)),
                                              ((2, 3, 4, 2), (2, 3, 1))])
def test_batch_scatter_update_is_tensorflows_rule(shape, idx_shape):
    rng = np.random.default_rng(1)
    arr = rng.normal(size=shape)
    k = len(idx_shape) - 1
    idx = rng.integers(0, shape[k], size=idx_shape)
    vals = rng.normal(size=idx_shape + shape[k + 1:])
    want = arr.copy()
    for pos in np.ndindex(*idx_shape):
        want[pos[:-1] + (idx[pos],)] = vals[pos]
    U.apply_update(arr, U.BATCH_SCATTER, U.check_update(shape, arr.dtype, "w", U.BATCH_SCATTER, (idx, vals)))
    if len(set(map(tuple, idx.reshape(-1, idx_shape[-1]).tolist()))) == idx.size // idx_shape[-1]:
        np.testing.assert_array_equal(arr, want)  # repeats within a row: which one wins is not specified


def test_batch_scatter_update_without_repeats_exactly():
    arr = np.zeros((2, 3, 2))
    idx = np.array([[2, 0], [1, 2]])
    vals = np.arange(8.0).reshape(2, 2, 2)
    U.apply_update(arr, U.BATCH_SCATTER, U.check_update(arr.shape, arr.dtype, "w", U.BATCH_SCATTER, (idx, vals)))
    want = np.zeros((2, 3, 2))
    want[0, 2], want[0, 0], want[1, 1], want[1, 2] = vals[0, 0], vals[0, 1], vals[1, 0], vals[1, 1]
    np.testing.assert_array_equal(arr, want)


@pytest.mark.parametrize(
    "shape, idx, vals, error, message",
    [
        ((3, 2), np.zeros((), int), np.zeros(()), ValueError,
         "sparse_delta.indices for batch_scatter_update of 'w' must have shape () + (n,) with fewer than 2 "
         "dimensions, got ()"),
        ((3, 2), np.zeros((3, 2, 1), int), np.zeros((3, 2, 1)), ValueError,
         "sparse_delta.indices for batch_scatter_update of 'w' must have shape (3, 2) + (n,) with fewer than 2 "
         "dimensions, got (3, 2, 1)"),
        ((3, 2), np.zeros((2, 1), int), np.zeros((2, 1)), ValueError,
         "sparse_delta.indices for batch_scatter_update of 'w' must have shape (3,) + (n,) with fewer than 2 "
         "dimensions, got (2, 1)"),
        ((3, 2), np.array([[0], [2], [1]]), np.zeros((3, 1)), IndexError,
         "sparse_delta.indices for variable 'w': index 2 is out of range [0, 2)"),
        ((3, 2), np.array([[0], [1], [1]]), np.zeros((3, 2)), ValueError,
         "sparse_delta.values for variable 'w' must have shape (3, 1), got (3, 2)"),
        ((3, 2, 4), np.array([[0], [1], [1]]), np.zeros((3, 1)), ValueError,
         "sparse_delta.values for variable 'w' must have shape (3, 1, 4), got (3, 1)"),
        ((3, 2), np.array([[0], [1], [1]]), np.array([["a"], ["b"], ["c"]]), TypeError,
         "sparse_delta.values for variable 'w' must be numeric, got dtype <U1 from ndarray"),
    ],
)
def test_batch_scatter_refusals(shape, idx, vals, error, message):
    with pytest.raises(error) as info:
        U.check_update(shape, np.float32, "w", U.BATCH_SCATTER, (idx, vals))
    assert str(info.value) == message


@pytest.mark.parametrize(
    "op, payload, error, message",
    [
        ("add", [1.0, 2.0], ValueError, "value for variable 'w' must have shape (3,), got (2,)"),
        ("assign", "abc", TypeError, "value for variable 'w' must be numeric, got dtype <U3 from str"),
        ("scatter_add", ([0, 3], [1.0, 1.0]), IndexError,
         "sparse_delta.indices for variable 'w': index 3 is out of range [0, 3)"),
        ("scatter_add", ([-1, 2], [1.0, 1.0]), IndexError,
         "sparse_delta.indices for variable 'w': index -1 is out of range [0, 3)"),
        ("scatter_add", ([0, 1], [1.0]), ValueError, "sparse_delta.values for variable 'w' must have shape (2,), got (1,)"),
        ("scatter_add", ([[0]], [[1.0]]), ValueError, "sparse_delta.indices for variable 'w' must be 1-D, got shape (1, 1)"),
        ("scatter_add", ([0.5], [1.0]), TypeError, "sparse_delta.indices for variable 'w' must be integers, got dtype float64"),
        ("scatter_mul", ([0], ["x"]), TypeError, "sparse_delta.values for variable 'w' must be numeric, got dtype <U1 from list"),
        ("scatter_pow", ([0], [1.0]), ValueError,
         "op must be one of ('assign', 'add', 'sub', 'scatter_add', 'scatter_sub', 'scatter_mul', 'scatter_div', "
         "'scatter_min', 'scatter_max', 'scatter_update', 'batch_scatter_update'), got 'scatter_pow'"),
    ],
)
def test_check_update_refusals(op, payload, error, message):
    with pytest.raises(error) as info:
        U.check_update((3,), np.float32, "w", op, payload)
    assert str(info.value) == message


def test_scatter_on_a_scalar_is_refused():
    with pytest.raises(ValueError) as info:
        U.check_update((), np.float32, "s", "scatter_update", ([0], [1.0]))
    assert str(info.value) == "scatter_update needs a variable of rank >= 1; 's' is a scalar"


def test_integer_scatter_div_by_zero_is_refused_and_float_is_not():
    with pytest.raises(ValueError) as info:
        U.check_update((3,), np.int32, "n", "scatter_div", ([1, 2], [2, 0]))
    assert str(info.value) == "scatter_div of integer variable 'n' by zero"
    U.check_update((3,), np.float32, "f", "scatter_div", ([1, 2], [2.0, 0.0]))
    U.check_update((3,), np.int32, "n", "scatter_mul", ([1, 2], [2, 0]))


def test_empty_indices_parse_as_integers():
    idx = U.check_indices([], 4, "w")
    assert idx.dtype == np.intp and idx.shape == (0,)
    idx, vals = U.check_update((4, 2), np.float32, "w", "scatter_add", ([], np.zeros((0, 2))))
    assert idx.dtype == np.intp and vals.shape == (0, 2)
    with pytest.raises(TypeError, match=r"^indices for variable 'w' must be integers, got dtype float64$"):
        U.check_indices([1.0], 4, "w")


def test_check_indices_accepts_every_index_in_range_and_returns_intp():
    idx = U.check_indices(np.array([0, 3], np.uint8), 4, "w")
    assert idx.tolist() == [0, 3] and idx.dtype == np.intp
    assert U.check_indices(np.array([[3, 0]]), 4, "w", one_d=False).shape == (1, 2)


@pytest.mark.parametrize(
    "value, dtype, error, message",
    [
        (np.array([1.5]), np.int32, TypeError, "v for variable 'w' must have a dtype castable to int32, got float64"),
        ([1.5], np.int32, TypeError, "v for variable 'w' has dtype int32; got non-integer values"),
        (np.array(["a"], object), np.float32, TypeError, "v for variable 'w' must be numeric, got dtype object from ndarray"),
        ({1: 2}, np.float32, TypeError, "v for variable 'w' must be numeric, got dtype object from dict"),
    ],
)
def test_coerce_values_refusals(value, dtype, error, message):
    with pytest.raises(error) as info:
        U.coerce_values(value, np.dtype(dtype), "w", "v")
    assert str(info.value) == message


def test_coerce_values_of_an_unconvertible_object_says_array_like():
    class Bad:
        def __array__(self, *a, **k):
            raise TypeError("no")

        dtype = np.float32

    with pytest.raises(TypeError) as info:
        U.coerce_values([Bad(), 1], np.dtype(np.float32), "w", "v")
    assert str(info.value) == "v for variable 'w' must be array-like, got list"


def test_coerce_values_takes_whole_python_numbers_into_integers_and_reads_array_likes():
    assert U.coerce_values([2.0, 3], np.dtype(np.int16), "w", "v").dtype == np.int16
    assert U.coerce_values(np.array([1, 2], np.int8), np.dtype(np.float32), "w", "v").dtype == np.float32
    sl = IndexedSlices(np.ones((1, 2)), [1], dense_shape=(3, 2))
    assert U.coerce_values(sl, np.dtype(np.float64), "w", "v").tolist() == [[0, 0], [1, 1], [0, 0]]


def test_check_gradient_splits_dense_and_rows():
    kind, arr = U.check_gradient((2,), np.float32, "w", [1, 2])
    assert kind == "dense" and arr.dtype == np.float32
    kind, (idx, vals) = U.check_gradient((3, 2), np.float32, "w", IndexedSlices(np.ones((2, 2)), [2, 0]))
    assert kind == "rows" and idx.tolist() == [2, 0] and vals.dtype == np.float32


@pytest.mark.parametrize(
    "shape, kind, grad, error, message",
    [
        ((), "rows", ([0], [1.0]), ValueError, "gradient for scalar variable 'w' cannot be IndexedSlices"),
        ((3, 2), "rows", ([0], [[1.0]]), ValueError,
         "gradient values for variable 'w' must have shape (1, 2), got (1, 1)"),
        ((3, 2), "rows", ([3], [[1.0, 1.0]]), IndexError,
         "gradient indices for variable 'w': index 3 is out of range [0, 3)"),
        ((3, 2), "rows", ([0], [["a", "b"]]), TypeError,
         "gradient values for variable 'w' must be numeric, got dtype <U1 from list"),
        ((3,), "sparse", [1.0], ValueError, "gradient kind must be 'dense' or 'rows', got 'sparse'"),
        ((3,), "dense", [1.0], ValueError, "gradient for variable 'w' must have shape (3,), got (1,)"),
        ((3,), "dense", ["a"], TypeError, "gradient for variable 'w' must be numeric, got dtype <U1 from list"),
    ],
)
def test_check_gradient_refusals(shape, kind, grad, error, message):
    with pytest.raises(error) as info:
        U.check_gradient_of_kind(shape, np.dtype(np.float32), "w", kind, grad)
    assert str(info.value) == message


def test_occurrence_rounds_split_repeats_into_rounds():
    rounds = U.occurrence_rounds(np.array([5, 1, 5, 5, 1, 2]))
    assert [np.flatnonzero(r).tolist() for r in rounds] == [[0, 1, 5], [2, 4], [3]]
    assert U.occurrence_rounds(np.array([], np.intp)) == []
