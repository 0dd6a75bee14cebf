"""Every optimizer, option and schedule against numbers Keras 3 computed itself.

The fixture is made by ``tests/fixtures/make_keras_optimizer_fixtures.py``
(Keras 3 on JAX); no Keras is needed here. The full matrix runs on local
variables; a representative subset runs on a real cluster, sharded variables
included (so clipping before the split and per-shard state are checked).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import daskps as dps
from tests.helpers.paths import ROOT, TESTS
from tests.helpers.variables import sharded

FIXTURE = np.load(TESTS / "fixtures" / "keras_optimizer_fixtures.npz")
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


def test_a_checkpoint_keeps_the_step_schedules_and_nadam_count_on(strategy, tmp_path):
    """Save after 2 steps, train on, restore, redo steps 3-5: Keras' numbers again (the count was restored)."""
    case = "AdamW-polynomial_cycle"
    starts, grads, after = dense_case(case)
    with strategy.scope():
        opt = make("AdamW", DENSE[case]["kwargs"])
        variables = [dps.Variable(s) for s in starts]
    for i in range(2):
        opt.apply(grads[i], variables)
    path = dps.Checkpoint(v=variables, opt=opt).write(str(tmp_path / "c"))
    for i in range(2, STEPS):
        opt.apply(grads[i], variables)
    dps.Checkpoint(v=variables, opt=opt).restore(path)
    for i in range(2, STEPS):
        opt.apply(grads[i], variables)
    for j, v in enumerate(variables):
        np.testing.assert_allclose(v.numpy(), after[-1][j], rtol=0, atol=ATOL)


def test_the_transform_resent_to_a_recreated_server_carries_the_schedule(strategy):
    with strategy.scope():
        opt = dps.optimizers.Nadam(schedule("cosine_warmup"), clipnorm=1.0)
    recipes = {r.recipe for r in opt.handles}
    assert len(recipes) == 1
    from daskps.server import ops

    recipe = recipes.pop()
    assert isinstance(recipe, ops.AddOptimizer) and recipe.transform.learning_rate == schedule("cosine_warmup")


def test_a_pickled_optimizer_keeps_its_clipping():
    import pickle

    opt = dps.optimizers.Lion(clipvalue=0.25)
    again = pickle.loads(pickle.dumps(opt))
    assert (again.clipvalue, again.clipnorm, again.global_clipnorm) == (0.25, None, None)
    v = dps.Variable(np.zeros(2, np.float32))
    again.apply([np.array([10.0, -10.0], np.float32)], [v])
    np.testing.assert_allclose(v.numpy(), [-0.001, 0.001], rtol=1e-6)


def test_clipping_runs_in_scheduled_functions_too(strategy, coordinator):
    with strategy.scope():
        opt = dps.optimizers.SGD(1.0, clipnorm=1.0)
        w = dps.Variable(np.zeros(2, np.float32))
    coordinator.schedule(lambda: opt.apply([np.array([3.0, 4.0], np.float32)], [w]))
    coordinator.join()
    np.testing.assert_allclose(w.numpy(), [-0.6, -0.8], rtol=1e-6)


# -- learning_rate, weight-decay exclusions ----------------------------------------------------


def test_learning_rate_with_a_schedule_is_its_value_at_iterations(strategy):
    with strategy.scope():
        opt = dps.optimizers.SGD(dps.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5))
        w = dps.Variable(np.zeros(1, np.float32))
    assert opt.learning_rate == pytest.approx(0.1)
    for _ in range(2):
        opt.apply([np.ones(1, np.float32)], [w])
    assert opt.learning_rate == pytest.approx(0.025)
    np.testing.assert_allclose(w.numpy(), [-0.15], rtol=1e-6)
    with pytest.raises(TypeError, match="LearningRateSchedule"):
        opt.learning_rate = 0.5
    opt.learning_rate = dps.optimizers.schedules.PiecewiseConstantDecay([0], [1.0, 2.0])  # reaches the servers
    opt.apply([np.ones(1, np.float32)], [w])  # w's step 2: past the boundary
    np.testing.assert_allclose(w.numpy(), [-2.15], rtol=1e-6)
    assert "ExponentialDecay" not in repr(opt) and "PiecewiseConstantDecay" in repr(opt)


def test_a_number_may_replace_a_number_on_every_server(strategy):
    with strategy.scope():
        opt = dps.optimizers.RMSprop(0.1, rho=0.0)
        w = dps.Variable(np.zeros(1, np.float32))
    opt.learning_rate = 0.5
    opt.apply([np.full(1, 3.0, np.float32)], [w])
    np.testing.assert_allclose(w.numpy(), [-0.5], rtol=1e-5)
    assert opt.learning_rate == 0.5


def test_exclude_from_weight_decay_by_variable_and_by_name(strategy):
    """Excluded variables move as without weight decay; the others as with it (sharded tables by shard name)."""
    start = np.ones((4, 2), np.float32)
    with strategy.scope():
        opt = dps.optimizers.AdamW(0.1, weight_decay=0.5)
        kept, by_var = dps.Variable(start, name="kernel"), dps.Variable(start, name="other")
    bias = sharded(strategy, start, [2, 2], name="dense/bias")
    opt.exclude_from_weight_decay(var_list=[by_var], var_names=["bias"])
    ref_decay, ref_plain = dps.optimizers.AdamW(0.1, weight_decay=0.5), dps.optimizers.Adam(0.1)
    want_decay, want_plain = dps.Variable(start), dps.Variable(start)
    g = np.full((4, 2), 0.5, np.float32)
    for _ in range(2):
        opt.apply([g, g, g], [kept, by_var, bias])
        ref_decay.apply([g], [want_decay])
        ref_plain.apply([g], [want_plain])
    np.testing.assert_allclose(kept.numpy(), want_decay.numpy(), atol=ATOL)
    np.testing.assert_allclose(by_var.numpy(), want_plain.numpy(), atol=ATOL)
    np.testing.assert_allclose(bias.numpy(), want_plain.numpy(), atol=ATOL)
    assert not np.allclose(want_decay.numpy(), want_plain.numpy())


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_it, arg", [
    (lambda: dps.optimizers.Ftrl(learning_rate_power=0.5), "learning_rate_power"),
    (lambda: dps.optimizers.Ftrl(initial_accumulator_value=-1.0), "initial_accumulator_value"),
    (lambda: dps.optimizers.Ftrl(l1_regularization_strength=-1.0), "l1_regularization_strength"),
    (lambda: dps.optimizers.Ftrl(l2_regularization_strength=-1.0), "l2_regularization_strength"),
    (lambda: dps.optimizers.Ftrl(l2_shrinkage_regularization_strength=-0.1), "l2_shrinkage_regularization_strength"),
    (lambda: dps.optimizers.Ftrl(beta=-0.1), "beta"),
    (lambda: dps.optimizers.Lion(beta_1=0.0), "beta_1"),
    (lambda: dps.optimizers.Lion(beta_2=1.5), "beta_2"),
    (lambda: dps.optimizers.Nadam(beta_2=1.0), "beta_2"),
    (lambda: dps.optimizers.Adamax(beta_1=-0.1), "beta_1"),
    (lambda: dps.optimizers.RMSprop(rho=2.0), "rho"),
    (lambda: dps.optimizers.RMSprop(momentum=-0.5), "momentum"),
    (lambda: dps.optimizers.AdamW(weight_decay=None), "weight_decay"),
    (lambda: dps.optimizers.SGD(weight_decay=-1.0), "weight_decay"),
    (lambda: dps.optimizers.Adam(clipnorm=0.0), "clipnorm"),
    (lambda: dps.optimizers.Adam(clipvalue=-1.0), "clipvalue"),
    (lambda: dps.optimizers.Adam(global_clipnorm="1"), "global_clipnorm"),
    (lambda: dps.optimizers.Adam(learning_rate="fast"), "learning_rate"),
    (lambda: dps.optimizers.schedules.ExponentialDecay(0.1, decay_steps=0, decay_rate=0.5), "decay_steps"),
    (lambda: dps.optimizers.schedules.PolynomialDecay(0.1, decay_steps=-1), "decay_steps"),
    (lambda: dps.optimizers.schedules.CosineDecay(0.1, 10, warmup_steps=-1), "warmup_steps"),
    (lambda: dps.optimizers.schedules.PiecewiseConstantDecay([1, 2], [0.1, 0.2]), "boundaries"),
])
def test_bad_arguments_name_the_argument(make_it, arg):
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        make_it()


@pytest.mark.parametrize("clip", [{"clipnorm": 1.0, "global_clipnorm": 1.0}, {"clipnorm": 1.0, "clipvalue": 1.0},
                                  {"clipvalue": 1.0, "global_clipnorm": 1.0}])
def test_at_most_one_kind_of_clipping(clip):
    with pytest.raises(ValueError, match="only one of clipnorm, clipvalue and global_clipnorm"):
        dps.optimizers.Adam(**clip)


def test_a_refused_apply_changes_no_state_on_the_servers(strategy):
    """A bad gradient in the middle of training: nothing moves, and steps after it are still Keras' numbers."""
    case = "Nadam-clipnorm"
    starts, grads, after = dense_case(case)
    with strategy.scope():
        opt = make("Nadam", DENSE[case]["kwargs"])
        variables = [dps.Variable(s) for s in starts]
    for i in range(STEPS):
        if i == 2:
            before = [v.numpy() for v in variables]
            with pytest.raises(ValueError, match="shape"):
                opt.apply(grads[i][:2] + [np.ones(7, np.float32)], variables)
            assert all(np.array_equal(v.numpy(), b) for v, b in zip(variables, before))
            assert int(opt.iterations.numpy()) == 2
        opt.apply(grads[i], variables)
    for j, v in enumerate(variables):
        np.testing.assert_allclose(v.numpy(), after[-1][j], rtol=0, atol=ATOL)


def test_a_refused_batch_on_a_server_changes_no_state(strategy):
    """The server checks every gradient before applying any: slots and counts stay as they were."""
    from daskps.client import protocol
    from daskps.server import ops

    starts, grads, after = dense_case("Ftrl-args")
    with strategy.scope():
        opt = make("Ftrl", DENSE["Ftrl-args"]["kwargs"])
        v = dps.Variable(starts[0])
    opt.apply([grads[0][0]], [v])
    work = [(v.handle.key, "dense", grads[1][0]), (v.handle.key, "dense", np.ones(3, np.float32))]
    with pytest.raises(ValueError, match="shape"):
        protocol.call([(v.handle.server, ops.ApplyGradients(opt.server_key, work, None))])
    for i in range(1, STEPS):
        opt.apply([grads[i][0]], [v])
    np.testing.assert_allclose(v.numpy(), after[-1][0], rtol=0, atol=ATOL)


def test_the_docs_optimizers_example_runs_as_written(capsys):
    page = (ROOT / "docs" / "user-guide" / "optimizers.md").read_text()
    section = page.split("\n## Optimizers\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/user-guide/optimizers.md (Optimizers)", "exec"), {})
    assert capsys.readouterr().out.strip() == "0.0001"
