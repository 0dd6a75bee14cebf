"""SidecarEvaluator evaluates new checkpoints as training writes them."""

from __future__ import annotations

import os

import numpy as np
import pytest
from distributed import Client, get_worker

import daskps as dps


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
        while len(sidecar.results) < step // 10 and sidecar._thread.is_alive():
            sidecar._stop.wait(0.02)  # let it see each one before the next
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
