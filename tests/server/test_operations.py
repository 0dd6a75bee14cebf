"""The parameter server on its own, in this process: every operation, its counters and its refusals.

``ParameterServer`` is plain Python (Dask hosts it as an actor); these tests
call ``execute`` directly, with numbers from numpy written from the rules
(SGD with momentum as Keras writes it), so they run without a cluster and
are mutation testing's killers for ``daskps/server/parameter_server.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from daskps._core import transforms
from daskps._core.ckpt_io import RestoreSpec
from daskps._core.updates import Refused
from daskps.errors import PartlyAppliedError
from daskps.server import ops
from daskps.server.ops import DenseSpec
from daskps.server.parameter_server import ParameterServer, sendable


def _server(task_id=0, **values) -> ParameterServer:
    ps = ParameterServer(task_id)
    for key, value in values.items():
        ps.execute([ops.Create(key, f"name_{key}", DenseSpec(np.asarray(value, np.float32)), "h")])
    return ps


def _value(ps: ParameterServer, key: str) -> np.ndarray:
    return ps.execute([ops.Read([key])])[0][0]


def _sgd(ps: ParameterServer, key="opt", lr=0.1, momentum=0.0, holder="h", name="SGD") -> None:
    ps.execute([ops.AddOptimizer(key, transforms.Chain(transforms.SGDStep(momentum), lr), True, name, holder)])


# -- creation, reads, updates --------------------------------------------------------

def test_create_answers_shape_dtype_and_refuses_a_key_twice_naming_the_server():
    ps = ParameterServer(3)
    created = ps.execute([ops.Create("k", "w", DenseSpec(np.zeros((2, 3), np.float64)), "h")])[0]
    assert created == ops.Created((2, 3), "<f8", False)
    with pytest.raises(ValueError, match=r"key 'k' already exists on ps task 3"):
        ps.execute([ops.Create("k", "w", DenseSpec(np.ones(1, np.float32)), "h")])
    np.testing.assert_array_equal(_value(ps, "k"), np.zeros((2, 3)))
    local = ParameterServer(None)
    local.execute([ops.Create("k", "w", DenseSpec(np.ones(1)), "h")])
    with pytest.raises(ValueError, match="already exists on this process"):
        local.execute([ops.Create("k", "w", DenseSpec(np.ones(1)), "h")])


def test_reads_are_copies_unless_the_caller_shares_them_and_rows_come_by_index():
    ps = _server(w=[[1, 2], [3, 4], [5, 6]])
    got = _value(ps, "w")
    got[:] = 0
    np.testing.assert_array_equal(_value(ps, "w"), [[1, 2], [3, 4], [5, 6]])
    shared = ps.execute([ops.Read(["w"])], shared_reads=True)[0][0]
    assert shared is ps.execute([ops.Read(["w"])], shared_reads=True)[0][0]
    assert ps.execute([ops.Read(["w"])])[0][0] is not shared  # the next message without it copies again
    rows = ps.execute([ops.Read(["w"], [np.array([2, 0])])])[0][0]
    np.testing.assert_array_equal(rows, [[5, 6], [1, 2]])
    rows[:] = -1
    np.testing.assert_array_equal(_value(ps, "w")[0], [1, 2])
    with pytest.raises(ValueError):  # one index per key
        ps.execute([ops.Read(["w", "w"], [np.array([0])])])


def test_an_update_checks_every_item_before_it_changes_any():
    ps = _server(a=[1, 2], b=[10, 20])
    with pytest.raises(ValueError):
        ps.execute([ops.Update([("a", "add", np.ones(2, np.float32)), ("b", "add", np.ones(3, np.float32))])])
    np.testing.assert_array_equal(_value(ps, "a"), [1, 2])
    with pytest.raises(LookupError, match="no variable with key 'zz' on ps task 0"):
        ps.execute([ops.Update([("a", "add", np.ones(2, np.float32)), ("zz", "add", np.ones(2, np.float32))])])
    np.testing.assert_array_equal(_value(ps, "a"), [1, 2])
    ps.execute([ops.Update([("a", "add", np.ones(2, np.float32)), ("b", "assign", np.array([7, 8], np.float32)),
                            ("a", "sub", np.array([0.5, 0.5], np.float32))])])
    np.testing.assert_array_equal(_value(ps, "a"), [1.5, 2.5])
    np.testing.assert_array_equal(_value(ps, "b"), [7, 8])


def test_counters_count_reads_updates_bytes_and_messages():
    ps = _server(a=np.zeros(4), b=np.zeros((3, 2)))  # 2 messages
    ps.execute([ops.Read(["a", "b"])])
    ps.execute([ops.Read(["b"], [np.array([1])])])
    ps.execute([ops.Update([("a", "add", np.ones(4, np.float32)), ("a", "add", np.ones(4, np.float32))])])
    ps.execute([ops.Update([("b", "scatter_add", (np.array([0, 2]), np.ones((2, 2), np.float32)))])])
    stats = ps.execute([ops.Stats()])[0]
    assert stats.task_id == 0 and stats.messages == 7
    assert stats.reads == 3 and stats.bytes_read == 16 + 24 + 8
    assert stats.updates == 3 and stats.bytes_received == 8 + 16 + 16 + (16 + 16)  # the read's index too
    assert stats.table_reads == {"a": 1, "b": 2} and stats.table_updates == {"a": 2, "b": 1}
    assert stats.num_variables == 2 and stats.nbytes == 16 + 24 and stats.slot_nbytes == 0
    assert stats.variables == {"a": ops.TableInfo("name_a", (4,), "<f4"), "b": ops.TableInfo("name_b", (3, 2), "<f4")}
    assert stats.calls == {"create": 2, "read": 2, "update": 2, "stats": 1}
    assert stats.num_optimizers == 0 and stats.blob_nbytes == 0 and stats.counts == {}
    assert 0 <= stats.uptime < 60


# -- lifetimes ------------------------------------------------------------------------

def test_acquire_checks_every_key_first_and_release_drops_at_zero():
    ps = _server(a=[1.0], b=[2.0])
    with pytest.raises(LookupError, match=r"ps task 0 no longer holds \['zz'\]"):
        ps.execute([ops.Acquire(["a", "zz"], "h")])
    assert ps.execute([ops.Release(["a"], "h")]) == [1]  # the failed acquire added no count to a
    assert ps.execute([ops.Stats()])[0].num_variables == 1
    ps.execute([ops.Acquire(["b"], "h"), ops.Acquire(["b"], "other")])  # h: 2, other: 1
    assert ps.execute([ops.Release(["b"], "h"), ops.Release(["b"], "h")]) == [0, 0]
    assert ps.execute([ops.Release(["b"], "h")]) == [0]  # h holds none: nothing
    assert ps.execute([ops.Release(["b", "gone"], "nobody")]) == [0]
    assert ps.execute([ops.Release(["b"], "other")]) == [1]
    assert ps.execute([ops.Stats()])[0].num_variables == 0
    with pytest.raises(LookupError, match="'b' on ps task 0 \\(it was released\\)"):
        ps.execute([ops.Read(["b"])])


def test_forget_place_drops_what_only_that_worker_held():
    ps = ParameterServer(1)
    for key, holder in [("mine", "p@tcp://a:1"), ("both", "p@tcp://a:1"), ("theirs", "p@tcp://b:2")]:
        ps.execute([ops.Create(key, key, DenseSpec(np.zeros(1, np.float32)), holder)])
    ps.execute([ops.Acquire(["both"], "q@tcp://b:2"), ops.Acquire(["mine"], "q@tcp://a:1")])
    assert ps.execute([ops.ForgetPlace("tcp://a:1")]) == [1]
    assert set(ps.execute([ops.Stats()])[0].variables) == {"both", "theirs"}
    assert ps.execute([ops.Release(["both"], "q@tcp://b:2")]) == [1]  # a's count on it is gone too
    assert ps.execute([ops.ForgetPlace("tcp://b:2")]) == [1]
    assert ps.execute([ops.ForgetPlace("tcp://b:2")]) == [0]


def test_blobs_live_while_held():
    ps = ParameterServer(2)
    ps.execute([ops.PutBlob("cfg", b"12345", "h")])
    assert ps.execute([ops.GetBlob("cfg")]) == [b"12345"]
    assert ps.execute([ops.Stats()])[0].blob_nbytes == 5
    with pytest.raises(ValueError, match="'cfg' already exists"):
        ps.execute([ops.PutBlob("cfg", b"x", "h")])
    assert ps.execute([ops.GetBlob("cfg")]) == [b"12345"]
    assert ps.execute([ops.Release(["cfg"], "h")]) == [1]
    with pytest.raises(LookupError, match=r"no blob 'cfg' on ps task 2 \(it was released\)"):
        ps.execute([ops.GetBlob("cfg")])


# -- optimizers -----------------------------------------------------------------------

def test_momentum_sgd_follows_keras_rule_and_keeps_its_slots_when_reconfigured():
    ps = _server(w=[1.0, -2.0], c=np.zeros((), np.int64).astype(np.float32))
    _sgd(ps, lr=0.1, momentum=0.9)
    g1, g2 = np.array([0.5, 1.0], np.float32), np.array([-1.0, 2.0], np.float32)
    ps.execute([ops.ApplyGradients("opt", [("w", "dense", g1)], bump="c")])
    m1 = -0.1 * g1
    np.testing.assert_allclose(_value(ps, "w"), np.array([1.0, -2.0]) + m1, rtol=1e-6)
    # New settings, same key, no holder: the momentum slot stays.
    ps.execute([ops.AddOptimizer("opt", transforms.Chain(transforms.SGDStep(0.9), 0.01), True, "SGD", None)])
    ps.execute([ops.ApplyGradients("opt", [("w", "dense", g2)], bump="c")])
    m2 = 0.9 * m1 - 0.01 * g2
    np.testing.assert_allclose(_value(ps, "w"), np.array([1.0, -2.0]) + m1 + m2, rtol=1e-6)
    assert _value(ps, "c") == 2
    stats = ps.execute([ops.Stats()])[0]
    assert stats.num_optimizers == 1 and stats.slot_nbytes == 8
    assert stats.updates == 2 and stats.bytes_received == 16 and stats.table_updates == {"w": 2}
    with pytest.raises(LookupError, match=r"no optimizer 'Adam' on ps task 0"):
        ps.execute([ops.AddOptimizer("other", transforms.Chain(transforms.SGDStep(), 0.1), True, "Adam", None)])
    with pytest.raises(ValueError, match="'opt' already exists"):
        _sgd(ps)


def test_merged_pushes_advance_counts_by_times():
    ps = _server(w=[1.0, 1.0], c=np.float32(5))
    _sgd(ps, lr=0.5)
    ps.execute([ops.ApplyGradients("opt", [("w", "dense", np.array([2.0, 4.0], np.float32))], bump="c", times=3)])
    np.testing.assert_allclose(_value(ps, "w"), [0.0, -1.0])  # the summed gradient applied once
    assert _value(ps, "c") == 8
    assert ps.execute([ops.Stats()])[0].updates == 1


def test_a_gradient_push_checks_everything_before_it_changes_anything():
    ps = _server(a=[1.0, 1.0], b=[1.0], c=np.float32(0))
    _sgd(ps, lr=1.0)
    bad = [
        (ops.ApplyGradients("nope", [("a", "dense", np.ones(2, np.float32))], bump="c"),
         LookupError, "optimizer 'nope' is not configured on ps task 0"),
        (ops.ApplyGradients("opt", [("a", "dense", np.ones(2, np.float32)), ("b", "dense", np.ones(3, np.float32))],
                            bump="c"), ValueError, "name_b"),
        (ops.ApplyGradients("opt", [("a", "dense", np.ones(2, np.float32)), ("zz", "dense", np.ones(1, np.float32))],
                            bump="c"), LookupError, "'zz'"),
        (ops.ApplyGradients("opt", [("a", "dense", np.ones(2, np.float32))], bump="gone"), LookupError, "'gone'"),
    ]
    for op, kind, text in bad:
        with pytest.raises(kind, match=text):
            ps.execute([op])
        np.testing.assert_array_equal(_value(ps, "a"), [1.0, 1.0])
        np.testing.assert_array_equal(_value(ps, "b"), [1.0])
        assert _value(ps, "c") == 0
    stats = ps.execute([ops.Stats()])[0]
    assert stats.updates == 0 and stats.slot_nbytes == 0 and stats.bytes_received == 0
    assert stats.table_updates == {}


def test_sparse_gradients_count_their_bytes_and_touch_only_their_rows():
    ps = _server(t=np.zeros((4, 2)))
    _sgd(ps, lr=1.0)
    rows, values = np.array([3, 1, 3]), np.ones((3, 2), np.float32)
    ps.execute([ops.ApplyGradients("opt", [("t", "rows", (rows, values))])])
    np.testing.assert_array_equal(_value(ps, "t"), [[0, 0], [-1, -1], [0, 0], [-2, -2]])
    assert ps.execute([ops.Stats()])[0].bytes_received == values.nbytes + rows.nbytes


def test_releasing_an_optimizer_drops_its_slots_in_every_table():
    ps = _server(a=[1.0, 2.0], b=[[1.0], [2.0]])
    _sgd(ps, key="o1", lr=0.1, momentum=0.5)
    _sgd(ps, key="o2", lr=0.1, momentum=0.5, holder="h2")
    for key, grad in [("a", np.ones(2, np.float32)), ("b", np.ones((2, 1), np.float32))]:
        ps.execute([ops.ApplyGradients("o1", [(key, "dense", grad)]), ops.ApplyGradients("o2", [(key, "dense", grad)])])
    assert ps.execute([ops.Stats()])[0].slot_nbytes == 2 * (8 + 8)
    assert ps.execute([ops.Release(["o1"], "h")]) == [1]
    stats = ps.execute([ops.Stats()])[0]
    assert stats.slot_nbytes == 8 + 8 and stats.num_optimizers == 1 and stats.num_variables == 2


# -- messages --------------------------------------------------------------------------

def test_an_unknown_operation_is_refused_and_isolate_counts_only_first():
    ps = _server(a=[1.0])
    with pytest.raises(ValueError, match="unknown parameter-server operation 'read'"):
        ps.execute(["read"])
    with pytest.raises(ValueError, match="unknown parameter-server operation Isolate"):
        ps.execute([ops.Read(["a"]), ops.Isolate(1), ops.Read(["a"])])


def test_isolated_pushes_each_stand_alone_and_a_later_failure_reports_them():
    ps = _server(a=[1.0, 1.0])
    good, bad = ops.Update([("a", "add", np.ones(2, np.float32))]), ops.Update([("a", "add", np.ones(5, np.float32))])
    results = ps.execute([ops.Isolate(3), good, bad, good, ops.Read(["a"])])
    assert results[0] is None and results[1] is None and results[3] is None
    assert isinstance(results[2], Refused) and isinstance(results[2].error, ValueError)
    np.testing.assert_array_equal(results[4][0], [3.0, 3.0])
    with pytest.raises(PartlyAppliedError) as caught:
        ps.execute([ops.Isolate(2), bad, good, ops.Read(["missing"])])
    assert isinstance(caught.value.error, LookupError)
    assert caught.value.outcomes[1] is None and isinstance(caught.value.outcomes[0], Refused)
    assert len(caught.value.outcomes) == 2
    np.testing.assert_array_equal(_value(ps, "a"), [4.0, 4.0])
    with pytest.raises(LookupError):  # no isolated operations: the error itself (the update before it ran)
        ps.execute([good, ops.Read(["missing"])])
    np.testing.assert_array_equal(_value(ps, "a"), [5.0, 5.0])
    refused, _ = ps.execute([ops.Isolate(2), ops.Read(["missing"]), good])[1:]  # refused on its own
    assert isinstance(refused, Refused) and isinstance(refused.error, LookupError)
    np.testing.assert_array_equal(_value(ps, "a"), [6.0, 6.0])


def test_an_error_that_would_not_travel_becomes_a_runtime_error_with_its_text():
    class Local(Exception):
        pass

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    assert sendable(ValueError("v")).args == ("v",)
    kept = LookupError("x")
    assert sendable(kept) is kept
    got = sendable(Unpicklable("held a lock"))
    assert type(got) is RuntimeError and str(got) == "Unpicklable: held a lock"
    lock_error = ValueError(threading.Lock())
    assert type(sendable(lock_error)) is RuntimeError
    assert type(sendable(Local("y"))) is RuntimeError  # a class defined in a function does not pickle


# -- checkpoints -----------------------------------------------------------------------

def _save(ps, base, key="w", tensor="w", offset=0, optimizers=()):
    return ps.execute([ops.Save(base, [ops.SavePiece(key, tensor, offset, list(optimizers))])])[0]


def test_save_then_restore_stages_and_commits_values_and_slots(tmp_path):
    ps = _server(w=[1.0, 2.0, 3.0])
    _sgd(ps, lr=0.1, momentum=0.9)
    ps.execute([ops.ApplyGradients("opt", [("w", "dense", np.ones(3, np.float32))])])
    saved_value = _value(ps, "w")
    records = _save(ps, str(tmp_path / "ck"), optimizers=[("optimizer", "opt")])
    pieces = [r.piece for r in records if r.tensor == "w"]
    assert pieces and all(r.dtype == "<f4" for r in records if r.tensor == "w")
    ps.execute([ops.ApplyGradients("opt", [("w", "dense", np.ones(3, np.float32))])])
    moved = _value(ps, "w")
    spec = RestoreSpec(0, 3, pieces, {"opt": None})
    ps.execute([ops.StageRestore("t1", str(tmp_path / "ck"), [("w", spec)])])
    np.testing.assert_array_equal(_value(ps, "w"), moved)  # staged: nothing changed yet
    ps.execute([ops.AbortRestore("t1")])
    ps.execute([ops.AbortRestore("never staged")])
    with pytest.raises(KeyError):
        ps.execute([ops.CommitRestore("t1")])
    np.testing.assert_array_equal(_value(ps, "w"), moved)
    ps.execute([ops.StageRestore("t2", str(tmp_path / "ck"), [("w", spec)]), ops.CommitRestore("t2")])
    np.testing.assert_array_equal(_value(ps, "w"), saved_value)
    assert ps.execute([ops.Stats()])[0].slot_nbytes == 0  # slots saved as None start afresh


def test_a_restore_naming_an_unknown_optimizer_or_variable_stages_nothing(tmp_path):
    ps = _server(w=[1.0, 2.0])
    records = _save(ps, str(tmp_path / "ck"))
    spec = RestoreSpec(0, 2, [r.piece for r in records], {"nope": None})
    with pytest.raises(LookupError, match="optimizer 'nope' is not configured"):
        ps.execute([ops.StageRestore("t", str(tmp_path / "ck"), [("w", spec)])])
    with pytest.raises(KeyError):
        ps.execute([ops.CommitRestore("t")])
    with pytest.raises(LookupError, match="'zz'"):
        ps.execute([ops.Save(str(tmp_path / "ck2"), [ops.SavePiece("zz", "zz", 0, [])])])


def test_counts_add_up_per_holder_and_per_operation():
    ps = _server(a=[1.0], b=[2.0], c=[3.0])  # h holds each once
    ps.execute([ops.Acquire(["a"], "h")])  # h: 2 on a
    assert ps.execute([ops.Release(["a"], "h")]) == [0]  # one count left: still held
    np.testing.assert_array_equal(_value(ps, "a"), [1.0])
    assert ps.execute([ops.ForgetPlace("nowhere")]) == [0]
    for key in ("a", "b", "c"):
        ps.execute([ops.Acquire([key], "p@tcp://x:1")])
    ps.execute([ops.Release(["a", "b", "c"], "h"), ops.Release(["a"], "h")])
    assert ps.execute([ops.ForgetPlace("tcp://x:1")]) == [3]  # every one dropped is counted
    assert ps.execute([ops.Stats()])[0].num_variables == 0
    ps = _server(s=np.float32(1))
    ps.execute([ops.Update([("s", "add", 1.0)])])  # a Python number: no array bytes
    assert ps.execute([ops.Stats()])[0].bytes_received == 0
    np.testing.assert_array_equal(_value(ps, "s"), 2.0)


def test_a_push_counts_the_bytes_of_every_gradient_and_names_the_optimizer_that_cannot_train():
    ps = _server(a=[1.0, 1.0], b=[1.0])
    ps.execute([ops.AddOptimizer("o", transforms.Chain(transforms.SGDStep(), 0.1), True, "MySGD", "h")])
    ps.execute([ops.ApplyGradients("o", [("a", "dense", np.ones(2, np.float32)), ("b", "dense", np.ones(1, np.float32))])])
    assert ps.execute([ops.Stats()])[0].bytes_received == 12
    ps.execute([ops.Create("i", "ints", DenseSpec(np.zeros(2, np.int32)), "h")])
    with pytest.raises(TypeError, match=r"^optimizer 'MySGD' cannot train variable 'ints' of dtype int32"):
        ps.execute([ops.ApplyGradients("o", [("i", "dense", np.ones(2, np.int32))])])


def test_a_merged_push_moves_a_schedule_on_by_every_step_it_holds():
    """A push merging 3 steps advances the count by 3: it is applied as the last of them (count 2), and the
    next push at count 3. (Only fixed-rate SGD pushes are merged; a schedule makes the count visible.)"""
    from daskps._core.schedules import ExponentialDecay

    ps = _server(w=[0.0])
    rate = ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    ps.execute([ops.AddOptimizer("o", transforms.Chain(transforms.SGDStep(), rate), True, "SGD", "h")])
    ps.execute([ops.ApplyGradients("o", [("w", "dense", np.ones(1, np.float32))], times=3)])  # at rate(2) = 0.25
    ps.execute([ops.ApplyGradients("o", [("w", "dense", np.ones(1, np.float32))])])  # at rate(3) = 0.125
    np.testing.assert_allclose(_value(ps, "w"), [-0.25 - 0.125])


def test_a_release_by_a_holder_without_counts_changes_nothing_and_releases_go_on_past_unknown_keys():
    ps = _server(a=[1.0], b=[2.0])  # h holds each once
    ps.execute([ops.Acquire(["a"], "other")])
    assert ps.execute([ops.Release(["a"], "nobody")]) == [0]  # no count to take: none goes below zero
    ps.execute([ops.Acquire(["a"], "nobody")])  # nobody: 1
    assert ps.execute([ops.Release(["a"], "h"), ops.Release(["a"], "other")]) == [0, 0]  # nobody holds it still
    assert ps.execute([ops.Release(["gone", "a", "b"], "nobody")]) == [1]  # past the unknown key; a dropped
    assert ps.execute([ops.Acquire(["b"], "x"), ops.Release(["b"], "x"), ops.Release(["b"], "h")])[1:] == [0, 1]
    ps = _server(c=[1.0], d=[2.0])
    assert ps.execute([ops.Release(["c", "d"], "h")]) == [2]  # every one dropped is counted


def test_a_recreated_servers_strategy_is_its_groups_in_labels():
    """After a recovery the server's key ends in -g1: /metrics and the plots still name its strategy's token."""
    from daskps.client.group import server_key, strategy_token
    from daskps.scheduler.timeline import server_label

    first, again = server_key(0, "abcdef0123", 0), server_key(0, "abcdef0123", 1)
    assert again.endswith("-g1")
    assert strategy_token(first) == strategy_token(again) == "abcdef0123"
    assert server_label({"key": again, "task": 0}, True) == server_label({"key": first, "task": 0}, True) == \
        "ps-0 (abcdef01)"


def test_a_released_table_takes_the_bags_its_lookups_left_with_it():
    """A server keeps a pooled lookup's bags for its gradient; releasing the table drops them (a gradient
    naming that lookup then finds nothing, as after a restore, and is dropped and counted)."""
    from daskps._core.bags import BagGrad, BagRead

    ps = _server(t=np.zeros((4, 2)))
    ps.execute([ops.AddOptimizer("opt", transforms.Chain(transforms.SGDStep(), 1.0), True, "SGD", "h")])
    read = BagRead(np.array([1, 2], np.int32), np.array([2], np.uint8), lane="lane", token=1)
    ps.execute([ops.Read(["t"], [read])])
    ps.execute([ops.Release(["t"], "h")])
    ps.execute([ops.Create("t", "t", DenseSpec(np.zeros((4, 2), np.float32)), "h")])  # the same key, made again
    ps.execute([ops.ApplyGradients("opt", [("t", "bags", BagGrad(np.ones((1, 2), np.float32), lane="lane", token=1))])])
    np.testing.assert_array_equal(_value(ps, "t"), np.zeros((4, 2)))
    assert ps.execute([ops.Stats()])[0].calls["pooled_gradient_from_before_a_restore"] == 1


def test_table_commands_are_operations_of_their_own_not_reads():
    """An embedding table's keys, rows, counts and eviction go through TableCommand; a read with a name
    instead of ids is refused, and a dense variable takes no command."""
    from daskps.server.ops import HashSpec

    ps = _server(w=np.zeros(3))
    spec = HashSpec(dim=2, dtype="float32", initializer=None, admit_after=1, evict_after_steps=None,
                    capacity=None, part=0, parts=1)
    ps.execute([ops.Create("t", "table", spec, "h")])
    ps.execute([ops.Read(["t"], [np.array([7, 3], np.int64)])])  # a lookup makes rows 7 and 3
    reads = ps.reads
    keys, rows, stats = ps.execute([ops.TableCommand(["t"], "keys"), ops.TableCommand(["t"], "rows"),
                                    ops.TableCommand(["t"], "stats")])
    assert keys[0].tolist() == [3, 7] and rows[0].shape == (2, 2) and stats[0][0] == 2  # rows held, by key
    assert ps.reads == reads and ps.calls["table_command"] == 3  # commands, not reads
    with pytest.raises(TypeError, match="ids for embedding table 'table' must be integers"):
        ps.execute([ops.Read(["t"], ["evict"])])  # no control through reads
    with pytest.raises(ValueError, match="'name_w' is a dense variable: it takes no command 'evict'"):
        ps.execute([ops.TableCommand(["w"], "evict")])
    with pytest.raises(ValueError, match="embedding table 'table' has no command 'drop'"):
        ps.execute([ops.TableCommand(["t"], "drop")])
