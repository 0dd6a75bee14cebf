"""Reprs for Jupyter: live state from the servers, never a long wait."""

from __future__ import annotations

import time

import dask.config
import numpy as np
import pytest

import daskps as dps
from tests.helpers.cluster import kill_worker, wait_for_summary


def test_strategy_html_lists_servers_trainers_and_dashboard(strategy):
    with strategy.scope():
        held = [dps.Variable(np.zeros(1000, np.float32), name="big"),  # dropped variables are freed
                dps.Variable(np.zeros(10, np.float32), name="small")]
    page = strategy._repr_html_()
    for ps in strategy.servers:
        assert ps.address in page
    assert page.count("<tr>") == 2 + 2 + 2  # headers + 2 servers + 2 trainers
    assert strategy.client.dashboard_link in page and "3.91 kiB" in page
    del held
    text = strategy.summary()
    assert "ps-0" in text and "ps-1" in text and "worker 1: worker-1 tcp://127.0.0.1:" in text


def test_variable_and_sharded_variable_html(strategy):
    with strategy.scope():
        v = dps.Variable(np.zeros((4, 2), np.float32), name="v")
        parts = [dps.Variable(np.zeros((3, 2), np.float32), name=f"t/part_{i}") for i in range(2)]
    page = v._repr_html_()
    assert "(4, 2)" in page and v.handle.server.address in page
    sv_page = dps.ShardedVariable(parts, name="t")._repr_html_()
    assert "t/part_1" in sv_page and "3:6" in sv_page and parts[1].handle.server.address in sv_page
    assert "this process" in dps.Variable([1.0])._repr_html_()


def test_coordinator_html_counts_and_last_error(strategy, coordinator):
    before = coordinator.summary()  # the coordinator is shared: count what this test adds
    for _ in range(5):
        coordinator.schedule(lambda: None)
    coordinator.join()
    coordinator.schedule(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        coordinator.join()
    page = coordinator._repr_html_()
    summary = coordinator.summary()
    assert (summary["done"] - before["done"], summary["failed"] - before["failed"], summary["in_flight"]) == (5, 1, 0)
    assert "ZeroDivisionError" in page and "done/s" in page
    assert f"<td>{summary['done']}</td><td>{summary['failed']}</td>" in page  # the counts, in their columns


def _boom():
    raise ValueError("boom")


def test_summary_rate_is_done_functions_per_second_since_the_coordinator_began(strategy):
    """``per_second`` divides what finished by the time since the coordinator was made; ``last_error`` is the
    error's repr, and ``None`` (not the text) before any."""
    start = time.monotonic()
    coordinator = dps.ClusterCoordinator(strategy)
    made = time.monotonic()
    first = coordinator.summary()
    assert (first["done"], first["per_second"], first["since_join"], first["last_error"]) == (0, 0.0, 0, None)
    for _ in range(6):
        coordinator.schedule(lambda: None)
    coordinator.join()
    coordinator.schedule(_boom)
    wait_for_summary(coordinator, lambda s: s["failed"] >= 1, 30)
    asked = time.monotonic()
    s = coordinator.summary()
    answered = time.monotonic()
    assert (s["done"], s["failed"], s["since_join"], s["last_error"]) == (6, 1, 1, "ValueError('boom')")
    assert 6 / (answered - start) <= s["per_second"] <= 6 / (asked - made)
    with pytest.raises(ValueError, match="boom"):
        coordinator.join()


def test_coordinator_repr_counts_what_it_scheduled_and_how_each_ended(strategy, coordinator):
    assert repr(coordinator) == "<ClusterCoordinator scheduled=0 pending=0 done=0 failed=0 cancelled=0>"
    for _ in range(3):
        coordinator.schedule(lambda: None)
    coordinator.join()  # (scheduled together, the error could cancel some: a trainer may fail first)
    coordinator.schedule(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        coordinator.join()
    assert repr(coordinator) == "<ClusterCoordinator scheduled=4 pending=0 done=3 failed=1 cancelled=0>"
    for _ in range(40):
        coordinator.schedule(time.sleep, args=(0.05,))
    pending = coordinator.cancel()
    assert pending > 0
    s = coordinator.summary()
    assert repr(coordinator) == (f"<ClusterCoordinator scheduled=44 pending={s['in_flight']} done={s['done']} "
                                 f"failed=1 cancelled={s['cancelled']}>")
    assert s["cancelled"] > 0 and s["done"] + s["cancelled"] + s["in_flight"] == 43


def _third_fails(i):
    time.sleep(0.01)
    if i == 2:
        raise ValueError("the third")
    return i


def test_the_counts_match_how_each_function_ended_after_a_failure(coordinator):
    """Functions after the failing one in its batch are cancelled (they never ran), as are those queued."""
    values = [coordinator.schedule(_third_fails, args=(i,)) for i in range(40)]
    with pytest.raises(ValueError):
        coordinator.join()
    ended = {"done": 0, "failed": 0, "cancelled": 0}
    for v in values:
        try:
            v.fetch()
            ended["done"] += 1
        except ValueError:
            ended["failed"] += 1
        except dps.errors.CancelledError:
            ended["cancelled"] += 1
    assert ended["failed"] == 1 and ended["cancelled"] > 0, ended
    assert repr(coordinator) == (f"<ClusterCoordinator scheduled=40 pending=0 done={ended['done']} failed=1 "
                                 f"cancelled={ended['cancelled']}>")


def test_lost_server_shows_as_such_without_hanging(fresh_cluster):
    cluster, client = fresh_cluster
    strategy = dps.ParameterServerStrategy(client)
    kill_worker(client, "ps-1")
    with dask.config.set({"daskps.display-timeout": "5s"}):  # the killed one refuses at once
        page = strategy._repr_html_()  # returns (pytest-timeout would catch a hang)
    assert "unreachable" in page and page.count("unreachable") == 1
    assert strategy.servers[0].address in page
