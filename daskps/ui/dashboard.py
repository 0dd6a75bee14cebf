"""A page of the Dask dashboard for the parameter servers.

``/individual-daskps`` shows, per parameter server, the bytes it holds, its
variables and shards, and reads and updates per second, and per trainer the
scheduled functions it completed. Because its route starts with
``/individual-``, dask-labextension lists it as a JupyterLab panel.

The page is a Bokeh app of the scheduler's dashboard (it needs ``bokeh``, as
the dashboard does: in the base install), so it must be known
before the scheduler starts:

- ``LocalPSCluster`` adds it itself;
- for a ``dask scheduler`` started by hand, preload this module:
  ``dask scheduler --preload daskps.dashboard``.

The numbers come from the scheduler plugin of :mod:`daskps.scheduler.plugin`, which
``ParameterServerStrategy`` registers: it notes where each server lives,
counts completed functions per trainer and asks every server for its
``stats()`` once a ``daskps.metrics-interval``; the page shows its latest
(it asks the servers nothing itself). The plot pages are in :mod:`daskps.ui.plots`.
"""

from __future__ import annotations

import html
import time
from typing import Any

from dask.utils import format_bytes

from daskps._core.config import setting
from daskps.scheduler.messages import PLUGIN_NAME
from daskps.scheduler.plugin import DaskPSSchedulerPlugin
from daskps.scheduler.quantities import TrainerCounts, bytes_held, natural_key, server_name
from daskps.ui.plots import PAGES, make_app

ROUTE = "/individual-daskps"
NAV_ROUTE = "/daskps"  # the same page inside Dask's own page frame, linked from its navigation bar


def _cell(x: Any) -> str:
    return f"<td style='padding:2px 12px'>{html.escape(str(x))}</td>"


def page_html(rows: list[dict[str, Any]], rates: dict[str, tuple[float, float]], scheduler: Any) -> str:
    """The page body: a servers table and a trainers table."""
    head = "".join(f"<th style='text-align:left;padding:2px 12px'>{h}</th>" for h in (
        "server", "address", "bytes held", "variables", "shards", "reads/s", "updates/s", "state"))
    body = []
    for r in rows:
        if "error" in r:
            cells = [server_name(r), r["address"], "", "", "", "", "", f"unreachable ({r['error']})"]
        else:
            names = [v[0] for v in r.get("variables", {}).values()]
            reads, updates = rates.get(r["key"], (0.0, 0.0))
            cells = [server_name(r), r["address"], format_bytes(bytes_held(r)), r["num_variables"],
                     sum("/part_" in n for n in names), f"{reads:,.1f}", f"{updates:,.1f}", "ok"]
        body.append("<tr>" + "".join(_cell(c) for c in cells) + "</tr>")
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    counts = plugin.reports.trainer_counts() if plugin is not None else {}
    live = {str(ws.name): ws.address for ws in scheduler.workers.values() if ws.resources.get("worker")}
    trainers = []
    for name in sorted(set(live) | set(counts), key=natural_key):  # those gone keep the counts they made
        done, failed, rerun = counts.get(name, TrainerCounts(0, 0, 0))
        trainers.append("<tr>" + "".join(_cell(c) for c in (
            name, live.get(name, "(gone)"), f"{done:,}", f"{failed:,}", f"{rerun:,}")) + "</tr>")
    thead = "".join(f"<th style='text-align:left;padding:2px 12px'>{h}</th>" for h in (
        "trainer", "address", "functions completed", "failed", "re-run"))
    note = "" if rows else "<p>No parameter servers yet: create a ParameterServerStrategy on this cluster.</p>"
    return (
        "<h3>daskps parameter servers</h3>" + note
        + f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        + _hash_tables_html(rows)
        + "<h3>Trainers</h3>"
        + f"<table><thead><tr>{thead}</tr></thead><tbody>{''.join(trainers)}</tbody></table>"
        + f"<p style='color:#777'>updated {time.strftime('%H:%M:%S')}</p>"
    )


def _hash_tables_html(rows: list[dict[str, Any]]) -> str:
    """Each embedding table's part on each server: rows held, admitted, evicted, gradients dropped."""
    fields = ("rows", "admitted", "evicted", "dropped", "pending")
    body = []
    for r in rows:
        for key, counts in sorted(r.get("counts", {}).items()):
            name = r["variables"][key][0] if key in r.get("variables", {}) else key
            cells = [name, server_name(r), *(f"{counts.get(f, 0):,}" for f in fields)]
            body.append("<tr>" + "".join(_cell(c) for c in cells) + "</tr>")
    if not body:
        return ""
    head = "".join(f"<th style='text-align:left;padding:2px 12px'>{h}</th>" for h in (
        "embedding table", "server", "rows held", "admitted", "evicted", "gradient rows dropped", "pending keys"))
    return f"<h3>Embedding tables</h3><table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def daskps_doc(scheduler: Any, extra: Any, doc: Any) -> None:
    """The Bokeh document behind ``/individual-daskps``."""
    from bokeh.models import Div  # type: ignore[attr-defined]

    div = Div(text=page_html([], {}, scheduler), sizing_mode="stretch_width")
    previous: dict[str, tuple[float, int, int]] = {}  # server -> (its uptime, reads, updates) when last shown
    shown: list[Any] = [None]

    async def refresh() -> None:
        plugin = scheduler.plugins.get(PLUGIN_NAME)
        rows = plugin.telemetry.server_snapshot if plugin is not None else []  # the plugin asks the servers, once a tick
        if rows is shown[0]:
            return  # nothing new since the last refresh
        shown[0] = rows
        if plugin is not None and plugin.places.servers and not rows:  # opened before the plugin's first look
            rows = await plugin.places.stats(scheduler.rpc, setting("display_timeout"))
        rates = {}
        for r in rows:
            if "error" in r:
                continue
            then, reads0, updates0 = previous.get(r["key"], (r["uptime"], r["reads"], r["updates"]))
            dt = r["uptime"] - then
            rates[r["key"]] = ((r["reads"] - reads0) / dt, (r["updates"] - updates0) / dt) if dt > 0 else (0.0, 0.0)
            previous[r["key"]] = (r["uptime"], r["reads"], r["updates"])
        div.text = page_html(rows, rates, scheduler)

    doc.title = "daskps: parameter servers"
    doc.add_root(div)
    doc.add_next_tick_callback(refresh)
    doc.add_periodic_callback(refresh, 1000)


def daskps_nav_doc(scheduler: Any, extra: Any, doc: Any) -> None:
    """``/daskps``: the page of ``/individual-daskps`` in Dask's frame, with its navigation bar.

    Dask's ``individual-`` pages are bare (for JupyterLab panels); the pages
    its bar links to (Status, Workers, ...) render in its ``simple.html``.
    """
    from distributed.dashboard.components.scheduler import env

    daskps_doc(scheduler, extra, doc)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)


def add_to_navigation(scheduler: Any) -> bool:
    """Put "Daskps" into the navigation bar of ``scheduler``'s dashboard, beside Status, Workers, ...

    Dask builds the bar's list once per scheduler (``template_variables``,
    memoized) and every page renders from that same list, so adding to it
    shows the link on every page from the next load on. False when the
    scheduler has no dashboard or started before :func:`register_page`.
    """
    try:
        from distributed.dashboard.scheduler import applications, template_variables
    except ImportError:
        return False
    if NAV_ROUTE not in applications or getattr(scheduler, "http_application", None) is None:
        return False
    pages = template_variables(scheduler).get("pages")
    if not isinstance(pages, list):
        return False
    name = NAV_ROUTE.strip("/")
    if name not in pages:
        pages.append(name)
    return True


def register_page() -> bool:
    """Add the page to the dashboard of schedulers started after this call; False without bokeh."""
    try:
        from distributed.dashboard.scheduler import applications
    except ImportError:
        return False
    applications.setdefault(ROUTE, daskps_doc)
    applications.setdefault(NAV_ROUTE, daskps_nav_doc)
    for route, page in PAGES.items():
        applications.setdefault(route, make_app(page))
    return True


# ``dask scheduler --preload daskps.dashboard``: the import adds the page...
register_page()


def dask_setup(scheduler: Any) -> None:
    """...and this adds the plugin and the navigation bar's link when the scheduler starts."""
    if PLUGIN_NAME not in scheduler.plugins:
        scheduler.add_plugin(DaskPSSchedulerPlugin(scheduler), name=PLUGIN_NAME)
    add_to_navigation(scheduler)

