"""daskps on the scheduler's Prometheus endpoint: ``/metrics``, beside Dask's own metrics.

Dask's scheduler serves ``/metrics`` (with ``prometheus_client`` installed:
``pip install ".[prometheus]"`` in the checkout) from ``prometheus_client``'s default
registry. The scheduler plugin registers one :class:`DaskPSCollector` there
(once per process), so a scrape also gets daskps' series, named under Dask's
namespace (``distributed.dashboard.prometheus.namespace``, ``dask``):
``dask_daskps_...``. Every series has a ``scheduler`` label (the scheduler's
address: a process may run more than one).

The values are what the plugin last heard: each parameter server's
``stats()``, asked every ``daskps.metrics-interval`` while there are servers;
each coordinator's counts, sent by the coordinator at most twice a second
(counts held back by that go half a second later); each checkpoint written, as it is written.
:data:`METRICS` lists every series.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import dask.config

from daskps._core import views
from daskps.client.group import strategy_token
from daskps.scheduler.quantities import bytes_held, server_name

# (name after the prefix, kind, labels besides "scheduler", help)
METRICS = [
    ("server_bytes", "gauge", ("server", "address", "strategy"), "Bytes of values and optimizer slots a parameter server holds"),
    ("server_variables", "gauge", ("server", "address", "strategy"), "Variables and shards a parameter server holds"),
    ("server_reads", "counter", ("server", "address", "strategy"), "Values (whole or rows) a parameter server has sent"),
    ("server_updates", "counter", ("server", "address", "strategy"), "Updates and gradients a parameter server has applied"),
    ("server_bytes_sent", "counter", ("server", "address", "strategy"), "Bytes of values a parameter server has sent"),
    ("server_bytes_received", "counter", ("server", "address", "strategy"),
     "Bytes a parameter server has received: read indices (row ids, bags), updates and gradients"),
    ("server_messages", "counter", ("server", "address", "strategy"), "Messages a parameter server has answered"),
    ("server_up", "gauge", ("server", "address", "strategy"), "1 if the parameter server answered the last look, else 0"),
    ("functions_scheduled", "counter", ("strategy",), "Functions a coordinator has scheduled"),
    ("functions_completed", "counter", ("strategy",), "Scheduled functions that completed"),
    ("functions_failed", "counter", ("strategy",), "Scheduled functions that failed for good (raised to join())"),
    ("functions_cancelled", "counter", ("strategy",), "Scheduled functions cancelled before they ran"),
    ("functions_rerun", "counter", ("strategy",), "Scheduled functions queued again after a parameter server was lost"),
    ("functions_in_flight", "gauge", ("strategy",), "Scheduled functions not finished yet"),
    ("recoveries", "counter", ("strategy",), "Lost parameter servers re-created and restored"),
    ("trainer_functions_completed", "counter", ("trainer",), "Scheduled functions a trainer completed"),
    ("trainer_functions_failed", "counter", ("trainer",), "Scheduled functions that failed for good on a trainer"),
    ("trainer_functions_rerun", "counter", ("trainer",),
     "Scheduled functions that failed on a trainer as a parameter server was lost, and were queued again"),
    ("checkpoint_saves", "counter", (), "Checkpoints written"),
    ("checkpoint_save_seconds", "counter", (), "Seconds spent writing checkpoints, in all"),
    ("checkpoint_last_save_seconds", "gauge", (), "Seconds the latest checkpoint took to write"),
    ("checkpoint_bytes", "counter", (), "Bytes of values written to checkpoints"),
]


def prefix() -> str:
    namespace = dask.config.get("distributed.dashboard.prometheus.namespace")
    return f"{namespace}_daskps_" if namespace else "daskps_"


class DaskPSCollector:
    """A ``prometheus_client`` collector over every daskps scheduler plugin of this process."""

    def __init__(self) -> None:
        self.plugins: weakref.WeakSet[Any] = weakref.WeakSet()

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        start = prefix()
        families = {}
        for name, kind, extra, text in METRICS:
            make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            families[name] = make(start + name, text, labels=["scheduler", *extra])
        for plugin in list(self.plugins):
            scheduler = getattr(plugin.scheduler, "address", "") or ""
            for row in plugin.telemetry.server_snapshot:
                labels = [scheduler, server_name(row), row["address"], strategy_token(row["key"])]
                families["server_up"].add_metric(labels, 0.0 if "error" in row else 1.0)
                if "error" in row:
                    continue
                families["server_bytes"].add_metric(labels, bytes_held(row))
                families["server_variables"].add_metric(labels, row["num_variables"])
                families["server_reads"].add_metric(labels, row["reads"])
                families["server_updates"].add_metric(labels, row["updates"])
                families["server_bytes_sent"].add_metric(labels, row["bytes_read"])
                families["server_bytes_received"].add_metric(labels, row["bytes_received"])
                families["server_messages"].add_metric(labels, row["messages"])
            for token, stats in plugin.reports.coordinator_stats.items():
                labels = [scheduler, token]
                for name, field in (("functions_scheduled", "scheduled"), ("functions_completed", "done"),
                                    ("functions_failed", "failed"), ("functions_cancelled", "cancelled"),
                                    ("functions_rerun", "rerun"), ("functions_in_flight", "in_flight"),
                                    ("recoveries", "recoveries")):
                    families[name].add_metric(labels, stats.get(field, 0))
            for trainer, counts in plugin.reports.trainer_counts().items():
                families["trainer_functions_completed"].add_metric([scheduler, trainer], counts.completed)
                families["trainer_functions_failed"].add_metric([scheduler, trainer], counts.failed)
                families["trainer_functions_rerun"].add_metric([scheduler, trainer], counts.rerun)
            saves = plugin.telemetry.checkpoint_saves
            families["checkpoint_saves"].add_metric([scheduler], saves["count"])
            families["checkpoint_save_seconds"].add_metric([scheduler], saves["seconds"])
            families["checkpoint_bytes"].add_metric([scheduler], saves["bytes"])
            if saves["count"]:
                families["checkpoint_last_save_seconds"].add_metric([scheduler], saves["last_seconds"])
        yield from families.values()


_COLLECTOR: list[DaskPSCollector] = []  # this process's, once registered


def register(plugin: Any) -> bool:
    """Have ``plugin``'s numbers on this process's ``/metrics``; False without ``prometheus_client``."""
    try:
        import prometheus_client
    except ImportError:
        return False
    if not _COLLECTOR:
        collector = DaskPSCollector()
        prometheus_client.REGISTRY.register(collector)
        _COLLECTOR.append(collector)
    _COLLECTOR[0].plugins.add(plugin)
    return True


def unregister(plugin: Any) -> None:
    """``plugin``'s scheduler is closing: its numbers leave ``/metrics``."""
    if _COLLECTOR:
        _COLLECTOR[0].plugins.discard(plugin)


class _OnScheduler(views.SchedulerExtra):
    """Registered in :data:`daskps._core.views.SCHEDULER_EXTRAS`: the plugin's numbers join and leave ``/metrics``."""

    def start(self, plugin: Any) -> None:
        register(plugin)

    def close(self, plugin: Any) -> None:
        unregister(plugin)


views.SCHEDULER_EXTRAS.append(_OnScheduler())
