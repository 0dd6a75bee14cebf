"""``dps.data``: Dask DataFrames and Arrays as per-worker input.

See :mod:`daskps.coordinator.dask_input`.
"""

from __future__ import annotations

from daskps.coordinator.dask_input import DaskInput, from_dask

__all__ = ["DaskInput", "from_dask"]
