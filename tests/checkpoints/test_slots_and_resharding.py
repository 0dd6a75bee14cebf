"""Checkpoints of variables in this process: optimizer slots and step counts, resharding between row
layouts, embedding tables, progress, and the refusals, against numpy written from the rules."""

from __future__ import annotations

import collections
import gc

import numpy as np
import pytest

import daskps as dps

FULL = np.arange(14, dtype=np.float32).reshape(7, 2)


def _adam_numpy(p, grads, lr=0.1, b1=0.9, b2=0.999, eps=1e-7):
    """Keras 3's Adam, step by step."""
    m = v = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        p = p - alpha * m / (np.sqrt(v) + eps)
    return p


def test_adam_resumes_from_its_saved_slots_and_step_count(tmp_path):
    w = dps.Variable(np.array([1.0, -2.0], np.float32), name="w")
    opt = dps.optimizers.Adam(0.1)
    ckpt = dps.Checkpoint(w=w, opt=opt)
    grads = [np.array([0.5, -1.0], np.float32), np.array([1.0, 2.0], np.float32), np.array([-0.3, 0.1], np.float32)]
    for g in grads[:2]:
        opt.apply([g], [w])
    path = ckpt.write(str(tmp_path / "c"))
    for _ in range(4):  # moves, slots and count all go on
        opt.apply([np.ones(2, np.float32)], [w])
    ckpt.read(path)
    assert int(opt.iterations.numpy()) == 2
    opt.apply([grads[2]], [w])
    np.testing.assert_allclose(w.numpy(), _adam_numpy(np.array([1.0, -2.0]), grads), rtol=1e-5)


def test_momentum_slots_follow_rows_into_another_sharding(tmp_path):
    """Saved from 2 shards by blocks, restored into 3 shards by blocks and into 3 shards by row mod 3."""
    lr, mu = 0.1, 0.9
    saved = dps.ShardedVariable(dps.create_partitioned_variables((7, 2), [2, 1], FULL, name="e"), name="e")
    opt = dps.optimizers.SGD(lr, momentum=mu)
    g = np.linspace(-1, 1, 14, dtype=np.float32).reshape(7, 2)
    opt.apply([g], [saved])
    path = dps.Checkpoint(e=saved, opt=opt).write(str(tmp_path / "c"))
    m1 = -lr * g
    want = FULL + m1 + (mu * m1 - lr * g)  # one more step after the restore
    blocks = dps.ShardedVariable(dps.create_partitioned_variables((7, 2), [3, 1], np.zeros((7, 2), np.float32),
                                                                   name="e"), name="e")
    by_mod = dps.ShardedVariable([dps.Variable(np.zeros((len(range(i, 7, 3)), 2), np.float32), name=f"e/part_{i}")
                                  for i in range(3)], name="e", layout="mod")
    for target in (blocks, by_mod):
        other = dps.optimizers.SGD(lr, momentum=mu)
        dps.Checkpoint(e=target, opt=other).read(path)
        np.testing.assert_array_equal(target.numpy(), FULL + m1)
        other.apply([g], [target])
        np.testing.assert_allclose(target.numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(by_mod.variables[1].numpy(), want[1::3], rtol=1e-6)
    # And back: saved by row mod 3, restored by blocks of 2.
    path2 = dps.Checkpoint(e=by_mod).write(str(tmp_path / "c2"))
    two = dps.ShardedVariable(dps.create_partitioned_variables((7, 2), [2, 1], np.zeros((7, 2), np.float32),
                                                                name="e"), name="e")
    dps.Checkpoint(e=two).read(path2)
    np.testing.assert_allclose(two.numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(two.variables[1].numpy(), want[4:], rtol=1e-6)


def test_a_mod_layout_restores_into_the_same_mod_layout(tmp_path):
    parts = [dps.Variable(FULL[i::2].copy(), name=f"e/part_{i}") for i in range(2)]
    src = dps.ShardedVariable(parts, name="e", layout="mod")
    np.testing.assert_array_equal(src.numpy(), FULL)
    path = dps.Checkpoint(e=src).write(str(tmp_path / "c"))
    dst = dps.ShardedVariable([dps.Variable(np.zeros_like(FULL[i::2]), name=f"e/part_{i}") for i in range(2)],
                              name="e", layout="mod")
    dps.Checkpoint(e=dst).read(path)
    np.testing.assert_array_equal(dst.numpy(), FULL)
    np.testing.assert_array_equal(dst.variables[0].numpy(), FULL[0::2])


def _zeros(shape, dtype):
    return np.zeros(shape, dtype)


def test_an_embedding_table_round_trips_with_its_keys_and_adagrad_slots(tmp_path):
    table = dps.EmbeddingTable(2, initializer=_zeros, name="t")
    opt = dps.optimizers.Adagrad(0.5, initial_accumulator_value=0.1)
    keys = np.array([5, 9, 5], np.int64)
    dps.embedding_lookup(table, keys)
    opt.apply([dps.IndexedSlices(np.ones((3, 2), np.float32), keys)], [table])
    path = dps.Checkpoint(t=table, opt=opt).write(str(tmp_path / "c"))
    after_one = dps.embedding_lookup(table, np.array([5, 9]))
    fresh = dps.EmbeddingTable(2, initializer=_zeros, name="t")
    other = dps.optimizers.Adagrad(0.5, initial_accumulator_value=0.1)
    dps.Checkpoint(t=fresh, opt=other).read(path)
    np.testing.assert_array_equal(dps.embedding_lookup(fresh, np.array([5, 9])), after_one)
    other.apply([dps.IndexedSlices(np.ones((1, 2), np.float32), np.array([9]))], [fresh])
    # Adagrad: acc = 0.1 + 1 + 1, p -= 0.5 * g / sqrt(acc)  (key 9 had gradient 1, then 1 again)
    acc = 0.1 + 1.0
    p = -0.5 / np.sqrt(acc + 1e-7)
    acc += 1.0
    p -= 0.5 / np.sqrt(acc + 1e-7)
    np.testing.assert_allclose(dps.embedding_lookup(fresh, np.array([9]))[0], [p, p], rtol=1e-5)


def test_a_table_is_not_restored_from_what_is_not_a_table_like_it(tmp_path):
    v = dps.Variable(np.zeros((3, 2), np.float32), name="t")
    var_path = dps.Checkpoint(t=v).write(str(tmp_path / "v"))
    table = dps.EmbeddingTable(2, initializer=_zeros, name="t")
    dps.embedding_lookup(table, np.array([1]))
    table_path = dps.Checkpoint(t=table).write(str(tmp_path / "t"))
    with pytest.raises(ValueError, match=r"t: the checkpoint lacks t/\.ATTRIBUTES/keys.* \(not saved from an "
                                         r"EmbeddingTable\)|t: the checkpoint lacks"):
        dps.Checkpoint(t=dps.EmbeddingTable(2, initializer=_zeros, name="t")).read(var_path)
    with pytest.raises(ValueError, match=r"t: checkpoint has rows of \[2\], embedding table has dim 3"):
        dps.Checkpoint(t=dps.EmbeddingTable(3, initializer=_zeros, name="t")).read(table_path)
    with pytest.raises(ValueError, match=r"t: checkpoint has dtype float32, embedding table has float64"):
        dps.Checkpoint(t=dps.EmbeddingTable(2, initializer=_zeros, dtype=np.float64, name="t")).read(table_path)


def test_progress_shows_the_bytes_written_when_asked(tmp_path, capsys):
    w = dps.Variable(np.zeros((64, 64), np.float32), name="w")
    path = dps.Checkpoint(w=w).write(str(tmp_path / "c"), progress=True)
    err = capsys.readouterr()
    shown = err.out + err.err
    assert f"saving {path}" in shown and "MiB" in shown
    dps.Checkpoint(w=w).write(str(tmp_path / "d"), progress=False)
    err = capsys.readouterr()
    assert "saving" not in err.out + err.err


def test_the_step_counter_spaces_saves_and_must_be_a_scalar_int(tmp_path):
    """TensorFlow's rule: with ``checkpoint_interval``, a save comes only once the step counter has moved on by
    at least the interval since the last save."""
    w = dps.Variable(np.zeros(2, np.float32), name="w")
    step = dps.Variable(np.int64(7))
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), step_counter=step, checkpoint_interval=5)
    assert manager.save() is not None
    step.assign(np.int64(11))
    assert manager.save() is None
    step.assign(np.int64(12))
    assert manager.save() is not None
    assert manager.save(check_interval=False) is None  # the same step is never saved twice
    step.assign(np.int64(13))
    assert manager.save() is None
    assert manager.save(check_interval=False) is not None  # before the interval, when asked
    with pytest.raises(ValueError) as info:
        dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path / "b"), step_counter=dps.Variable(1.5),
                              checkpoint_interval=2)
    assert str(info.value) == ("step_counter must be a scalar int variable (such as optimizer.iterations), "
                               "got float32 ()")


def test_restore_or_initialize_restores_the_latest_or_calls_init(tmp_path):
    w = dps.Variable(np.zeros(2, np.float32), name="w")
    called = []
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), init_fn=lambda: called.append(1))
    assert manager.restore_or_initialize() is None and called == [1]
    w.assign(np.array([3.0, 4.0], np.float32))
    saved = manager.save()
    w.assign(np.zeros(2, np.float32))
    again = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), init_fn=lambda: called.append(2))
    assert again.restore_or_initialize() == saved and called == [1]
    np.testing.assert_array_equal(w.numpy(), [3.0, 4.0])
    assert repr(dps.Checkpoint(w=w, b=w)) == "<daskps.Checkpoint ['b', 'w'] save_counter=0>"


def _momentum_checkpoint(tmp_path):
    w = dps.Variable(np.zeros((3, 2), np.float32), name="w")
    b = dps.Variable(np.zeros(2, np.float32), name="b")
    opt = dps.optimizers.SGD(0.1, momentum=0.9)
    opt.apply([np.ones((3, 2), np.float32), np.ones(2, np.float32)], [w, b])
    return dps.Checkpoint(w=w, b=b, opt=opt, extra=dps.Variable(1.0)).write(str(tmp_path / "c"))


def test_a_restore_that_does_not_match_lists_every_problem_and_changes_nothing(tmp_path):
    path = _momentum_checkpoint(tmp_path)
    w = dps.Variable(np.full((4, 2), 7.0, np.float32), name="w")
    b = dps.Variable(np.full(2, 7.0), name="b")
    with pytest.raises(ValueError) as info:
        dps.Checkpoint(w=w, b=b, opt=dps.optimizers.SGD(0.1, momentum=0.9)).read(path)
    assert str(info.value) == (
        f"cannot restore from {path!r}; nothing was changed:\n"
        "  w: checkpoint has shape (3, 2), object has (4, 2)\n"
        "  w/.OPTIMIZER_SLOT/opt/momentum: checkpoint has shape (3, 2), variable has (4, 2)\n"
        "  b: checkpoint has dtype float32, object has float64\n"
        "  (in the checkpoint but not asked for: extra)")
    assert (w.numpy() == 7).all() and (b.numpy() == 7).all()
    with pytest.raises(ValueError) as info:
        dps.Checkpoint(w=dps.Variable(np.zeros((3, 2), np.float32)), missing=b).read(path)
    assert str(info.value) == (f"cannot restore from {path!r}; nothing was changed:\n"
                               "  missing: not in the checkpoint\n"
                               "  (in the checkpoint but not asked for: b, extra, opt/iterations)")


def test_a_count_without_slots_is_restored_so_a_schedule_goes_on_from_it(tmp_path):
    """Plain SGD keeps no slot arrays, only its step count: a schedule's rate after the restore is the one
    at the saved count (1.0 * 0.5**step)."""
    w = dps.Variable(np.zeros(1, np.float32), name="w")
    opt = dps.optimizers.SGD(dps.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5))
    ckpt = dps.Checkpoint(w=w, opt=opt)
    for _ in range(2):
        opt.apply([np.ones(1, np.float32)], [w])  # -1, -0.5
    path = ckpt.write(str(tmp_path / "c"))
    for _ in range(3):
        opt.apply([np.ones(1, np.float32)], [w])
    ckpt.read(path)
    opt.apply([np.ones(1, np.float32)], [w])  # rate(2) = 0.25
    np.testing.assert_allclose(w.numpy(), [-1.75])


@pytest.mark.parametrize("kwargs, kind, message", [
    ({"checkpoint": "w"}, TypeError, "checkpoint must be a daskps.Checkpoint, got str"),
    ({"directory": 3}, TypeError, "directory must be a str (a path or an fsspec URL), got int"),
    ({"max_to_keep": 0}, ValueError, "max_to_keep must be a positive int or None, got 0"),
    ({"max_to_keep": 1.5}, TypeError, "max_to_keep must be a positive int or None, got float"),
    ({"max_to_keep": True}, TypeError, "max_to_keep must be a positive int or None, got bool"),
    ({"keep_checkpoint_every_n_hours": -1}, ValueError,
     "keep_checkpoint_every_n_hours must be a positive number or None, got -1"),
    ({"checkpoint_name": "a/b"}, ValueError,
     "checkpoint_name must be a file name inside the directory (no '/', not '..'), got 'a/b'"),
    ({"checkpoint_interval": 5}, ValueError,
     "checkpoint_interval needs step_counter (a scalar int variable, such as optimizer.iterations) to count steps by"),
    ({"checkpoint_interval": 0, "step_counter": "counter"}, ValueError,
     "checkpoint_interval must be a positive int or None, got 0"),
    ({"init_fn": 3}, TypeError, "init_fn must be callable or None, got int"),
])
def test_manager_arguments_are_refused_word_for_word(tmp_path, kwargs, kind, message):
    w = dps.Variable(np.zeros(2, np.float32), name="w")
    given = {"checkpoint": dps.Checkpoint(w=w), "directory": str(tmp_path), **kwargs}
    if given.get("step_counter") == "counter":
        given["step_counter"] = dps.Variable(np.int64(0))
    with pytest.raises(kind) as info:
        dps.CheckpointManager(**given)
    assert str(info.value) == message


def test_one_kept_means_the_newest_one(tmp_path):
    w = dps.Variable(np.zeros(2, np.float32), name="w")
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), max_to_keep=1)
    first, second = manager.save(), manager.save()
    assert manager.checkpoints == [second] and manager.latest_checkpoint == second and first != second
    counted = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path / "n"), step_counter=np.int64(4),
                                    checkpoint_interval=1)
    assert counted.save() is not None  # a plain number counts as the step too


def test_save_numbers_checkpoints_and_a_restore_takes_the_counter_back(tmp_path):
    import json

    w = dps.Variable(np.float32(1.5), name="w")  # a scalar
    ckpt = dps.Checkpoint(w=w)
    prefix = str(tmp_path / "ck")
    assert [ckpt.save(prefix), ckpt.save(prefix)] == [f"{prefix}-1", f"{prefix}-2"] and ckpt.save_counter == 2
    manifest = json.loads((tmp_path / "ck-2" / "manifest.json").read_text())
    assert manifest["format"] == "daskps-checkpoint/1" and manifest["save_counter"] == 2
    w.assign(np.float32(-4.0))
    later = dps.Checkpoint(w=w)
    later.restore(f"{prefix}-2/")  # restore (not read) takes save_counter back; a trailing slash is the same
    assert later.save_counter == 2 and float(w.numpy()) == 1.5
    assert later.save(prefix) == f"{prefix}-3"


def test_progress_follows_daskps_progress_bytes_unless_asked(tmp_path, capsys):
    import dask

    w = dps.Variable(np.zeros(256, np.float32), name="w")  # 1,024 bytes
    ckpt = dps.Checkpoint(w=w)
    with dask.config.set({"daskps.progress-bytes": 1024}):
        ckpt.write(str(tmp_path / "a"))
    assert "saving" in "".join(capsys.readouterr())
    with dask.config.set({"daskps.progress-bytes": 1025}):
        ckpt.write(str(tmp_path / "b"))
    assert "saving" not in "".join(capsys.readouterr())
    ckpt.save(str(tmp_path / "c"), progress=True)
    assert "saving" in "".join(capsys.readouterr())


def test_an_error_while_saving_with_progress_is_raised(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    w = dps.Variable(np.zeros(4, np.float32), name="w")
    with pytest.raises((FileExistsError, NotADirectoryError, ValueError)):
        dps.Checkpoint(w=w).write(str(tmp_path / "file" / "c"), progress=True)


def _spoiled(tmp_path, change):
    """A checkpoint of ``w`` (3 x 2, two pieces by two shards) and a scalar ``s``, its manifest changed by
    ``change(manifest)``; returns its path."""
    import json

    w = dps.ShardedVariable(dps.create_partitioned_variables((3, 2), [2, 1], np.ones((3, 2), np.float32), name="w"),
                            name="w")
    path = dps.Checkpoint(w=w, s=dps.Variable(np.float32(2.0), name="s")).write(str(tmp_path / "c"))
    manifest_file = tmp_path / "c" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(change(manifest) if isinstance(change(manifest), str) else json.dumps(manifest))
    return path


def _set(path, value):
    def change(manifest):
        *keys, last = path
        target = manifest
        for k in keys:
            target = target[k]
        target[last] = value
        return manifest
    return change


def _pieces(transform):
    def change(manifest):
        manifest["tensors"]["w"]["pieces"] = transform(manifest["tensors"]["w"]["pieces"])
        return manifest
    return change


SPOILED = {
    "not JSON": (lambda m: "{", "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
                                "(char 1))"),
    "no tensors": (lambda m: m.pop("tensors") and m, "no 'tensors' mapping"),
    "a negative save_counter": (_set(["save_counter"], -1), "save_counter -1 is not a non-negative int"),
    "no pieces key": (lambda m: m["tensors"]["w"].pop("pieces") and m, "tensor 'w' lacks dtype, shape or pieces"),
    "no dtype": (lambda m: m["tensors"]["w"].pop("dtype") and m, "tensor 'w' lacks dtype, shape or pieces"),
    "an unknown dtype": (_set(["tensors", "w", "dtype"], "nope"), "tensor 'w': dtype 'nope' is not a numpy dtype"),
    "objects": (_set(["tensors", "w", "dtype"], "|O"), "tensor 'w': dtype object / shape [3, 2] cannot be a "
                                                      "variable's"),
    "a negative dimension": (_set(["tensors", "w", "shape"], [-3, 2]),
                             "tensor 'w': dtype float32 / shape [-3, 2] cannot be a variable's"),
    "a shape that is no list": (_set(["tensors", "w", "shape"], "3x2"),
                                "tensor 'w': dtype float32 / shape '3x2' cannot be a variable's"),
    "a mod layout of no shards": (_set(["tensors", "w", "layout"], ["mod", 0]),
                                  "tensor 'w': layout ['mod', 0] is not ['div'] or ['mod', shards]"),
    "another layout": (_set(["tensors", "w", "layout"], ["cyclic"]),
                       "tensor 'w': layout ['cyclic'] is not ['div'] or ['mod', shards]"),
    "a negative step": (_set(["tensors", "w", "step"], -1), "tensor 'w': step -1 is not a non-negative int"),
    "negative steps": (_set(["tensors", "w", "steps"], {"opt": -1}),
                       "tensor 'w': steps {'opt': -1} is not a mapping of optimizer paths to non-negative ints"),
    "steps of no mapping": (_set(["tensors", "w", "steps"], [1]),
                            "tensor 'w': steps [1] is not a mapping of optimizer paths to non-negative ints"),
    "no pieces": (_pieces(lambda p: []), "tensor 'w' has no pieces"),
    "a piece without its file": (_pieces(lambda p: [{k: v for k, v in p[0].items() if k != "file"}, p[1]]),
                                 "tensor 'w': a piece lacks file, offset, rows or shape"),
    "a piece that is no mapping": (_pieces(lambda p: [p[0], 7]),
                                   "tensor 'w': a piece lacks file, offset, rows or shape"),
    "a piece outside the directory": (_pieces(lambda p: [dict(p[0], file="../w.npy"), p[1]]), "tensor 'w': "),
    "a piece of a negative shape": (_pieces(lambda p: [dict(p[0], shape=[2, -2]), p[1]]),
                                    "tensor 'w': piece 'w@0.npy' has shape [2, -2]"),
    "a gap": (_pieces(lambda p: [p[0], dict(p[1], offset=3)]),
              "tensor 'w': piece 'w@2.npy' (offset 3, rows 1, shape [1, 2]) does not follow on at row 2 of [3, 2]"),
    "rows that are not its shape's": (_pieces(lambda p: [dict(p[0], rows=1), p[1]]),
                                      "tensor 'w': piece 'w@0.npy' (offset 0, rows 1, shape [2, 2]) does not follow "
                                      "on at row 0 of [3, 2]"),
    "pieces short of the rows": (_pieces(lambda p: [p[0]]), "tensor 'w': its pieces cover 2 of 3 rows"),
    "a piece of other rows": (_pieces(lambda p: [dict(p[0], shape=[2, 3]), p[1]]),
                              "tensor 'w': piece 'w@0.npy' (offset 0, rows 2, shape [2, 3]) does not follow on at "
                              "row 0 of [3, 2]"),
    "a scalar in two pieces": (lambda m: m["tensors"]["s"]["pieces"].append(m["tensors"]["s"]["pieces"][0]) or m,
                               "tensor 's' is a scalar but its pieces are "),
}


@pytest.mark.parametrize("case", SPOILED)
def test_a_malformed_manifest_is_refused_naming_the_fault_and_changes_nothing(tmp_path, case):
    change, fault = SPOILED[case]
    path = _spoiled(tmp_path, change)
    w = dps.ShardedVariable(dps.create_partitioned_variables((3, 2), [2, 1], np.zeros((3, 2), np.float32), name="w"),
                            name="w")
    s = dps.Variable(np.float32(0.0), name="s")
    with pytest.raises(ValueError) as info:
        dps.Checkpoint(w=w, s=s).read(path)
    text = str(info.value)
    assert text.startswith(f"malformed checkpoint manifest {path}/manifest.json: {fault}"), text
    assert text.endswith("; nothing was changed")
    assert not w.numpy().any() and float(s.numpy()) == 0.0


def test_names_in_a_checkpoint_follow_the_objects_nesting_escaped_as_tensorflow_escapes_them(tmp_path):
    import json

    w, first, second = dps.Variable(np.ones(2, np.float32)), dps.Variable(1.0), dps.Variable(2.0)
    m, opt = dps.metrics.Mean(name="loss"), dps.optimizers.SGD(0.1)
    objects = {"model": {"a.b/c": w, "list": [first, (second,)]}, "m": m, "opt": opt}
    path = dps.Checkpoint(**objects).write(str(tmp_path / "c"))
    names = sorted(json.loads((tmp_path / "c" / "manifest.json").read_text())["tensors"])
    assert names == ["m/count", "m/total", "model/a..b.Sc", "model/list/0", "model/list/1/0", "opt/iterations"]
    for v in (w, first, second):
        v.assign(np.zeros(v.shape, np.float32))
    dps.Checkpoint(**objects).read(path)
    assert w.numpy().tolist() == [1.0, 1.0] and float(first.numpy()) == 1.0 and float(second.numpy()) == 2.0


@pytest.mark.parametrize("objects, message", [
    ({"x": {3: 1}}, "checkpoint keys must be non-empty str, got 3 in 'x'"),
    ({"x": {"": 1}}, "checkpoint keys must be non-empty str, got '' in 'x'"),
    ({"x": 3}, "checkpoint object 'x' is a int; expected a Variable, ShardedVariable, EmbeddingTable, optimizer, "
               "metric, or a dict/list/tuple of them"),
    ({"x": [None, "s"]}, "checkpoint object 'x/0' is a NoneType; expected a Variable, ShardedVariable, "
                         "EmbeddingTable, optimizer, metric, or a dict/list/tuple of them"),
])
def test_what_cannot_be_checkpointed_is_named_by_its_place(objects, message):
    with pytest.raises(TypeError) as info:
        dps.Checkpoint(**objects)
    assert str(info.value) == message


def test_writing_replaces_a_checkpoint_but_never_anything_else(tmp_path):
    target = tmp_path / "c"
    four = dps.ShardedVariable(dps.create_partitioned_variables((4, 2), [4, 1], np.ones((4, 2), np.float32),
                                                                 name="w"), name="w")
    dps.Checkpoint(w=four).write(str(target))
    assert len(list(target.glob("*.npy"))) == 4
    one = dps.Variable(np.full((4, 2), 3.0, np.float32), name="w")
    dps.Checkpoint(w=one).write(str(target))  # the old pieces go
    assert len(list(target.glob("*.npy"))) == 1
    four.assign(np.zeros((4, 2), np.float32))
    dps.Checkpoint(w=four).read(str(target))
    assert (four.numpy() == 3.0).all()
    stray = tmp_path / "notes"
    stray.mkdir()
    (stray / "todo.txt").write_text("mine")
    with pytest.raises(ValueError) as info:
        dps.Checkpoint(w=one).write(str(stray))
    assert str(info.value) == f"{str(stray)!r} exists and is not a daskps checkpoint; refusing to overwrite it"
    assert (stray / "todo.txt").read_text() == "mine"
    fresh = tmp_path / "new" / "deeper"
    dps.Checkpoint(w=one).write(str(fresh))
    assert (fresh / "manifest.json").exists()


@pytest.mark.parametrize("kwargs, kind, message", [
    ({"checkpoint_name": "."}, ValueError,
     "checkpoint_name must be a file name inside the directory (no '/', not '..'), got '.'"),
    ({"checkpoint_name": 3}, TypeError, "checkpoint_name must be a str, got int"),
    ({"keep_checkpoint_every_n_hours": True}, TypeError,
     "keep_checkpoint_every_n_hours must be a positive number or None, got bool"),
    ({"keep_checkpoint_every_n_hours": 0}, ValueError,
     "keep_checkpoint_every_n_hours must be a positive number or None, got 0"),
])
def test_more_manager_arguments_are_refused_word_for_word(tmp_path, kwargs, kind, message):
    w = dps.Variable(np.zeros(2, np.float32), name="w")
    with pytest.raises(kind) as info:
        dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), **kwargs)
    assert str(info.value) == message


def test_checkpoint_numbers_start_at_zero_and_a_trailing_slash_changes_nothing(tmp_path):
    w = dps.Variable(np.zeros(2, np.float32), name="w")
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path) + "/")
    assert manager.save(checkpoint_number=0) == f"{tmp_path}/ckpt-0"
    with pytest.raises(ValueError) as info:
        manager.save(checkpoint_number=-1)
    assert str(info.value) == "checkpoint_number must be a non-negative int or None, got -1"
    assert manager.checkpoints == [f"{tmp_path}/ckpt-0"]


def _rewrite(path, change):
    import json
    import pathlib

    file = pathlib.Path(path) / "manifest.json"
    manifest = json.loads(file.read_text())
    change(manifest)
    file.write_text(json.dumps(manifest))


def test_manifests_written_otherwise_but_well_formed_are_read(tmp_path):
    """Pieces in any order (an empty one before the piece at its offset), only the keys that must be there,
    no save_counter, a mod layout of one shard (the same rows as blocks)."""
    values = np.arange(8, dtype=np.float32).reshape(4, 2)
    parts = [dps.Variable(values[:2], name="w/part_0"), dps.Variable(np.zeros((0, 2), np.float32), name="w/part_1"),
             dps.Variable(values[2:], name="w/part_2")]
    path = dps.Checkpoint(w=dps.ShardedVariable(parts, name="w")).write(str(tmp_path / "c"))

    def bare(layout):
        def change(manifest):
            entry = manifest["tensors"]["w"]
            assert sorted(p["rows"] for p in entry["pieces"]) == [0, 2, 2]
            manifest["tensors"]["w"] = {"dtype": entry["dtype"], "shape": entry["shape"],
                                        "pieces": sorted(entry["pieces"], key=lambda p: -p["rows"]), **layout}
            manifest.pop("save_counter", None)
        return change

    for layout in ({}, {"layout": ["mod", 1]}):
        _rewrite(path, bare(layout))
        target = dps.Variable(np.zeros((4, 2), np.float32), name="w")
        ckpt = dps.Checkpoint(w=target)
        ckpt.restore(path)
        np.testing.assert_array_equal(target.numpy(), values)
        assert ckpt.save_counter == 0
    _rewrite(path, lambda m: m["tensors"]["w"]["pieces"][0].update(offset="4"))
    with pytest.raises(ValueError, match=r"tensor 'w': piece '[^']+' \(offset '4', rows 2"):
        dps.Checkpoint(w=target).read(path)


def test_a_metric_named_with_slashes_keeps_its_state_names(tmp_path):
    import json

    m = dps.metrics.Mean(name="eval/loss")
    m.update_state([2.0, 4.0])
    path = dps.Checkpoint(m=m).write(str(tmp_path / "c"))
    assert sorted(json.loads((tmp_path / "c" / "manifest.json").read_text())["tensors"]) == ["m/count", "m/total"]
    m.reset_state()
    dps.Checkpoint(m=m).read(path)
    assert float(m.result()) == 3.0


def test_tables_and_variables_are_not_restored_from_each_other_and_every_problem_is_listed(tmp_path):
    table = dps.EmbeddingTable(2, initializer=_zeros, name="t")
    opt = dps.optimizers.Adagrad(0.1)
    dps.embedding_lookup(table, np.array([1, 2]))
    opt.apply([dps.IndexedSlices(np.ones((1, 2), np.float32), np.array([1]))], [table])
    v = dps.Variable(np.zeros((3, 2), np.float32), name="v")
    path = dps.Checkpoint(t=table, v=v, a=dps.Variable(1.0), opt=opt).write(str(tmp_path / "c"))
    head = f"cannot restore from {path!r}; nothing was changed:\n  "
    with pytest.raises(ValueError) as info:
        dps.Checkpoint(t=dps.Variable(np.zeros((3, 2), np.float32))).read(path)
    assert str(info.value) == head + (
        "t: the checkpoint holds an EmbeddingTable's rows (by key) there, not a variable\n"
        "  t/.OPTIMIZER_SLOT/opt/accumulator: checkpoint has shape (2, 2), variable has (3, 2)\n"
        "  (in the checkpoint but not asked for: a, opt/iterations, t/.CLOCKS, t/.KEYS, t/.LAST_UPDATED, "
        "t/.LAST_USED, v)")
    with pytest.raises(ValueError) as info:  # three problems, of variables and a table; nothing else unasked
        dps.Checkpoint(a=dps.Variable(np.zeros(2)), t=dps.EmbeddingTable(3, initializer=_zeros, name="t"),
                       v=dps.Variable(np.zeros((4, 2), np.float32)), opt=dps.optimizers.Adagrad(0.1)).read(path)
    assert str(info.value) == head + ("a: checkpoint has shape (), object has (2,)\n"
                                      "  t: checkpoint has rows of [2], embedding table has dim 3\n"
                                      "  v: checkpoint has shape (3, 2), object has (4, 2)")
    var_path = dps.Checkpoint(t=v).write(str(tmp_path / "v"))
    with pytest.raises(ValueError) as info:
        dps.Checkpoint(t=dps.EmbeddingTable(2, initializer=_zeros, name="t")).read(var_path)
    assert str(info.value) == (f"cannot restore from {var_path!r}; nothing was changed:\n  t: the checkpoint lacks "
                               "t/.KEYS, t/.LAST_UPDATED, t/.LAST_USED, t/.CLOCKS (not saved from an EmbeddingTable)")


def test_a_table_slot_saved_with_another_shape_than_its_rows_is_refused_by_name(tmp_path):
    """A checkpoint edited by hand (or written by another tool) whose table slot does not match the
    table's rows: the restore names the slot and both shapes, and changes nothing."""
    import json

    table = dps.EmbeddingTable(2, initializer=_zeros, name="t")
    opt = dps.optimizers.Adagrad(0.1, initial_accumulator_value=0.1)
    dps.embedding_lookup(table, np.array([1, 2]))
    opt.apply([dps.IndexedSlices(np.ones((1, 2), np.float32), np.array([1]))], [table])
    path = dps.Checkpoint(t=table, opt=opt).write(str(tmp_path / "c"))
    manifest_file = tmp_path / "c" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    slot = manifest["tensors"]["t/.OPTIMIZER_SLOT/opt/accumulator"]
    np.save(tmp_path / "c" / slot["pieces"][0]["file"], np.zeros((2, 3), np.float32))
    slot["shape"] = slot["pieces"][0]["shape"] = [2, 3]
    manifest_file.write_text(json.dumps(manifest))

    opt.apply([dps.IndexedSlices(np.ones((2, 2), np.float32), np.array([1, 2]))], [table])
    before = (table.export(), opt.iterations.numpy())
    with pytest.raises(ValueError) as info:
        dps.Checkpoint(t=table, opt=opt).read(path)
    assert str(info.value) == (f"cannot restore from {path!r}; nothing was changed:\n  "
                               "t/.OPTIMIZER_SLOT/opt/accumulator: checkpoint has shape (2, 3), rows have (2, 2)")
    after = (table.export(), opt.iterations.numpy())
    np.testing.assert_array_equal(after[0][0], before[0][0])
    np.testing.assert_array_equal(after[0][1], before[0][1])
    assert after[1] == before[1] == 2


def test_an_empty_shard_in_the_middle_does_not_overwrite_the_next_piece(tmp_path):
    """An empty shard starts where the next one does: its file must not take the next one's name."""
    values = np.arange(8, dtype=np.float32).reshape(4, 2)
    parts = [dps.Variable(values[:2], name="w/part_0"), dps.Variable(np.zeros((0, 2), np.float32), name="w/part_1"),
             dps.Variable(values[2:], name="w/part_2")]
    path = dps.Checkpoint(w=dps.ShardedVariable(parts, name="w")).write(str(tmp_path / "c"))
    assert len(list((tmp_path / "c").glob("*.npy"))) == 3
    target = dps.Variable(np.zeros((4, 2), np.float32), name="w")
    dps.Checkpoint(w=target).read(path)
    np.testing.assert_array_equal(target.numpy(), values)


def test_an_optimizer_nested_in_the_objects_finds_its_slots_and_a_table_does_not_end_the_restore(tmp_path):
    table = dps.EmbeddingTable(2, initializer=_zeros, name="t")
    w = dps.Variable(np.zeros(2, np.float32), name="w")
    opt = dps.optimizers.SGD(0.5, momentum=0.5)
    dps.embedding_lookup(table, np.array([3]))
    g = dps.IndexedSlices(np.ones((1, 2), np.float32), np.array([3]))
    opt.apply([g, np.ones(2, np.float32)], [table, w])  # momentum -0.5 on both
    objects = {"train": {"opt": opt}, "t": table, "w": w}  # w comes after the table
    path = dps.Checkpoint(**objects).write(str(tmp_path / "c"))
    opt.apply([g, np.ones(2, np.float32)], [table, w])
    dps.Checkpoint(**objects).read(path)
    np.testing.assert_array_equal(w.numpy(), [-0.5, -0.5])
    opt.apply([g, np.ones(2, np.float32)], [table, w])  # m = 0.5 * -0.5 - 0.5 = -0.75 from the saved slot
    np.testing.assert_allclose(w.numpy(), [-1.25, -1.25])
    np.testing.assert_allclose(dps.embedding_lookup(table, np.array([3])), [[-1.25, -1.25]])


def test_checkpoints_of_another_name_rotate_too(tmp_path):
    w = dps.Variable(np.zeros(2, np.float32), name="w")
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), max_to_keep=2, checkpoint_name="model")
    paths = [manager.save() for _ in range(3)]
    assert manager.checkpoints == paths[1:] and paths[2] == f"{tmp_path}/model-3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-2", "model-3"]


def test_a_manager_keeps_five_checkpoints_named_ckpt_by_default(tmp_path):
    w = dps.Variable(np.zeros(2, np.float32), name="w")
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path))
    paths = [manager.save() for _ in range(6)]
    assert paths[0] == f"{tmp_path}/ckpt-1" and manager.checkpoints == paths[1:]


class _Finished:
    """A coordinator's count of finished functions, by server generation, as a recovery reads it back."""

    def __init__(self):
        self.done = 0

    def count(self):
        return collections.Counter({0: self.done})


def test_each_save_notes_what_had_finished_then_and_rotation_forgets_dropped_checkpoints(tmp_path):
    w = dps.Variable(np.zeros(2, np.float32))
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), max_to_keep=2)
    finished = _Finished()
    manager.count_finished_with(finished.count)
    paths = []
    for done in (3, 5, 8):
        finished.done = done
        paths.append(manager.save())
    assert manager.finished_at(paths[0]) is None  # rotated away (max_to_keep=2)
    assert manager.finished_at(paths[1]) == collections.Counter({0: 5})  # as counted when it was saved
    assert manager.finished_at(paths[2]) == collections.Counter({0: 8})
    assert manager.finished_at(str(tmp_path / "ckpt-99")) is None


def test_a_bound_counter_is_held_weakly_and_a_plain_function_strongly(tmp_path):
    w = dps.Variable(np.zeros(2, np.float32))
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), max_to_keep=None)
    assert manager.finished_at(manager.save()) is None  # no counter: nothing noted
    finished = _Finished()
    finished.done = 2
    manager.count_finished_with(finished.count)
    first = manager.save()
    del finished
    gc.collect()
    second = manager.save()  # its coordinator is gone: nothing to note
    assert manager.finished_at(first) == collections.Counter({0: 2}) and manager.finished_at(second) is None
    manager.count_finished_with(lambda: collections.Counter({1: 4}))
    gc.collect()
    assert manager.finished_at(manager.save()) == collections.Counter({1: 4})

