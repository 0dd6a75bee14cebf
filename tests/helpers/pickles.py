"""An object whose unpickling is counted on the worker that unpickles it."""

from __future__ import annotations

from distributed import get_worker


def _count_unpickle() -> Expensive:
    worker = get_worker()
    worker.daskps_test_unpickles = getattr(worker, "daskps_test_unpickles", 0) + 1
    return Expensive()


class Expensive:
    """Stands for a jitted function or a compiled module: each unpickling is counted on the worker."""

    def __reduce__(self):
        return (_count_unpickle, ())


def _unpickles(dask_worker) -> int:
    return dask_worker.__dict__.pop("daskps_test_unpickles", 0)
