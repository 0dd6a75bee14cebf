"""Bad input, one case per row of the "Bad input" table (docs/reference/bad-input.md).

Every case runs against real parameter servers and checks two things: the
exact exception, with a message that names the argument and what was
expected, and that no parameter server changed (every value, every
optimizer slot, and each server's variables and byte counts). The NaN/inf
rows check the opposite: the values are stored, as TensorFlow stores them,
and nothing else moves.

One strategy serves the whole module, so the servers' state carries over
from case to case; each case compares against a snapshot taken just before.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import shutil
import threading
import time
from types import SimpleNamespace

import dask.config
import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskps as dps
from tests.helpers.waiting import wait_until

ROWS = 6  # every variable the id cases touch has 6 rows, so one "out of range" fits all


# -- the module's servers, and their snapshot ------------------------------------------
class _Steerable:
    """A partitioner whose answer a test can replace: two shards otherwise."""

    def __init__(self):
        self.override = None

    def __call__(self, shape, dtype):
        if self.override is not None:
            return self.override(shape, dtype)
        return dps.partitioners.FixedShardsPartitioner(2)(shape, dtype)


@contextlib.contextmanager
def _partitioner_says(state, fn):
    state.partitioner.override = fn
    try:
        yield
    finally:
        state.partitioner.override = None


@pytest.fixture(scope="module")
def state(client, tmp_path_factory):
    partitioner = _Steerable()
    strategy = dps.ParameterServerStrategy(client, variable_partitioner=partitioner)
    ns = SimpleNamespace(strategy=strategy, partitioner=partitioner, tmp=tmp_path_factory.mktemp("hostile"))
    with strategy.scope():
        ns.table = dps.Variable(np.arange(12, dtype=np.float32).reshape(ROWS, 2), name="table")  # 2 shards
        with _partitioner_says(ns, lambda shape, dtype: [1] * len(shape)):
            ns.w = dps.Variable(np.linspace(-1, 1, 12, dtype=np.float32).reshape(ROWS, 2), name="w")
            ns.counts = dps.Variable(np.arange(ROWS, dtype=np.int64), name="counts")
            ns.nan_target = dps.Variable(np.ones(3, np.float32), name="nan_target")
        ns.opt = dps.optimizers.Adam(0.1)
        ns.sgd = dps.optimizers.SGD(1.0)
    assert isinstance(ns.table, dps.ShardedVariable) and isinstance(ns.w, dps.Variable)
    step = [(dps.IndexedSlices(np.ones((2, 2), np.float32), [0, 5]), ns.table), (np.ones((ROWS, 2), np.float32), ns.w)]
    ns.opt.apply_gradients(step)  # slots exist on both servers
    ns.ckpt = dps.Checkpoint(table=ns.table, w=ns.w, opt=ns.opt).write(str(ns.tmp / "saved"))
    ns.coordinator = dps.ClusterCoordinator(strategy)
    ns.snapshots = itertools.count()
    yield ns
    strategy.close()


def _saved_tensors(path):
    """Every tensor of the checkpoint at ``path``, put together from its pieces."""
    manifest = json.loads((path / "manifest.json").read_text())
    out = {}
    for name, entry in manifest["tensors"].items():
        pieces = sorted(entry["pieces"], key=lambda p: p["offset"])
        arrays = [np.load(path / p["file"]) for p in pieces]
        out[name] = arrays[0] if not entry["shape"] else np.concatenate(arrays)
    return out


def snapshot(state):
    """What the servers hold: values, optimizer slots and iterations, and per-server sizes."""
    named = {"table": state.table, "w": state.w, "counts": state.counts, "nan_target": state.nan_target,
             "opt/iterations": state.opt.iterations, "sgd/iterations": state.sgd.iterations}
    values = dict(zip(named, dps.read_values(list(named.values()))))
    path = state.tmp / f"snapshot-{next(state.snapshots)}"
    dps.Checkpoint(table=state.table, w=state.w, counts=state.counts, nan_target=state.nan_target,
                   opt=state.opt, sgd=state.sgd).write(str(path))
    slots = {k: v for k, v in _saved_tensors(path).items() if ".OPTIMIZER_SLOT" in k}
    shutil.rmtree(path)
    servers = [{k: s[k] for k in ("num_variables", "nbytes", "slot_nbytes", "variables")}
               for s in state.strategy.ps_stats()]
    return {"arrays": {**values, **slots}, "servers": servers}


def assert_same(before, after, changed=()):
    """Everything in ``after`` equals ``before`` except the arrays named in ``changed`` (NaN equals NaN)."""
    assert after["servers"] == before["servers"]
    assert after["arrays"].keys() == before["arrays"].keys()
    for key, value in before["arrays"].items():
        if key not in changed:
            np.testing.assert_array_equal(after["arrays"][key], value, err_msg=f"{key} changed")


@contextlib.contextmanager
def nothing_changes(state):
    before = snapshot(state)
    yield
    assert_same(before, snapshot(state))


def test_the_snapshot_sees_a_change(state):
    """The check the rest relies on: one scatter on one row shows up."""
    before = snapshot(state)
    state.table.scatter_add(dps.IndexedSlices(np.ones((1, 2), np.float32), [3]))
    after = snapshot(state)
    with pytest.raises(AssertionError, match="table changed"):
        assert_same(before, after)
    state.table.scatter_sub(dps.IndexedSlices(np.ones((1, 2), np.float32), [3]))
    assert_same(before, snapshot(state))


# -- ids: out of range, negative, float, not 1-D -----------------------------------------
def _slices(ids):
    return dps.IndexedSlices(np.ones(np.shape(ids) + (2,), np.float32), ids)


# name -> (call, what the message calls the ids, whether the ids go through IndexedSlices)
ID_OPS = {
    "embedding_lookup(sharded)": (lambda s, ids: dps.embedding_lookup(s.table, ids), "ids for variable 'table'", False),
    "embedding_lookup(variable)": (lambda s, ids: dps.embedding_lookup(s.w, ids), "ids for variable 'w'", False),
    "sharded.sparse_read": (lambda s, ids: s.table.sparse_read(ids), "indices for variable 'table'", False),
    "variable.sparse_read": (lambda s, ids: s.w.sparse_read(ids), "indices for variable 'w'", False),
    "sharded.scatter_add": (lambda s, ids: s.table.scatter_add(_slices(ids)),
                            "sparse_delta.indices for variable 'table'", True),
    "variable.scatter_update": (lambda s, ids: s.w.scatter_update(_slices(ids)),
                                "sparse_delta.indices for variable 'w'", True),
    "apply_gradients(IndexedSlices)": (lambda s, ids: s.opt.apply_gradients([(_slices(ids), s.table)]),
                                       "gradient indices for variable 'table'", True),
}
ID_CASES = {
    "out of range": ([0, ROWS], IndexError, rf"index {ROWS} is out of range \[0, {ROWS}\)"),
    "negative": ([2, -1], IndexError, rf"index -1 is out of range \[0, {ROWS}\)"),
    "float": ([0.0, 1.0], TypeError, "must be integers, got dtype float64"),
    "not 1-D": ([[0, 1]], ValueError, r"must be 1-D, got shape \(1, 2\)"),
}
_ID_PARAMS = [(op, case) for op, case in itertools.product(ID_OPS, ID_CASES)
              if not (op.startswith("embedding_lookup") and case == "not 1-D")]  # any shape is fine there


@pytest.mark.parametrize("op, case", _ID_PARAMS)
def test_bad_ids_are_refused(state, op, case):
    call, arg, sliced = ID_OPS[op]
    ids, error, match = ID_CASES[case]
    if sliced and case == "float":
        arg = "indices"  # IndexedSlices itself refuses them, before any variable is involved
    with nothing_changes(state), pytest.raises(error, match=match) as info:
        call(state, ids)
    assert type(info.value) is error and arg in str(info.value)


def test_embedding_lookup_takes_ids_of_any_shape(state):
    """As TensorFlow: the result has shape ids.shape + row shape; only sparse_read and scatters want 1-D."""
    with nothing_changes(state):
        got = dps.embedding_lookup(state.table, [[0, 5], [5, 3]])
    np.testing.assert_array_equal(got, np.asarray(state.table)[[[0, 5], [5, 3]]])


# -- wrong shape or dtype: assign*, scatters, apply_gradients ----------------------------
_SCATTERS = ["scatter_add", "scatter_sub", "scatter_mul", "scatter_div", "scatter_min", "scatter_max",
             "scatter_update", "batch_scatter_update"]
VALUE_CASES = {
    "assign, wrong shape": (lambda s: s.table.assign(np.ones((ROWS, 3), np.float32)),
                            ValueError, r"value for variable 'table' must have shape \(6, 2\), got \(6, 3\)"),
    "assign, strings": (lambda s: s.w.assign(np.full((ROWS, 2), "a")),
                        TypeError, "value for variable 'w' must be numeric, got dtype <U1"),
    "assign, None": (lambda s: s.w.assign(None), TypeError, "value for variable 'w' must be numeric"),
    "assign_add, wrong shape": (lambda s: s.w.assign_add(np.ones(ROWS, np.float32)),
                                ValueError, r"delta for variable 'w' must have shape \(6, 2\), got \(6,\)"),
    "assign_add, complex into float": (lambda s: s.table.assign_add(np.ones((ROWS, 2), np.complex64)),
                                       TypeError, "delta for variable 'table' must have a dtype castable to "
                                                  "float32, got complex64"),
    "assign_sub, strings": (lambda s: s.table.assign_sub([["a", "b"]] * ROWS),
                            TypeError, "delta for variable 'table' must be numeric, got dtype <U1"),
    "assign_sub, fractions into int": (lambda s: s.counts.assign_sub([0.5] * ROWS),
                                       TypeError, "delta for variable 'counts' has dtype int64; got non-integer"),
    "assign, float array into int": (lambda s: s.counts.assign(np.zeros(ROWS, np.float32)),
                                     TypeError, "castable to int64, got float32"),
    **{f"{m}, wrong values shape": (lambda s, m=m: getattr(s.table, m)(
        dps.IndexedSlices(np.ones((2, 3), np.float32), [0, 5])),
        ValueError, r"sparse_delta.values for variable 'table' must have shape \(2, 2\), got \(2, 3\)")
        for m in _SCATTERS},
    "scatter_add, strings": (lambda s: s.w.scatter_add(dps.IndexedSlices(np.full((1, 2), "a"), [0])),
                             TypeError, "sparse_delta.values for variable 'w' must be numeric"),
    "scatter_max, complex": (lambda s: s.table.scatter_max(dps.IndexedSlices(np.ones((1, 2), np.complex128), [4])),
                             TypeError, "sparse_delta.values for variable 'table' must have a dtype castable"),
    "scatter_update, not IndexedSlices": (lambda s: s.table.scatter_update(np.ones((ROWS, 2))),
                                          TypeError, "sparse_delta must be a daskps.IndexedSlices, got ndarray"),
    "scatter_div of ints by zero": (lambda s: s.counts.scatter_div(dps.IndexedSlices(np.zeros(1, np.int64), [1])),
                                    ValueError, "scatter_div of integer variable 'counts' by zero"),
    "apply_gradients, dense wrong shape": (lambda s: s.opt.apply_gradients([(np.ones((ROWS, 3), np.float32), s.w)]),
                                           ValueError, r"gradient for variable 'w' must have shape \(6, 2\)"),
    "apply_gradients, dense strings": (lambda s: s.opt.apply_gradients([(np.full((ROWS, 2), "a"), s.table)]),
                                       TypeError, "gradient for variable 'table' must be numeric"),
    "apply_gradients, dense complex": (lambda s: s.opt.apply_gradients([(np.ones((ROWS, 2), np.complex64), s.w)]),
                                       TypeError, "gradient for variable 'w' must have a dtype castable to float32"),
    "apply_gradients, sparse wrong shape": (
        lambda s: s.opt.apply_gradients([(dps.IndexedSlices(np.ones((1, 3), np.float32), [1]), s.table)]),
        ValueError, r"gradient values for variable 'table' must have shape \(1, 2\), got \(1, 3\)"),
    "apply_gradients, sparse complex": (
        lambda s: s.opt.apply_gradients([(dps.IndexedSlices(np.ones((1, 2), np.complex64), [1]), s.w)]),
        TypeError, "gradient values for variable 'w' must have a dtype castable to float32"),
    "apply_gradients, one good pair and one bad": (
        lambda s: s.opt.apply_gradients([(np.ones((ROWS, 2), np.float32), s.table),
                                         (np.ones((ROWS, 1), np.float32), s.w)]),
        ValueError, r"gradient for variable 'w' must have shape \(6, 2\), got \(6, 1\)"),
    "apply_gradients, integer variable": (lambda s: s.opt.apply_gradients([(np.ones(ROWS, np.int64), s.counts)]),
                                          TypeError, "cannot train variable 'counts' of dtype int64"),
}


@pytest.mark.parametrize("case", VALUE_CASES)
def test_wrong_shape_or_dtype_is_refused(state, case):
    call, error, match = VALUE_CASES[case]
    with nothing_changes(state), pytest.raises(error, match=match) as info:
        call(state)
    assert type(info.value) is error


def _apply(opt, var, grad):
    opt.apply_gradients([(grad, var)])


def _assign(var, value):
    var.assign(value)


def _scatter(var, delta):
    var.scatter_add(delta)


IN_FUNCTION = {
    "apply_gradients, dense wrong shape": (lambda s: (_apply, (s.opt, s.w, np.ones(ROWS, np.float32))),
                                           ValueError, r"gradient for variable 'w' must have shape \(6, 2\)"),
    "apply_gradients, sparse out of range": (
        lambda s: (_apply, (s.opt, s.table, dps.IndexedSlices(np.ones((1, 2), np.float32), [ROWS]))),
        IndexError, r"gradient indices for variable 'table': index 6 is out of range"),
    "assign, complex into float": (lambda s: (_assign, (s.table, np.ones((ROWS, 2), np.complex64))),
                                   TypeError, "value for variable 'table' must have a dtype castable to float32"),
    "scatter_add, negative id": (lambda s: (_scatter, (s.w, dps.IndexedSlices(np.ones((1, 2), np.float32), [-1]))),
                                 IndexError, "sparse_delta.indices for variable 'w': index -1 is out of range"),
}


@pytest.mark.parametrize("case", IN_FUNCTION)
def test_bad_update_in_a_scheduled_function_surfaces_from_join(state, case):
    make, error, match = IN_FUNCTION[case]
    fn, args = make(state)
    coordinator = state.coordinator
    with nothing_changes(state):
        failed = coordinator.schedule(fn, args=args)
        with pytest.raises(error, match=match) as info:
            coordinator.join()
        assert type(info.value) is error
        with pytest.raises(error, match=match):
            failed.fetch()
    assert coordinator.fetch(coordinator.schedule(int, args=("7",))) == 7  # and the coordinator goes on


# -- NaN and inf: stored, as TensorFlow stores them ---------------------------------------
def test_nan_and_inf_are_stored_by_assign(state):
    before = snapshot(state)
    state.nan_target.assign([np.nan, np.inf, -np.inf])
    after = snapshot(state)
    np.testing.assert_array_equal(after["arrays"]["nan_target"], np.array([np.nan, np.inf, -np.inf], np.float32))
    assert_same(before, after, changed={"nan_target"})
    state.nan_target.assign_add([1.0, -np.inf, np.inf])  # inf - inf is NaN, as in numpy and TensorFlow
    np.testing.assert_array_equal(state.nan_target.numpy(), [np.nan, np.nan, np.nan])
    state.nan_target.assign([1.0, 1.0, 1.0])


def test_nan_and_inf_gradients_are_applied(state):
    state.nan_target.assign([1.0, 2.0, 3.0])
    before = snapshot(state)
    state.sgd.apply_gradients([(np.array([np.nan, np.inf, 0.5], np.float32), state.nan_target)])  # lr 1.0
    after = snapshot(state)
    np.testing.assert_array_equal(after["arrays"]["nan_target"], np.array([np.nan, -np.inf, 2.5], np.float32))
    assert after["arrays"]["sgd/iterations"] == before["arrays"]["sgd/iterations"] + 1
    assert_same(before, after, changed={"nan_target", "sgd/iterations"})
    state.nan_target.assign([1.0, 1.0, 1.0])


def test_nan_in_a_sparse_update_reaches_only_its_row(state):
    before = snapshot(state)
    state.table.scatter_update(dps.IndexedSlices(np.array([[np.nan, np.inf]], np.float32), [4]))
    after = snapshot(state)
    want = before["arrays"]["table"].copy()
    want[4] = [np.nan, np.inf]
    np.testing.assert_array_equal(after["arrays"]["table"], want)
    assert_same(before, after, changed={"table"})
    state.table.assign(before["arrays"]["table"])


# -- partitioners and initial values -----------------------------------------------------
BAD_PARTITIONS = {
    "zero shards": [0, 1],
    "negative": [-1, 1],
    "splits axis 1": [2, 2],
    "empty": [],
    "None": None,
    "not a list": 3,
    "a fraction": [1.5, 1],
    "a whole float": [2.0, 1],
    "a string": ["2", 1],
    "a bool": [True, 1],
    "a string of digits": "21",
}


@pytest.mark.parametrize("case", BAD_PARTITIONS)
def test_invalid_partitioner_output_is_refused_and_nothing_is_left(state, case):
    result = BAD_PARTITIONS[case]
    with nothing_changes(state), _partitioner_says(state, lambda shape, dtype: result), state.strategy.scope():
        with pytest.raises(ValueError, match="variable_partitioner must return a list of ints") as info:
            dps.Variable(np.zeros((ROWS, 2), np.float32), name="refused")
    assert f"it returned {result!r}" in str(info.value)


def test_a_partitioner_that_raises_passes_its_error_on(state):
    def broken(shape, dtype):
        raise ZeroDivisionError("partitioner bug")

    with nothing_changes(state), _partitioner_says(state, broken), state.strategy.scope():
        with pytest.raises(ZeroDivisionError, match="partitioner bug"):
            dps.Variable(np.zeros((ROWS, 2), np.float32))


def _wait_for_servers(state, want, timeout=10.0):
    """Releases are sent in the background: wait until the servers hold exactly ``want`` again."""
    wait_until(lambda: snapshot(state)["servers"] == want, timeout, failure="the servers did not drop the variable")


@pytest.mark.parametrize("result, shards", [([100, 1], ROWS), ([2], 2), ([3, 1, 1], 3)])
def test_partitioner_output_tensorflow_accepts(state, result, shards):
    """As TensorFlow: more shards than rows gives one row per shard; entries past the first only need to be 1."""
    before = snapshot(state)
    with _partitioner_says(state, lambda shape, dtype: result), state.strategy.scope():
        v = dps.Variable(np.arange(12, dtype=np.float32).reshape(ROWS, 2), name="accepted")
    assert len(v.variables) == shards
    np.testing.assert_array_equal(np.asarray(v), np.arange(12).reshape(ROWS, 2))
    del v
    _wait_for_servers(state, before["servers"])
    assert_same(before, snapshot(state))


def _half_fails(shape, dtype, partition_shape, partition_offset):
    if partition_offset[0]:
        raise RuntimeError("initializer failed for the second shard")
    return np.zeros(partition_shape, dtype)


@pytest.mark.parametrize(
    "initial_value, error, match",
    [
        (_half_fails, RuntimeError, "initializer failed for the second shard"),
        (lambda shape, dtype, partition_shape: np.zeros(3, dtype), ValueError,
         r"initial_value of variable 'half/part_0' has shape \(3,\), expected shape \(3, 2\)"),
    ],
)
def test_an_initializer_failing_on_one_shard_leaves_no_shard_behind(state, initial_value, error, match):
    with nothing_changes(state), state.strategy.scope():
        with pytest.raises(error, match=match):
            dps.Variable(initial_value, shape=(ROWS, 2), dtype=np.float32, name="half")


@pytest.mark.parametrize("kwargs", [{"shape": (ROWS, 2), "dtype": np.float32}, {}])
def test_a_partitioned_variable_without_initial_value_is_refused(state, kwargs):
    with nothing_changes(state), state.strategy.scope():
        with pytest.raises(ValueError, match="initial_value must be given") as info:
            dps.Variable(**kwargs)
    assert type(info.value) is ValueError


# -- schedule: not callable, not picklable -----------------------------------------------
def _bump(var, *extra, **more):
    var.assign_add(np.ones(var.shape, var.dtype))


def _lock_capturing_step(var):
    lock = threading.Lock()

    def step():
        with lock:
            _bump(var)

    return step


def _local_variable_step(var):
    local = dps.Variable(np.zeros(2, np.float32), name="local_only")

    def step():
        _bump(var)
        local.assign_add([1.0, 1.0])

    return step


SCHEDULE_CASES = {
    "not callable": (lambda s: (3, (), {}), TypeError, "fn must be callable, got int"),
    "a lock captured": (lambda s: (_lock_capturing_step(s.w), (), {}), TypeError,
                        r"cannot pickle variable 'lock' captured by .*step \(a _thread.lock\)"),
    "a lock as an argument": (lambda s: (_bump, (s.w, threading.Lock()), {}), TypeError,
                              r"cannot pickle args\[1\] \(a _thread.lock\).*\(in the arguments of '_bump'\)"),
    "a lock as a keyword": (lambda s: (_bump, (s.w,), {"guard": threading.Lock()}), TypeError,
                            r"cannot pickle kwargs\['guard'\] \(a _thread.lock\).*\(in the arguments of '_bump'\)"),
    "a generator as an argument": (lambda s: (_bump, (s.w, (i for i in range(3))), {}), TypeError,
                                   r"args\[1\] \(a builtins.generator\).*'_bump'"),
    "args not a tuple": (lambda s: (_bump, s.w, {}), TypeError, "args must be a tuple or list"),
    "a variable made outside the scope": (lambda s: (_local_variable_step(s.w), (), {}), ValueError,
                                          "variable 'local_only' was created outside strategy.scope()"),
    "a RemoteValue as an argument": (lambda s: (_bump, (s.w, s.coordinator.schedule(int)), {}), ValueError,
                                     r"^args contains a RemoteValue; .*fetch\(\) it first"),
}


@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_schedule_refuses_what_cannot_run_and_nothing_runs(state, case):
    make, error, match = SCHEDULE_CASES[case]
    coordinator = state.coordinator
    fn, args, kwargs = make(state)
    coordinator.join()  # the RemoteValue case scheduled one harmless function
    before = snapshot(state)
    with pytest.raises(error, match=match) as info:
        coordinator.schedule(fn, args=args, kwargs=kwargs)
    assert type(info.value) is error
    coordinator.join()  # nothing was queued: had the step run, it would have bumped w
    assert coordinator.done()
    assert_same(before, snapshot(state))


# -- a dataset_fn that raises ------------------------------------------------------------
def _failing_dataset_fn(input_context):
    raise KeyError(f"no shard of data for pipeline {input_context.input_pipeline_id}")


def _next_and_bump(iterator, var):
    batch = next(iterator)
    _bump(var)
    return batch


def test_a_dataset_fn_that_raises_surfaces_from_join(state):
    coordinator = state.coordinator
    iterator = iter(coordinator.create_per_worker_dataset(_failing_dataset_fn))
    with nothing_changes(state):
        failed = coordinator.schedule(_next_and_bump, args=(iterator, state.w))
        with pytest.raises(KeyError, match="no shard of data for pipeline") as info:
            coordinator.join()
        assert type(info.value) is KeyError  # the original exception, not a wrapper
        with pytest.raises(KeyError, match="no shard of data"):
            failed.fetch()
    # The coordinator goes on, and a dataset that works still works.
    good = iter(coordinator.create_per_worker_dataset(lambda: iter(range(100))))
    assert coordinator.fetch(coordinator.schedule(next, args=(good,))) == 0


# -- Checkpoint.restore into mismatched objects ------------------------------------------
def _away_from_the_checkpoint(state):
    """One more training step, so a restore that slipped through would show in the snapshot."""
    state.opt.apply_gradients([(dps.IndexedSlices(np.ones((2, 2), np.float32), [1, 4]), state.table),
                               (np.ones((ROWS, 2), np.float32), state.w)])


def _restore_into(state, **replace):
    objects = {"table": state.table, "w": state.w, "opt": state.opt, **replace}
    return dps.Checkpoint(**{k: v for k, v in objects.items() if v is not None}).restore(state.ckpt)


MISMATCHES = {
    "another shape": ({"w": lambda: dps.Variable(np.zeros((ROWS, 3), np.float32), name="w")},
                      r"w: checkpoint has shape \(6, 2\), object has \(6, 3\)"),
    "another dtype": ({"w": lambda: dps.Variable(np.zeros((ROWS, 2), np.float64), name="w")},
                      "w: checkpoint has dtype float32, object has float64"),
    "an int for a float": ({"w": lambda: dps.Variable(np.zeros((ROWS, 2), np.int32), name="w")},
                           "w: checkpoint has dtype float32, object has int32"),
    "an object the checkpoint lacks": ({"extra": lambda: dps.Variable(np.zeros(2, np.float32))},
                                       "extra: not in the checkpoint"),
    "another structure": ({"w": lambda: None, "model": lambda: {"w": dps.Variable(np.zeros((ROWS, 2), np.float32))}},
                          "model/w: not in the checkpoint"),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_restore_into_mismatched_objects_changes_nothing(state, case):
    replace, match = MISMATCHES[case]
    made = {k: make() for k, make in replace.items()}  # local objects: they live in this process
    local = {k: np.asarray(v).copy() for k, v in made.items() if isinstance(v, dps.Variable)}
    _away_from_the_checkpoint(state)
    with nothing_changes(state), pytest.raises(ValueError, match=match) as info:
        _restore_into(state, **made)
    assert type(info.value) is ValueError and "nothing was changed" in str(info.value)
    for k, value in local.items():
        np.testing.assert_array_equal(np.asarray(made[k]), value)


def test_a_good_restore_does_change_the_servers(state):
    """The refused restores would have shown: this one, into the right objects, moves the values."""
    _away_from_the_checkpoint(state)
    before = snapshot(state)
    _restore_into(state)
    after = snapshot(state)
    for key in ("table", "w", "opt/iterations", "table/.OPTIMIZER_SLOT/opt/m", "w/.OPTIMIZER_SLOT/opt/v"):
        with pytest.raises(AssertionError, match=re.escape(f"{key} changed")):
            assert_same(before, after, changed=set(before["arrays"]) - {key})


# -- a corrupted checkpoint --------------------------------------------------------------
def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _first_piece(path, tensor="table"):
    return path / _manifest(path)["tensors"][tensor]["pieces"][0]["file"]


def _slot_piece(path):
    return _first_piece(path, next(t for t in _manifest(path)["tensors"] if ".OPTIMIZER_SLOT" in t))


def _truncate(path):
    piece = _first_piece(path)
    piece.write_bytes(piece.read_bytes()[:-8])
    return piece, "is shorter than its header says"


def _garbage(path):
    piece = _first_piece(path)
    piece.write_bytes(b"not an array" * 20)
    return piece, r"is not a readable .npy file: the magic string is not correct"


def _header_cut(path):
    piece = _first_piece(path)
    piece.write_bytes(piece.read_bytes()[:40])
    return piece, "is not a readable .npy file: EOF"


def _empty(path):
    piece = _first_piece(path)
    piece.write_bytes(b"")
    return piece, "is not a readable .npy file"


def _piece_deleted(path):
    piece = _first_piece(path)
    piece.unlink()
    return piece, "cannot be read: FileNotFoundError"


def _slot_deleted(path):
    piece = _slot_piece(path)
    piece.unlink()
    return piece, "cannot be read: FileNotFoundError"


def _manifest_deleted(path):
    (path / "manifest.json").unlink()
    return path, "no manifest.json"


@pytest.mark.parametrize("corrupt", [_truncate, _garbage, _header_cut, _empty, _piece_deleted, _slot_deleted,
                                     _manifest_deleted])
def test_a_corrupted_checkpoint_is_refused_and_nothing_changes(state, tmp_path, corrupt):
    path = tmp_path / "copy"
    shutil.copytree(state.ckpt, path)
    culprit, match = corrupt(path)
    _away_from_the_checkpoint(state)
    with nothing_changes(state), pytest.raises(ValueError, match=match) as info:
        dps.Checkpoint(table=state.table, w=state.w, opt=state.opt).restore(str(path))
    assert type(info.value) is ValueError and str(culprit) in str(info.value)  # names the file


# -- a cluster without parameter servers or trainers -------------------------------------
@contextlib.contextmanager
def _plain_cluster():
    with LocalCluster(n_workers=1, processes=False, protocol="tcp://", host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster:
        yield cluster


@pytest.mark.cluster
@pytest.mark.parametrize(
    "make, missing",
    [
        (lambda: dps.LocalPSCluster(num_ps=0, num_workers=1, processes=False),
         "the cluster has no parameter server: no worker has resource 'ps'"),
        (lambda: dps.LocalPSCluster(num_ps=1, num_workers=0, processes=False),
         "the cluster has no training worker: no worker has resource 'worker'"),
        (_plain_cluster, "the cluster has no parameter server"),
    ],
    ids=["no ps", "no trainer", "no resources at all"],
)
def test_a_cluster_without_ps_or_trainers_is_refused(make, missing):
    with make() as cluster, Client(cluster) as client:
        assert client.scheduler_info()["address"].startswith("tcp://127.0.0.1:")
        started = time.monotonic()
        with dask.config.set({"daskps.workers-timeout": "1.5s"}), \
                pytest.raises(ValueError, match=re.escape(missing)) as info:
            dps.ParameterServerStrategy(client)
        assert 1.5 <= time.monotonic() - started < 30  # it waited for the missing kind to join, then gave up
        assert type(info.value) is ValueError
        assert "after waiting 1.5 s (daskps.workers-timeout); 1 worker(s) joined: " in str(info.value)
        # Refused before any parameter-server actor was started: the scheduler holds no task.
        assert client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.tasks)) == []


def test_an_initial_value_that_is_not_numbers_is_named(state):
    with nothing_changes(state), state.strategy.scope():
        with pytest.raises(TypeError, match=r"initial_value of variable 'strings.*' cannot be an array of dtype float32"):
            dps.Variable(lambda shape, dtype: np.array(["x"] * shape[0]), shape=(2,), dtype="float32", name="strings")
        with pytest.raises(ValueError, match="initial_value must be an array-like of one shape"):
            dps.Variable([[1.0, 2.0], [3.0]], name="ragged")


# -- numbers and callables given to functions and constructors ---------------------------------
@pytest.fixture(scope="module")
def keyed(state):
    """An EmbeddingTable of the module's strategy (a lookup makes its rows): alive as long as the module."""
    with state.strategy.scope():
        table = dps.EmbeddingTable(2, name="keyed")
    table.lookup([1, 2])
    yield table


BAD_MAX_NORMS = {
    "a string": ("1.0", TypeError, "max_norm must be a positive number or None, got str '1.0'"),
    "a bool": (True, TypeError, "max_norm must be a positive number or None, got bool True"),
    "a list": ([1.0], TypeError, r"max_norm must be a positive number or None, got list \[1.0\]"),
    "zero": (0.0, ValueError, "max_norm must be a positive number or None, got 0.0"),
    "negative": (-1, ValueError, "max_norm must be a positive number or None, got -1"),
    "NaN": (float("nan"), ValueError, "max_norm must be a positive number or None, got nan"),
}
# name -> (params, ids); the table gets keys it has never seen (a lookup would make their rows)
LOOKUP_PARAMS = {"sharded": lambda s, k, n: (s.table, [0, 5, 3]), "variable": lambda s, k, n: (s.w, [0, 5, 3]),
                 "embedding table": lambda s, k, n: (k, [100 + n, 200 + n]),
                 "list of shards": lambda s, k, n: (s.table.variables, [0, 5, 3])}


@pytest.mark.parametrize("params", LOOKUP_PARAMS)
@pytest.mark.parametrize("case", BAD_MAX_NORMS)
def test_a_bad_max_norm_is_refused_before_any_row_is_read(state, keyed, params, case):
    max_norm, error, match = BAD_MAX_NORMS[case]
    table, ids = LOOKUP_PARAMS[params](state, keyed, list(BAD_MAX_NORMS).index(case))
    rows = keyed.size()
    with nothing_changes(state), pytest.raises(error, match=match) as info:
        dps.embedding_lookup(table, ids, max_norm=max_norm)
    assert type(info.value) is error
    assert keyed.size() == rows  # no key made: the lookup never reached the table


@pytest.mark.parametrize("max_norm", [np.float32(2.5), 2, float("inf")])
def test_max_norm_accepts_any_positive_number(state, max_norm):
    rows = np.asarray(state.table)[[0, 5]].astype(np.float64)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    want = rows * np.minimum(1.0, float(max_norm) / norms)  # TensorFlow's clip_by_norm, row by row
    np.testing.assert_allclose(dps.embedding_lookup(state.table, [0, 5], max_norm=max_norm), want, rtol=1e-6)


# PerWorkerValues: TensorFlow has one value per worker, and fails where a worker has none.
BAD_PER_WORKER = {
    "empty": ([], ValueError, "values must hold one value per training worker, got none"),
    "a string": ("ab", TypeError, "values must be a list or tuple of one value per training worker, got str"),
    "a dict": ({0: "a"}, TypeError, "values must be a list or tuple .* got dict"),
    "a set": ({"a", "b"}, TypeError, "values must be a list or tuple .* got set"),
    "a number": (3, TypeError, "values must be a list or tuple .* got int"),
}


@pytest.mark.parametrize("case", BAD_PER_WORKER)
def test_per_worker_values_need_a_sequence_of_values(case):
    values, error, match = BAD_PER_WORKER[case]
    with pytest.raises(error, match=match) as info:
        dps.PerWorkerValues(values)
    assert type(info.value) is error


def test_per_worker_values_do_not_wrap_round():
    values = dps.PerWorkerValues(iter(["for 0", "for 1"]))  # any iterable, kept in order
    assert values.values == ("for 0", "for 1") and values.on_worker(1) == "for 1"
    for index in (2, 3):
        with pytest.raises(ValueError, match=f"hold 2 value\\(s\\), one per training worker, but this function "
                                             f"runs on the trainer with index {index}"):
            values.on_worker(index)


def _bump_on_worker_1(value, var):
    from distributed import get_worker

    time.sleep(0.05)  # long enough that functions spread over both trainers
    if get_worker().name == "worker-1":
        var.assign_add(np.ones(var.shape, var.dtype))
    return value


def test_a_trainer_without_its_value_refuses_to_run_the_function(client):
    """One value for two trainers: what worker-0 runs gets its value; on worker-1 the function never starts."""
    with dps.ParameterServerStrategy(client) as strategy:
        with strategy.scope():
            var = dps.Variable(np.zeros(2, np.float32), name="untouched")
        coordinator = dps.ClusterCoordinator(strategy)
        values = dps.PerWorkerValues(["only worker-0's"])
        results = [coordinator.schedule(_bump_on_worker_1, args=(values, var)) for _ in range(16)]
        with pytest.raises(ValueError, match="hold 1 value\\(s\\).* the trainer with index 1") as info:
            coordinator.join()
        assert type(info.value) is ValueError
        done, refused = [], 0
        for r in results:
            try:
                done.append(r.fetch())
            except ValueError:
                refused += 1
            except dps.errors.CancelledError:
                pass  # queued behind the refusal
        assert refused >= 1 and set(done) <= {"only worker-0's"}
        np.testing.assert_array_equal(var.numpy(), [0.0, 0.0])  # the function never started on worker-1


def _manager(state, tmp_path, **kwargs):
    return dps.CheckpointManager(dps.Checkpoint(w=state.w), kwargs.pop("directory", str(tmp_path / "m")), **kwargs)


# name -> (keyword arguments, error, message)
BAD_MANAGER_ARGS = {
    "max_to_keep, a string": ({"max_to_keep": "3"}, TypeError, "max_to_keep must be a positive int or None, got str"),
    "max_to_keep, a float": ({"max_to_keep": 2.0}, TypeError, "max_to_keep must be a positive int or None, got float"),
    "max_to_keep, a bool": ({"max_to_keep": True}, TypeError, "max_to_keep must be a positive int or None, got bool"),
    "max_to_keep, zero": ({"max_to_keep": 0}, ValueError, "max_to_keep must be a positive int or None, got 0"),
    "max_to_keep, negative": ({"max_to_keep": -2}, ValueError, "max_to_keep must be a positive int or None, got -2"),
    "directory, a number": ({"directory": 3}, TypeError, "directory must be a str .* got int"),
    "checkpoint_name, a number": ({"checkpoint_name": 3}, TypeError, "checkpoint_name must be a str, got int"),
    "checkpoint_name, a path": ({"checkpoint_name": "../up"}, ValueError, "checkpoint_name must be a file name"),
    "keep_checkpoint_every_n_hours, a string": ({"keep_checkpoint_every_n_hours": "1"}, TypeError,
                                                "keep_checkpoint_every_n_hours must be a positive number or None, "
                                                "got str"),
    "keep_checkpoint_every_n_hours, NaN": ({"keep_checkpoint_every_n_hours": float("nan")}, ValueError,
                                           "keep_checkpoint_every_n_hours must be a positive number or None, got nan"),
    "checkpoint_interval, a string": ({"checkpoint_interval": "5"}, TypeError,
                                      "checkpoint_interval must be a positive int or None, got str"),
    "checkpoint_interval, a bool": ({"checkpoint_interval": True}, TypeError,
                                    "checkpoint_interval must be a positive int or None, got bool"),
    "init_fn, not callable": ({"init_fn": 5}, TypeError, "init_fn must be callable or None, got int"),
}


@pytest.mark.parametrize("case", BAD_MANAGER_ARGS)
def test_checkpoint_manager_refuses_bad_arguments_and_writes_nothing(state, tmp_path, case):
    kwargs, error, match = BAD_MANAGER_ARGS[case]
    with nothing_changes(state), pytest.raises(error, match=match) as info:
        _manager(state, tmp_path, **kwargs)
    assert type(info.value) is error
    assert list(tmp_path.iterdir()) == []  # no directory made, nothing written


@pytest.mark.parametrize("max_to_keep", [None, 1, np.int64(2)])
def test_checkpoint_manager_accepts_none_or_a_positive_int_and_a_path(state, tmp_path, max_to_keep):
    manager = _manager(state, tmp_path, directory=tmp_path / "as-a-path", max_to_keep=max_to_keep)
    for _ in range(3):
        manager.save()
    kept = 3 if max_to_keep is None else int(max_to_keep)
    assert [p.rsplit("-", 1)[1] for p in manager.checkpoints] == ["1", "2", "3"][3 - kept:]


def _never_called(path):
    raise AssertionError("eval_fn ran")


BAD_SIDECAR_ARGS = {
    **{f"{arg}, {what}": ({arg: value}, error, f"{arg} must be a positive int or None, got {shown}")
       for arg in ("until", "max_evaluations")
       for what, value, error, shown in [("a string", "3", TypeError, "str"), ("a float", 2.5, TypeError, "float"),
                                         ("a bool", True, TypeError, "bool"), ("zero", 0, ValueError, "0"),
                                         ("negative", -1, ValueError, "-1")]},
    **{f"{arg}, {what}": ({arg: value, "until": 1}, error, f"{arg} must be a positive finite number of seconds.*, "
                                                           f"got {shown}")
       for arg in ("poll_interval", "timeout")
       for what, value, error, shown in [("a string", "1", TypeError, "str"), ("zero", 0, ValueError, "0"),
                                         ("negative", -0.5, ValueError, "-0.5"), ("NaN", np.nan, ValueError, "nan"),
                                         ("infinite", np.inf, ValueError, "inf")]},
    "checkpoint_dir, a number": ({"checkpoint_dir": 7, "until": 1}, TypeError, "checkpoint_dir must be a str"),
    "checkpoint_name, a number": ({"checkpoint_name": 7, "until": 1}, TypeError,
                                  "checkpoint_name must be a str, got int"),
    "checkpoint_name, a path": ({"checkpoint_name": "a/b", "until": 1}, ValueError,
                                "checkpoint_name must be the CheckpointManager's checkpoint_name"),
    "log, not callable": ({"log": "print", "until": 1}, TypeError, "log must be callable or None, got str"),
}


@pytest.mark.parametrize("case", BAD_SIDECAR_ARGS)
def test_sidecar_evaluator_refuses_bad_arguments(client, tmp_path, case):
    kwargs, error, match = BAD_SIDECAR_ARGS[case]
    kwargs = {"checkpoint_dir": str(tmp_path), **kwargs}
    published = client.list_datasets()
    with pytest.raises(error, match=match) as info:
        dps.SidecarEvaluator(_never_called, client=client, **kwargs)
    assert type(info.value) is error
    assert client.list_datasets() == published and list(tmp_path.iterdir()) == []


def test_sidecar_evaluator_accepts_what_its_loop_can_use(tmp_path):
    w = dps.Variable(np.ones(3, np.float32))
    dps.CheckpointManager(dps.Checkpoint(w=w), tmp_path).save()
    seen = []
    results = dps.SidecarEvaluator(lambda path: {"n": len(seen.append(path) or seen)}, tmp_path,
                                   until=np.int64(1), max_evaluations=1, poll_interval=np.float32(0.01),
                                   timeout=30).run()
    assert seen == [f"{tmp_path}/ckpt-1"] and results == [(seen[0], {"n": 1})]


# Shapes, slicing and row counts: ints only (TensorFlow's TensorShape takes no 2.5), none negative.
BAD_SHAPE_ARGS = {
    "create_partitioned_variables, a fractional dimension": (
        lambda: dps.create_partitioned_variables((2.5, 2), [1, 1], np.zeros((2, 2))),
        ValueError, r"shape must be a tuple of ints, got \(2.5, 2\)"),
    "create_partitioned_variables, a negative dimension": (
        lambda: dps.create_partitioned_variables((-2, 2), [1, 1], lambda shape, dtype: np.zeros(shape, dtype)),
        ValueError, r"shape must not have negative dimensions, got \(-2, 2\)"),
    "create_partitioned_variables, fractional slicing": (
        lambda: dps.create_partitioned_variables((6, 2), [2.5, 1], np.zeros((6, 2))),
        ValueError, r"slicing must be a tuple of ints, got \[2.5, 1\]"),
    "create_partitioned_variables, a string in slicing": (
        lambda: dps.create_partitioned_variables((6, 2), ["2", 1], np.zeros((6, 2))),
        ValueError, r"slicing must be a tuple of ints, got \['2', 1\]"),
    "a partitioner, a fractional dimension": (
        lambda: dps.partitioners.FixedShardsPartitioner(2)((6.5, 2), np.float32),
        ValueError, r"shape must be a tuple of ints, got \(6.5, 2\)"),
    "div_offsets, no shards": (lambda: dps.partitioners.div_offsets(5, 0), ValueError,
                               "num_shards must be a positive int, got 0"),
    "div_offsets, negative rows": (lambda: dps.partitioners.div_offsets(-1, 2), ValueError,
                                   "rows must be an int >= 0, got -1"),
    "div_offsets, fractional rows": (lambda: dps.partitioners.div_offsets(2.5, 2), ValueError,
                                     "rows must be an int >= 0, got 2.5"),
    "InputContext, no pipelines": (lambda: dps.InputContext(num_input_pipelines=0), ValueError,
                                   "num_input_pipelines must be an int >= 1, got 0"),
    "InputContext, a negative id": (lambda: dps.InputContext(input_pipeline_id=-1), ValueError,
                                    "input_pipeline_id must be an int >= 0, got -1"),
    "InputContext, no replicas": (lambda: dps.InputContext(num_replicas_in_sync=0), ValueError,
                                  "num_replicas_in_sync must be an int >= 1, got 0"),
    "InputContext, a float": (lambda: dps.InputContext(num_input_pipelines=2.0), TypeError,
                              "num_input_pipelines must be an int >= 1, got float"),
    "get_per_replica_batch_size, a string": (lambda: dps.InputContext().get_per_replica_batch_size("64"), TypeError,
                                             "global_batch_size must be an int >= 0, got str"),
    "ValueContext, an id past the replicas": (lambda: dps.ValueContext(2, 2), ValueError,
                                              r"replica_id_in_sync_group must be in \[0, num_replicas_in_sync=2\), "
                                              "got 2"),
    "ValueContext, no replicas": (lambda: dps.ValueContext(0, 0), ValueError,
                                  "num_replicas_in_sync must be an int >= 1, got 0"),
}


@pytest.mark.parametrize("case", BAD_SHAPE_ARGS)
def test_bad_shapes_and_counts_are_refused_in_a_scope_and_nothing_is_made(state, case):
    call, error, match = BAD_SHAPE_ARGS[case]
    with nothing_changes(state), state.strategy.scope(), pytest.raises(error, match=match) as info:
        call()
    assert type(info.value) is error


@pytest.mark.parametrize("case", BAD_SHAPE_ARGS)
def test_bad_shapes_and_counts_are_refused_outside_any_scope(case):
    call, error, match = BAD_SHAPE_ARGS[case]
    with pytest.raises(error, match=match) as info:
        call()
    assert type(info.value) is error


@pytest.mark.parametrize("trainable", ["no", 1, 0.0, [True]])
@pytest.mark.parametrize("where", ["in the scope", "outside"])
def test_trainable_must_be_true_or_false(state, trainable, where):
    """``"no"`` was read as True; refused by name, no server hears of the variable."""
    with nothing_changes(state), (state.strategy.scope() if where == "in the scope" else contextlib.nullcontext()), \
            pytest.raises(TypeError, match=re.escape(f"trainable must be True or False, got {trainable!r}")):
        dps.Variable(np.zeros(3, np.float32), trainable=trainable, name="flagged")


@pytest.mark.parametrize("trainable, want", [(True, True), (np.bool_(False), False), (None, True)])
def test_trainable_takes_bools_and_none_for_the_default(state, trainable, want):
    with state.strategy.scope():
        v = dps.Variable(np.zeros(3, np.float32), trainable=trainable, name="flag_ok")
    assert v.trainable is want
