"""Checkpoints: servers write their own shards, the manifest commits, restores reshard."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import fsspec
import numpy as np
import pytest
from distributed import Client
from fsspec.implementations.memory import MemoryFileSystem

import daskps as dps
from tests.helpers.checkpoints import build, train, values
from tests.helpers.variables import calls
from tests.helpers.waiting import wait_until


def test_save_and_restore_round_trip(client, tmp_path):
    strategy, *model = build(client, 2)
    train(*model, steps=3)
    table, dense, opt, loss = model
    ckpt = dps.Checkpoint(model={"table": table, "dense": dense}, opt=opt, metrics=[loss])
    before_saves = calls(strategy, "save")
    path = ckpt.save(str(tmp_path / "ckpt"))
    assert path == str(tmp_path / "ckpt-1") and ckpt.save_counter == 1
    assert [b - a for a, b in zip(before_saves, calls(strategy, "save"))] == [1, 1]  # each server wrote its own
    saved = values(*model)
    train(*model, steps=2)
    ckpt.restore(path)
    got = values(*model)
    np.testing.assert_array_equal(got[0], saved[0])
    np.testing.assert_array_equal(got[1], saved[1])
    assert got[2:] == saved[2:]


@pytest.mark.parametrize("restore_shards", [1, 2, 3])
def test_restore_into_other_shard_counts_with_slots(client, tmp_path, restore_shards):
    """Save with 2 shards, restore into 1, 2 or 3; training then continues exactly as it would have."""
    _, *model = build(client, 2)
    train(*model, steps=3)
    table, dense, opt, loss = model
    path = dps.Checkpoint(table=table, dense=dense, opt=opt, loss=loss).write(str(tmp_path / "c"))
    train(*model, steps=2, seed=7)  # the reference continuation
    want = values(*model)

    _, *other = build(client, restore_shards, seed=99)
    t2, d2, o2, l2 = other
    assert (len(t2.variables) if isinstance(t2, dps.ShardedVariable) else 1) == restore_shards
    dps.Checkpoint(table=t2, dense=d2, opt=o2, loss=l2).restore(path)
    train(*other, steps=2, seed=7)
    got = values(*other)
    np.testing.assert_allclose(got[0], want[0], atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], atol=1e-6)
    assert got[2:] == want[2:]


def test_restore_into_local_variables(client, tmp_path):
    _, table, dense, opt, loss = build(client, 3)
    path = dps.Checkpoint(t=table, d=dense).write(str(tmp_path / "c"))
    t, d = dps.Variable(np.zeros((12, 3), np.float32)), dps.Variable(np.zeros(3, np.float32))
    dps.Checkpoint(t=t, d=d).read(path)
    np.testing.assert_array_equal(t.numpy(), np.asarray(table))
    np.testing.assert_array_equal(d.numpy(), dense.numpy())


def test_mismatched_objects_are_listed_and_nothing_changes(client, tmp_path):
    _, table, dense, opt, loss = build(client, 2)
    path = dps.Checkpoint(table=table, dense=dense).write(str(tmp_path / "c"))
    _, t2, d2, _, _ = build(client, 2, seed=5)
    wrong = dps.Variable(np.zeros((4,), np.float32))
    before = np.asarray(t2).copy()
    with pytest.raises(ValueError) as info:
        dps.Checkpoint(table=t2, dense=wrong, extra=d2).restore(path)
    message = str(info.value)
    assert "dense: checkpoint has shape (3,), object has (4,)" in message
    assert "extra: not in the checkpoint" in message and "nothing was changed" in message
    np.testing.assert_array_equal(np.asarray(t2), before)


def test_an_optimizer_made_outside_the_scope_is_refused_for_server_variables(client, tmp_path):
    strategy, table, dense, opt, loss = build(client, 2)
    train(table, dense, opt, loss, 2)
    path = dps.Checkpoint(table=table, dense=dense, opt=opt).write(str(tmp_path / "c"))
    outside = dps.optimizers.Adam(0.1)  # outside strategy.scope(): its state stays in this process
    before = values(table, dense, opt, loss)
    refused = (r"cannot restore from '.+'; nothing was changed: optimizer 'opt' \('.+'\) has slots for '(table|dense)', "
               r"which lives on .+, but the optimizer was created outside strategy.scope\(\) and keeps its state "
               r"in this process only; create it inside the scope")
    with pytest.raises(ValueError) as info:
        dps.Checkpoint(table=table, dense=dense, opt=outside).restore(path)
    assert re.fullmatch(refused, str(info.value)), str(info.value)
    # Found also behind objects without slots (a metric) and an optimizer with none for these variables.
    with strategy.scope():
        unused = dps.optimizers.SGD(0.1, momentum=0.9)
    path = dps.Checkpoint(loss=loss, first=unused, table=table, dense=dense, opt=opt).write(str(tmp_path / "d"))
    with pytest.raises(ValueError) as info:
        dps.Checkpoint(loss=loss, first=unused, table=table, dense=dense, opt=outside).restore(path)
    assert re.fullmatch(refused, str(info.value)), str(info.value)
    after = values(table, dense, opt, loss)
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)


def test_restore_needs_a_committed_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="no manifest.json"):
        dps.Checkpoint(v=dps.Variable([1.0])).restore(str(tmp_path / "nothing"))


def test_write_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a daskps checkpoint"):
        dps.Checkpoint(v=dps.Variable([1.0])).write(str(tmp_path))
    assert (tmp_path / "notes.txt").exists()


def test_unsupported_objects_are_refused():
    with pytest.raises(TypeError, match="'model/x' is a str"):
        dps.Checkpoint(model={"x": "hello"})


def test_manager_numbers_keeps_and_restores(client, tmp_path):
    _, table, dense, opt, loss = build(client, 2)
    ckpt = dps.Checkpoint(table=table, opt=opt)
    manager = dps.CheckpointManager(ckpt, str(tmp_path), max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.restore_or_initialize() is None
    for _ in range(3):
        train(table, dense, opt, loss, steps=1)
        manager.save()
    assert manager.checkpoints == [str(tmp_path / "ckpt-2"), str(tmp_path / "ckpt-3")]
    assert not (tmp_path / "ckpt-1").exists()
    saved = np.asarray(table).copy()
    train(table, dense, opt, loss, steps=1)
    fresh = dps.Checkpoint(table=table, opt=opt)
    again = dps.CheckpointManager(fresh, str(tmp_path), max_to_keep=2)
    assert again.restore_or_initialize() == str(tmp_path / "ckpt-3")
    np.testing.assert_array_equal(np.asarray(table), saved)
    assert fresh.save_counter == 3 and again.save().endswith("ckpt-4")
    called = []
    dps.CheckpointManager(dps.Checkpoint(t=table), str(tmp_path / "empty"), init_fn=lambda: called.append(1)).restore_or_initialize()
    assert called == [1]


class FlakyMemory(MemoryFileSystem):
    """In-memory files; writing a file whose name contains 'boom' fails."""

    protocol = "flakymem"

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol("memory://" + path[len("flakymem://"):] if path.startswith("flakymem://") else path)

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode and "boom" in path:
            raise OSError(f"disk full while writing {path}")
        return super()._open(path, mode, **kwargs)


@pytest.fixture(scope="module")
def threaded():
    """Workers as threads of this process, so in-memory filesystems are shared."""
    with dps.LocalPSCluster(num_ps=2, num_workers=1, processes=False) as cluster, Client(cluster) as client:
        yield client


@pytest.mark.cluster
def test_memory_filesystem(threaded):
    _, table, dense, opt, loss = build(threaded, 2)
    manager = dps.CheckpointManager(dps.Checkpoint(table=table, dense=dense), "memory://daskps-test/run")
    path = manager.save()
    assert path == "memory://daskps-test/run/ckpt-1" and manager.latest_checkpoint == path
    assert fsspec.filesystem("memory").exists("/daskps-test/run/ckpt-1/manifest.json")
    saved = np.asarray(table).copy()
    table.assign(np.zeros((12, 3), np.float32))
    manager.restore_or_initialize()
    np.testing.assert_array_equal(np.asarray(table), saved)


@pytest.mark.cluster
def test_failed_save_leaves_previous_checkpoint_whole_and_unlisted(threaded):
    fsspec.register_implementation("flakymem", FlakyMemory, clobber=True)
    strategy = dps.ParameterServerStrategy(threaded)
    with strategy.scope():
        fine = dps.Variable(np.ones(4, np.float32), name="fine")
        boom = dps.Variable(np.ones(4, np.float32), name="boom")
    assert fine.device != boom.device
    ckpt = dps.Checkpoint(fine=fine, ok=boom)
    manager = dps.CheckpointManager(ckpt, "flakymem://run")
    manager.save()
    fine.assign(np.full(4, 2, np.float32))
    failing = dps.CheckpointManager(dps.Checkpoint(fine=fine, boom=boom), "flakymem://run")
    with pytest.raises(OSError, match="disk full"):
        failing.save()
    fs = FlakyMemory()
    assert fs.exists("/run/ckpt-2/fine@0.npy")  # one server finished its part...
    assert not fs.exists("/run/ckpt-2/manifest.json")  # ...but nothing was committed
    assert manager.checkpoints == ["flakymem://run/ckpt-1"]
    manager.restore_or_initialize()
    assert fine.numpy().tolist() == [1, 1, 1, 1]


KILLED_SAVE = textwrap.dedent('''
    import sys, time
    import numpy as np
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
    import daskps as dps

    class SlowLocal(LocalFileSystem):
        protocol = "slowfile"
        def _open(self, path, mode="rb", **kwargs):
            if "w" in mode and path.endswith(".npy"):
                time.sleep(3)  # a large shard takes a while to write
            return super()._open(path, mode, **kwargs)

    if __name__ == "__main__":
        fsspec.register_implementation("slowfile", SlowLocal, clobber=True)
        with dps.LocalPSCluster(num_ps=2, num_workers=1, processes=False) as cluster:
            strategy = dps.ParameterServerStrategy(
                cluster.get_client(), variable_partitioner=dps.partitioners.FixedShardsPartitioner(2))
            with strategy.scope():
                w = dps.Variable(np.ones((8, 2), np.float32), name="w")
            manager = dps.CheckpointManager(dps.Checkpoint(w=w), sys.argv[1])
            manager.save()
            w.assign(np.full((8, 2), 5, np.float32))
            print("saving", flush=True)
            manager.save()
            print("saved", flush=True)
''')


@pytest.mark.cluster
def test_coordinator_killed_during_save(tmp_path):
    script = tmp_path / "killed_save.py"
    script.write_text(KILLED_SAVE)
    directory = tmp_path / "ckpts"
    proc = subprocess.Popen([sys.executable, str(script), f"slowfile://{directory}"], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "saving"
        wait_until(lambda: (directory / 'ckpt-2').exists(), 30,
                   failure="the second save never started", interval=0.05, collect=False)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert (directory / "ckpt-1" / "manifest.json").exists()
    assert not (directory / "ckpt-2" / "manifest.json").exists()
    w = dps.Variable(np.zeros((8, 2), np.float32))
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(directory))
    assert manager.checkpoints == [str(directory / "ckpt-1")]
    manager.restore_or_initialize()
    assert w.numpy().tolist() == np.ones((8, 2)).tolist()
    assert manager.save().endswith("ckpt-2")  # the unfinished one is replaced


def test_keys_with_slashes_and_dots_as_tensorflow_allows(client, tmp_path):
    strategy = dps.ParameterServerStrategy(client)
    with strategy.scope():
        kernel, bias = dps.Variable([1.0, 2.0]), dps.Variable([3.0])
        other = dps.Variable([4.0])
    ckpt = dps.Checkpoint(model={"dense/kernel": kernel, "dense.bias": bias, "dense": {"kernel": other}})
    path = ckpt.write(str(tmp_path / "c"))
    names = set(json.loads((tmp_path / "c" / "manifest.json").read_text())["tensors"])
    assert {"model/dense.Skernel", "model/dense..bias", "model/dense/kernel"} <= names  # no collision
    kernel.assign([0.0, 0.0])
    other.assign([0.0])
    ckpt.restore(path)
    assert kernel.numpy().tolist() == [1.0, 2.0] and other.numpy().tolist() == [4.0]
