"""``dps.partitioners``: how many shards a variable is split into.

See :mod:`daskps.distribute.partitioners`.
"""

from __future__ import annotations

from daskps.distribute.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    div_offsets,
    fixed_size_partitioner,
    min_max_variable_partitioner,
    variable_axis_size_partitioner,
)
from daskps.variables.partitioned import create_partitioned_variables

__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "create_partitioned_variables",
    "div_offsets",
    "fixed_size_partitioner",
    "min_max_variable_partitioner",
    "variable_axis_size_partitioner",
]
