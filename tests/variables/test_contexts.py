"""Distribution contexts, without a cluster: the default strategy and helpers."""

import numpy as np
import pytest

import daskps as dps


def test_reduce_op_accepts_strings_in_any_case():
    assert dps.ReduceOp.coerce("sum") is dps.ReduceOp.SUM
    assert dps.ReduceOp.coerce("Mean") is dps.ReduceOp.MEAN
    assert dps.ReduceOp.coerce(dps.ReduceOp.SUM) is dps.ReduceOp.SUM


@pytest.mark.parametrize("bad", ["max", 3, None])
def test_reduce_op_rejects_others(bad):
    with pytest.raises(ValueError, match="reduce_op"):
        dps.ReduceOp.coerce(bad)


def test_default_context_is_a_replica_context():
    assert not dps.has_strategy()
    assert not dps.in_cross_replica_context()
    ctx = dps.get_replica_context()
    assert ctx.replica_id_in_sync_group == 0
    assert ctx.num_replicas_in_sync == 1
    assert ctx.strategy is dps.get_strategy()


def test_default_strategy_runs_in_replica_context():
    strategy = dps.get_strategy()
    assert strategy.run(lambda: dps.get_replica_context().replica_id_in_sync_group) == 0
    assert strategy.num_replicas_in_sync == 1
    assert strategy.experimental_local_results(5) == (5,)


def test_default_scope_enters_cross_replica_context():
    strategy = dps.get_strategy()
    with strategy.scope():
        assert dps.in_cross_replica_context()
        assert dps.get_replica_context() is None
    assert not dps.in_cross_replica_context()


def test_merge_call_runs_in_cross_replica_context():
    strategy = dps.get_strategy()

    def replica_fn():
        ctx = dps.get_replica_context()
        return ctx.merge_call(lambda s, x: (s, dps.in_cross_replica_context(), x), args=(3,))

    s, cross, x = strategy.run(replica_fn)
    assert s is strategy and cross and x == 3


def test_merge_call_rejects_non_callable():
    with pytest.raises(TypeError, match="merge_fn"):
        dps.get_replica_context().merge_call(3)


def test_all_reduce_keeps_structure():
    ctx = dps.get_replica_context()
    out = ctx.all_reduce("sum", {"a": [1.0, 2.0], "b": (3,)})
    np.testing.assert_array_equal(out["a"], [1.0, 2.0])
    assert isinstance(out["b"], tuple) and out["b"] == (3,)
    with pytest.raises(ValueError, match="reduce_op"):
        ctx.all_reduce("prod", 1.0)


def test_default_reduce_with_axis():
    strategy = dps.get_strategy()
    value = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(strategy.reduce("SUM", value, axis=None), value)
    np.testing.assert_array_equal(strategy.reduce("SUM", value, axis=0), [3, 5, 7])
    np.testing.assert_array_equal(strategy.reduce("MEAN", value, axis=1), [1, 4])
    with pytest.raises(ValueError, match="axis"):
        strategy.reduce("SUM", value, axis=2)


def test_gather_checks_axis_and_rank():
    strategy = dps.get_strategy()
    with strategy.scope():
        np.testing.assert_array_equal(strategy.gather(np.ones((1, 2)), axis=1), np.ones((1, 2)))
        with pytest.raises(ValueError, match="axis"):
            strategy.gather(np.ones((1, 2)), axis=2)
        with pytest.raises(ValueError, match="rank"):
            strategy.gather(np.float32(1), axis=0)


def test_distribute_values_from_function():
    strategy = dps.get_strategy()
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)
    )
    assert strategy.experimental_local_results(values) == ((0, 1),)
    with pytest.raises(TypeError, match="value_fn"):
        strategy.experimental_distribute_values_from_function(None)


def test_input_context():
    ctx = dps.InputContext(num_input_pipelines=3, input_pipeline_id=2, num_replicas_in_sync=4)
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (3, 2, 4)
    assert ctx.get_per_replica_batch_size(64) == 16
    with pytest.raises(ValueError, match="global_batch_size"):
        ctx.get_per_replica_batch_size(10)


def test_value_context():
    ctx = dps.ValueContext(replica_id_in_sync_group=2, num_replicas_in_sync=4)
    assert ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync == 0.5


def test_replica_context_rejects_non_integer_id():
    with pytest.raises(ValueError, match="replica_id_in_sync_group"):
        dps.ReplicaContext(dps.get_strategy(), "0")


def test_options_are_frozen_dataclasses():
    import dataclasses

    assert dps.RunOptions().experimental_enable_dynamic_batch_size
    assert dps.InputOptions().experimental_per_replica_buffer_size == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        dps.RunOptions().experimental_enable_dynamic_batch_size = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        dps.InputOptions().experimental_per_replica_buffer_size = 2
