"""Properties over spaces too large for a table of cases, drawn by hypothesis.

Each property is checked against a reference written here from the published
rule, never against daskps itself:

- partitioners: TensorFlow's formulas (``partitioned_variables.py``) restated
  in integer arithmetic and searched by brute force; element sizes from a
  table, not from numpy;
- the rows each shard gets: the "div" rule (sizes differ by at most one, the
  larger shards first) and TensorFlow's owner of an index
  (``ShardedVariable._decompose_indices``);
- slicing a ShardedVariable (any shard sizes, both layouts): numpy on the
  whole array;
- scatter ops with repeated indices: a Python loop applying each
  ``(index, value)`` in turn, as TensorFlow's scatter kernels accumulate;
- checkpoints saved with n shards in one layout and restored into m shards in
  another: the value saved, and Adagrad's accumulators on the right rows (the
  next step follows Keras' rule).

The cluster-backed properties share one strategy on the session cluster and
draw few examples; the pure ones draw many.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from fractions import Fraction

import hypothesis.extra.numpy as npst
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import daskps as dps
from daskps.variables.rows import split_rows

P = dps.partitioners

PURE = settings(max_examples=300, deadline=None, database=None)
CLUSTER = settings(max_examples=50, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Bytes per element, as TensorFlow's DType.size; strings count bytes_per_string.
ELEMENT_BYTES = {"float16": 2, "float32": 4, "float64": 8, "int8": 1, "int32": 4, "int64": 8, "uint16": 2,
                 "bool": 1, "complex64": 8, "complex128": 16}
STRING_DTYPES = ["U7", "S3", "O"]


class _Steerable:
    """A partitioner a test can set (``self.partitioner``); whole variables otherwise."""

    def __init__(self):
        self.partitioner = None

    def __call__(self, shape, dtype):
        return [1] * len(shape) if self.partitioner is None else self.partitioner(shape, dtype)


@pytest.fixture(scope="module")
def ps(client):
    """A strategy of its own on the session cluster; variables are whole unless a test steers its partitioner."""
    strategy = dps.ParameterServerStrategy(client, variable_partitioner=_Steerable())
    yield strategy
    strategy.close()


# -- partitioners ------------------------------------------------------------------------
@st.composite
def partition_inputs(draw):
    """``(shape, dtype, element bytes, bytes_per_string, axis)``: shapes up to 3-D, any axis, some empty."""
    rank = draw(st.integers(1, 3))
    dims = draw(st.lists(st.integers(0, 40), min_size=rank, max_size=rank))
    axis = draw(st.integers(-rank, rank - 1))
    dims[axis] = draw(st.one_of(st.integers(0, 40), st.integers(41, 3000)))
    bytes_per_string = draw(st.one_of(st.sampled_from([1, 3, 100, 1000]), st.integers(1, 64)))  # far from itemsize
    dtype = draw(st.one_of(st.sampled_from(sorted(ELEMENT_BYTES)), st.sampled_from(STRING_DTYPES)))
    size = ELEMENT_BYTES.get(dtype, bytes_per_string)
    return tuple(dims), np.dtype(dtype), size, bytes_per_string, axis


def _only_axis(rank, axis, k):
    out = [1] * rank
    out[axis] = k
    return out


def _tf_min_size(dims, axis, size, min_bytes, max_shards):
    """TensorFlow: ``max(1, min(dims[axis], max_shards, ceil(total / min_bytes)))``, by search: the most
    shards ``k`` (up to the axis and ``max_shards``) such that ``k - 1`` shards of ``min_bytes`` stay
    below the total."""
    total, limit = math.prod(dims) * size, min(dims[axis], max_shards)
    k = 1
    while k + 1 <= limit and k * min_bytes < total:
        k += 1
    return k


def _tf_max_size(dims, axis, size, max_bytes, max_shards):
    """TensorFlow: the fewest shards whose largest (a "div" split's first, ceil(n / k) slices) fits
    ``max_bytes``; every slice its own shard when one slice is already too big; capped by
    ``max_shards``. An empty variable: one shard (TensorFlow divides by zero there)."""
    if math.prod(dims) == 0:
        return 1
    n = dims[axis]
    slice_bytes = math.prod(dims) // n * size
    k = next((k for k in range(1, n + 1) if -(-n // k) * slice_bytes <= max_bytes), n)
    return min(k, max_shards) if max_shards else k


@PURE
@given(partition_inputs(), st.integers(1, 50))
def test_fixed_shards_gives_min_of_shards_and_axis_length(inputs, num_shards):
    dims, dtype, _, _, axis = inputs
    want = _only_axis(len(dims), axis, min(num_shards, dims[axis]))
    assert P.FixedShardsPartitioner(num_shards)(dims, dtype, axis=axis) == want
    assert P.fixed_size_partitioner(num_shards, axis)(dims, dtype) == want


def _near(total, step=1):
    """Byte limits near where the answer changes: about ``total / k``, or ``k`` steps of ``step`` bytes."""
    return st.one_of(st.integers(1, 64), st.integers(1, 1 << 22),
                     st.tuples(st.integers(1, 60), st.integers(-1, 1)).map(lambda t: max(1, total // t[0] + t[1])),
                     st.tuples(st.integers(1, 60), st.integers(-1, 1)).map(lambda t: max(1, step * t[0] + t[1])))


@PURE
@given(partition_inputs(), st.integers(1, 200), st.data())
def test_min_size_partitioner_follows_tensorflows_rule(inputs, max_shards, data):
    dims, dtype, size, per_string, axis = inputs
    min_bytes = data.draw(_near(math.prod(dims) * size), label="min_shard_bytes")
    want = _only_axis(len(dims), axis, _tf_min_size(dims, axis, size, min_bytes, max_shards))
    assert P.MinSizePartitioner(min_bytes, max_shards, per_string)(dims, dtype, axis=axis) == want
    assert P.min_max_variable_partitioner(max_shards, axis, min_bytes, per_string)(dims, dtype) == want


@PURE
@given(partition_inputs(), st.one_of(st.none(), st.integers(1, 200)), st.data())
def test_max_size_partitioner_follows_tensorflows_rule(inputs, max_shards, data):
    dims, dtype, size, per_string, axis = inputs
    slice_bytes = math.prod(dims) // dims[axis] * size if dims[axis] else 0
    max_bytes = data.draw(_near(math.prod(dims) * size, max(1, slice_bytes)), label="max_shard_bytes")
    want = _only_axis(len(dims), axis, _tf_max_size(dims, axis, size, max_bytes, max_shards))
    assert P.MaxSizePartitioner(max_bytes, max_shards, per_string)(dims, dtype, axis=axis) == want
    assert P.variable_axis_size_partitioner(max_bytes, axis, per_string, max_shards)(dims, dtype) == want


@PURE
@given(st.integers(0, 10_000), st.integers(1, 300))
def test_div_offsets_give_sizes_within_one_the_larger_first(rows, num_shards):
    offsets = P.div_offsets(rows, num_shards)
    sizes = np.diff(offsets)
    assert offsets[0] == 0 and offsets[-1] == rows and len(sizes) == num_shards
    assert sizes.min() >= 0 and sizes.max() - sizes.min() <= 1
    assert np.all(np.diff(sizes) <= 0)  # the slack goes to the first shards


@PURE
@given(st.integers(1, 500).flatmap(lambda rows: st.tuples(
    st.just(rows), st.integers(1, rows), st.lists(st.integers(0, rows - 1), max_size=40))))
def test_split_rows_sends_each_index_where_tensorflow_does(case):
    rows, num_shards, ids = case
    idx = np.asarray(ids, np.intp)
    base, extra = divmod(rows, num_shards)
    # sharded_variable.py, _decompose_indices: the owner and the local row of each index.
    owner = np.maximum(idx // (base + 1), (idx - extra) // base)
    local = np.where(owner < extra, idx % (base + 1), (idx - extra) % base)
    parts = split_rows(P.div_offsets(rows, num_shards), idx, np.arange(len(idx)))
    assert len(parts) == num_shards
    for s, (got_local, positions) in enumerate(parts):
        np.testing.assert_array_equal(positions, np.flatnonzero(owner == s))  # in order, each once
        np.testing.assert_array_equal(got_local, local[owner == s])


@CLUSTER
@given(st.integers(0, 30), st.integers(1, 3), st.sampled_from(["fixed", "min", "max", "any"]), st.data())
def test_the_strategy_splits_as_its_partitioner_says(ps, rows, cols, kind, data):
    """End to end, as TensorFlow's strategy: ``min(num_shards, rows)`` shards holding "div" blocks (an empty
    axis 0: one empty shard, where TensorFlow divides by zero)."""
    if kind == "fixed":
        rows = max(rows, 1)  # it answers 0 shards for an empty axis, which TensorFlow refuses too
        partitioner = P.FixedShardsPartitioner(data.draw(st.integers(1, 8)))
    elif kind == "min":
        partitioner = P.MinSizePartitioner(data.draw(st.integers(1, 64)), max_shards=data.draw(st.integers(1, 8)))
    elif kind == "max":
        partitioner = P.MaxSizePartitioner(data.draw(st.integers(4, 256)), max_shards=data.draw(st.integers(1, 8)))
    else:  # any answer [n, 1, ...]: more shards than rows too
        n = data.draw(st.integers(1, 40))
        partitioner = lambda shape, dtype: [n] + [1] * (len(shape) - 1)  # noqa: E731
    whole = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    ps.variable_partitioner.partitioner = partitioner
    try:
        with ps.scope():
            v = dps.Variable(whole, name="split")
    finally:
        ps.variable_partitioner.partitioner = None
    k = max(1, min(partitioner((rows, cols), np.float32)[0], rows))
    shards = v.variables if isinstance(v, dps.ShardedVariable) else [v]
    assert len(shards) == k
    start = 0
    for i, shard in enumerate(shards):  # shard i: rows // k, plus one for the first rows % k
        size = rows // k + (i < rows % k)
        np.testing.assert_array_equal(shard.numpy(), whole[start:start + size])
        start += size
    assert start == rows


# -- sharded variables of any shard sizes, in both layouts ----------------------------------
@st.composite
def sharded_cases(draw, max_rows=12, dtypes=("float32",)):
    """``(whole, layout, shard sizes)``: "div" shards of any sizes (some empty), or a "mod" split."""
    layout = draw(st.sampled_from(["div", "mod"]))
    rows = draw(st.integers(0 if layout == "div" else 1, max_rows))
    rest = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    whole = np.arange(rows * math.prod(rest), dtype=dtype).reshape((rows,) + rest)
    whole = np.array(draw(st.permutations(whole.ravel())), dtype).reshape(whole.shape) if whole.size else whole
    if layout == "mod":
        n = draw(st.integers(1, rows))
        sizes = [rows // n + (i < rows % n) for i in range(n)]
    else:
        cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=0, max_size=4)))
        sizes = list(np.diff([0, *cuts, rows]))
    return whole, layout, sizes


def _make_sharded(whole, layout, sizes, name="sv"):
    """Shards holding ``whole``'s rows as the layout says: "div" blocks in order, or row r on shard r % n."""
    if layout == "mod":
        n = len(sizes)
        parts = [whole[i::n] for i in range(n)]
    else:
        starts = np.cumsum([0, *sizes])
        parts = [whole[a:b] for a, b in zip(starts, starts[1:])]
    variables = [dps.Variable(p, name=f"{name}/part_{i}", dtype=whole.dtype) for i, p in enumerate(parts)]
    return dps.ShardedVariable(variables, name=name, layout=layout)


def _slices(n):
    bound = st.one_of(st.none(), st.integers(-2 * n - 2, 2 * n + 2))
    step = st.one_of(st.none(), st.integers(-n - 2, n + 2).filter(bool))
    return st.builds(slice, bound, bound, step)


def indexes(shape):
    """Indexes into an array of ``shape``: ints (out of range too), slices of any bounds and step, basic
    tuples with None and Ellipsis, integer arrays and lists (negative too), boolean masks, and mixes."""
    n = shape[0]
    ints = st.integers(-2 * n - 1, 2 * n + 1)
    rows = st.lists(st.integers(-n, n - 1), max_size=6) if n else st.just([])
    other = st.one_of(st.integers(-shape[1], shape[1] - 1), _slices(shape[1])) if len(shape) > 1 else st.nothing()
    return st.one_of(
        ints,
        _slices(n),
        npst.basic_indices(shape, allow_newaxis=True, allow_ellipsis=True),
        rows,
        rows.map(np.array),
        npst.integer_array_indices(shape) if n else st.nothing(),
        npst.arrays(np.bool_, shape[:1]),
        npst.arrays(np.bool_, shape),
        st.tuples(st.one_of(_slices(n), rows.map(np.array)), other),
        st.tuples(st.just(Ellipsis), st.integers(-shape[-1], shape[-1] - 1)) if shape[-1] else st.nothing(),
    )


def _agrees_with_numpy(sv, whole, index):
    try:
        want = whole[index]
    except IndexError:
        with pytest.raises(IndexError):
            sv[index]
        return
    got = sv[index]
    assert np.shape(got) == want.shape and np.asarray(got).dtype == want.dtype, index
    np.testing.assert_array_equal(got, want)


@settings(PURE, max_examples=200)
@given(sharded_cases(), st.data())
def test_slicing_agrees_with_numpy(case, data):
    """Local shards (the same reads as on servers, in this process): many shapes and indexes."""
    whole, layout, sizes = case
    sv = _make_sharded(whole, layout, sizes)
    for _ in range(5):
        _agrees_with_numpy(sv, whole, data.draw(indexes(whole.shape)))


@CLUSTER
@given(sharded_cases(), st.data())
def test_slicing_agrees_with_numpy_on_servers(ps, case, data):
    whole, layout, sizes = case
    with ps.scope():
        sv = _make_sharded(whole, layout, sizes)
    for _ in range(5):
        _agrees_with_numpy(sv, whole, data.draw(indexes(whole.shape)))


# -- scatter ops with repeated indices ------------------------------------------------------------
SCATTERS = ["scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min", "scatter_max",
            "scatter_update"]


def _truncated(a, b):
    """Integer division rounding toward zero, as TensorFlow's (not numpy's floor division)."""
    return np.vectorize(lambda x, y: int(Fraction(int(x), int(y))), otypes=[a.dtype])(a, b)


def _scatter_reference(whole, op, ids, values):
    """Each ``(index, row)`` applied in turn: repeated indices accumulate (add, sub, mul, div, min,
    max); for scatter_update the last one wins (daskps' rule; TensorFlow leaves the order open)."""
    out = whole.copy()
    with np.errstate(divide="ignore", invalid="ignore"):  # x / 0.0 is inf or NaN, as in TensorFlow
        _apply_in_turn(out, op, ids, values)
    return out


def _apply_in_turn(out, op, ids, values):
    for i, row in zip(ids, values):
        old = out[i]
        if op == "scatter_add":
            out[i] = old + row
        elif op == "scatter_sub":
            out[i] = old - row
        elif op == "scatter_mul":
            out[i] = old * row
        elif op == "scatter_div":
            out[i] = _truncated(old, row) if out.dtype.kind == "i" else old / row
        elif op == "scatter_min":
            out[i] = np.minimum(old, row)
        elif op == "scatter_max":
            out[i] = np.maximum(old, row)
        else:
            out[i] = row


@st.composite
def scatter_cases(draw):
    """A variable (plain, or sharded in either layout), an op, and indices with repeats."""
    whole, layout, sizes = draw(sharded_cases(max_rows=8, dtypes=("float32", "int32")))
    assume_rows = whole.shape[0]
    if assume_rows == 0:
        whole, layout, sizes = np.arange(2, dtype=whole.dtype) + 1, "div", [2]
    kind = draw(st.sampled_from(["plain", "sharded"]))
    op = draw(st.sampled_from(SCATTERS))
    ids = draw(st.lists(st.integers(0, len(whole) - 1), max_size=10))
    ids = ids + [ids[0]] * draw(st.integers(0, 3)) if ids else ids  # repeats, always some
    ints = whole.dtype.kind == "i"
    small = st.integers(-4, 4).filter(lambda x: x != 0) if (ints and op == "scatter_div") else st.integers(-8, 8)
    shape = (len(ids),) + whole.shape[1:]
    values = np.asarray(draw(npst.arrays(np.int64, shape, elements=small)))
    values = values.astype(whole.dtype) if ints else (values / 2).astype(whole.dtype)  # halves: exact sums
    whole = (whole % 9 - 4).astype(whole.dtype)  # small values, sums and products stay exact
    return whole, layout, sizes, kind, op, np.asarray(ids, np.int64), values


@settings(CLUSTER, max_examples=150)
@given(scatter_cases())
def test_scatter_with_repeated_indices_matches_the_rule(ps, case):
    whole, layout, sizes, kind, op, ids, values = case
    with ps.scope():
        var = dps.Variable(whole, name="target") if kind == "plain" else _make_sharded(whole, layout, sizes)
    getattr(var, op)(dps.IndexedSlices(values, ids))
    want = _scatter_reference(whole, op, ids, values)
    got = var.numpy()
    assert got.dtype == whole.dtype
    if op == "scatter_div" and whole.dtype.kind == "f":  # quotients round; the order of repeats is open
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


@CLUSTER
@given(sharded_cases(max_rows=8), st.data())
def test_batch_scatter_update_matches_per_row_assignment(ps, case, data):
    """TensorFlow's batch_scatter_update on a rank-2 variable: row i gets ``values[i, j]`` at column
    ``indices[i, j]`` (distinct within a row), whichever shard holds row i."""
    whole, layout, sizes = case
    if whole.ndim != 2 or not whole.size:
        whole, layout, sizes = np.arange(6, dtype=np.float32).reshape(3, 2), layout, [2, 1] if layout == "div" else [3]
    rows, cols = whole.shape
    k = data.draw(st.integers(1, cols))
    ids = np.array([data.draw(st.permutations(range(cols)))[:k] for _ in range(rows)])
    values = -np.arange(rows * k, dtype=whole.dtype).reshape(rows, k) - 1
    with ps.scope():
        sv = _make_sharded(whole, layout, sizes)
    sv.batch_scatter_update(dps.IndexedSlices(values, ids))
    want = whole.copy()
    for i in range(rows):
        for j in range(k):
            want[i, ids[i, j]] = values[i, j]
    np.testing.assert_array_equal(sv.numpy(), want)


# -- checkpoints: save with n shards, restore with m ----------------------------------------------
@st.composite
def layouts(draw, rows):
    """``("whole", None)``, ``("div", sizes)`` of any sizes, or ``("mod", sizes)``."""
    kind = draw(st.sampled_from(["whole", "div", "mod"]))
    if kind == "whole":
        return kind, None
    if kind == "mod":
        n = draw(st.integers(1, rows))
        return kind, [rows // n + (i < rows % n) for i in range(n)]
    # Cuts anywhere, repeated ones too: a shard may be empty (its checkpoint piece has a file of its own).
    cuts = sorted(draw(st.lists(st.integers(0, rows), max_size=4)))
    return kind, list(np.diff([0, *cuts, rows]))


def _variable(whole, layout, name):
    kind, sizes = layout
    if kind == "whole":
        return dps.Variable(whole, name=name)
    return _make_sharded(whole, kind, sizes, name=name)


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("reshard")


ADAGRAD = {"learning_rate": 0.1, "initial_accumulator_value": 0.1, "epsilon": 1e-7}


def _adagrad(acc, w, g):
    """Keras' Adagrad: ``acc += g**2; w -= lr * g / (sqrt(acc) + epsilon)`` (float64 here)."""
    acc = acc + g.astype(np.float64) ** 2
    return acc, w - ADAGRAD["learning_rate"] * g / (np.sqrt(acc) + ADAGRAD["epsilon"])


@settings(CLUSTER, max_examples=40)
@given(st.integers(1, 20).flatmap(lambda rows: st.tuples(st.just(rows), st.integers(1, 3), layouts(rows),
                                                          layouts(rows))), st.randoms(use_true_random=False))
def test_a_checkpoint_restores_into_any_number_of_shards(ps, ckpt_root, case, rnd):
    rows, cols, saved_as, restored_as = case
    rng = np.random.default_rng(rnd.randrange(2**32))
    w0 = rng.normal(size=(rows, cols)).astype(np.float32)
    g1, g2 = rng.normal(size=(2, rows, cols)).astype(np.float32)
    with ps.scope():
        source = _variable(w0, saved_as, "emb")
        opt = dps.optimizers.Adagrad(**ADAGRAD)
    opt.apply_gradients([(g1, source)])
    acc, w1 = _adagrad(np.full((rows, cols), ADAGRAD["initial_accumulator_value"]), w0, g1)
    saved = source.numpy()
    np.testing.assert_allclose(saved, w1, rtol=1e-5, atol=1e-6)
    directory = tempfile.mkdtemp(dir=ckpt_root)
    try:
        path = dps.Checkpoint(emb=source, opt=opt).write(f"{directory}/ck")
        with ps.scope():
            target = _variable(np.zeros((rows, cols), np.float32), restored_as, "emb")
            opt2 = dps.optimizers.Adagrad(**ADAGRAD)
        dps.Checkpoint(emb=target, opt=opt2).restore(path)
    finally:
        shutil.rmtree(directory)
    np.testing.assert_array_equal(target.numpy(), saved)  # exactly what was saved, every row in place
    opt2.apply_gradients([(g2, target)])  # the accumulators came along, on the right rows
    _, w2 = _adagrad(acc, saved.astype(np.float64), g2)
    np.testing.assert_allclose(target.numpy(), w2, rtol=1e-5, atol=1e-6)


def test_an_empty_shard_round_trips_whichever_server_holds_it(ps, ckpt_root):
    whole = np.array([[1.0], [2.0]], np.float32)
    held_empty = []
    for _ in range(2):  # the empty shard alone on one server, then on the other
        # Each round takes three places in the round robin (first, empty, target; last is colocated),
        # so with two servers the next round's empty shard lands on the other one.
        with ps.scope():
            first = dps.Variable(whole[:1], name="e/part_0")
            empty = dps.Variable(np.zeros((0, 1), np.float32), name="e/part_1")
            with ps.extended.colocate_vars_with(first):
                last = dps.Variable(whole[1:], name="e/part_2")
        assert empty.device != first.device == last.device
        held_empty.append(empty.device)
        sv = dps.ShardedVariable([first, empty, last], name="e")
        path = dps.Checkpoint(e=sv).write(tempfile.mkdtemp(dir=ckpt_root) + "/ck")
        with ps.scope():
            target = dps.Variable(np.zeros((2, 1), np.float32), name="e")
        dps.Checkpoint(e=target).restore(path)
        np.testing.assert_array_equal(target.numpy(), whole)
    assert held_empty[0] != held_empty[1], held_empty  # both servers held the empty shard
