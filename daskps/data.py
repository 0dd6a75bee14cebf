"""``dps.data``: Dask DataFrames and Arrays as per-worker input.

See :mod:`daskps.distribute.dask_data` (the collection) and :mod:`daskps.trainer.dask_input` (the trainers).
"""

from __future__ import annotations

from daskps.distribute.dask_data import DaskInput, from_dask

__all__ = ["DaskInput", "from_dask"]
