"""daskps: TensorFlow-style parameter-server training on Dask distributed.

>>> import daskps as dps
>>> cluster = dps.LocalPSCluster(num_ps=2, num_workers=2)      # doctest: +SKIP
>>> strategy = dps.ParameterServerStrategy(cluster.get_client())  # doctest: +SKIP
>>> coordinator = dps.ClusterCoordinator(strategy)              # doctest: +SKIP
"""

from __future__ import annotations

from daskps import errors, metrics, optimizers, partitioners
from daskps.checkpoint import Checkpoint, CheckpointManager
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
from daskps.indexed_slices import IndexedSlices
from daskps.partitioners import create_partitioned_variables
from daskps.progress import progress
from daskps.sharding import ShardedVariable, embedding_lookup
from daskps.sidecar import SidecarEvaluator
from daskps.strategy import ParameterServerStrategy
from daskps.variables import Variable, read_values

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "ClusterCoordinator",
    "DaskClusterResolver",
    "IndexedSlices",
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
    "ShardedVariable",
    "SidecarEvaluator",
    "ValueContext",
    "Variable",
    "create_partitioned_variables",
    "embedding_lookup",
    "errors",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "metrics",
    "optimizers",
    "partitioners",
    "progress",
    "read_values",
]
