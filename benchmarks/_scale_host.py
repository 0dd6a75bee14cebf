"""Many Dask workers in one process, on one event loop: the simulated trainers (or servers) of
``bench_scale.py``.

    python benchmarks/_scale_host.py SCHEDULER_FILE ROLE FIRST COUNT

starts ``COUNT`` workers named ``{ROLE}-{FIRST}`` ... with the resource ``ROLE=1`` (``worker`` for a
trainer, ``ps`` for a server), one thread each, listening on 127.0.0.1, and runs until killed. A real
worker process holds one worker; here a process holds many, so that a 2-core machine can hold hundreds.
Per-process machinery that Dask repeats per worker (the profiler, the system and memory monitors, the
timing of the event loop's ticks) is slowed or off, as it would run once per machine in a real deployment. For the same reason the process imports daskps
before its workers start: on a real cluster every worker process imports it at the first strategy's
start-up, all at once on machines of their own; here the hosts would import it one after another on two
cores, and the strategy's start-up would grow with the number of hosts for that alone.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import dask
from distributed import Worker


async def main(scheduler_file: str, role: str, first: int, count: int) -> None:
    workers = [Worker(scheduler_file=scheduler_file, nthreads=1, name=f"{role}-{first + i}", host="127.0.0.1",
                      resources={role: 1}, dashboard=False) for i in range(count)]
    await asyncio.gather(*(w.start() for w in workers))
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await asyncio.gather(*(w.close(timeout=5) for w in workers), return_exceptions=True)


if __name__ == "__main__":
    import daskps.client.worker_state  # noqa: F401  (see above: what a strategy's start-up has every worker load)
    import daskps.server.actor  # noqa: F401
    dask.config.set({
        "distributed.worker.profile.enabled": False,
        "distributed.admin.system-monitor.interval": "10s",
        "distributed.worker.memory.monitor-interval": "10s",
        "distributed.admin.tick.interval": "1s",  # each worker timing the one event loop they share, every 20 ms
    })
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
