"""Variables: local ones, and ones on parameter servers of a real cluster."""

import pickle

import numpy as np
import pytest
from distributed import get_worker

import daskps as dps
from daskps.variables.variable import Variable


def test_local_variable_lives_in_this_process():
    v = dps.Variable([1.0, 2.0], name="w")
    assert v.device == "/job:chief/replica:0/task:0/device:CPU:0"
    assert v.dtype == np.float32 and v.shape == (2,) and v.name == "w" and v.trainable
    np.testing.assert_array_equal(v.assign_add([1, 1]).numpy(), [2.0, 3.0])


def test_python_numbers_default_to_32_bits():
    assert dps.Variable(1.0).dtype == np.float32
    assert dps.Variable(3).dtype == np.int32
    assert dps.Variable(np.float64(1.0)).dtype == np.float64
    assert dps.Variable(1, dtype="float64").dtype == np.float64


def test_local_callable_initializer_gets_shape_and_dtype():
    v = dps.Variable(lambda shape, dtype: np.full(shape, 7, dtype), shape=(2, 3), dtype=np.int64)
    np.testing.assert_array_equal(v.numpy(), np.full((2, 3), 7))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"initial_value": None}, ValueError, "initial_value"),
        ({"initial_value": 1.0, "name": 3}, TypeError, "name"),
        ({"initial_value": 1.0, "dtype": "U3"}, TypeError, "dtype"),
        ({"initial_value": [1.0, 2.0], "shape": (3,)}, ValueError, "shape"),
        ({"initial_value": "abc"}, TypeError, "initial_value"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        dps.Variable(**kwargs)


def test_round_robin_placement(strategy):
    with strategy.scope():
        vs = [dps.Variable(float(i)) for i in range(5)]
    devices = [v.device for v in vs]
    assert devices == [f"/job:ps/replica:0/task:{i % 2}/device:CPU:0" for i in range(5)]
    assert all(isinstance(v, Variable) for v in vs)
    assert all(strategy.extended.variable_created_in_scope(v) for v in vs)
    assert not strategy.extended.variable_created_in_scope(dps.Variable(1.0))


def test_variable_outside_scope_is_local_even_with_strategy(strategy):
    v = dps.Variable(0.0)
    assert v.device.startswith("/job:chief")


def test_ps_variable_reads(strategy):
    with strategy.scope():
        v = dps.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="m")
    expected = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(v.numpy(), expected)
    np.testing.assert_array_equal(v.read_value(), expected)
    np.testing.assert_array_equal(np.asarray(v), expected)
    np.testing.assert_array_equal(v[1, ::-1], expected[1, ::-1])
    np.testing.assert_array_equal(v[..., 0], expected[..., 0])
    assert v.name == "m" and v.shape == (2, 3) and v.dtype == np.float32


def test_ps_variable_operators(strategy):
    with strategy.scope():
        v = dps.Variable([1.0, 2.0, 4.0])
    a = np.array([1.0, 2.0, 4.0], np.float32)
    np.testing.assert_array_equal(v + 1, a + 1)
    np.testing.assert_array_equal(1 - v, 1 - a)
    np.testing.assert_array_equal(v * v, a * a)
    np.testing.assert_array_equal(2 / v, 2 / a)
    np.testing.assert_array_equal(v ** 2, a ** 2)
    np.testing.assert_array_equal(-v, -a)
    np.testing.assert_array_equal(v @ v, a @ a)
    np.testing.assert_array_equal(v > 1.5, a > 1.5)
    np.testing.assert_array_equal(v == 2.0, a == 2.0)
    np.testing.assert_array_equal(np.ones(3) + v, 1 + a)
    np.testing.assert_array_equal(np.maximum(v, 2), np.maximum(a, 2))
    assert len(v) == 3
    with pytest.raises(TypeError, match="unhashable"):
        hash(v)
    assert {v.ref(): 1}[v.ref()] == 1


def test_ps_variable_updates_return_the_variable(strategy):
    with strategy.scope():
        v = dps.Variable([1.0, 2.0])
    assert v.assign([5, 6]) is v
    np.testing.assert_array_equal(v.assign_add(np.ones(2, np.float32)).numpy(), [6, 7])
    np.testing.assert_array_equal(v.assign_sub([1.0, 1.0]).numpy(), [5, 6])


@pytest.mark.parametrize(
    "method, value, error, match",
    [
        ("assign", [1.0, 2.0, 3.0], ValueError, "shape"),
        ("assign_add", np.ones((2, 1)), ValueError, "shape"),
        ("assign_sub", ["a", "b"], TypeError, "numeric"),
        ("assign", np.array([1 + 2j, 3j]), TypeError, "castable"),
        ("assign", object(), TypeError, "numeric"),
    ],
)
def test_bad_updates_leave_the_value_unchanged(strategy, method, value, error, match):
    with strategy.scope():
        v = dps.Variable([1.0, 2.0], name="guarded")
    with pytest.raises(error, match=match):
        getattr(v, method)(value)
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])


def test_integer_variable_refuses_float_update(strategy):
    with strategy.scope():
        v = dps.Variable([1, 2])
    with pytest.raises(TypeError, match="has dtype int32; got non-integer values"):
        v.assign_add([0.5, 0.5])
    with pytest.raises(TypeError, match="castable to int32, got float64"):
        v.assign(np.array([1.5, 2.5]))
    np.testing.assert_array_equal(v.numpy(), [1, 2])


def test_server_validates_too(strategy):
    """The ps checks every update before applying any: a batch with one bad item changes nothing."""
    with strategy.scope():
        a = dps.Variable([1.0, 2.0])
    from daskps.client import protocol
    from daskps.server import ops

    with pytest.raises(ValueError, match="shape"):
        protocol.call([(a.handle.server, ops.Update([(a.handle.key, "add", np.ones(2, np.float32)),
                                                  (a.handle.key, "add", np.ones(3))]))])
    np.testing.assert_array_equal(a.numpy(), [1.0, 2.0])


def _only_on_a_worker(shape, dtype):
    get_worker()  # raises ValueError anywhere but on a worker
    return np.full(shape, 3, dtype)


def test_callable_initializer_runs_on_the_parameter_server(strategy):
    with pytest.raises(ValueError):
        _only_on_a_worker((1,), np.float32)
    with strategy.scope():
        v = dps.Variable(_only_on_a_worker, shape=(4, 2), dtype=np.float32, name="init")
    np.testing.assert_array_equal(v.numpy(), np.full((4, 2), 3, np.float32))
    assert v.shape == (4, 2) and v.dtype == np.float32


def test_zero_argument_initializer_on_the_parameter_server(strategy):
    with strategy.scope():
        v = dps.Variable(lambda: [1.0, 2.0, 3.0])
    assert v.shape == (3,) and v.dtype == np.float32


def test_initializer_shape_mismatch_is_refused(strategy):
    with strategy.scope():
        with pytest.raises(ValueError, match="shape"):
            dps.Variable(lambda: np.zeros(3), shape=(4,))


def test_handle_pickles_small(strategy):
    with strategy.scope():
        v = dps.Variable(np.zeros((1000, 100), np.float32))
    blob = pickle.dumps(v)
    assert len(blob) < 600
    w = pickle.loads(blob)
    assert w.shape == v.shape and w.device == v.device
    assert w.numpy().shape == (1000, 100)


def test_read_values_one_round_trip_per_parameter_server(strategy):
    with strategy.scope():
        vs = [dps.Variable(np.full(3, i, np.float32)) for i in range(6)]
    local = dps.Variable([9.0])
    before = [s["calls"].get("read", 0) for s in strategy.ps_stats()]
    values = dps.read_values(vs + [local])
    after = [s["calls"].get("read", 0) for s in strategy.ps_stats()]
    assert [b - a for a, b in zip(before, after)] == [1, 1]
    for i in range(6):
        np.testing.assert_array_equal(values[i], np.full(3, i))
    np.testing.assert_array_equal(values[6], [9.0])


def test_read_values_rejects_non_variables():
    with pytest.raises(TypeError, match="variables"):
        dps.read_values([np.ones(2)])


def test_colocate_vars_with(strategy):
    with strategy.scope():
        a = dps.Variable(1.0)
        b = dps.Variable(2.0)
        with strategy.extended.colocate_vars_with(b):
            c = dps.Variable(3.0)
            d = dps.Variable(4.0)
    assert a.device != b.device
    assert c.device == d.device == b.device
    with pytest.raises(ValueError, match="colocate_with_variable"):
        with strategy.extended.colocate_vars_with(dps.Variable(0.0)):
            pass


# -- operators follow numpy exactly -------------------------------------------------------
import operator  # noqa: E402

BINARY = [operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
          operator.pow, operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne, divmod]
INTEGER_ONLY = [operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift]
UNARY = [operator.neg, operator.pos, operator.abs]
OPERANDS = [2, 0.5, True, np.float64(0.5), np.int64(3), np.float16(2), np.array([1, 2], np.int8),
            np.array([0.5, 2.0], np.float64), np.array([3, 4], np.uint16)]
DTYPES = ["float32", "float64", "int32", "int64", "uint8", "float16"]


def _same(got, want) -> None:
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
        return
    assert np.asarray(got).dtype == np.asarray(want).dtype
    np.testing.assert_array_equal(got, want)


def _check_operators(var, value):
    with np.errstate(all="ignore"):
        for op in BINARY + (INTEGER_ONLY if value.dtype.kind in "iu" else []):
            for other in OPERANDS:
                if op in INTEGER_ONLY and np.asarray(other).dtype.kind not in "biu":
                    continue
                for left, right, plain in ((var, other, (value, other)), (other, var, (other, value))):
                    try:
                        want = op(*plain)
                    except Exception as exc:
                        with pytest.raises(type(exc)):
                            op(left, right)
                        continue
                    _same(op(left, right), want)
        for op in UNARY + ([operator.invert] if value.dtype.kind in "iu" else []):
            _same(op(var), op(value))
        _same(np.add(var, 1), np.add(value, 1))
        _same(np.maximum(0.5, var), np.maximum(0.5, value))
        _same(var @ np.ones(2, value.dtype), value @ np.ones(2, value.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_operator_gives_numpys_dtype_on_servers(strategy, dtype):
    """Each operator and ufunc, both ways round, against Python and numpy scalars and arrays."""
    value = np.array([3, 5], dtype)
    with strategy.scope():
        v = dps.Variable(value)
    _check_operators(v, value)


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_every_operator_gives_numpys_dtype_on_sharded_variables(strategy, dtype):
    value = np.array([3, 5], dtype)
    with strategy.scope():
        shards = [dps.Variable(value[:1]), dps.Variable(value[1:])]
    _check_operators(dps.ShardedVariable(shards), value)


def test_float32_stays_float32_with_python_scalars(strategy):
    with strategy.scope():
        v = dps.Variable(np.ones(2, np.float32))
        i = dps.Variable(np.ones(2, np.int32))
    assert (v * 0.5).dtype == np.float32 and (0.5 * v).dtype == np.float32 and (v + 1).dtype == np.float32
    assert (i + 1).dtype == np.int32 and (1 + i).dtype == np.int32


def test_out_cannot_be_a_variable(strategy):
    v = dps.Variable(np.ones(2, np.float32))
    with pytest.raises(TypeError, match="assign"):
        np.add(v, 1, out=v)
