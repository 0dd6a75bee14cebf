"""Clusters: ``LocalPSCluster`` on one machine, ``DaskClusterResolver`` for any.

A daskps cluster is an ordinary Dask cluster whose workers carry a resource
tag: ``ps`` for parameter servers, ``worker`` for trainers. The coordinator is
the user's own process, holding a ``distributed.Client``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

import dask.config
from distributed import Client, Nanny, Scheduler, Security, SpecCluster, Worker
from distributed.core import Status

from daskps._core import views
from daskps._core.config import setting
from daskps.scheduler.quantities import natural_key

__all__ = ["DaskClusterResolver", "LocalPSCluster"]

LOCALHOST = "127.0.0.1"
PRELOAD = "daskps.distribute.worker_preload"


class LocalPSCluster(SpecCluster):
    """A Dask cluster of parameter servers and trainers on this machine.

    Every worker runs in its own process under a ``Nanny`` (a killed worker
    comes back), and every server binds to 127.0.0.1 on a free port.

    Parameters
    ----------
    num_ps : int
        Workers started with resource ``ps=1``, named ``ps-0``, ``ps-1``, ...
    num_workers : int
        Workers started with resource ``worker=1``, named ``worker-0``, ...
    threads_per_worker : int
        Threads per worker process.
    processes : bool
        ``True`` (default) runs each worker in a Nanny-managed process;
        ``False`` runs them as threads in this process (faster to start, but a
        worker cannot be killed on its own).
    num_evaluators : int
        Workers started with resource ``evaluator=1``, named ``evaluator-0``,
        ...: where ``SidecarEvaluator`` runs evaluations.
    memory_limit : str or int, optional
        Passed to every worker.
    security : distributed.Security or bool, optional
        TLS for every connection: the scheduler, every worker and Nanny,
        the clients and the parameter-server traffic (which then goes
        through Dask's encrypted comms). ``True`` makes a temporary
        certificate authority for this cluster (needs ``cryptography``:
        ``pip install ".[tls]"`` in the checkout); a client needs ``cluster.security``
        to connect (``cluster.get_client()`` has it).
    **kwargs
        Passed to ``distributed.SpecCluster`` (``silence_logs``, ``name``, ...).

    Raises
    ------
    RuntimeError
        When made at the top level of a script without
        ``if __name__ == "__main__":``: each worker process imports the
        script again (Dask spawns them), and would start a cluster of its own.

    Examples
    --------
    >>> import daskps as dps
    >>> with dps.LocalPSCluster(num_ps=2, num_workers=2) as cluster:  # doctest: +SKIP
    ...     strategy = dps.ParameterServerStrategy(cluster.get_client())
    """

    def __init__(
        self,
        num_ps: int = 2,
        num_workers: int = 2,
        threads_per_worker: int = 1,
        processes: bool = True,
        num_evaluators: int = 0,
        memory_limit: Any = None,
        dashboard_address: str = f"{LOCALHOST}:0",
        security: Security | bool | None = None,
        **kwargs: Any,
    ):
        if _importing_script_in_worker():
            _leave_worker_process()
        checks = (("num_ps", num_ps, 0), ("num_workers", num_workers, 0),
                  ("threads_per_worker", threads_per_worker, 1), ("num_evaluators", num_evaluators, 0))
        for arg, value, low in checks:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")
        if security is True:
            try:
                security = Security.temporary()
            except ImportError as exc:
                raise ImportError('LocalPSCluster(security=True) needs cryptography: pip install ".[tls]" in '
                                  "the daskps checkout (or pip install cryptography)") from exc
        elif security is False:
            security = None
        if security is not None and not isinstance(security, Security):
            raise TypeError(f"security must be a distributed.Security, True or None, got {type(security).__name__}")
        tls = security is not None and bool(security.require_encryption)
        self.num_ps = num_ps
        self.num_workers = num_workers
        cls = Nanny if processes else Worker
        base: dict[str, Any] = {"nthreads": threads_per_worker, "host": LOCALHOST}
        if security is not None:
            base.update(security=security, protocol="tls://" if tls else None)
        if memory_limit is not None:
            base["memory_limit"] = memory_limit
        if processes:
            base["dashboard_address"] = f"{LOCALHOST}:0"
            base["silence_logs"] = logging.ERROR
            # Ctrl-C reaches the script alone: worker processes ignore SIGINT (the script's close stops them)
            yours = dask.config.get("distributed.worker.preload") or []
            yours = [yours] if isinstance(yours, str) else list(yours)
            base["preload"] = [*yours, PRELOAD]
            argv = dask.config.get("distributed.worker.preload-argv") or []
            if argv and isinstance(argv[0], (list, tuple)):  # one list per preload: ours takes none
                base["preload_argv"] = [*argv, []]

        def spec(resource: str) -> dict[str, Any]:
            return {"cls": cls, "options": {**base, "resources": {resource: 1}}}

        workers = {f"ps-{i}": spec("ps") for i in range(num_ps)}
        workers.update({f"worker-{i}": spec("worker") for i in range(num_workers)})
        workers.update({f"evaluator-{i}": spec("evaluator") for i in range(num_evaluators)})
        scheduler: dict[str, Any] = {
            "cls": Scheduler,
            "options": {"host": LOCALHOST, "port": 0, "dashboard_address": dashboard_address},
        }
        if security is not None:
            scheduler["options"].update(security=security, protocol="tls://" if tls else None)
            kwargs["security"] = security
        kwargs.setdefault("silence_logs", "error")
        for extra in views.CLUSTER_EXTRAS:  # the dashboard's daskps page, before the scheduler starts
            extra.before_start()
        with dask.config.set(_unset(self.quiet_config)):
            _start_explaining_unguarded_script(
                functools.partial(super().__init__, workers=workers, scheduler=scheduler, worker=spec("worker"),
                                  **kwargs))
        for extra in views.CLUSTER_EXTRAS:  # "Daskps" in Dask's own navigation bar, beside Status, Workers, ...
            extra.started(self.scheduler)
        link = self.daskps_link
        if link:  # where to look, at once (stderr: a script's own output stays its own)
            print(f"daskps dashboard: {link}", file=sys.stderr, flush=True)

    @property
    def daskps_link(self) -> str | None:
        """The link to daskps' page of this cluster's servers and trainers (``/individual-daskps``), or
        ``None`` without a dashboard."""
        return daskps_page(self.dashboard_link)

    # Dask's monitors (loop health ticks, resource sampling, memory polling, the statistical
    # profiler sampling each worker every 10 ms) cost a quarter of a core on an idle 2 ps + 2
    # trainer cluster with Dask's defaults (37% with 8 trainers), and a third of that with these.
    # They apply where you have not set the key yourself.
    quiet_config = {
        "distributed.admin.tick.interval": "200ms",
        "distributed.admin.system-monitor.interval": "2s",
        "distributed.worker.memory.monitor-interval": "1s",
        "distributed.worker.profile.interval": "100ms",
        "distributed.worker.profile.cycle": "5s",
    }

    def scale(self, n: int = 0, memory: Any = None, cores: Any = None) -> Any:
        """Dask's ``scale``: ``n`` workers in all, the parameter servers and evaluators counted.

        Workers added are trainers (``worker-N``, resource ``worker=1``); a
        running coordinator gives them work within a second. Scaling down
        removes trainers, the newest first, never a parameter server or an
        evaluator, so ``n`` must be at least their number.
        """
        if self.status in (Status.closing, Status.closed):
            return super().scale(n, memory, cores)  # closing: everything goes
        kept = [name for name, spec in self.worker_spec.items()
                if "worker" not in spec.get("options", {}).get("resources", {})]
        if isinstance(n, bool) or not isinstance(n, int) or n < len(kept):
            raise ValueError(f"n must be an int >= {len(kept)} (the parameter servers and evaluators, which "
                             f"scale never removes), got {n!r}")
        for name in [name for name in self.worker_spec if name not in kept]:
            self.worker_spec[name] = self.worker_spec.pop(name)  # trainers last: Dask removes from the end
        result = super().scale(n, memory, cores)
        self.num_workers = len(self.worker_spec) - len(kept)
        return result

    def _new_worker_name(self, worker_number: int) -> str:
        return f"worker-{worker_number}"

    def __repr__(self) -> str:
        return (
            f"LocalPSCluster({self.scheduler_address!r}, num_ps={self.num_ps}, "
            f"num_workers={self.num_workers})"
        )


# Dask's worker processes are spawned: each one runs the user's script again, as module
# ``__mp_main__``, before it becomes a worker. A script that starts a LocalPSCluster at its top
# level, without ``if __name__ == "__main__":``, starts one in every worker process too, and Dask
# shows that as a wall of tracebacks per worker ending in "Nanny failed to start". Instead the
# worker process leaves a mark and exits quietly, and the user's process, finding the mark, raises
# one error that says what to do.
UNGUARDED_MARK_ENV = "DASKPS_UNGUARDED_SCRIPT_MARK"


def _unguarded_message() -> str:
    # The running script: multiprocessing names it __mp_main__ as well as __main__ in the user's
    # process, and only __mp_main__ while a worker process runs it again.
    script = getattr(sys.modules.get("__mp_main__", sys.modules.get("__main__")), "__file__", None)
    return (
        f"LocalPSCluster was started while a worker process imported your script"
        f"{f' {script}' if script else ''}: Dask starts each worker in a new Python process that runs "
        f"the script's top-level code again. Start the cluster (and everything that uses it) under "
        f'if __name__ == "__main__":'
    )


def _importing_script_in_worker() -> bool:
    """Whether this is a spawned child process still running the user's script as ``__mp_main__``."""
    if multiprocessing.current_process().name == "MainProcess":
        return False
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


def _leave_worker_process() -> NoReturn:
    """Exits a worker process that is running an unguarded script again: quietly when a
    LocalPSCluster in the user's process will explain it, else with the error."""
    mark = os.environ.get(UNGUARDED_MARK_ENV)
    if mark:
        try:
            open(mark, "x").close()
        except FileExistsError:
            pass  # another worker process got there first
        except OSError:
            mark = None  # the user's process will not know: say it here
    if not mark:
        raise RuntimeError(_unguarded_message())
    raise SystemExit(1)


def daskps_page(dashboard_link: str | None) -> str | None:
    """daskps' page on the dashboard at ``dashboard_link`` (Dask's ``.../status``)."""
    if not dashboard_link:
        return None
    base = dashboard_link[: -len("/status")] if dashboard_link.endswith("/status") else dashboard_link.rstrip("/")
    return f"{base}/individual-daskps"


def _start_explaining_unguarded_script(start: Callable[[], None]) -> None:
    """Calls ``start`` and, when a worker process left the mark, raises ``_unguarded_message()``
    instead of Dask's error."""
    mark = os.path.join(tempfile.gettempdir(), f"daskps-unguarded-{uuid.uuid4().hex}")
    previous = os.environ.get(UNGUARDED_MARK_ENV)
    os.environ[UNGUARDED_MARK_ENV] = mark  # inherited by the worker processes spawned meanwhile
    try:
        start()
    except Exception:
        if os.path.exists(mark):
            raise RuntimeError(_unguarded_message()) from None
        raise
    finally:
        if previous is None:
            os.environ.pop(UNGUARDED_MARK_ENV, None)
        else:
            os.environ[UNGUARDED_MARK_ENV] = previous
        with contextlib.suppress(FileNotFoundError):
            os.remove(mark)


def _unset(settings: dict[str, Any]) -> dict[str, Any]:
    """The ``settings`` whose keys still have Dask's default value."""
    defaults = dask.config.merge(*dask.config.defaults)
    return {key: value for key, value in settings.items()
            if dask.config.get(key, None) == dask.config.get(key, None, config=defaults)}


def cluster_workers(client: Client) -> dict[str, dict[str, Any]]:
    """The scheduler's record of every worker, keyed by address, fetched now.

    ``Client.scheduler_info()`` is not used: it fetches into an attribute that
    the client's own two-second refresh overwrites with a worker-less summary,
    so under load it can return no workers at all.
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


class DaskClusterResolver:
    """Finds the parameter servers and trainers of a Dask cluster.

    Workers are told apart by their resources: those with ``ps_resource`` are
    parameter servers, those with ``worker_resource`` are trainers, each listed
    in natural order of worker name (``ps-2`` before ``ps-10``).

    Parameters
    ----------
    client : distributed.Client
    ps_resource, worker_resource : str
        Resource names that tag parameter servers and trainers.

    Examples
    --------
    >>> resolver = DaskClusterResolver(client)  # doctest: +SKIP
    >>> resolver.cluster_spec()                 # doctest: +SKIP
    {'chief': ['tcp://127.0.0.1:50010'], 'ps': [...], 'worker': [...]}
    """

    task_type = "chief"
    task_id = 0
    rpc_layer = "tcp"

    def __init__(self, client: Client, ps_resource: str = "ps", worker_resource: str = "worker"):
        if not isinstance(client, Client):
            raise TypeError(f"client must be a distributed.Client, got {type(client).__name__}")
        for arg, value in (("ps_resource", ps_resource), ("worker_resource", worker_resource)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{arg} must be a non-empty str, got {value!r}")
        if ps_resource == worker_resource:
            raise ValueError(f"ps_resource and worker_resource must differ, both are {ps_resource!r}")
        self.client = client
        self.ps_resource = ps_resource
        self.worker_resource = worker_resource

    def _workers(self, resource: str) -> list[tuple[str, str]]:
        """(name, address) of live workers holding ``resource``, in name order."""
        info = cluster_workers(self.client)
        found = [
            (str(w.get("name", addr)), addr)
            for addr, w in info.items()
            if w.get("resources", {}).get(resource, 0) > 0
        ]
        return sorted(found, key=lambda item: (natural_key(item[0]), item[1]))

    def ps_workers(self) -> list[tuple[str, str]]:
        return self._workers(self.ps_resource)

    def training_workers(self) -> list[tuple[str, str]]:
        return self._workers(self.worker_resource)

    def wait_for_workers(self, timeout: float | None = None, settle: float = 2.0,
                         ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Wait until the cluster has a parameter server and a trainer; ``(ps, trainers)``.

        Workers started beside a scheduler join it over a few seconds, so a
        strategy made at once would find none, or only some. When the first
        look finds both kinds, they are returned at once (a ``LocalPSCluster``
        starts all its workers before it returns). Otherwise this waits for
        both, then until no worker has joined for ``settle`` seconds (so the
        rest of a starting set is found too), all within ``timeout`` seconds
        (config ``daskps.workers-timeout`` when ``None``). Raises
        ``ValueError`` naming the missing resource and the workers that did
        join once the time is up.
        """
        if timeout is None:
            timeout = setting("workers_timeout")
        start = time.monotonic()
        ps, trainers = self.ps_workers(), self.training_workers()
        if ps and trainers:
            return ps, trainers
        told = False
        seen, quiet_since = len(ps) + len(trainers), time.monotonic()
        while True:
            now = time.monotonic()
            if ps and trainers and now - quiet_since >= settle:
                return ps, trainers
            if now - start >= timeout:
                break
            if not told and now - start >= 1.0:
                print(f"daskps: waiting up to {timeout:g} s (daskps.workers-timeout) for workers with "
                      f"resources {self.ps_resource!r} and {self.worker_resource!r} to join "
                      f"{self.client.scheduler.address}", file=sys.stderr, flush=True)
                told = True
            time.sleep(0.2)
            ps, trainers = self.ps_workers(), self.training_workers()
            if len(ps) + len(trainers) != seen:
                seen, quiet_since = len(ps) + len(trainers), time.monotonic()
        if ps and trainers:  # both came, but workers were still joining when the time ran out
            return ps, trainers
        self._refuse(ps, timeout)

    def _refuse(self, ps: list[tuple[str, str]], timeout: float) -> NoReturn:
        kind, resource = (("training worker", self.worker_resource) if ps
                          else ("parameter server", self.ps_resource))
        joined = cluster_workers(self.client)
        if joined:
            others = ", ".join(f"{w.get('name', addr)} (resources {dict(w.get('resources') or {})})"
                               for addr, w in sorted(joined.items()))
            seen = f"{len(joined)} worker(s) joined: {others}"
        else:
            seen = "no worker joined the scheduler at all"
        raise ValueError(
            f"the cluster has no {kind}: no worker has resource {resource!r} after waiting {timeout:g} s "
            f"(daskps.workers-timeout); {seen}. Start one with `dask worker ADDRESS --resources {resource}=1`"
        )

    def cluster_spec(self) -> dict[str, list[str]]:
        comm = getattr(self.client.scheduler_comm, "comm", None)
        chief = getattr(comm, "local_address", None) or f"client:{self.client.id}"
        return {
            "chief": [chief],
            "ps": [addr for _, addr in self.ps_workers()],
            "worker": [addr for _, addr in self.training_workers()],
        }

    @property
    def num_ps(self) -> int:
        return len(self.ps_workers())

    @property
    def num_workers(self) -> int:
        return len(self.training_workers())

    def __repr__(self) -> str:
        return (
            f"DaskClusterResolver({self.client.scheduler.address!r}, "
            f"ps_resource={self.ps_resource!r}, worker_resource={self.worker_resource!r})"
        )
