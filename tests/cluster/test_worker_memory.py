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

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc"), pytest.mark.cluster]


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


def test_the_heartbeat_failure_of_a_closing_worker_is_not_logged_while_a_running_ones_is():
    """Dask logs a heartbeat cut short by the worker's own close with its traceback; daskps drops that one
    message once its workers are closing, and nothing else."""
    import asyncio
    import logging

    from distributed import Scheduler, Worker

    from daskps.client.worker_state import HEARTBEAT_FAILED, QuietHeartbeatAtClose

    failed = logging.makeLogRecord({"name": "distributed.worker", "msg": HEARTBEAT_FAILED, "levelno": logging.ERROR})
    other = logging.makeLogRecord({"name": "distributed.worker", "msg": "Heartbeat: %s", "levelno": logging.DEBUG})

    async def main():
        quiet = QuietHeartbeatAtClose()
        assert quiet.filter(failed)  # no daskps worker here: Dask's message as it is
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0") as s:
            a = await Worker(s.address, host="127.0.0.1", dashboard_address="127.0.0.1:0", nthreads=1)
            b = await Worker(s.address, host="127.0.0.1", dashboard_address="127.0.0.1:0", nthreads=1)
            quiet.workers.update([a, b])
            assert quiet.filter(failed) and quiet.filter(other)  # running: shown
            await a.close()
            assert quiet.filter(failed)  # b still runs: its heartbeat failing would be news
            await b.close()
            assert not quiet.filter(failed)  # every worker closed: dropped
            assert quiet.filter(other)  # only that message

    asyncio.run(main())


def test_importing_daskps_leaves_dasks_loggers_alone_until_a_worker_sets_up():
    """No import-time side effects: the filter goes on Dask's worker logger in the worker plugin's setup."""
    import subprocess
    import sys

    code = (
        "import logging\n"
        "import daskps\n"
        "from daskps.client.worker_state import _QUIET, DaskPSWorkerPlugin\n"
        "log = logging.getLogger('distributed.worker')\n"
        "assert log.filters == [], log.filters\n"
        "class Worker: pass\n"
        "w = Worker()\n"
        "DaskPSWorkerPlugin().setup(w)\n"
        "DaskPSWorkerPlugin().setup(w)\n"
        "assert log.filters == [_QUIET], log.filters\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
