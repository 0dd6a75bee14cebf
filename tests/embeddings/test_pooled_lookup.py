"""Pooled lookups (``dps.embedding_lookup_sparse``) and their gradients (``dps.PooledSlices``).

References are numpy written from TensorFlow's definition of
``safe_embedding_lookup_sparse`` (``reference`` below, which uses no daskps
code) and TensorFlow's own answers (``fixtures/sparse_lookup_fixtures.npz``,
made by ``fixtures/make_sparse_lookup_fixtures.py``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse

import daskps as dps
from daskps._core.bags import BagGrad
from daskps.client import protocol
from tests.helpers.paths import TESTS

FIXTURE = np.load(TESTS / "fixtures" / "sparse_lookup_fixtures.npz")
MANIFEST = json.loads(str(FIXTURE["manifest"]))


def reference(table, values, lengths, weights, combiner, default_id=None, max_norm=None, upstream=None):
    """TensorFlow's safe_embedding_lookup_sparse in plain numpy (float64), and the dense gradient of
    ``sum(result * upstream)`` with respect to ``table`` (without max_norm: the TF fixtures cover its gradient)."""
    table = np.asarray(table, np.float64)
    n_bags, dim = len(lengths), table.shape[1:]
    out = np.zeros((n_bags,) + dim)
    grad = np.zeros_like(table)
    start = 0
    for b, n in enumerate(lengths):
        ids = list(values[start:start + n])
        w = [1.0] * n if weights is None else list(weights[start:start + n])
        start += n
        kept = [(i, x) for i, x in zip(ids, w) if i >= 0 and (weights is None or combiner == "sum" or x > 0)]
        if not kept:
            if default_id is None:
                continue
            kept = [(default_id, 1.0)]
        rows = []
        for i, _ in kept:
            r = table[i]
            if max_norm is not None and np.linalg.norm(r) > max_norm:
                r = r * max_norm / np.linalg.norm(r)
            rows.append(r)
        total = sum(x * r for (_, x), r in zip(kept, rows))
        div = {"sum": 1.0, "mean": sum(x for _, x in kept), "sqrtn": np.sqrt(sum(x * x for _, x in kept))}[combiner]
        out[b] = total / div if div != 0 else 0.0
        if upstream is not None and div != 0:
            for i, x in kept:
                grad[i] += upstream[b] * x / div
    return out, grad


VALUES = np.array([3, 1, 3, -1, 7, 2, -4, 9, 0, 0, 5, 8, 1, 6, 6])
LENGTHS = np.array([3, 0, 2, 1, 1, 4, 0, 2, 2])
WEIGHTS = np.array([0.5, 2.0, 1.5, 1.0, 3.0, -1.0, 2.0, 0.0, 1.0, 0.25, 4.0, 1.0, 0.5, 1.0, 2.0])
ROWS = 10


def _table(seed: int = 0, rows: int = ROWS, dim: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, dim)).astype(np.float32)


def make(strategy, layout: str, init: np.ndarray):
    """The table ``init`` in ``layout`` (and a function reading it back whole)."""
    if layout == "numpy":
        return init.copy(), lambda t: t
    if layout == "variable":
        with strategy.scope():
            v = dps.Variable(init, name="bagtable")
        return v, lambda t: t.numpy()
    if layout in ("div", "mod", "list"):
        n = len(init)
        sizes = [n // 3 + (i < n % 3) for i in range(3)]
        if layout == "mod":
            parts = [init[i::3] for i in range(3)]
        else:
            parts = np.split(init, np.cumsum(sizes)[:-1])
        with strategy.scope():
            shards = [dps.Variable(p, name=f"bagtable/part_{i}") for i, p in enumerate(parts)]
        if layout == "list":
            return shards, lambda t: np.concatenate([s.numpy() for s in t])
        return dps.ShardedVariable(shards, name="bagtable", layout=layout), lambda t: t.numpy()
    raise ValueError(layout)


LAYOUTS = ["numpy", "variable", "div", "mod", "list"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_values_match_tensorflows_definition(strategy, layout, combiner, weighted):
    init = _table()
    table, _ = make(strategy, layout, init)
    w = WEIGHTS if weighted else None
    for default_id, max_norm in ((None, None), (4, None), (None, 1.2)):
        got = dps.embedding_lookup_sparse(table, (VALUES, LENGTHS), w, combiner=combiner, default_id=default_id,
                                          max_norm=max_norm)
        want, _ = reference(init, VALUES, LENGTHS, w, combiner, default_id, max_norm)
        assert got.shape == (len(LENGTHS), 3) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("layout", ["variable", "div", "mod"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_gradient_with_sgd_is_tensorflows_gradient(strategy, layout, combiner, weighted):
    init = _table(1)
    table, whole = make(strategy, layout, init)
    w = WEIGHTS if weighted else None
    upstream = np.random.default_rng(2).normal(size=(len(LENGTHS), 3)).astype(np.float32)
    with strategy.scope():
        opt = dps.optimizers.SGD(1.0)
    for default_id in (None, 4):
        before = whole(table).astype(np.float64)
        bags = dps.Bags((VALUES, LENGTHS), w, combiner=combiner, default_id=default_id)
        dps.embedding_lookup_sparse(table, bags)
        opt.apply_gradients([(dps.PooledSlices(upstream, bags), table)])
        _, grad = reference(before, VALUES, LENGTHS, w, combiner, default_id, upstream=upstream)
        np.testing.assert_allclose(whole(table), before - grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(MANIFEST))
def test_matches_tensorflow_fixtures(strategy, case):
    spec = MANIFEST[case]
    table_init = FIXTURE["table"]
    with strategy.scope():
        sv = dps.ShardedVariable([dps.Variable(table_init[:6], name="tf/part_0"),
                                  dps.Variable(table_init[6:], name="tf/part_1")], name="tf")
        opt = dps.optimizers.SGD(1.0)
    w = FIXTURE["weights"] if spec["weighted"] else None
    bags = dps.Bags((FIXTURE["values"], FIXTURE["lengths"]), w, combiner=spec["combiner"],
                    default_id=spec["default_id"], max_norm=spec["max_norm"])
    got = dps.embedding_lookup_sparse(sv, bags)
    np.testing.assert_allclose(got, FIXTURE[f"{case}/result"], rtol=1e-6, atol=1e-6)
    opt.apply_gradients([(dps.PooledSlices(FIXTURE["upstream"], bags), sv)])  # through the clipping too
    np.testing.assert_allclose(sv.numpy(), table_init - FIXTURE[f"{case}/grad"], rtol=1e-5, atol=1e-6)


def test_scipy_csr_bags_use_their_data_as_weights(strategy):
    init = _table(3)
    with strategy.scope():
        table = dps.Variable(init, name="csr")
    dense = np.zeros((4, ROWS), np.float32)
    dense[0, [1, 5]] = [2.0, 0.5]
    dense[2, 9] = 3.0
    dense[3, [0, 2, 4]] = 1.0
    csr = scipy.sparse.csr_matrix(dense)
    values, lengths = csr.indices, np.diff(csr.indptr)
    for combiner in ("sum", "mean", "sqrtn"):
        got = dps.embedding_lookup_sparse(table, csr, combiner=combiner, default_id=7)
        want, _ = reference(init, values, lengths, csr.data, combiner, default_id=7)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    ones = scipy.sparse.csr_matrix((dense > 0).astype(np.float32))  # unweighted: data all ones
    got = dps.embedding_lookup_sparse(table, ones, combiner="mean")
    want, _ = reference(init, ones.indices, np.diff(ones.indptr), None, "mean")
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    with pytest.raises(TypeError, match="weights must be None when ids is a scipy.sparse matrix"):
        dps.embedding_lookup_sparse(table, csr, np.ones(csr.nnz))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_hash_table_pooled_values_and_gradients(strategy, combiner):
    with strategy.scope():
        table = dps.EmbeddingTable(3, initializer=lambda shape, dtype: np.ones(shape, dtype), name="bag_hash")
        opt = dps.optimizers.SGD(1.0)
    keys = np.array([10**12, 5, 10**12, -3, 77, 5, 6, 9, 2**40, 11])
    lengths = np.array([3, 0, 2, 1, 4])
    weights = np.array([1.0, 2.0, 0.5, 1.0, 2.0, 1.0, 1.0, 0.5, 3.0, 1.0])
    bags = dps.Bags((keys, lengths), weights, combiner=combiner, default_id=123)
    got = dps.embedding_lookup_sparse(table, bags)
    known = sorted({int(k) for k in keys if k >= 0} | {123})
    index = {k: i for i, k in enumerate(known)}
    ones = np.ones((len(known), 3))
    want, _ = reference(ones, [index.get(int(k), -1) for k in keys], lengths, weights, combiner, index[123])
    np.testing.assert_allclose(got, want, rtol=2e-6)
    upstream = np.arange(15, dtype=np.float32).reshape(5, 3)
    opt.apply_gradients([(dps.PooledSlices(upstream, bags), table)])
    _, grad = reference(ones, [index.get(int(k), -1) for k in keys], lengths, weights, combiner, index[123],
                        upstream=upstream)
    exported_keys, rows = table.export()
    assert exported_keys.tolist() == known
    np.testing.assert_allclose(rows, ones - grad, rtol=1e-5, atol=1e-6)


def test_hash_table_admission_and_drops_count_as_for_lookups(strategy):
    with strategy.scope():
        table = dps.EmbeddingTable(2, admit_after=2, name="bag_admit")
        opt = dps.optimizers.SGD(1.0)
    bags = dps.Bags((np.array([4, 4, 8]), np.array([2, 1])), combiner="sum")
    np.testing.assert_array_equal(dps.embedding_lookup_sparse(table, bags), np.zeros((2, 2)))
    opt.apply_gradients([(dps.PooledSlices(np.ones((2, 2), np.float32), bags), table)])
    stats = {k: sum(s[k] for s in table.stats()) for k in ("rows", "dropped", "pending")}
    assert stats == {"rows": 0, "dropped": 2, "pending": 2}  # one sighting per distinct key; both dropped
    dps.embedding_lookup_sparse(table, bags)  # the second sighting admits both
    opt.apply_gradients([(dps.PooledSlices(np.ones((2, 2), np.float32), bags), table)])
    keys, rows = table.export()
    assert keys.tolist() == [4, 8]
    np.testing.assert_array_equal(rows, [[-2.0, -2.0], [-1.0, -1.0]])  # key 4 twice in its bag


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("make_opt", [
    lambda lazy: dps.optimizers.Adagrad(0.1, lazy_sparse=lazy),
    lambda lazy: dps.optimizers.Adam(0.05, lazy_sparse=lazy, weight_decay=0.01),
    lambda lazy: dps.optimizers.Ftrl(0.1, lazy_sparse=lazy),
    lambda lazy: dps.optimizers.SGD(0.1, momentum=0.9, lazy_sparse=lazy, clipnorm=0.5),
], ids=["adagrad", "adamw", "ftrl", "momentum_clipnorm"])
def test_every_optimizer_takes_a_pooled_gradient_as_its_indexed_slices(strategy, make_opt, lazy):
    """The same optimizer on two copies of a table: PooledSlices on one, on the other the IndexedSlices
    numpy makes from TensorFlow's definition (a row per id)."""
    init = _table(4)
    with strategy.scope():
        a = dps.ShardedVariable([dps.Variable(init[:5], name="pa/part_0"), dps.Variable(init[5:], name="pa/part_1")],
                                name="pa")
        b = dps.ShardedVariable([dps.Variable(init[:5], name="pb/part_0"), dps.Variable(init[5:], name="pb/part_1")],
                                name="pb")
        opt_a, opt_b = make_opt(lazy), make_opt(lazy)
    rng = np.random.default_rng(5)
    for step in range(3):
        upstream = rng.normal(size=(len(LENGTHS), 3)).astype(np.float32)
        bags = dps.Bags((VALUES, LENGTHS), WEIGHTS, combiner="mean", default_id=2)
        dps.embedding_lookup_sparse(a, bags)
        opt_a.apply_gradients([(dps.PooledSlices(upstream, bags), a)])
        # The per-id rows, from the definition: upstream[bag] * w / sum(w) over each bag's kept ids.
        ids, rows = [], []
        start = 0
        for bag, n in enumerate(LENGTHS):
            kept = [(i, x) for i, x in zip(VALUES[start:start + n], WEIGHTS[start:start + n]) if i >= 0 and x > 0]
            start += n
            kept = kept or [(2, 1.0)]
            total = sum(x for _, x in kept)
            for i, x in kept:
                ids.append(i)
                rows.append(upstream[bag] * np.float32(x) / np.float32(total))
        opt_b.apply_gradients([(dps.IndexedSlices(np.array(rows, np.float32), np.array(ids)), b)])
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-5, atol=2e-6, err_msg=f"step {step}")


def test_read_values_pools_beside_dense_reads_in_one_message_per_server(strategy):
    init = _table(6)
    with strategy.scope():
        t0 = dps.Variable(init, name="rv_t0")
        t1 = dps.Variable(init * 2, name="rv_t1")
        w = dps.Variable(np.ones(4, np.float32), name="rv_w")
    bags = dps.Bags((VALUES, LENGTHS), combiner="sqrtn")
    before = [(s["messages"], s["calls"].get("read", 0)) for s in strategy.ps_stats()]
    got_w, p0, p1 = dps.read_values([w, (t0, bags), (t1, bags)])
    after = [(s["messages"], s["calls"].get("read", 0)) for s in strategy.ps_stats()]
    # One message per server holding a table (the stats call is one more), with one read in it.
    assert [(m1 - m0, r1 - r0) for (m0, r0), (m1, r1) in zip(before, after)] == [(2, 1), (2, 1)]
    want, _ = reference(init, VALUES, LENGTHS, None, "sqrtn")
    np.testing.assert_allclose(p0, want, rtol=2e-6)
    np.testing.assert_allclose(p1, 2 * want, rtol=2e-6)
    np.testing.assert_array_equal(got_w, np.ones(4))


def test_a_gradient_after_its_lookup_carries_no_ids(strategy):
    """The server keeps the lookup's bags: the gradient is one row per bag, nothing more."""
    with strategy.scope():
        table = dps.Variable(_table(7, rows=1000, dim=16), name="nobytes")
        opt = dps.optimizers.SGD(0.1)
    rng = np.random.default_rng(8)
    lengths = rng.integers(1, 21, size=64)
    values = rng.integers(0, 1000, size=int(lengths.sum()))
    task = int(table.device.split("task:")[1].split("/")[0])

    def received():
        return strategy.ps_stats()[task]["bytes_received"]

    bags = dps.Bags((values, lengths))
    start = received()
    dps.embedding_lookup_sparse(table, bags)
    looked = received() - start
    assert looked == values.size * 4 + lengths.size * 1  # int32 ids, uint8 lengths
    start = received()
    opt.apply_gradients([(dps.PooledSlices(np.ones((64, 16), np.float32), bags), table)])
    assert received() - start == 64 * 16 * 4  # a vector per bag, no ids


def test_a_gradient_without_its_lookup_sends_the_bags(strategy):
    init = _table(9)
    with strategy.scope():
        table = dps.Variable(init, name="nolookup")
        opt = dps.optimizers.SGD(1.0)
    upstream = np.ones((len(LENGTHS), 3), np.float32)
    bags = dps.Bags((VALUES, LENGTHS), combiner="sum")
    opt.apply_gradients([(dps.PooledSlices(upstream, bags), table)])  # never looked up: the bags go along
    _, grad = reference(init, VALUES, LENGTHS, None, "sum", upstream=upstream)
    np.testing.assert_allclose(table.numpy(), init - grad, rtol=1e-6)
    # Applied twice after one lookup: the second carries the bags again (a lookup is trained once).
    dps.embedding_lookup_sparse(table, bags)
    opt.apply_gradients([(dps.PooledSlices(upstream, bags), table)])
    opt.apply_gradients([(dps.PooledSlices(upstream, bags), table)])
    np.testing.assert_allclose(table.numpy(), init - 3 * grad, rtol=1e-5)


def test_a_gradient_naming_a_lookup_the_server_never_saw_is_dropped_and_counted(strategy):
    """As after a restore: the server was made again since the lookup (whose rows the restore rolled back)."""
    init = _table(10)
    with strategy.scope():
        table = dps.Variable(init, name="lost")
        opt = dps.optimizers.SGD(1.0)
    task = int(table.device.split("task:")[1].split("/")[0])
    grad = BagGrad(np.ones((2, 3), np.float32), lane="someone-else", token=12345)
    protocol.apply_gradients(opt.server_key, [(table.handle, "bags", grad)])
    np.testing.assert_array_equal(table.numpy(), init)
    assert strategy.ps_stats()[task]["calls"]["pooled_gradient_from_before_a_restore"] == 1


def test_a_server_that_no_longer_holds_a_lookup_says_so_and_changes_nothing(strategy):
    init = _table(10)
    with strategy.scope():
        table = dps.Variable(init, name="forgotten")
        opt = dps.optimizers.SGD(1.0)
    bags = dps.Bags((VALUES, LENGTHS))
    dps.embedding_lookup_sparse(table, bags)  # this process's lane is now known to the server
    from daskps.variables.bags import lookup_lane

    grad = BagGrad(np.ones((len(LENGTHS), 3), np.float32), lane=lookup_lane(), token=10**9)  # a token never sent
    with pytest.raises(LookupError, match="no longer holds"):
        protocol.apply_gradients(opt.server_key, [(table.handle, "bags", grad)])
    np.testing.assert_array_equal(table.numpy(), init)


def test_bad_input_is_refused_by_name_and_changes_nothing(strategy):
    init = _table(11)
    with strategy.scope():
        table = dps.Variable(init, name="badbags")
        opt = dps.optimizers.SGD(1.0)
    ragged = (VALUES, LENGTHS)
    with pytest.raises(ValueError, match="combiner must be one of"):
        dps.embedding_lookup_sparse(table, ragged, combiner="max")
    with pytest.raises(IndexError, match="id 10 is out of range"):
        dps.embedding_lookup_sparse(table, (np.array([1, 10]), np.array([2])))
    with pytest.raises(IndexError, match="out of range"):
        dps.embedding_lookup_sparse(table, ragged, default_id=99)
    with pytest.raises(ValueError, match="row_lengths add up to 3"):
        dps.embedding_lookup_sparse(table, (np.array([1, 2]), np.array([1, 2])))
    with pytest.raises(ValueError, match="row_lengths.*>= 0"):
        dps.embedding_lookup_sparse(table, (np.array([1]), np.array([2, -1])))
    with pytest.raises(TypeError, match="ids values must be a 1-D array of integers"):
        dps.embedding_lookup_sparse(table, (np.array([1.5]), np.array([1])))
    with pytest.raises(ValueError, match="weights must be 15 numbers"):
        dps.embedding_lookup_sparse(table, ragged, np.ones(3))
    with pytest.raises(ValueError, match="same row_lengths"):
        dps.embedding_lookup_sparse(table, ragged, (WEIGHTS, LENGTHS[::-1]))
    with pytest.raises(ValueError, match="max_norm must be a positive number"):
        dps.embedding_lookup_sparse(table, ragged, max_norm=0.0)
    with pytest.raises(TypeError, match="ids must be a"):
        dps.embedding_lookup_sparse(table, np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="leave those arguments unset"):
        dps.embedding_lookup_sparse(table, dps.Bags(ragged), combiner="sum")
    bags = dps.Bags(ragged)
    with pytest.raises(ValueError, match=r"values must have a row per bag, shape \(9, ...\)"):
        dps.PooledSlices(np.ones((3, 3)), bags)
    with pytest.raises(ValueError, match=r"gradient values for 'badbags' must have shape \(9, 3\)"):
        opt.apply_gradients([(dps.PooledSlices(np.ones((9, 4)), bags), table)])
    with pytest.raises(TypeError, match="bags must be a dps.Bags"):
        dps.PooledSlices(np.ones((9, 3)), ragged)
    with strategy.scope():
        clipping = dps.optimizers.SGD(1.0, clipvalue=0.1)
    with pytest.raises(ValueError, match="clipvalue"):
        clipping.apply_gradients([(dps.PooledSlices(np.ones((9, 3)), dps.Bags(ragged, WEIGHTS)), table)])
    np.testing.assert_array_equal(table.numpy(), init)
    assert int(opt.iterations.numpy()) == 0


def test_local_bags_to_indexed_slices_is_tensorflows_gradient():
    upstream = np.random.default_rng(12).normal(size=(len(LENGTHS), 3)).astype(np.float32)
    bags = dps.Bags((VALUES, LENGTHS), WEIGHTS, combiner="sqrtn", default_id=0)
    slices = dps.PooledSlices(upstream, bags).to_indexed_slices()
    _, grad = reference(np.zeros((ROWS, 3)), VALUES, LENGTHS, WEIGHTS, "sqrtn", 0, upstream=upstream)
    dense = np.zeros((ROWS, 3))
    np.add.at(dense, slices.indices, slices.values)
    np.testing.assert_allclose(dense, grad, rtol=1e-5, atol=1e-6)


def test_a_jax_step_pushes_the_gradient_of_its_pooled_inputs(strategy):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    init = _table(13)
    with strategy.scope():
        table = dps.Variable(init, name="jaxbags")
        opt = dps.optimizers.SGD(0.5)
    head = np.random.default_rng(14).normal(size=(3,)).astype(np.float32)
    y = np.arange(len(LENGTHS), dtype=np.float32)

    def loss(pooled):
        return jnp.mean((pooled @ head - y) ** 2)

    bags = dps.Bags((VALUES, LENGTHS), WEIGHTS, combiner="sqrtn")
    pooled = dps.embedding_lookup_sparse(table, bags)
    grad = jax.grad(loss)(jnp.asarray(pooled))  # a JAX array: taken as it is
    opt.apply_gradients([(dps.PooledSlices(grad, bags), table)])
    want_pooled, _ = reference(init, VALUES, LENGTHS, WEIGHTS, "sqrtn")
    upstream = 2 * ((want_pooled @ head - y)[:, None] * head[None, :]) / len(y)  # d mean((p h - y)^2) / d p
    _, dense = reference(init, VALUES, LENGTHS, WEIGHTS, "sqrtn", upstream=upstream)
    np.testing.assert_allclose(table.numpy(), init - 0.5 * dense, rtol=1e-5, atol=1e-5)


def test_hash_table_rows_trained_by_pooled_gradients_count_as_updated_for_eviction(strategy):
    with strategy.scope():
        table = dps.EmbeddingTable(2, evict_after_steps=1, name="bag_evict")
        opt = dps.optimizers.SGD(1.0)
    a, b = dps.Bags((np.array([7]), np.array([1]))), dps.Bags((np.array([9]), np.array([1])))
    dps.read_values([(table, a), (table, b)])  # both rows made
    opt.apply_gradients([(dps.PooledSlices(np.ones((1, 2), np.float32), a), table)])  # only key 7 trained
    assert table.evict() == 1
    assert table.export()[0].tolist() == [7]


def test_a_checkpoint_restores_what_pooled_gradients_trained_and_the_optimizer_slots(strategy, tmp_path):
    init = _table(15)
    with strategy.scope():
        sv = dps.ShardedVariable([dps.Variable(init[:4], name="ck/part_0"), dps.Variable(init[4:], name="ck/part_1")],
                                 name="ck")
        opt = dps.optimizers.Adagrad(0.3)
    upstream = np.random.default_rng(16).normal(size=(len(LENGTHS), 3)).astype(np.float32)

    def step():
        bags = dps.Bags((VALUES, LENGTHS), WEIGHTS, combiner="mean")
        dps.embedding_lookup_sparse(sv, bags)
        opt.apply_gradients([(dps.PooledSlices(upstream, bags), sv)])

    step()
    step()
    ckpt = dps.Checkpoint(table=sv, optimizer=opt)
    path = ckpt.write(str(tmp_path / "pooled"))
    saved = sv.numpy()
    step()
    after_one_more = sv.numpy()
    assert not np.allclose(after_one_more, saved)
    ckpt.read(path)
    np.testing.assert_array_equal(sv.numpy(), saved)
    step()  # the accumulators came back too: the same step gives the same values
    np.testing.assert_allclose(sv.numpy(), after_one_more, rtol=1e-6)


def test_bags_looked_up_here_and_trained_on_a_trainer_carry_their_ids_there(strategy, coordinator):
    """A Bags pickled into a scheduled function: its lookup was this process's, so the trainer sends the bags."""
    init = _table(17)
    with strategy.scope():
        table = dps.Variable(init, name="travels")
        opt = dps.optimizers.SGD(1.0)
    bags = dps.Bags((VALUES, LENGTHS), combiner="sum")
    dps.embedding_lookup_sparse(table, bags)  # looked up here, in the coordinator's process
    upstream = np.ones((len(LENGTHS), 3), np.float32)

    def train(bags):
        opt.apply_gradients([(dps.PooledSlices(upstream, bags), table)])

    coordinator.schedule(train, args=(bags,))
    coordinator.join()
    _, grad = reference(init, VALUES, LENGTHS, None, "sum", upstream=upstream)
    np.testing.assert_allclose(table.numpy(), init - grad, rtol=1e-6)


def test_edge_cases_the_review_found(strategy):
    init = _table(18)
    with strategy.scope():
        table = dps.Variable(init, name="edges")
        opt = dps.optimizers.SGD(1.0, clipnorm=1.0)
        scalar = dps.Variable(np.float32(1.0), name="edges_scalar")
        adagrad = dps.optimizers.Adagrad(0.1)
    # nothing to pool, with max_norm and clipping: zeros, and a gradient that changes nothing
    empty = dps.Bags((np.array([-1]), np.array([1])), max_norm=1.0)
    np.testing.assert_array_equal(dps.embedding_lookup_sparse(table, empty), np.zeros((1, 3)))
    none = dps.Bags((np.zeros(0, np.int64), np.zeros(0, np.int64)), max_norm=1.0)
    assert dps.embedding_lookup_sparse(table, none).shape == (0, 3)
    opt.apply_gradients([(dps.PooledSlices(np.zeros((0, 3), np.float32), none), table)])
    np.testing.assert_array_equal(table.numpy(), init)
    # Adagrad on a 0-d variable (its step once reused an array that a scalar is not)
    adagrad.apply_gradients([(np.float32(0.5), scalar)])
    np.testing.assert_allclose(scalar.numpy(), 1.0 - 0.1 * 0.5 / np.sqrt(0.1 + 0.25 + 1e-7), rtol=1e-6)
    # ids that do not fit int64, NaN weights in a sparse matrix, default_id out of range: refused by name
    with pytest.raises(ValueError, match="must fit in int64"):
        dps.Bags((np.array([2**63], np.uint64), np.array([1])))
    bad = scipy.sparse.csr_matrix(np.array([[np.nan, 1.0]]))
    with pytest.raises(ValueError, match="must be finite"):
        dps.Bags(bad)
    with pytest.raises(IndexError, match="default_id for 'edges': id 10 is out of range"):
        dps.embedding_lookup_sparse(table, (np.array([1]), np.array([1, 0])), default_id=10)
    np.testing.assert_array_equal(table.numpy(), init)


@pytest.mark.parametrize("staleness", [0, 3])
def test_pooled_steps_on_one_trainer_are_sequential_sgd_with_and_without_staleness(client, strategy, coordinator,
                                                                                    staleness):
    """One trainer, its pushes held back (up to 3 steps with staleness): a pooled read still carries them
    first, so 12 steps give exactly what numpy's sequential SGD gives."""
    from tests.helpers.cluster import set_trainer_slots

    init = _table(19, rows=40, dim=4)
    with strategy.scope():
        table = dps.Variable(init, name=f"seq{staleness}")
        opt = dps.optimizers.SGD(0.2)
    head = np.random.default_rng(20).normal(size=(4,)).astype(np.float32)

    def step(seed):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(0, 6, size=8)
        bags = dps.Bags((rng.integers(0, 40, size=lengths.sum()), lengths), combiner="mean")
        pooled = dps.embedding_lookup_sparse(table, bags)
        g = (pooled @ head)[:, None] * head[None, :] / 8  # d/dp of mean((p . h)^2) / 2
        opt.apply_gradients([(dps.PooledSlices(g.astype(np.float32), bags), table)])

    set_trainer_slots(client, "worker-1", 0)
    try:
        for seed in range(12):
            coordinator.schedule(step, args=(seed,), staleness=staleness)
        coordinator.join()
    finally:
        set_trainer_slots(client, "worker-1", 1)
    want = init.astype(np.float64)
    for seed in range(12):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(0, 6, size=8)
        values = rng.integers(0, 40, size=lengths.sum())
        pooled, _ = reference(want, values, lengths, None, "mean")
        g = (pooled @ head)[:, None] * head[None, :] / 8
        _, dense = reference(want, values, lengths, None, "mean", upstream=g)
        want = want - 0.2 * dense
    np.testing.assert_allclose(table.numpy(), want, rtol=1e-5, atol=1e-6)
