"""daskps: TensorFlow-style parameter-server training on Dask distributed.

The package is layered; each layer imports only those below it:

- ``_core``: numpy only (update checks and maths, optimizer transforms,
  initializers, the checkpoint piece format);
- ``ps``: the parameter server, the protocol that talks to it, server groups
  and the reference counts that keep server-side objects alive;
- ``ui``: reprs, the dashboard page and progress bars;
- ``distribute``: contexts, clusters, partitioners, placement, the strategy;
- ``variables``: ``Variable``, ``ShardedVariable``, embedding lookups;
- ``training``: optimizers, metrics, checkpoints, the sidecar evaluator;
- ``coordinator``: scheduled functions and per-worker datasets.

>>> import daskps as dps
>>> cluster = dps.LocalPSCluster(num_ps=2, num_workers=2)      # doctest: +SKIP
>>> strategy = dps.ParameterServerStrategy(cluster.get_client())  # doctest: +SKIP
>>> coordinator = dps.ClusterCoordinator(strategy)              # doctest: +SKIP
"""

from __future__ import annotations

import daskps._core.config  # noqa: F401  (first: registers the daskps.* config defaults)
from daskps import data, errors, keras, metrics, optimizers, partitioners, summary
from daskps._core.slices import IndexedSlices
from daskps.coordinator.coordinator import ClusterCoordinator, RemoteValue
from daskps.distribute.cluster import DaskClusterResolver, LocalPSCluster
from daskps.distribute.context import (
    ReplicaContext,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from daskps.distribute.strategy import ParameterServerStrategy
from daskps.distribute.values import InputContext, InputOptions, ReduceOp, RunOptions, ValueContext
from daskps.trainer.datasets import PerWorkerDataset, PerWorkerIterator, PerWorkerValues
from daskps.training.checkpoint import Checkpoint
from daskps.training.checkpoint_manager import CheckpointManager
from daskps.training.sidecar import SidecarEvaluator
from daskps.ui.training_progress import progress
from daskps.variables.bags import Bags, PooledSlices, embedding_lookup_sparse
from daskps.variables.embedding import embedding_lookup
from daskps.variables.hashed import EmbeddingTable
from daskps.variables.params import create_variables
from daskps.variables.partitioned import create_partitioned_variables
from daskps.variables.variable import ShardedVariable, Variable, read_values

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name == "torch":  # needs PyTorch: imported on first use
        import importlib

        return importlib.import_module("daskps.torch")
    raise AttributeError(f"module 'daskps' has no attribute {name!r}")

__all__ = [
    "Bags",
    "Checkpoint",
    "CheckpointManager",
    "ClusterCoordinator",
    "DaskClusterResolver",
    "EmbeddingTable",
    "IndexedSlices",
    "InputContext",
    "InputOptions",
    "LocalPSCluster",
    "ParameterServerStrategy",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
    "PooledSlices",
    "ReduceOp",
    "RemoteValue",
    "ReplicaContext",
    "RunOptions",
    "ShardedVariable",
    "SidecarEvaluator",
    "ValueContext",
    "Variable",
    "create_partitioned_variables",
    "create_variables",
    "data",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "errors",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "keras",
    "metrics",
    "optimizers",
    "partitioners",
    "progress",
    "read_values",
    "summary",
]
