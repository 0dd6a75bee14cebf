"""CheckpointManager's cadence, as TensorFlow's: checkpoint_interval with step_counter, keep_checkpoint_every_n_hours."""

from __future__ import annotations

import json
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


def _committed_at(directory, n: int) -> float:
    """The commit time checkpoint ``n`` records in its manifest (what the manager goes by)."""
    return json.loads((directory / f"ckpt-{n}" / "manifest.json").read_text())["time"]


def _set_committed_at(directory, n: int, when: float) -> None:
    path = directory / f"ckpt-{n}" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["time"] = when
    path.write_text(json.dumps(manifest))


def tf_preserved(evicted: list[tuple[int, float]], last_preserved: float, hours: float) -> list[int]:
    """TensorFlow's CheckpointManager._sweep: a checkpoint leaving the newest max_to_keep (oldest first) is
    kept when ``timestamp - hours * 3600 >= last_preserved``, which then becomes its timestamp."""
    kept = []
    for n, timestamp in evicted:
        if timestamp - hours * 3600.0 >= last_preserved:
            kept.append(n)
            last_preserved = timestamp
    return kept


def test_keep_checkpoint_every_n_hours_preserves_old_ones(tmp_path):
    w, _ = _model()
    # 0.5 s, in hours: checkpoints leaving the newest 2 are kept when 0.5 s passed since the last kept one.
    hours = 0.5 / 3600
    created = time.time()  # TensorFlow starts counting from the manager's making
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), max_to_keep=2,
                                    keep_checkpoint_every_n_hours=hours)
    time.sleep(0.6)
    committed = []
    for n in range(1, 7):
        manager.save()
        committed.append((n, _committed_at(tmp_path, n)))
        time.sleep(0.2)
    on_disk = sorted(int(p.name.rsplit("-", 1)[1]) for p in tmp_path.iterdir())
    managed = [int(p.rsplit("-", 1)[1]) for p in manager.checkpoints]
    assert managed == [5, 6]
    preserved = sorted(set(on_disk) - set(managed))
    # Exactly those TensorFlow's rule keeps, from the commit times (1 always: 0.6 s after the start).
    want = tf_preserved(committed[:4], created, hours)
    assert want[0] == 1 and want != [1, 2, 3, 4]  # 2 is 0.2 s and a save after 1: too close to it
    assert preserved == want
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


def test_keep_checkpoint_every_n_hours_keeps_exactly_what_tensorflow_keeps(tmp_path):
    """Commit times set in each manifest (whole seconds, so the boundary case is exact), one hour apart
    or not; the set kept is TensorFlow's, and a new manager picks up the last one kept."""
    w, _ = _model()
    start = float(int(time.time()))  # at or just before the manager is made
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), max_to_keep=2,
                                    keep_checkpoint_every_n_hours=1)
    offsets = [1800, 3960, 5760, 7560, 9000, 11200, 12000, 12100]  # 7560 - 3960: exactly one hour
    for n, offset in enumerate(offsets, start=1):
        assert manager.save() == f"{tmp_path}/ckpt-{n}"
        _set_committed_at(tmp_path, n, start + offset)
    evicted = [(n, start + offset) for n, offset in enumerate(offsets[:-2], start=1)]
    assert tf_preserved(evicted, start, 1) == [2, 4, 6]
    on_disk = sorted(int(p.name.rsplit("-", 1)[1]) for p in tmp_path.iterdir())
    assert on_disk == [2, 4, 6, 7, 8]
    assert [int(p.rsplit("-", 1)[1]) for p in manager.checkpoints] == [7, 8]
    assert sorted(int(p.parent.name.rsplit("-", 1)[1]) for p in tmp_path.glob("*/PRESERVED")) == [2, 4, 6]

    # Made again, the manager counts from the newest preserved (6, at 11200 s): 7 and 8 are too close to it.
    again = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), max_to_keep=2,
                                  keep_checkpoint_every_n_hours=1)
    for n, offset in [(9, 14000), (10, 14100)]:
        assert again.save() == f"{tmp_path}/ckpt-{n}"
        _set_committed_at(tmp_path, n, start + offset)
    assert tf_preserved([(7, start + 12000), (8, start + 12100)], start + 11200, 1) == []
    assert sorted(int(p.name.rsplit("-", 1)[1]) for p in tmp_path.iterdir()) == [2, 4, 6, 9, 10]
