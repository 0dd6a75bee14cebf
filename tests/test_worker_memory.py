"""Workers' ``malloc``: arrays of a step's sizes come from the heap, not from fresh pages each time.

Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_``, which keeps glibc's mmap
threshold at 128 KiB: every larger array would be mapped, faulted in page by
page, and unmapped when freed. daskps' worker plugin raises the threshold
(``daskps.worker-mmap-threshold``). Counted here with the kernel's own
minor-fault counter while a worker makes and drops 2 MiB arrays.
"""

import sys

import dask
import pytest

import daskps as dps

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


def _faults_per_array():
    import resource

    import numpy as np

    for _ in range(5):
        np.ones(1 << 18)  # 2 MiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        a = np.ones(1 << 18)
        del a
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50


def _faults(threshold):
    with dask.config.set({"daskps.worker-mmap-threshold": threshold}):
        with dps.LocalPSCluster(num_ps=1, num_workers=1) as cluster, cluster.get_client() as client:
            with dps.ParameterServerStrategy(client):
                return client.run(_faults_per_array)


def test_a_strategy_keeps_step_sized_arrays_on_the_heap():
    faults = _faults("32MiB")
    assert len(faults) == 2 and all(f < 16 for f in faults.values()), faults  # a 2 MiB array is 512 pages


def test_zero_leaves_malloc_as_dask_set_it():
    faults = _faults(0)
    assert len(faults) == 2 and all(f > 256 for f in faults.values()), faults  # each array faulted in afresh


@pytest.mark.parametrize("bad", ["lots", "-5MiB", -1, "4GiB", None, True])
def test_a_bad_threshold_is_refused_naming_the_key(client, bad):
    with dask.config.set({"daskps.worker-mmap-threshold": bad}):
        with pytest.raises(ValueError, match="daskps.worker-mmap-threshold"):
            dps.ParameterServerStrategy(client)
    with dps.ParameterServerStrategy(client) as strategy:  # nothing was left half made
        with strategy.scope():
            assert dps.Variable(1.0).numpy() == 1.0
