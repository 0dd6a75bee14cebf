"""SidecarEvaluator evaluates new checkpoints as training writes them."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from distributed import Client, get_worker

import daskps as dps
from tests.helpers.waiting import wait_until


def evaluate(path: str) -> dict:
    w = dps.Variable(np.zeros(3, np.float32))
    dps.Checkpoint(w=w).read(path)
    try:
        where = get_worker().name
    except ValueError:
        where = "local"
    return {"total": float(w.numpy().sum()), "where": where, "pid": os.getpid()}


@pytest.fixture(scope="module")
def with_evaluator():
    with dps.LocalPSCluster(num_ps=1, num_workers=1, num_evaluators=1) as cluster, Client(cluster) as client:
        yield client


@pytest.mark.cluster
def test_evaluates_each_new_checkpoint_on_the_evaluator_worker(with_evaluator, tmp_path):
    strategy = dps.ParameterServerStrategy(with_evaluator)
    with strategy.scope():
        w = dps.Variable(np.zeros(3, np.float32))
    manager = dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path), max_to_keep=None)
    lines = []
    sidecar = dps.SidecarEvaluator(evaluate, str(tmp_path), with_evaluator, until=30, poll_interval=0.05,
                                   timeout=60, log=lines.append).start()
    for step in (10, 20, 30):
        w.assign_add(np.ones(3, np.float32))
        manager.save(checkpoint_number=step)
        while len(sidecar.results) < step // 10 and sidecar.thread.is_alive():
            threading.Event().wait(0.02)  # let it see each one before the next
    results = sidecar.join(timeout=60)
    assert [p.rsplit("-", 1)[1] for p, _ in results] == ["10", "20", "30"]
    assert [m["total"] for _, m in results] == [3.0, 6.0, 9.0]
    assert {m["where"] for _, m in results} == {"evaluator-0"}
    assert "sidecar: ckpt-30: total=9" in lines[-1]


def test_evaluates_locally_without_an_evaluator_and_stops_after_max(tmp_path):
    w = dps.Variable(np.ones(3, np.float32))
    dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path)).save()
    results = dps.SidecarEvaluator(evaluate, str(tmp_path), max_evaluations=1, poll_interval=0.01).run()
    assert results[0][1]["where"] == "local" and results[0][1]["pid"] == os.getpid()


def test_timeout_and_argument_checks(tmp_path):
    with pytest.raises(TimeoutError, match="no new checkpoint"):
        dps.SidecarEvaluator(evaluate, str(tmp_path), timeout=0.1, poll_interval=0.02).run()
    with pytest.raises(ValueError, match="never stops"):
        dps.SidecarEvaluator(evaluate, str(tmp_path))
    with pytest.raises(TypeError, match="eval_fn"):
        dps.SidecarEvaluator("nope", str(tmp_path), until=1)


def count_ids(path: str, batches) -> dict:
    """Metrics from every batch of the pass: which ids came, in how many batches, where."""
    ids = [b["id"] for b in batches]
    try:
        where = get_worker().name
    except ValueError:
        where = "local"
    seen = np.concatenate(ids)
    return {"n": len(seen), "distinct": len(np.unique(seen)), "sum": int(seen.sum()), "batches": len(ids),
            "where": where, "path": path}


def _in_memory(keys, dask_scheduler=None) -> list:
    """Which of ``keys`` a worker still holds (run on the scheduler: ``Client.who_has`` takes futures, not keys)."""
    return [k for k, where in dask_scheduler.get_who_has(keys).items() if where]


@pytest.mark.cluster
def test_evaluates_a_from_dask_dataset_on_the_evaluator_reading_every_row_once(with_evaluator, tmp_path):
    import dask.dataframe as dd
    import pandas as pd

    w = dps.Variable(np.ones(3, np.float32))
    dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path)).save()
    frame = dd.from_pandas(pd.DataFrame({"id": np.arange(10_000)}), npartitions=7)
    data = dps.data.from_dask(frame, batch_size=256, shuffle=True, seed=1)
    sidecar = dps.SidecarEvaluator(count_ids, str(tmp_path), with_evaluator, max_evaluations=1, poll_interval=0.01,
                                   data=data)
    (path, metrics), = sidecar.run()
    assert metrics == {"n": 10_000, "distinct": 10_000, "sum": 10_000 * 9_999 // 2, "batches": 40,
                       "where": "evaluator-0", "path": f"{tmp_path}/ckpt-1"}
    assert path == f"{tmp_path}/ckpt-1"
    # Persisted on the evaluator: every partition lives there.
    name = sidecar.published_dataset
    held = with_evaluator.who_has([f for fs in with_evaluator.get_dataset(name) for f in fs])
    evaluator = next(a for a, w in with_evaluator.scheduler_info()["workers"].items() if w["name"] == "evaluator-0")
    assert held and all(list(where) == [evaluator] for where in held.values()), (held, evaluator)
    # Dropping the evaluator releases the partitions it persisted and published.
    import gc

    del sidecar
    gc.collect()
    wait_until(lambda: not (name in with_evaluator.list_datasets() or with_evaluator.run_on_scheduler(_in_memory, list(held))), 20,
               failure="the sidecar's data was not released", interval=0.1, collect=False)


def test_evaluates_a_from_dask_dataset_here_without_an_evaluator(client, tmp_path):
    import dask.array as da

    w = dps.Variable(np.ones(3, np.float32))
    dps.CheckpointManager(dps.Checkpoint(w=w), str(tmp_path)).save()
    x = da.arange(1000, chunks=300)

    def total(path, batches):
        got = list(batches)
        return {"sum": int(sum(b.sum() for b in got)), "sizes": [len(b) for b in got], "path": path}

    data = dps.data.from_dask(x, batch_size=128, epochs=2, drop_remainder=True)
    (_, metrics), = dps.SidecarEvaluator(total, str(tmp_path), client, max_evaluations=1, poll_interval=0.01,
                                         data=data).run()
    assert metrics["sizes"] == [128] * 14  # 7 whole batches an epoch, batched across partition ends
    assert metrics["sum"] == 2 * sum(range(896))
    assert metrics["path"] == f"{tmp_path}/ckpt-1"


def test_data_arguments_are_checked(client, tmp_path):
    import dask.array as da

    x = da.arange(10, chunks=5)
    with pytest.raises(TypeError, match=r"data must be made by dps.data.from_dask\(...\), got Array"):
        dps.SidecarEvaluator(count_ids, str(tmp_path), client, max_evaluations=1, data=x)
    with pytest.raises(ValueError, match="data needs client"):
        dps.SidecarEvaluator(count_ids, str(tmp_path), max_evaluations=1, data=dps.data.from_dask(x, batch_size=2))
    with pytest.raises(ValueError, match="data must have a number of epochs"):
        dps.SidecarEvaluator(count_ids, str(tmp_path), client, max_evaluations=1,
                             data=dps.data.from_dask(x, batch_size=2, epochs=None))
