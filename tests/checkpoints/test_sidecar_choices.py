"""SidecarEvaluator in this process (no evaluator worker): which checkpoints it evaluates, when it stops,
what it logs, and every argument it refuses, word for word as documented."""

from __future__ import annotations

import inspect
import pathlib
import threading
import time

import dask.array as da
import numpy as np
import pytest

import daskps as dps
from daskps.training.manifest import MANIFEST
from tests.helpers.waiting import wait_until


def _commit(root: pathlib.Path, number: int, name: str = "ckpt") -> None:
    """A committed checkpoint as the evaluator sees one: a numbered directory holding a manifest."""
    (root / f"{name}-{number}").mkdir(parents=True)
    (root / f"{name}-{number}" / MANIFEST).write_text("{}")


def _sidecar(root, calls, **kwargs):
    kwargs.setdefault("poll_interval", 0.01)

    def eval_fn(path):
        calls.append(path)
        return {"n": len(calls), "loss": 1 / 3}

    return dps.SidecarEvaluator(eval_fn, str(root), **kwargs)


def _started(root, calls, **kwargs):
    """A background evaluator, once it has evaluated its first checkpoint."""
    sidecar = _sidecar(root, calls, **kwargs).start()
    wait_until(lambda: calls, 30, failure="no evaluation in 30 s", interval=0.01, collect=False)
    return sidecar


def test_evaluates_the_latest_committed_checkpoint_and_stops_after_until(tmp_path):
    for n in (3, 10, 7):
        _commit(tmp_path, n)
    (tmp_path / "ckpt-12").mkdir()  # not committed: no manifest
    _commit(tmp_path, 11, name="other")  # another manager's
    calls, lines = [], []
    results = _sidecar(tmp_path, calls, until=10, log=lines.append).run()
    assert calls == [f"{tmp_path}/ckpt-10"]  # the latest only: 3 and 7 are skipped
    assert results == [(f"{tmp_path}/ckpt-10", {"n": 1, "loss": 1 / 3})]
    assert lines == ["sidecar: ckpt-10: n=1, loss=0.3333"]  # floats to 4 significant digits


def test_until_is_reached_by_a_later_number_and_an_earlier_one_does_not_stop_it(tmp_path):
    _commit(tmp_path, 4)
    calls = []
    sidecar = _started(tmp_path, calls, until=5, timeout=30)
    assert sidecar.thread.is_alive()  # 4 < until: still watching
    _commit(tmp_path, 9)
    results = sidecar.join(timeout=30)
    assert not sidecar.thread.is_alive()
    assert [p for p, _ in results] == [f"{tmp_path}/ckpt-4", f"{tmp_path}/ckpt-9"]


def test_max_evaluations_counts_evaluations_and_each_number_is_evaluated_once(tmp_path):
    _commit(tmp_path, 1)
    calls = []
    sidecar = _started(tmp_path, calls, max_evaluations=2, timeout=30)
    threading.Event().wait(0.1)  # several polls see the same checkpoint
    assert calls == [f"{tmp_path}/ckpt-1"] and sidecar.thread.is_alive()
    _commit(tmp_path, 2)
    assert [p for p, _ in sidecar.join(timeout=30)] == [f"{tmp_path}/ckpt-1", f"{tmp_path}/ckpt-2"]
    assert not sidecar.thread.is_alive()


@pytest.mark.parametrize("as_path", [False, True])
def test_a_checkpoint_name_and_a_trailing_slash_and_a_path_object(tmp_path, as_path):
    _commit(tmp_path, 5, name="model")
    _commit(tmp_path, 6)  # the default name's: not this evaluator's
    calls = []
    directory = pathlib.Path(tmp_path) if as_path else str(tmp_path) + "//"
    results = dps.SidecarEvaluator(lambda p: calls.append(p) or {"s": "x"}, directory,
                                   checkpoint_name="model", max_evaluations=1, poll_interval=0.01,
                                   log=lambda line: calls.append(line)).run()
    assert results == [(f"{tmp_path}/model-5", {"s": "x"})]
    assert calls == [f"{tmp_path}/model-5", "sidecar: model-5: s=x"]  # not a float: as it is


def test_an_fsspec_url(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe(f"/sidecar-{id(tmp_path)}/ckpt-2/{MANIFEST}", b"{}")
    calls = []
    results = _sidecar(f"memory:///sidecar-{id(tmp_path)}", calls, until=2).run()
    assert [p for p, _ in results] == [f"memory:///sidecar-{id(tmp_path)}/ckpt-2"]


def test_timeout_counts_from_the_last_evaluation(tmp_path):
    _commit(tmp_path, 1)
    calls, lines = [], []
    sidecar = _sidecar(tmp_path, calls, timeout=0.3, log=lines.append).start()
    with pytest.raises(TimeoutError) as info:
        sidecar.join(timeout=30)
    assert str(info.value) == f"no new checkpoint in {str(tmp_path)!r} for 0.3s"
    assert calls == [f"{tmp_path}/ckpt-1"]  # it evaluated first, then waited 0.3 s for another
    assert sidecar.results == [(f"{tmp_path}/ckpt-1", {"n": 1, "loss": 1 / 3})]


def test_timeout_waits_its_length_before_giving_up(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no new checkpoint"):
        _sidecar(tmp_path, [], timeout=0.4, poll_interval=0.05).run()
    assert 0.4 <= time.monotonic() - start < 5


def test_the_background_run_is_a_daemon_thread_named_for_it_and_join_can_time_out(tmp_path):
    calls = []
    sidecar = _sidecar(tmp_path, calls, until=100, poll_interval=0.05).start()
    try:
        mine = [t for t in threading.enumerate() if t.name == "daskps-sidecar"]
        assert len(mine) == 1 and mine[0].daemon  # a script that ends without join() does not hang on it
        before = time.monotonic()
        assert sidecar.join(timeout=0.2) == []  # nothing yet, and join() gave up waiting
        assert 0.2 <= time.monotonic() - before < 5 and mine[0].is_alive()
    finally:
        sidecar.stop()
        sidecar.join(timeout=30)
    assert not mine[0].is_alive()


def test_stop_ends_a_background_run_and_join_returns_what_it_evaluated(tmp_path):
    _commit(tmp_path, 1)
    calls = []
    sidecar = _started(tmp_path, calls, until=100)
    sidecar.stop()
    assert sidecar.join(timeout=30) == [(f"{tmp_path}/ckpt-1", {"n": 1, "loss": 1 / 3})]
    assert not sidecar.thread.is_alive()


def test_join_raises_what_eval_fn_raised_and_a_join_without_start_returns_nothing(tmp_path):
    _commit(tmp_path, 1)

    def broken(path):
        raise KeyError("no such variable")

    sidecar = dps.SidecarEvaluator(broken, str(tmp_path), until=1, poll_interval=0.01)
    assert sidecar.join() == []  # never started
    with pytest.raises(KeyError, match="no such variable"):
        sidecar.start().join(timeout=30)


def test_evaluates_a_real_checkpoint_of_local_variables(tmp_path):
    w = dps.Variable(np.array([1.0, 2.0, 3.0], np.float32))
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path))
    manager.save(checkpoint_number=4)

    def evaluate(path):
        mine = dps.Variable(np.zeros(3, np.float32))
        dps.Checkpoint(w=mine).read(path)
        return {"sum": float(mine.numpy().sum())}

    assert dps.SidecarEvaluator(evaluate, str(tmp_path), until=4, poll_interval=0.01).run() == [
        (f"{tmp_path}/ckpt-4", {"sum": 6.0})]


GOOD = {"until": 1, "max_evaluations": None, "poll_interval": 1.0, "timeout": None, "checkpoint_name": "ckpt",
        "log": None}


@pytest.mark.parametrize(("changes", "error", "message"), [
    ({"checkpoint_dir": 3}, TypeError, "checkpoint_dir must be a str (a path or an fsspec URL), got int"),
    ({"until": 1.5}, TypeError, "until must be a positive int or None, got float"),
    ({"until": True}, TypeError, "until must be a positive int or None, got bool"),
    ({"until": 0}, ValueError, "until must be a positive int or None, got 0"),
    ({"max_evaluations": "2"}, TypeError, "max_evaluations must be a positive int or None, got str"),
    ({"max_evaluations": -1}, ValueError, "max_evaluations must be a positive int or None, got -1"),
    ({"until": None, "max_evaluations": "2"}, TypeError, "max_evaluations must be a positive int or None, got str"),
    ({"until": None, "max_evaluations": 0}, ValueError, "max_evaluations must be a positive int or None, got 0"),
    ({"poll_interval": None}, TypeError, "poll_interval must be a positive finite number of seconds, got NoneType"),
    ({"poll_interval": True}, TypeError, "poll_interval must be a positive finite number of seconds, got bool"),
    ({"poll_interval": np.bool_(True)}, TypeError,
     "poll_interval must be a positive finite number of seconds, got bool"),
    ({"poll_interval": "1"}, TypeError, "poll_interval must be a positive finite number of seconds, got str"),
    ({"poll_interval": 0}, ValueError, "poll_interval must be a positive finite number of seconds, got 0"),
    ({"poll_interval": -0.5}, ValueError, "poll_interval must be a positive finite number of seconds, got -0.5"),
    ({"poll_interval": float("inf")}, ValueError,
     "poll_interval must be a positive finite number of seconds, got inf"),
    ({"poll_interval": float("nan")}, ValueError,
     "poll_interval must be a positive finite number of seconds, got nan"),
    ({"timeout": "5"}, TypeError, "timeout must be a positive finite number of seconds or None, got str"),
    ({"timeout": 0.0}, ValueError, "timeout must be a positive finite number of seconds or None, got 0.0"),
    ({"timeout": float("inf")}, ValueError, "timeout must be a positive finite number of seconds or None, got inf"),
    ({"checkpoint_name": 7}, TypeError, "checkpoint_name must be a str, got int"),
    ({"checkpoint_name": ""}, ValueError, "checkpoint_name must be the CheckpointManager's checkpoint_name "
                                          "(a non-empty str without '/'), got ''"),
    ({"checkpoint_name": "a/b"}, ValueError, "checkpoint_name must be the CheckpointManager's checkpoint_name "
                                             "(a non-empty str without '/'), got 'a/b'"),
    ({"log": "print"}, TypeError, "log must be callable or None, got str"),
    ({"until": None}, ValueError, "give until, max_evaluations or timeout, or the evaluator never stops"),
])
def test_bad_arguments_are_refused_with_their_name(tmp_path, changes, error, message):
    kwargs = {**GOOD, **changes}
    directory = kwargs.pop("checkpoint_dir", str(tmp_path))
    with pytest.raises(error) as info:
        dps.SidecarEvaluator(lambda p: {}, directory, **kwargs)
    assert str(info.value) == message


def test_the_documented_defaults():
    parameters = inspect.signature(dps.SidecarEvaluator).parameters
    assert parameters["poll_interval"].default == 1.0 and parameters["checkpoint_name"].default == "ckpt"
    assert parameters["client"].default is None and parameters["data"].default is None


@pytest.mark.parametrize("fine", [{"until": np.int64(3)}, {"poll_interval": 1}, {"poll_interval": np.float32(0.5)},
                                  {"timeout": 2}, {"until": None, "max_evaluations": 1},
                                  {"until": None, "timeout": 0.5}, {"log": print}])
def test_what_is_accepted(tmp_path, fine):
    dps.SidecarEvaluator(lambda p: {}, str(tmp_path), **{**GOOD, **fine})


def test_eval_fn_and_data_are_checked_before_anything_else(tmp_path):
    with pytest.raises(TypeError) as info:
        dps.SidecarEvaluator("nope", 3, until=1)
    assert str(info.value) == "eval_fn must be callable, got str"
    with pytest.raises(TypeError) as info:
        dps.SidecarEvaluator(lambda p, b: {}, str(tmp_path), until=1, data=[1, 2])
    assert str(info.value) == "data must be made by dps.data.from_dask(...), got list"
    data = dps.data.from_dask(da.zeros((8, 2), chunks=4), batch_size=4)
    with pytest.raises(ValueError) as info:
        dps.SidecarEvaluator(lambda p, b: {}, str(tmp_path), until=1, data=data)
    assert str(info.value) == "data needs client: the Dask client of the cluster that reads the collection"
    forever = dps.data.from_dask(da.zeros((8, 2), chunks=4), batch_size=4, epochs=None)
    with pytest.raises(ValueError) as info:
        dps.SidecarEvaluator(lambda p, b: {}, str(tmp_path), object(), until=1, data=forever)
    assert str(info.value) == ("data must have a number of epochs (an evaluation is one pass), got epochs=None")
