"""TensorBoard scalars from the coordinator (``dps.summary``): event files TensorBoard's format defines."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

import daskps as dps
from daskps.scheduler.messages import METRICS_TOPIC
from daskps.ui import tensorboard as scalar_logging

pytest.importorskip("tensorboardX.proto.event_pb2")  # tensorboardX is in the test extra

from tests.helpers.events import read_scalars  # noqa: E402
from tests.helpers.waiting import wait_until


def test_scalars_reach_an_event_file_every_n_functions(strategy, coordinator, tmp_path):
    with strategy.scope():
        loss = dps.metrics.Mean(name="loss")
        count = dps.metrics.Sum(name="count")

    def step():
        loss.update_state(np.float32(2.5))
        count.update_state(np.float32(1.0))

    with dps.summary.ScalarLogger(coordinator, tmp_path, {"loss": loss, "count": count}, every_n_steps=20,
                                  examples_per_step=32, interval=0.02) as logger:
        for _ in range(30):
            coordinator.schedule(step)
        coordinator.join()
        wait_until(lambda: logger.steps, 60, failure="nothing written", interval=0.02, collect=False)
        assert 20 <= logger.steps[0] <= 30  # written while the logger runs, not only when it stops
        time.sleep(0.3)  # 15 more looks at the counts, with nothing completed: nothing more is written
        assert len(logger.steps) == 1
        for _ in range(30):
            coordinator.schedule(step)
        coordinator.join()
    assert logger.steps[-1] == 60  # stopping writes the last step

    scalars = read_scalars(tmp_path)
    steps = [s for s, _ in scalars["loss"]]
    assert steps == logger.steps and steps == sorted(set(steps)) and steps[-1] == 60
    assert len(steps) >= 2
    assert all(v == 2.5 for _, v in scalars["loss"])  # every update was 2.5: the mean is 2.5
    for s, v in scalars["count"]:
        assert s <= v <= 60  # a write reads the metric after ``s`` functions reported their pushes applied
    assert dict(scalars["count"])[60] == 60
    rates = dict(scalars["daskps/functions_per_second"])
    examples = dict(scalars["daskps/examples_per_second"])
    assert set(rates) == set(steps) and all(r > 0 for r in rates.values())
    assert all(examples[s] == pytest.approx(32 * rates[s], rel=1e-6) for s in steps)
    assert [v for _, v in scalars["daskps/failed"]] == [0] * len(steps)


def test_a_writer_of_ones_own_and_a_metric_that_cannot_be_read(coordinator):
    class Writer:
        def __init__(self):
            self.rows, self.flushed = [], 0

        def add_scalar(self, tag, value, step):
            self.rows.append((tag, value, step))

        def flush(self):
            self.flushed += 1

    writer = Writer()

    def broken():
        raise RuntimeError("no value yet")

    for _ in range(5):
        coordinator.schedule(lambda: None)
    coordinator.join()
    logger = dps.summary.ScalarLogger(coordinator, writer, {"bad": broken, "ok": lambda: 7}, every_n_steps=1)
    for _ in range(3):
        coordinator.schedule(lambda: None)
    coordinator.join()
    with pytest.warns(RuntimeWarning, match="metric 'bad' could not be read .RuntimeError: no value yet"):
        logger.stop()  # not started: stopping still writes the last step
    assert ("ok", 7.0, 8) in writer.rows and not any(tag == "bad" for tag, _, _ in writer.rows)
    assert writer.flushed == 2  # after the write, and at stop (a writer passed in is not closed)


def test_a_metric_on_a_server_being_recovered_is_a_quiet_gap_only_with_a_checkpoint_manager(client, tmp_path):
    """While a lost server is re-created from its checkpoint, its metric cannot be read: with a manager the
    logger leaves it out of that step quietly; without one, the loss is for good and it warns."""
    import warnings

    def lost():
        raise dps.errors.PSUnavailableError("parameter server 0 is unavailable")

    strategy = dps.ParameterServerStrategy(client)  # its own: a manager given to a coordinator stays
    with strategy.scope():
        v = dps.Variable(0.0, name="v_for_the_logger")
    for manager in (None, dps.CheckpointManager(dps.Checkpoint(v=v), str(tmp_path))):
        coordinator = dps.ClusterCoordinator(strategy, checkpoint_manager=manager)  # the same one, then given it
        rows = []
        writer = type("W", (), {"add_scalar": lambda self, *row, rows=rows: rows.append(row),
                                "flush": lambda self: None})()
        logger = dps.summary.ScalarLogger(coordinator, writer, {"lost": lost, "ok": lambda: 7}, every_n_steps=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logger.write(1)
        said = [str(w.message) for w in caught]
        assert ("ok", 7.0, 1) in rows and not any(tag == "lost" for tag, _, _ in rows)  # a gap, not a 0
        if manager is not None:
            assert said == []
        else:
            assert said == ["ScalarLogger: metric 'lost' could not be read (PSUnavailableError: parameter "
                            "server 0 is unavailable); it is left out"]
    strategy.close()


@pytest.mark.parametrize("kwargs, error, text", [
    ({"every_n_steps": 0}, ValueError, "every_n_steps must be a positive integer, got 0"),
    ({"every_n_steps": 2.5}, ValueError, "every_n_steps must be a positive integer, got 2.5"),
    ({"examples_per_step": -1}, ValueError, "examples_per_step must be a positive number or None, got -1"),
    ({"interval": 0}, ValueError, "interval must be a positive number of seconds, got 0"),
    ({"metrics": {"loss": 3}}, TypeError, "metrics must map tags .str. to dps.metrics objects"),
    ({"logdir": 5}, TypeError, r"logdir must be a directory, a writer with add_scalar\(tag, value, step\) or None, "
                               r"got int$"),
    ({"examples_per_step": 0}, ValueError, "examples_per_step must be a positive number or None, got 0$"),
    ({"examples_per_step": True}, ValueError, "examples_per_step must be a positive number or None, got True$"),
    ({"interval": True}, ValueError, "interval must be a positive number of seconds, got True$"),
    ({"metrics": {"loss": 3}}, TypeError, r"metrics must map tags \(str\) to dps.metrics objects or functions of no "
                                          r"arguments; got 'loss': int$"),
])
def test_bad_arguments_are_refused_by_name(coordinator, tmp_path, kwargs, error, text):
    args = {"logdir": tmp_path, **kwargs}
    with pytest.raises(error, match=text):
        dps.summary.ScalarLogger(coordinator, **args)
    assert not list(tmp_path.glob("events.out.tfevents.*"))  # nothing written for a refused logger


def test_coordinator_must_be_a_coordinator(tmp_path):
    with pytest.raises(TypeError, match="coordinator must be a ClusterCoordinator, got str"):
        dps.summary.ScalarLogger("coordinator", tmp_path)


class _Rows:
    """A writer of one's own: the scalars it was given, in order."""

    def __init__(self, failures: int = 0):
        self.rows: list[tuple[str, float, int]] = []
        self.failures, self.flushed = failures, 0

    def add_scalar(self, tag, value, step):
        if self.failures:
            self.failures -= 1
            raise OSError("disk full")
        self.rows.append((tag, value, step))

    def flush(self):
        if self.failures:
            raise OSError("disk full")
        self.flushed += 1


def _run(coordinator, n):
    for _ in range(n):
        coordinator.schedule(lambda: None)
    coordinator.join()


def test_poll_writes_once_per_n_completed_functions_and_says_so(coordinator):
    writer = _Rows()
    logger = dps.summary.ScalarLogger(coordinator, writer, every_n_steps=4)
    assert logger.poll() is False and writer.rows == []  # nothing completed
    _run(coordinator, 3)
    assert logger.poll() is False and writer.rows == []  # 3 of 4
    _run(coordinator, 1)
    assert logger.poll() is True and {step for _, _, step in writer.rows} == {4}
    assert logger.poll() is False and logger.steps == [4]  # written at 4 already
    _run(coordinator, 5)
    assert logger.poll() is True and logger.steps == [4, 9]  # two boundaries crossed: one write, at 9
    assert writer.flushed == 2


def test_throughput_is_functions_completed_over_the_seconds_since_the_last_write(coordinator):
    _run(coordinator, 3)  # the logger counts from the 3 done when it is made
    writer = _Rows()
    started = time.monotonic()
    logger = dps.summary.ScalarLogger(coordinator, writer, every_n_steps=100)
    made = time.monotonic()
    _run(coordinator, 10)
    before_write = time.monotonic()
    logger.write(13)
    elapsed = time.monotonic() - started
    (rate,) = [value for tag, value, _ in writer.rows if tag == "daskps/functions_per_second"]
    assert 10 / elapsed <= rate <= 10 / (before_write - made)  # 10 functions in between these two spans
    assert [value for tag, value, _ in writer.rows if tag == "daskps/failed"] == [0.0]
    assert "daskps/examples_per_second" not in {tag for tag, _, _ in writer.rows}  # no examples_per_step given


def test_a_writer_that_fails_warns_once_and_logging_goes_on(coordinator):
    writer = _Rows(failures=1)
    with pytest.warns(RuntimeWarning) as warned:
        logger = dps.summary.ScalarLogger(coordinator, writer, every_n_steps=2, interval=0.01).start()
        _run(coordinator, 2)
        wait_until(lambda: warned.list, 30, failure="no warning", interval=0.01, collect=False)
        writer.failures = 3  # fails again, three times: no second warning
        _run(coordinator, 2)
        wait_until(lambda: not writer.failures, 30, failure="the writer was not tried again", interval=0.01,
                   collect=False)
        _run(coordinator, 2)
        wait_until(lambda: logger.steps, 30, failure="nothing written after the failures", interval=0.01,
                   collect=False)
        logger.stop()
    assert [str(w.message) for w in warned] == [
        "ScalarLogger: could not write scalars (OSError: disk full); it goes on trying"]
    assert logger.steps and logger.steps[-1] == 6 and ("daskps/failed", 0.0, 6) in writer.rows  # written after


def test_the_logger_runs_in_one_daemon_thread_named_for_it(coordinator):
    logger = dps.summary.ScalarLogger(coordinator, None, every_n_steps=1, interval=0.01)
    assert logger.start() is logger
    thread = logger.thread
    assert logger.start() is logger and logger.thread is thread  # started once
    named = [t for t in threading.enumerate() if t.name == "daskps-scalar-logger"]
    assert named == [thread] and thread.daemon
    logger.stop()
    assert not thread.is_alive()


def test_without_tensorboardx_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed: importing it fails
    with pytest.raises(ImportError) as err:
        dps.summary.create_file_writer(tmp_path)
    assert str(err.value) == scalar_logging.TENSORBOARD_MISSING
    assert 'pip install ".[tensorboard]"' in str(err.value) and "add_scalar(tag, value, step)" in str(err.value)


def test_what_is_accepted_and_the_defaults(coordinator):
    class ResultOnly:  # a metric object that is not itself callable
        def result(self):
            return 1.5

    writer = _Rows()
    logger = dps.summary.ScalarLogger(coordinator, writer, {"m": ResultOnly()}, examples_per_step=0.5)
    assert (logger.every_n_steps, logger.interval) == (100, 0.2)
    _run(coordinator, 99)
    assert logger.poll() is False
    _run(coordinator, 1)
    assert logger.poll() is True and logger.steps == [100] and ("m", 1.5, 100) in writer.rows
    (rate,) = [v for tag, v, _ in writer.rows if tag == "daskps/functions_per_second"]
    assert ("daskps/examples_per_second", rate * 0.5, 100) in writer.rows


def test_stopping_with_nothing_new_writes_nothing_and_a_bad_metric_warns_once(coordinator):
    writer = _Rows()
    dps.summary.ScalarLogger(coordinator, writer, every_n_steps=1).stop()  # nothing completed meanwhile
    assert writer.rows == [] and writer.flushed == 1

    def broken():
        raise RuntimeError("no value yet")

    logger = dps.summary.ScalarLogger(coordinator, writer, {"bad": broken}, every_n_steps=1)
    with pytest.warns(RuntimeWarning) as warned:
        for _ in range(2):
            _run(coordinator, 1)
            assert logger.poll() is True
    assert [str(w.message) for w in warned] == [
        "ScalarLogger: metric 'bad' could not be read (RuntimeError: no value yet); it is left out"]


def test_the_values_also_reach_the_scheduler_for_the_dashboard(strategy, coordinator):
    logger = dps.summary.ScalarLogger(coordinator, None, {"seven": lambda: 7}, every_n_steps=2)
    _run(coordinator, 2)
    assert logger.poll() is True
    events = [e for _, e in strategy.client.get_events(METRICS_TOPIC) if e["strategy"] == strategy.token]
    assert len(events) == 1 and events[0]["step"] == 2 and type(events[0]["step"]) is int
    values = events[0]["values"]
    assert set(values) == {"daskps/functions_per_second", "daskps/failed", "daskps/rerun", "seven"}
    assert values["seven"] == 7.0 and values["daskps/failed"] == 0.0 and values["daskps/functions_per_second"] > 0
    assert values["daskps/rerun"] == 0.0


def test_a_step_function_sets_the_step_written_and_the_plots_x(strategy, coordinator):
    """step=: the optimizer's iterations, say (several per function here), for TensorBoard and the plot alike."""
    with strategy.scope():
        iterations = dps.Variable(np.int64(1000), name="iterations_for_the_logger")  # as after a resumed run
    rows = []
    writer = type("W", (), {"add_scalar": lambda self, *row: rows.append(row), "flush": lambda self: None})()
    logger = dps.summary.ScalarLogger(coordinator, writer, {"seven": lambda: 7}, every_n_steps=2,
                                      step=lambda: int(iterations.numpy()))
    for _ in range(2):
        coordinator.schedule(lambda: iterations.assign_add(np.int64(4)))  # 4 optimizer steps per function
    coordinator.join()
    assert logger.poll() is True
    assert ("seven", 7.0, 1008) in rows and {step for _, _, step in rows} == {1008}
    events = [e for _, e in strategy.client.get_events(METRICS_TOPIC) if e["strategy"] == strategy.token]
    assert events[-1]["step"] == 1008 and events[-1]["values"]["seven"] == 7.0
    coordinator.schedule(lambda: None)  # a function completes, but no optimizer step is taken
    coordinator.join()
    logger.stop()  # it would write the last step: 1008 again
    assert {step for _, _, step in rows} == {1008} and len(rows) == len(set(rows)), rows
    with pytest.raises(TypeError, match=r"step must be a function of no arguments returning the step .*got int"):
        dps.summary.ScalarLogger(coordinator, None, step=5)


def test_a_mean_with_no_value_since_its_reset_is_left_out_not_written_as_zero(strategy, coordinator, tmp_path):
    """As the demo resets its train loss each epoch: a write between the reset and the next update has no loss."""
    with strategy.scope():
        loss = dps.metrics.Mean(name="reset_loss")
        total = dps.metrics.Sum(name="reset_total")
    logger = dps.summary.ScalarLogger(coordinator, tmp_path, {"loss": loss, "total": total, "none": lambda: None},
                                      every_n_steps=1)
    loss.update_state(3.0)
    logger.write(1)
    loss.reset_state()
    total.reset_state()
    logger.write(2)  # after the reset, before any update
    loss.update_state(5.0)
    logger.write(3)
    logger.stop()
    scalars = read_scalars(tmp_path)
    assert scalars["loss"] == [(1, 3.0), (3, 5.0)]  # a gap at step 2, not a 0
    assert [s for s, _ in scalars["total"]] == [1, 2, 3]  # a sum of nothing is 0, a value
    assert "none" not in scalars
