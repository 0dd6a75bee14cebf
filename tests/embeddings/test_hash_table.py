"""EmbeddingTable: hash-keyed rows, admission, eviction by age and by capacity, slots dropped with rows.

The reference below is written from the rules in ``daskps/server/hash_table.py``'s
docstring and from Keras' Adagrad, in plain Python and numpy, with its own
splitmix64 (integers, not numpy), and checked against a table on a real
2-server cluster.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import daskps as dps
from daskps._core.hashing import KeyIndex
from daskps.errors import RollbackWarning
from tests.helpers.cluster import kill_worker
from tests.helpers.waiting import wait_until

DIM, LR, ACC0, EPS = 3, 0.1, 0.1, 1e-7
MASK = (1 << 64) - 1


def splitmix64(key: int) -> int:
    z = (key + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def init_rows(shape, dtype):
    """Rows that differ by position, so a row made for the wrong key shows."""
    n, d = shape
    return (np.arange(n * d, dtype=np.float64).reshape(n, d) / 10 + 1).astype(dtype)


class Part:
    def __init__(self, admit_after, capacity, evict_after):
        self.rows: dict[int, dict] = {}  # key -> {"value", "acc", "used", "updated"}
        self.sightings: dict[int, int] = {}
        self.clock = self.steps = 0
        self.admit_after, self.capacity, self.evict_after = admit_after, capacity, evict_after
        self.admitted = self.evicted = self.dropped = 0

    def lookup(self, keys):  # distinct keys, in ascending order (as the client sends them)
        self.clock += 1
        out, made = {}, []
        for k in keys:
            if k in self.rows:
                self.rows[k]["used"] = self.clock
                out[k] = self.rows[k]["value"].copy()
                continue
            seen = self.sightings.get(k, 0) + 1
            if seen >= self.admit_after:
                self.sightings.pop(k, None)
                made.append(k)
            else:
                self.sightings[k] = seen
                out[k] = np.zeros(DIM, np.float32)
        values = init_rows((len(made), DIM), np.float32)
        for k, v in zip(made, values):
            self.rows[k] = {"value": v.copy(), "acc": np.full(DIM, ACC0, np.float32), "used": self.clock,
                            "updated": self.steps}
            out[k] = v.copy()
        self.admitted += len(made)
        while self.capacity is not None and len(self.rows) > self.capacity:
            victim = min(self.rows, key=lambda k: (self.rows[k]["used"], k))
            del self.rows[victim]
            self.evicted += 1
        return out

    def gradient(self, keys, values):
        self.steps += 1
        self.clock += 1
        summed: dict[int, np.ndarray] = {}
        for k, g in zip(keys, values):
            if k not in self.rows:
                continue
            summed[k] = summed.get(k, np.zeros(DIM, np.float32)) + g
        self.dropped += len(set(keys) - set(self.rows))  # distinct keys without a row
        for k, g in summed.items():
            row = self.rows[k]
            row["acc"] = row["acc"] + np.square(g)
            row["value"] = row["value"] - np.float32(LR) * g / np.sqrt(row["acc"] + np.float32(EPS))
            row["updated"], row["used"] = self.steps, self.clock

    def evict(self):
        old = [k for k, r in self.rows.items() if r["updated"] <= self.steps - self.evict_after]
        for k in old:
            del self.rows[k]
        self.evicted += len(old)
        return len(old)


class Reference:
    def __init__(self, parts, admit_after=1, capacity=None, evict_after=None):
        shares = [None] * parts if capacity is None else [capacity // parts + (i < capacity % parts)
                                                           for i in range(parts)]
        self.parts = [Part(admit_after, s, evict_after) for s in shares]

    def part(self, key):
        return splitmix64(key) % len(self.parts)

    def lookup(self, ids):
        ids = np.asarray(ids)
        found = {}
        uniq = sorted(set(int(k) for k in ids.ravel()))
        for p, part in enumerate(self.parts):
            mine = [k for k in uniq if self.part(k) == p]
            if mine:
                found.update(part.lookup(mine))
        return np.array([found[int(k)] for k in ids.ravel()], np.float32).reshape(ids.shape + (DIM,))

    def gradient(self, keys, values):
        for p, part in enumerate(self.parts):
            mine = [i for i, k in enumerate(keys) if self.part(int(k)) == p]
            part.gradient([int(keys[i]) for i in mine], values[mine].astype(np.float32))

    def evict(self):
        return sum(p.evict() for p in self.parts)

    def export(self):
        rows = {k: r["value"] for p in self.parts for k, r in p.rows.items()}
        keys = sorted(rows)
        return np.array(keys, np.int64), np.array([rows[k] for k in keys], np.float32).reshape(-1, DIM)

    def stats(self):
        return [{"rows": len(p.rows), "admitted": p.admitted, "evicted": p.evicted, "dropped": p.dropped,
                 "pending": len(p.sightings), "steps": p.steps} for p in self.parts]


def _check_same(table, ref):
    keys, rows = table.export()
    want_keys, want_rows = ref.export()
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_allclose(rows, want_rows, rtol=2e-6, atol=1e-6)
    assert table.stats() == ref.stats()


KEYS = np.array([0, 1, 2, 3, -1, -5, 7, 11, 2**40 + 3, -(2**50), 2**62 + 7, 123456789, 42, 99, -42, 8])


@pytest.mark.parametrize("admit_after, capacity, evict_after", [(1, None, None), (2, None, 3), (1, 9, None),
                                                                (3, 7, 2)])
def test_a_table_follows_the_reference_rules(strategy, admit_after, capacity, evict_after):
    rng = np.random.default_rng(admit_after * 100 + (capacity or 0))
    with strategy.scope():
        table = dps.EmbeddingTable(DIM, initializer=init_rows, admit_after=admit_after, capacity=capacity,
                                   evict_after_steps=evict_after)
        opt = dps.optimizers.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS)
    ref = Reference(2, admit_after, capacity, evict_after)
    for step in range(60):
        ids = rng.choice(KEYS, size=(2, 3))  # repeats included
        got = dps.embedding_lookup(table, ids)
        assert got.shape == (2, 3, DIM)
        np.testing.assert_allclose(got, ref.lookup(ids), rtol=2e-6, atol=1e-6)
        grad_keys = rng.choice(KEYS, size=5)
        values = rng.normal(size=(5, DIM)).astype(np.float32)
        opt.apply_gradients([(dps.IndexedSlices(values, grad_keys), table)])
        ref.gradient(grad_keys, values)
        if evict_after is not None and step % 4 == 3:
            assert table.evict() == ref.evict()
        if step % 10 == 9:
            _check_same(table, ref)
    _check_same(table, ref)
    stats = ref.stats()
    saw_drop = sum(s["dropped"] for s in stats) > 0
    saw_evict = sum(s["evicted"] for s in stats) > 0
    assert saw_drop  # gradients for keys without a row (never looked up, not yet admitted, or evicted)
    assert saw_evict == (capacity is not None or evict_after is not None)
    if capacity is not None:
        assert all(s["rows"] <= capacity // 2 + 1 for s in table.stats())


def test_first_touch_any_int64_and_the_default_initializer(strategy):
    with strategy.scope():
        table = dps.EmbeddingTable(4)
    ids = np.array([[-(2**63), 2**63 - 1], [0, 2**41 + 1]])  # splitmix64 % 2: 1, 1, 1, 0
    assert dps.embedding_lookup(table, ids).shape == (2, 2, 4)
    assert not dps.embedding_lookup(table, ids).any()  # zeros by default
    keys, rows = table.export()
    assert sorted(keys.tolist()) == sorted(ids.ravel().tolist()) and table.size() == 4
    assert [s["rows"] for s in table.stats()] == [1, 3]  # both servers hold rows, each its own keys
    assert dps.embedding_lookup(table, np.array([], np.int64)).shape == (0, 4)


def test_an_evicted_row_comes_back_with_fresh_slots(strategy):
    with strategy.scope():
        table = dps.EmbeddingTable(1, evict_after_steps=1)
        opt = dps.optimizers.Adagrad(1.0, initial_accumulator_value=1.0, epsilon=1e-12)
    key = np.array([5])

    def step(g):
        dps.embedding_lookup(table, key)
        opt.apply_gradients([(dps.IndexedSlices(np.array([[g]], np.float32), key), table)])
        return float(table.export()[1][0, 0])

    assert step(3.0) == pytest.approx(-3 / np.sqrt(10))
    opt.apply_gradients([(dps.IndexedSlices(np.zeros((1, 1), np.float32), np.array([6])), table)])
    assert table.evict() == 1 and table.size() == 0
    # Kept slots would give -3 / sqrt(1 + 9 + 9); fresh ones give the first step's value again.
    assert step(3.0) == pytest.approx(-3 / np.sqrt(10))


def test_trainers_look_up_and_train_a_table(strategy, coordinator):
    with strategy.scope():
        table = dps.EmbeddingTable(2, name="items")
        opt = dps.optimizers.SGD(0.5)

    def step(i):
        ids = np.array([i, -i, 2**40 + i])
        rows = dps.embedding_lookup(table, ids)
        opt.apply_gradients([(dps.IndexedSlices(np.ones_like(rows), ids), table)])
        return rows.sum()

    coordinator.fetch([coordinator.schedule(step, args=(i,)) for i in range(1, 9)])
    keys, rows = table.export()
    assert len(keys) == 24 and table.size() == 24
    np.testing.assert_array_equal(rows, np.full((24, 2), -0.5, np.float32))
    assert "EmbeddingTable 'items' dim=2" in repr(table)


def _snapshot(table):
    keys, rows = table.export()
    return keys.tolist(), rows.tolist(), table.stats()


@pytest.mark.parametrize("bad, error, match", [
    (np.array([1.5]), TypeError, "ids .* must be integers"),
    (np.array(["a"]), TypeError, "ids .* must be integers"),
    (np.array([2**64 - 1], np.uint64), ValueError, "fit in int64"),
    ([True, False], TypeError, "must be integers"),
])
def test_bad_ids_are_refused_and_nothing_changes(strategy, bad, error, match):
    with strategy.scope():
        table = dps.EmbeddingTable(2, admit_after=2)
    dps.embedding_lookup(table, np.array([1, 2, 3]))
    before = _snapshot(table)
    with pytest.raises(error, match=match):
        dps.embedding_lookup(table, bad)
    assert _snapshot(table) == before


@pytest.mark.parametrize("grad, error, match", [
    (dps.IndexedSlices(np.ones((2, 1, 2), np.float32), np.array([[1], [2]])), ValueError, "gradient keys .* 1-D"),
    (dps.IndexedSlices(np.ones((1, 2), np.float32), np.array([2**64 - 1], np.uint64)), ValueError, "fit in int64"),
    (dps.IndexedSlices(np.ones((2, 3), np.float32), np.array([1, 2])), ValueError, r"shape \(2, 2\)"),
    (dps.IndexedSlices(np.array([["a", "b"], ["c", "d"]]), np.array([1, 2])), TypeError, "numeric"),
    (np.ones((2, 2), np.float32), TypeError, "must be IndexedSlices"),
])
def test_bad_gradients_are_refused_and_nothing_changes(strategy, grad, error, match):
    with strategy.scope():
        table = dps.EmbeddingTable(2)
        opt = dps.optimizers.SGD(1.0)
    dps.embedding_lookup(table, np.array([1, 2, 3]))
    before = _snapshot(table)
    with pytest.raises(error, match=match):
        opt.apply_gradients([(grad, table)])
    assert _snapshot(table) == before


def test_int32_keys_must_fit(strategy):
    with strategy.scope():
        table = dps.EmbeddingTable(2, key_dtype=np.int32)
    with pytest.raises(ValueError, match="key_dtype int32"):
        dps.embedding_lookup(table, np.array([2**31]))
    assert table.size() == 0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"dim": 0}, ValueError, "dim must be an int >= 1"),
    ({"dim": 2, "admit_after": 0}, ValueError, "admit_after must be an int >= 1"),
    ({"dim": 2, "evict_after_steps": 0}, ValueError, "evict_after_steps"),
    ({"dim": 2, "capacity": 1}, ValueError, "capacity must be at least the number of parameter servers"),
    ({"dim": 2, "dtype": np.int32}, TypeError, "float dtype"),
    ({"dim": 2, "key_dtype": np.float32}, TypeError, "key_dtype"),
    ({"dim": 2, "initializer": 3}, TypeError, "initializer must be callable"),
])
def test_bad_arguments_are_refused(strategy, kwargs, error, match):
    with strategy.scope(), pytest.raises(error, match=match):
        dps.EmbeddingTable(**kwargs)


def test_an_initializer_of_the_wrong_shape_fails_the_lookup_and_changes_nothing(strategy):
    with strategy.scope():
        table = dps.EmbeddingTable(2, initializer=lambda shape, dtype: np.zeros((shape[0] + 1, 2), dtype))
    with pytest.raises(ValueError, match="initializer .* returned shape"):
        dps.embedding_lookup(table, np.array([10, 11, 12, 13]))
    assert table.size() == 0 and all(s["pending"] == 0 for s in table.stats())


def _train(table, opt, ref, rng, steps, keys=KEYS):
    for _ in range(steps):
        ids = rng.choice(keys, size=6)
        np.testing.assert_allclose(dps.embedding_lookup(table, ids), ref.lookup(ids), rtol=2e-6, atol=1e-6)
        grad_keys = rng.choice(keys, size=5)
        values = rng.normal(size=(5, DIM)).astype(np.float32)
        opt.apply_gradients([(dps.IndexedSlices(values, grad_keys), table)])
        ref.gradient(grad_keys, values)


def _accumulators(ref):
    return {k: r["acc"] for p in ref.parts for k, r in p.rows.items()}


def test_a_checkpoint_saved_from_two_servers_restores_into_three(strategy, tmp_path):
    rng = np.random.default_rng(7)
    with strategy.scope():
        table = dps.EmbeddingTable(DIM, initializer=init_rows, evict_after_steps=6, name="emb")
        opt = dps.optimizers.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS)
    ref = Reference(2, evict_after=6)
    _train(table, opt, ref, rng, 20)
    _train(table, opt, ref, rng, 8, keys=KEYS[:4])  # the other keys age out: the save evicts them
    path = dps.Checkpoint(emb=table, opt=opt).write(str(tmp_path / "ck"))
    evicted = ref.evict()
    assert evicted > 0
    _check_same(table, ref)  # the save evicted what the reference evicts
    want_keys, want_rows = ref.export()
    want_acc = _accumulators(ref)

    with dps.LocalPSCluster(num_ps=3, num_workers=1) as cluster, cluster.get_client() as client:
        three = dps.ParameterServerStrategy(client)
        with three.scope():
            again = dps.EmbeddingTable(DIM, initializer=init_rows, evict_after_steps=6, name="emb")
            opt3 = dps.optimizers.Adagrad(LR, initial_accumulator_value=ACC0, epsilon=EPS)
        dps.Checkpoint(emb=again, opt=opt3).restore(path)
        keys, rows = again.export()
        np.testing.assert_array_equal(keys, want_keys)
        np.testing.assert_allclose(rows, want_rows, rtol=1e-6)
        per_server = [s["rows"] for s in again.stats()]
        assert len(per_server) == 3 and sum(per_server) == len(want_keys) and min(per_server) > 0
        assert {s["steps"] for s in again.stats()} == {ref.parts[0].steps}
        # The accumulators came along: one more step gives the reference's Adagrad answer.
        g = np.full((len(keys), DIM), 0.5, np.float32)
        opt3.apply_gradients([(dps.IndexedSlices(g, keys), again)])
        acc = np.array([want_acc[int(k)] for k in keys]) + 0.25
        expect = want_rows - np.float32(LR) * 0.5 / np.sqrt(acc + np.float32(EPS))
        np.testing.assert_allclose(again.export()[1], expect, rtol=1e-5)
        three.close()


def test_a_restore_that_does_not_fit_changes_nothing(strategy, tmp_path):
    with strategy.scope():
        table = dps.EmbeddingTable(2, name="t")
        other = dps.EmbeddingTable(3, name="t")
        dense = dps.Variable(np.zeros((4, 2), np.float32))
    dps.embedding_lookup(table, np.array([1, 2]))
    dps.embedding_lookup(other, np.array([5]))
    path = dps.Checkpoint(t=table).write(str(tmp_path / "ck"))
    before = _snapshot(other)
    with pytest.raises(ValueError, match="embedding table has dim 3"):
        dps.Checkpoint(t=other).restore(path)
    with pytest.raises(ValueError, match="holds an EmbeddingTable's rows"):
        dps.Checkpoint(t=dense).restore(path)
    with pytest.raises(ValueError, match="lacks"):
        dps.Checkpoint(t=other).restore(dps.Checkpoint(t=dense).write(str(tmp_path / "dense")))
    assert _snapshot(other) == before


def test_a_dropped_table_is_released_on_every_server(strategy):
    with strategy.scope():
        table = dps.EmbeddingTable(2, name="dropped")
    dps.embedding_lookup(table, np.arange(50))

    def parts():
        return [k for s in strategy.ps_stats() for k in s["variables"] if k.startswith("dropped@")]

    assert len(parts()) == 2
    del table
    gc.collect()
    for _ in range(100):
        if not parts():
            break
        time.sleep(0.05)
    assert parts() == []


def test_the_part_of_a_lost_server_comes_back_from_the_checkpoint(fresh_cluster, tmp_path):
    _, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    keys = np.array([-9, -1, 0, 1, 2, 3, 5, 8, 13, 2**40, 2**50 + 1, 77, 78, 79, 80, 81])
    on_ps0 = np.array([splitmix64(int(k)) % 2 == 0 for k in keys])
    assert 0 < on_ps0.sum() < len(keys)
    with strategy.scope():
        table = dps.EmbeddingTable(2, name="emb")
        opt = dps.optimizers.SGD(1.0)
    manager = dps.CheckpointManager(dps.Checkpoint(emb=table, opt=opt), str(tmp_path))
    coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)
    ones = np.ones((len(keys), 2), np.float32)

    def step():
        dps.embedding_lookup(table, keys)
        opt.apply_gradients([(dps.IndexedSlices(ones, keys), table)])

    for _ in range(3):
        coordinator.schedule(step)
    coordinator.join()
    manager.save()
    for _ in range(2):
        coordinator.schedule(step)
    coordinator.join()
    kill_worker(client, "ps-0")
    with pytest.warns(RollbackWarning, match="emb"):
        wait_until(lambda: coordinator.recoveries, 60, failure="no recovery", interval=0.05, collect=False)
        coordinator.join()
    got_keys, rows = table.export()
    np.testing.assert_array_equal(got_keys, np.sort(keys))
    by_key = dict(zip(got_keys.tolist(), rows[:, 0].tolist()))
    # ps-0's part is back at the checkpoint (3 steps); ps-1's part kept all 5.
    assert [by_key[int(k)] for k in keys] == [-3.0 if lost else -5.0 for lost in on_ps0]
    coordinator.schedule(step)
    coordinator.join()
    assert table.size() == len(keys) and float(table.export()[1].sum()) == 2 * (-4.0 * on_ps0.sum() - 6.0 * (~on_ps0).sum())


def test_the_key_index_matches_a_dict_through_inserts_deletes_and_rebuilds():
    rng = np.random.default_rng(3)
    stored = np.zeros(200_000, np.int64)  # the key of each row, as a table keeps it
    index, want, next_row = KeyIndex(lambda rows: stored[rows]), {}, 0
    for it in range(200):
        keys = np.unique(np.concatenate([rng.integers(-(2**62), 2**62, rng.integers(0, 400)),
                                         rng.integers(0, 60, 50)]))  # fresh keys and a few that repeat
        rows = index.find(keys)
        assert rows.tolist() == [want.get(int(k), -1) for k in keys]
        new = keys[rows < 0]
        at = np.arange(next_row, next_row + len(new))
        stored[at], next_row = new, next_row + len(new)
        index.insert(new, at)
        want.update(zip(new.tolist(), at.tolist()))
        if it % 2:
            gone = np.array(list(want))[rng.random(len(want)) < 0.3]
            index.delete(gone)
            for k in gone.tolist():
                del want[k]
        assert len(index) == len(want)
    assert sorted(index.rows().tolist()) == sorted(want.values())


def test_reprs_and_server_stats_show_rows_admitted_and_evicted_per_server(strategy):
    with strategy.scope():
        table = dps.EmbeddingTable(2, name="shown", capacity=4, admit_after=2)
    for _ in range(2):
        dps.embedding_lookup(table, np.arange(20))
    counts = table.stats()
    assert sum(c["admitted"] for c in counts) == 20 and sum(c["rows"] for c in counts) == 4
    assert sum(c["evicted"] for c in counts) == 16
    html = table._repr_html_()
    for c in counts:
        assert f"<td>{c['rows']:,}</td><td>{c['admitted']:,}</td><td>{c['evicted']:,}</td>" in html
    on_servers = [s["counts"] for s in strategy.ps_stats()]
    mine = [next(v for k, v in c.items() if k.startswith("shown@")) for c in on_servers]
    assert mine == counts


def test_key_index_rebuilds_a_slice_at_a_time_and_reserves_room():
    """Rebuilds (growing, and in place when deletions fill the index) keep every key across many slices."""
    rng = np.random.default_rng(3)
    stored = np.zeros(400_000, np.int64)
    index, want, next_row = KeyIndex(lambda rows: stored[rows]), {}, 0
    for it in range(12):
        new = np.setdiff1d(rng.integers(-(2**62), 2**62, 30_000), np.array(list(want), np.int64))
        at = np.arange(next_row, next_row + len(new))
        stored[at], next_row = new, next_row + len(new)
        index.insert(new, at)
        want.update(zip(new.tolist(), at.tolist()))
        gone = np.array(list(want))[rng.random(len(want)) < 0.5]
        index.delete(gone)
        for k in gone.tolist():
            del want[k]
        keys = np.array(list(want), np.int64)
        assert index.find(keys).tolist() == list(want.values()), it
        assert (index.find(gone) == -1).all()
    assert len(index) == len(want) > 2 * 8192 and sorted(index.rows().tolist()) == sorted(want.values())

    reserved = KeyIndex(lambda rows: stored[rows])
    reserved.insert(stored[:10], np.arange(10))
    reserved.reserve(100_000)
    size = reserved.nbytes()
    assert size >= 4 * 3 * 100_000
    reserved.insert(stored[10:100_000], np.arange(10, 100_000))  # fits: no rebuild, no larger index
    assert reserved.nbytes() == size
    assert reserved.find(stored[:100_000]).tolist() == list(range(100_000))


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
