"""What the cluster holds, for people: text and HTML summaries for Jupyter.

Each summary draws a plain view (:mod:`daskps._core.views`) that the object
shown made of itself: the servers' numbers were asked for by the domain code,
which waits at most ``daskps.display-timeout`` (1 s) for each server, so a
slow or lost server shows as such instead of hanging the notebook. Importing
this module registers the drawers.
"""

from __future__ import annotations

import html
from typing import Any

from dask.utils import format_bytes

from daskps._core import views
from daskps._core.views import CoordinatorView, EmbeddingTableView, ShardedView, StrategyView, VariableView
from daskps.scheduler.quantities import bytes_held, server_name


def _rows(view: StrategyView) -> list[dict[str, Any]]:
    return [{"task": r.task, "device": r.device, "address": r.address, "status": r.status, **(r.stats or {})}
            for r in view.servers]


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def strategy_html(view: StrategyView) -> str:
    rows = []
    for r in _rows(view):
        if r["status"] == "ok":
            rows.append([server_name(r), r["address"], r["variables"], format_bytes(bytes_held(r)),
                         f"{r['reads']:,}", f"{r['updates']:,}", "ok"])
        else:
            rows.append([server_name(r), r["address"], "", "", "", "", r["status"]])
    trainers = [[f"worker {i}", name, addr] for i, (name, addr) in enumerate(view.trainers)]
    link = view.dashboard_link
    return (
        f"<div><strong>ParameterServerStrategy</strong> &mdash; {len(view.servers)} parameter servers, "
        f"{len(trainers)} trainers &mdash; dashboard: <a href='{html.escape(link)}' target='_blank'>"
        f"{html.escape(link)}</a>"
        + _table(["server", "address", "variables", "bytes", "reads", "updates", "state"], rows)
        + _table(["trainer", "worker name", "address"], trainers)
        + "</div>"
    )


def strategy_text(view: StrategyView) -> str:
    lines = [view.title, f"dashboard: {view.dashboard_link}"]
    for r in _rows(view):
        if r["status"] == "ok":
            lines.append(f"  {server_name(r)} {r['address']}: {r['variables']} variables, "
                         f"{format_bytes(bytes_held(r))}, {r['reads']:,} reads, {r['updates']:,} updates")
        else:
            lines.append(f"  {server_name(r)} {r['address']}: {r['status']}")
    lines += [f"  worker {i}: {name} {addr}" for i, (name, addr) in enumerate(view.trainers)]
    return "\n".join(lines)


def variable_html(v: VariableView) -> str:
    rows = [[v.name, v.shape, v.dtype, format_bytes(v.nbytes), v.device, v.address]]
    return "<div><strong>daskps.Variable</strong>" + _table(
        ["name", "shape", "dtype", "bytes", "device", "address"], rows) + "</div>"


def sharded_html(sv: ShardedView) -> str:
    rows = [[v.name, span, format_bytes(v.nbytes), v.device, v.address] for v, span in sv.shards]
    return (
        f"<div><strong>daskps.ShardedVariable</strong> {html.escape(sv.name)} shape={sv.shape} "
        f"dtype={sv.dtype} ({format_bytes(sv.nbytes)} in {len(rows)} shards)"
        + _table(["shard", "rows", "bytes", "device", "address"], rows) + "</div>"
    )


def embedding_table_html(table: EmbeddingTableView) -> str:
    """An EmbeddingTable: its settings, and per server the rows it holds and what came and went."""
    rows = [[device, address, *(f"{counts[f]:,}" for f in ("rows", "admitted", "evicted", "dropped", "pending"))]
            for device, address, counts in table.parts]
    return (
        f"<div><strong>daskps.EmbeddingTable</strong> {html.escape(table.name)} dim={table.dim} "
        f"dtype={table.dtype} {html.escape(table.rules)}"
        + _table(["device", "address", "rows held", "admitted", "evicted", "gradient rows dropped", "pending keys"],
                 rows) + "</div>"
    )


def coordinator_html(view: CoordinatorView) -> str:
    """A coordinator's ``summary()`` as HTML."""
    s = view.summary
    rows = [[s["scheduled"], s["in_flight"], s["done"], s["failed"], s["cancelled"], f"{s['per_second']:.1f}"]]
    error = "" if s["last_error"] is None else f"<div>last error: <code>{html.escape(s['last_error'])}</code></div>"
    return (
        "<div><strong>ClusterCoordinator</strong>"
        + _table(["scheduled", "in flight", "done", "failed", "cancelled", "done/s"], rows) + error + "</div>"
    )


views.draw(StrategyView, html=strategy_html, text=strategy_text)
views.draw(VariableView, html=variable_html)
views.draw(ShardedView, html=sharded_html)
views.draw(EmbeddingTableView, html=embedding_table_html)
views.draw(CoordinatorView, html=coordinator_html)
