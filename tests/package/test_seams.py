"""The seams the code is built on: tables behind one server interface, typed operations, errors with
fields, daskps' per-worker state in a Dask WorkerPlugin."""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import numpy as np
import pytest

import daskps as dps
from daskps._core.updates import check_update
from daskps.client import protocol, refs
from daskps.client.worker_state import WORKER_PLUGIN_NAME
from daskps.errors import PartlyAppliedError, PSUnavailableError
from daskps.server import ops
from daskps.server.ops import DenseSpec
from daskps.server.parameter_server import ParameterServer
from daskps.server.tables import Staged, Table


# -- a new kind of table is one class (and its spec) ---------------------------------------------
class RowCountTable(Table):
    """A table of a fixed number of rows that also counts how often each row was read."""

    def __init__(self, name: str, rows: int):
        self.name, self.value, self.reads, self.slots = name, np.zeros(rows), np.zeros(rows, np.int64), {}

    def read(self, index: Any, shared: bool) -> np.ndarray:
        if index is not None:
            np.add.at(self.reads, np.asarray(index), 1)
            return self.value[index].copy()
        return self.value.copy()

    def check_update(self, op: str, payload: Any) -> Any:
        return check_update(self.value.shape, self.value.dtype, self.name, op, payload)

    def apply_update(self, op: str, checked: Any) -> None:
        np.add.at(self.value, checked[0], checked[1]) if op == "scatter_add" else self.value.__setitem__(..., checked)

    def check_gradient(self, kind: str, gradient: Any, optimizer: str) -> tuple[str, Any]:
        raise TypeError(f"{self.name!r} is not trained by optimizers")

    def apply_gradient(self, opt_key: str, transform: Any, checked: tuple[str, Any], lazy_sparse: bool) -> None:
        raise AssertionError("never called: check_gradient refuses")

    def info(self) -> tuple[str, tuple[int, ...], str]:
        return self.name, self.value.shape, "counted"

    def nbytes(self) -> int:
        return int(self.value.nbytes + self.reads.nbytes)

    def save(self, fs: Any, root: str, tensor: str, offset: int, optimizers: Any) -> list:
        return []

    def stage(self, fs: Any, root: str, spec: Any) -> Staged:
        return Staged(self.value.copy(), {})

    def commit(self, staged: Staged, optimizers: Any) -> None:
        self.value = staged.value


class RowCountSpec(NamedTuple):
    rows: int

    def build(self, name: str) -> tuple[Table, bool]:
        return RowCountTable(name, self.rows), False


def test_a_new_table_kind_is_one_class_on_the_server(strategy):
    server = strategy.servers[0]
    made = protocol.create([protocol.table(server, "counted@test", "counted", RowCountSpec(5))], strategy.group)
    assert made == [ops.Created((5,), "counted", False)]
    ref = refs.owned(server, "counted@test", "counted", strategy.group)  # freed when the test drops it

    protocol.update([(ref, "scatter_add", (np.array([1, 1, 4]), np.array([1.0, 2.0, 5.0])))])
    assert protocol.read([(ref, np.array([1, 4, 4]))])[0].tolist() == [3.0, 5.0, 5.0]
    stats = strategy.ps_stats()[0]
    assert stats["variables"]["counted@test"] == ("counted", (5,), "counted")  # the table's own info
    assert stats["nbytes"] >= 5 * 8 + 5 * 8

    with strategy.scope():
        opt = dps.optimizers.SGD(0.1)  # configured on every server, this one included
    with pytest.raises(TypeError, match="not trained by optimizers"):
        protocol.apply_gradients(opt.server_key, [(ref, "dense", np.ones(5))])
    with pytest.raises(ValueError, match="shape"):  # the table's own check; nothing applied
        protocol.update([(ref, "assign", np.ones(4))])
    assert protocol.read([(ref, None)])[0].tolist() == [0.0, 3.0, 0.0, 0.0, 5.0]
    del ref


# -- typed operations ---------------------------------------------------------------------------
def test_operations_are_typed_and_anything_else_is_refused():
    ps = ParameterServer(0)
    ps.execute([ops.Create("k", "w", DenseSpec([1.0, 2.0], dtype="float32"), "me")])
    with pytest.raises(ValueError, match="unknown parameter-server operation"):
        ps.execute([("read", (["k"],))])  # the old string form
    with pytest.raises(ValueError, match="unknown parameter-server operation"):
        ps.execute([ops.Read(["k"]), ops.Isolate(1)])  # Isolate only first in a message
    assert ps.execute([ops.Read(["k"])])[0][0].tolist() == [1.0, 2.0]
    assert ps.stats(ops.Stats()).calls == {"create": 1, "read": 2}  # (the refused message ran its first read)


def test_a_failure_after_isolated_pushes_says_how_each_went():
    ps = ParameterServer(0)
    ps.execute([ops.Create("k", "w", DenseSpec([1.0, 2.0], dtype="float32"), "me")])
    message = [ops.Isolate(2), ops.Update([("k", "add", np.ones(2, np.float32))]),
               ops.Update([("k", "add", np.ones(3, np.float32))]), ops.Read(["missing"])]
    with pytest.raises(PartlyAppliedError) as raised:
        ps.execute(message)
    first, second = raised.value.outcomes
    assert first is None and "shape" in str(second.error)  # the first applied, the second refused
    assert isinstance(raised.value.error, LookupError)
    again = pickle.loads(pickle.dumps(raised.value))  # it travels back from the server by pickle
    assert isinstance(again.error, LookupError) and len(again.outcomes) == 2
    assert ps.execute([ops.Read(["k"])])[0][0].tolist() == [2.0, 3.0]


def test_ps_unavailable_error_keeps_its_fields_through_pickle():
    error = PSUnavailableError("parameter server ps:1 is gone. It held 'w'.", "daskps-ps-1-abc", "ps:1 is gone.")
    again = pickle.loads(pickle.dumps(error))
    assert (again.server_key, again.what, str(again)) == ("daskps-ps-1-abc", "ps:1 is gone.", str(error))
    assert isinstance(again, ConnectionError)


# -- per-worker state ---------------------------------------------------------------------------
def _state_of(dask_worker=None):
    plugin = dask_worker.plugins.get(WORKER_PLUGIN_NAME)
    leftovers = [a for a in vars(dask_worker) if a.startswith("_daskps")]
    return None if plugin is None else sorted(plugin.parts), leftovers


def _read_next(v, it):
    return float(v.numpy()) + next(it)


def test_worker_state_lives_in_a_dask_worker_plugin(client, strategy, coordinator):
    with strategy.scope():
        v = dps.Variable(1.0)
    it = iter(coordinator.create_per_worker_dataset(lambda: iter(range(1000))))
    coordinator.fetch([coordinator.schedule(_read_next, args=(v, it)) for _ in range(8)])
    states = client.run(_state_of)
    assert all(parts is not None and not leftovers for parts, leftovers in states.values()), states
    trainers = set(strategy.cluster_resolver.cluster_spec()["worker"])
    assert any("datasets" in states[a][0] for a in trainers)  # a trainer built its dataset there
    plugins = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.worker_plugins))
    assert plugins.count(WORKER_PLUGIN_NAME) == 1  # one for the cluster, however many strategies


def test_a_worker_that_joins_gets_the_plugin(fresh_cluster):
    cluster, client = fresh_cluster
    dps.ParameterServerStrategy(client)
    cluster.scale(5)  # a third trainer
    client.wait_for_workers(5, timeout=60)
    states = client.run(_state_of)
    assert len(states) == 5 and all(parts is not None for parts, _ in states.values()), states
