"""CheckpointManager's cadence, as TensorFlow's: checkpoint_interval with step_counter, keep_checkpoint_every_n_hours."""

from __future__ import annotations

import time

import numpy as np
import pytest

import daskps as dps


def _model():
    w = dps.Variable(np.zeros(3, np.float32), name="w")
    step = dps.Variable(0, name="step")  # int32
    return w, step


def test_save_every_interval_steps(tmp_path):
    w, step = _model()
    manager = dps.CheckpointManager(dps.Checkpoint(w=w, step=step), str(tmp_path), max_to_keep=None,
                                    step_counter=step, checkpoint_interval=10)
    saved = []
    for _ in range(35):  # a loop that asks after every step
        step.assign_add(1)
        w.assign_add(np.ones(3, np.float32))
        path = manager.save()
        if path is not None:
            saved.append(int(step.numpy()))
    assert saved == [1, 11, 21, 31]
    assert [p.rsplit("-", 1)[1] for p in manager.checkpoints] == ["1", "2", "3", "4"]
    assert manager.save() is None  # the step has not moved
    step.assign_add(1)
    assert manager.save() is None  # 32 < 31 + 10
    assert manager.save(check_interval=False) is not None  # moved, and told not to wait
    assert manager.save(check_interval=False) is None  # same step twice: never


def test_interval_arguments_are_checked(tmp_path):
    w, step = _model()
    ckpt = dps.Checkpoint(w=w)
    with pytest.raises(ValueError, match="checkpoint_interval needs step_counter"):
        dps.CheckpointManager(ckpt, str(tmp_path), checkpoint_interval=5)
    with pytest.raises(ValueError, match="checkpoint_interval must be a positive int"):
        dps.CheckpointManager(ckpt, str(tmp_path), step_counter=step, checkpoint_interval=0)
    with pytest.raises(ValueError, match="step_counter must be a scalar int"):
        dps.CheckpointManager(ckpt, str(tmp_path), step_counter=w, checkpoint_interval=5)
    with pytest.raises(ValueError, match="keep_checkpoint_every_n_hours"):
        dps.CheckpointManager(ckpt, str(tmp_path), keep_checkpoint_every_n_hours=-1)
    assert list(tmp_path.iterdir()) == []


def test_keep_checkpoint_every_n_hours_preserves_old_ones(tmp_path):
    w, _ = _model()
    # 0.3 s, in hours: checkpoints leaving the newest 2 are kept when 0.3 s passed since the last kept one.
    hours = 0.3 / 3600
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), max_to_keep=2,
                                    keep_checkpoint_every_n_hours=hours)
    time.sleep(0.35)
    for _ in range(6):
        manager.save()
        time.sleep(0.12)
    on_disk = sorted(int(p.name.rsplit("-", 1)[1]) for p in tmp_path.iterdir())
    managed = [int(p.rsplit("-", 1)[1]) for p in manager.checkpoints]
    assert managed == [5, 6]
    preserved = sorted(set(on_disk) - set(managed))
    # 1 is 0.35 s after the start: kept; then one each time 0.3 s have passed (2 and 3 are too close to 1).
    assert preserved and preserved[0] == 1 and len(preserved) <= 4
    assert all((tmp_path / f"ckpt-{n}" / "PRESERVED").exists() for n in preserved)
    # A new manager on the directory keeps them out of its rotation too.
    again = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), max_to_keep=2,
                                  keep_checkpoint_every_n_hours=hours)
    assert [int(p.rsplit("-", 1)[1]) for p in again.checkpoints] == [5, 6]
    again.save()
    assert all((tmp_path / f"ckpt-{n}").exists() for n in preserved)  # never rotated out
    assert [int(p.rsplit("-", 1)[1]) for p in again.checkpoints] == [6, 7]
    w2 = dps.Variable(np.ones(3, np.float32), name="w")
    dps.Checkpoint(w=w2).restore(str(tmp_path / f"ckpt-{preserved[0]}"))  # still a whole checkpoint
    np.testing.assert_array_equal(w2.numpy(), np.zeros(3))
