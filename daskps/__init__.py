"""daskps: TensorFlow-style parameter-server training on Dask distributed.

>>> import daskps as dps
>>> cluster = dps.LocalPSCluster(num_ps=2, num_workers=2)      # doctest: +SKIP
>>> strategy = dps.ParameterServerStrategy(cluster.get_client())  # doctest: +SKIP
>>> coordinator = dps.ClusterCoordinator(strategy)              # doctest: +SKIP
"""

from __future__ import annotations

from daskps import errors
from daskps.cluster import DaskClusterResolver, LocalPSCluster
from daskps.context import (
    InputContext,
    InputOptions,
    ReduceOp,
    ReplicaContext,
    RunOptions,
    ValueContext,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from daskps.coordinator import ClusterCoordinator, RemoteValue
from daskps.datasets import PerWorkerDataset, PerWorkerIterator, PerWorkerValues
from daskps.strategy import ParameterServerStrategy
from daskps.variables import Variable, read_values

__version__ = "0.1.0"

__all__ = [
    "ClusterCoordinator",
    "DaskClusterResolver",
    "InputContext",
    "InputOptions",
    "LocalPSCluster",
    "ParameterServerStrategy",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
    "ReduceOp",
    "RemoteValue",
    "ReplicaContext",
    "RunOptions",
    "ValueContext",
    "Variable",
    "errors",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "read_values",
]
