"""Variables made for tests, and the servers' call counts."""

from __future__ import annotations

import numpy as np

import daskps as dps


def sharded(strategy, full: np.ndarray, sizes: list[int], name: str = "sv") -> dps.ShardedVariable:
    """A ShardedVariable with the given rows per shard, shards round robin over the servers."""
    offsets = np.cumsum([0] + sizes)
    with strategy.scope():
        shards = [dps.Variable(full[a:b], name=f"{name}/part_{i}") for i, (a, b) in enumerate(zip(offsets, offsets[1:]))]
    return dps.ShardedVariable(shards, name=name)


def calls(strategy, method: str = "read") -> list[int]:
    return [s["calls"].get(method, 0) for s in strategy.ps_stats()]
