"""Metrics: state on a parameter server, updates from any trainer."""

from __future__ import annotations

import numpy as np
import pytest

import daskps as dps


def test_mean_and_sum_from_many_workers(strategy, coordinator):
    with strategy.scope():
        mean, total = dps.metrics.Mean(name="loss"), dps.metrics.Sum()
    assert all(v.device.startswith("/job:ps/") for v in mean.variables + total.variables)
    assert len({v.device for v in mean.variables}) == 1  # colocated: one call per update

    def step(x):
        mean.update_state([x, x + 1.0])
        total.update_state(x)

    for i in range(10):
        coordinator.schedule(step, args=(float(i),))
    coordinator.join()
    assert mean.result() == pytest.approx(np.mean([[i, i + 1] for i in range(10)]))
    assert total.result() == pytest.approx(45.0)
    assert mean.result().dtype == np.float32
    mean.reset_state()
    assert mean.result() == 0.0


def test_weighted_mean():
    m = dps.metrics.Mean()
    m.update_state([[1.0, 2.0], [3.0, 4.0]], sample_weight=[1.0, 0.0])
    assert m.result() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="sample_weight"):
        m.update_state([1.0, 2.0], sample_weight=[1.0, 2.0, 3.0])


def test_accuracy_metrics(strategy):
    with strategy.scope():
        acc, sparse = dps.metrics.Accuracy(), dps.metrics.SparseCategoricalAccuracy()
    acc.update_state([1, 2, 3, 4], [1, 2, 0, 4])
    assert acc.result() == pytest.approx(0.75)
    sparse.update_state([[2], [1]], [[0.1, 0.6, 0.3], [0.05, 0.95, 0.0]])
    assert sparse.result() == pytest.approx(0.5)
    assert sparse([0], [[0.9, 0.1, 0.0]]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="y_true"):
        sparse.update_state([1, 2, 3], [[0.1, 0.9]])


def test_tensorflow_habits(strategy):
    with strategy.scope():
        m = dps.metrics.Mean()
    m.update_state([1.0, 3.0])
    assert m.result().numpy() == 2.0 and m.result().numpy().dtype == np.float32
    assert float(m.result()) == 2.0 and m.result() + 1 == 3.0
    m.reset_states()
    assert m.result().numpy() == 0.0
