"""Metrics on variables of this process against Keras 3's metrics (the reference), and their refusals."""

from __future__ import annotations

import numpy as np
import pytest

import daskps as dps

keras = pytest.importorskip("keras")

Y_TRUE = np.array([0, 2, 1, 1, 3])
Y_PROBS = np.array([[0.7, 0.1, 0.1, 0.1], [0.2, 0.2, 0.5, 0.1], [0.1, 0.2, 0.6, 0.1], [0.3, 0.4, 0.2, 0.1],
                    [0.4, 0.1, 0.1, 0.4]], np.float32)
WEIGHTS = np.array([1.0, 0.5, 2.0, 0.0, 3.0])


def _keras(name, *batches):
    metric = getattr(keras.metrics, name)()
    for args, kwargs in batches:
        metric.update_state(*args, **kwargs)
    return float(metric.result())


@pytest.mark.parametrize("name, batches", [
    ("Mean", [(([1.0, 2.0, 3.0],), {}), (([10.0],), {"sample_weight": [3.0]})]),
    ("Mean", [(([[1.0, 2.0], [3.0, 4.0]],), {"sample_weight": [0.25, 2.0]})]),
    ("Sum", [(([1.0, 2.0, 3.0],), {}), (([[1.0, 2.0], [3.0, 4.0]],), {"sample_weight": [0.5, 2.0]})]),
    ("Accuracy", [(([1, 2, 3, 4], [1, 2, 0, 4]), {}), (([[1], [2]], [1, 0]), {"sample_weight": [2.0, 1.0]})]),
    ("SparseCategoricalAccuracy", [((Y_TRUE, Y_PROBS), {}), ((Y_TRUE, Y_PROBS), {"sample_weight": WEIGHTS}),
                                   ((Y_TRUE.reshape(5, 1), Y_PROBS), {})]),
])
def test_results_match_keras(name, batches):
    ours = getattr(dps.metrics, name)()
    for args, kwargs in batches:
        ours.update_state(*args, **kwargs)
    got = ours.result()
    assert got.dtype == np.float32 and got.shape == ()
    np.testing.assert_allclose(float(got), _keras(name, *batches), rtol=1e-6)


def test_a_fresh_mean_is_zero_and_reset_zeroes_every_state_variable():
    m = dps.metrics.Mean(name="loss", dtype=np.float64)
    assert [v.name for v in m.variables] == ["loss/total", "loss/count"]
    assert all(v.trainable is False and v.dtype == np.float64 for v in m.variables)
    assert float(m.result()) == 0.0 and m.result().dtype == np.float64
    assert float(m([2.0, 4.0])) == 3.0  # __call__ updates, then answers
    m.reset_state()
    assert [float(v.numpy()) for v in m.variables] == [0.0, 0.0]
    m.update_state([5.0])
    m.reset_states()
    assert float(m.result()) == 0.0
    s = dps.metrics.Sum()
    assert s.name == "sum" and [v.name for v in s.variables] == ["sum/total"]
    s.update_state([1.5, 2.5])
    assert float(s.result()) == 4.0
    s.reset_state()
    assert float(s.result()) == 0.0
    assert dps.metrics.SparseCategoricalAccuracy().name == "sparsecategoricalaccuracy"


def test_the_result_is_an_array_that_also_answers_numpy():
    m = dps.metrics.Mean()
    m.update_state([1.0, 2.0])
    r = m.result()
    copy = r.numpy()
    assert type(copy) is np.ndarray and copy == 1.5
    copy[...] = 9
    assert float(r) == 1.5
    assert repr(r) == "array(1.5, dtype=float32)"
    assert repr(m) == "<daskps.metrics.Mean 'mean' on /job:chief/replica:0/task:0/device:CPU:0>"


def test_bad_shapes_are_refused_word_for_word_and_change_nothing():
    m = dps.metrics.Mean()
    m.update_state([1.0])
    with pytest.raises(ValueError) as info:
        m.update_state([[1.0, 2.0], [3.0, 4.0]], sample_weight=[1.0, 2.0, 3.0])
    assert str(info.value) == "sample_weight of shape (3,) does not broadcast to values of shape (2, 2)"
    a = dps.metrics.Accuracy()
    with pytest.raises(ValueError) as info:
        a.update_state([1, 2, 3], [1, 2])
    assert str(info.value) == "y_true has shape (3,) but y_pred has shape (2,)"
    s = dps.metrics.SparseCategoricalAccuracy()
    with pytest.raises(ValueError) as info:
        s.update_state([0, 1, 2], Y_PROBS[:2])
    assert str(info.value) == "y_true has shape (3,); expected labels of shape (2,) for y_pred of shape (2, 4)"
    assert float(m.result()) == 1.0 and float(a.result()) == 0.0 and float(s.result()) == 0.0
    assert [float(v.numpy()) for v in a.variables + s.variables] == [0.0] * 4


def test_the_base_class_leaves_update_and_result_to_subclasses():
    class Nothing(dps.metrics.Metric):
        _state_names = ("x",)

    n = Nothing()
    with pytest.raises(NotImplementedError):
        n.update_state(1.0)
    with pytest.raises(NotImplementedError):
        n.result()


def test_state_is_kept_in_float64_and_call_passes_weights():
    s = dps.metrics.Sum(dtype=np.float64)
    s.update_state(np.array([16777216.0, 1.0], np.float32))  # 2**24 + 1: float32 cannot hold it
    s.update_state(np.array([1.0], np.float32), sample_weight=np.array([1.0], np.float32))
    assert float(s.result()) == 16777218.0
    m = dps.metrics.Mean()
    assert float(m([1.0, 3.0], sample_weight=[3.0, 1.0])) == 1.5


def test_sparse_categorical_accuracy_takes_the_last_axis_of_a_sequence():
    probs = np.zeros((2, 3, 4), np.float32)
    labels = np.array([[0, 1, 2], [3, 3, 0]])
    probs[0, 0, 0] = probs[0, 1, 1] = probs[0, 2, 3] = 1.0
    probs[1, 0, 3] = probs[1, 1, 2] = probs[1, 2, 0] = 1.0
    ours = dps.metrics.SparseCategoricalAccuracy()
    ours.update_state(labels, probs)
    theirs = keras.metrics.SparseCategoricalAccuracy()
    theirs.update_state(labels, probs)
    assert float(ours.result()) == pytest.approx(float(theirs.result())) == pytest.approx(4 / 6)
