"""Every optimizer, option and schedule against numbers Keras 3 computed itself.

The fixture is made by ``tests/fixtures/make_keras_optimizer_fixtures.py``
(Keras 3 on JAX); no Keras is needed here. The full matrix runs on local
variables; a representative subset runs on a real cluster, sharded variables
included (so clipping before the split and per-shard state are checked).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import daskps as dps
from tests.test_sparse import sharded

FIXTURE = np.load(pathlib.Path(__file__).parent / "fixtures" / "keras_optimizer_fixtures.npz")
MANIFEST = json.loads(str(FIXTURE["manifest"]))
DENSE, SPARSE, SCHEDULES = MANIFEST["dense"], MANIFEST["sparse"], MANIFEST["schedules"]
STEPS = MANIFEST["steps"]
ATOL = 1e-6


def schedule(name: str):
    cls, args = SCHEDULES[name]
    return getattr(dps.optimizers.schedules, cls)(**args)


def make(optimizer: str, kwargs: dict, **extra):
    kw = dict(kwargs)
    if isinstance(kw.get("learning_rate"), dict):
        kw["learning_rate"] = schedule(kw["learning_rate"]["schedule"])
    return getattr(dps.optimizers, optimizer)(**kw, **extra)


def dense_case(case: str) -> tuple[list, list, list]:
    n = sum(1 for k in FIXTURE.files if k.startswith(f"{case}/start"))
    starts = [FIXTURE[f"{case}/start{j}"] for j in range(n)]
    grads = [[FIXTURE[f"{case}/grads{j}"][i] for j in range(n)] for i in range(STEPS)]
    after = [[FIXTURE[f"{case}/after{j}"][i] for j in range(n)] for i in range(STEPS)]
    return starts, grads, after


@pytest.mark.parametrize("case", sorted(DENSE))
def test_dense_steps_match_keras_on_local_variables(case):
    spec = DENSE[case]
    starts, grads, after = dense_case(case)
    opt = make(spec["optimizer"], spec["kwargs"])
    variables = [dps.Variable(s) for s in starts]
    for i in range(STEPS):
        opt.apply(grads[i], variables)
        for j, v in enumerate(variables):
            np.testing.assert_allclose(v.numpy(), after[i][j], rtol=0, atol=ATOL, err_msg=f"step {i}, var {j}")
    assert int(opt.iterations.numpy()) == STEPS


def sparse_case(case: str) -> tuple[np.ndarray, np.ndarray, list, dict]:
    return (FIXTURE[f"{case}/sparse_start"], FIXTURE[f"{case}/sparse_values"], SPARSE[case]["indices"],
            {"dense": FIXTURE[f"{case}/sparse_dense_after"], "lazy": FIXTURE[f"{case}/sparse_lazy_after"]})


@pytest.mark.parametrize("mode", ["lazy", "dense"])
@pytest.mark.parametrize("case", sorted(SPARSE))
def test_sparse_steps_match_keras_on_local_variables(case, mode):
    spec = SPARSE[case]
    start, values, indices, want = sparse_case(case)
    opt = make(spec["optimizer"], spec["kwargs"], lazy_sparse=mode == "lazy")
    table = dps.Variable(start)
    for i in range(STEPS):
        opt.apply([dps.IndexedSlices(values[i], indices)], [table])
        np.testing.assert_allclose(table.numpy(), want[mode][i], rtol=0, atol=ATOL, err_msg=f"step {i}")


CLUSTER_CASES = ["Nadam-args", "Ftrl-args", "RMSprop-args", "AdamW-args", "Lion-weight_decay", "SGD-clipnorm",
                 "Adam-global_clipnorm", "Nadam-clipvalue", "SGD-cosine_warmup", "AdamW-polynomial_cycle"]


@pytest.mark.parametrize("case", CLUSTER_CASES)
def test_dense_steps_match_keras_on_servers_and_shards(strategy, case):
    """Remote variables, and the same values as 2-shard ShardedVariables (their own apply call): both as Keras.

    Clipping sees each sharded gradient whole (global_clipnorm: all three
    together), and every shard keeps its own state and step count.
    """
    spec = DENSE[case]
    starts, grads, after = dense_case(case)
    with strategy.scope():
        opt = make(spec["optimizer"], spec["kwargs"])
        plain = [dps.Variable(s) for s in starts]
    shards = [sharded(strategy, s, [2, len(s) - 2]) for s in starts]
    for i in range(STEPS):
        opt.apply(grads[i], plain)
        opt.apply(grads[i], shards)
        for j in range(len(starts)):
            np.testing.assert_allclose(plain[j].numpy(), after[i][j], rtol=0, atol=ATOL)
            np.testing.assert_allclose(shards[j].numpy(), after[i][j], rtol=0, atol=ATOL)
    assert int(opt.iterations.numpy()) == 2 * STEPS


@pytest.mark.parametrize("mode", ["lazy", "dense"])
@pytest.mark.parametrize("case", ["Nadam-args", "Ftrl-args", "Adam-weight_decay", "Adam-exponential"])
def test_sparse_steps_match_keras_on_sharded_tables(strategy, case, mode):
    spec = SPARSE[case]
    start, values, indices, want = sparse_case(case)
    with strategy.scope():
        opt = make(spec["optimizer"], spec["kwargs"], lazy_sparse=mode == "lazy")
    table = sharded(strategy, start, [3, 3])  # rows 1 and 4 on different shards
    for i in range(STEPS):
        opt.apply([dps.IndexedSlices(values[i], indices)], [table])
    np.testing.assert_allclose(table.numpy(), want[mode][-1], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedules_match_keras(name):
    got = [schedule(name)(s) for s in MANIFEST["schedule_steps"]]
    np.testing.assert_allclose(got, FIXTURE[f"schedule/{name}"], rtol=1e-6, atol=1e-8)
