"""TensorBoard scalars from the coordinator (``dps.summary``): event files TensorBoard's format defines."""

from __future__ import annotations

import pathlib
import struct
import time

import numpy as np
import pytest

import daskps as dps

event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")  # tensorboardX is in the test extra


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit, as the TFRecord format specifies it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(logdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``logdir``: tag -> [(step, value)], each record's CRCs checked."""
    found: dict[str, list[tuple[int, float]]] = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {logdir}"
    for path in files:
        data, at = path.read_bytes(), 0
        while at < len(data):
            header = data[at:at + 8]
            (length,), (length_crc,) = struct.unpack("<Q", header), struct.unpack("<I", data[at + 8:at + 12])
            assert _masked(_crc32c(header)) == length_crc
            record = data[at + 12:at + 12 + length]
            (record_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
            assert _masked(_crc32c(record)) == record_crc
            at += 16 + length
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


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
        deadline = time.monotonic() + 60
        while not logger.steps and time.monotonic() < deadline:
            time.sleep(0.02)
        assert logger.steps and 20 <= logger.steps[0] <= 30  # written while the logger runs, not only when it stops
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


@pytest.mark.parametrize("kwargs, error, text", [
    ({"every_n_steps": 0}, ValueError, "every_n_steps must be a positive integer, got 0"),
    ({"every_n_steps": 2.5}, ValueError, "every_n_steps must be a positive integer, got 2.5"),
    ({"examples_per_step": -1}, ValueError, "examples_per_step must be a positive number or None, got -1"),
    ({"interval": 0}, ValueError, "interval must be a positive number of seconds, got 0"),
    ({"metrics": {"loss": 3}}, TypeError, "metrics must map tags .str. to dps.metrics objects"),
    ({"logdir": 5}, TypeError, "logdir must be a directory, a writer with add_scalar.tag, value, step. or None"),
])
def test_bad_arguments_are_refused_by_name(coordinator, tmp_path, kwargs, error, text):
    args = {"logdir": tmp_path, **kwargs}
    with pytest.raises(error, match=text):
        dps.summary.ScalarLogger(coordinator, **args)
    assert not list(tmp_path.glob("events.out.tfevents.*"))  # nothing written for a refused logger


def test_coordinator_must_be_a_coordinator(tmp_path):
    with pytest.raises(TypeError, match="coordinator must be a ClusterCoordinator, got str"):
        dps.summary.ScalarLogger("coordinator", tmp_path)
