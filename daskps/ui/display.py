"""What the cluster holds, for people: text and HTML summaries for Jupyter.

Every summary reads live state but waits at most ``daskps.display-timeout``
(1 s, Dask config) for each parameter server; a slow or lost server shows as
such instead of hanging the notebook.
"""

from __future__ import annotations

import html
from typing import Any, NamedTuple

from dask.utils import format_bytes

from daskps._core.config import setting
from daskps.ps import protocol
from daskps.ps.quantities import bytes_held, server_name
from daskps.ps.routing import ServerRef


def display_timeout() -> float:
    return setting("display_timeout")


class StrategyView(NamedTuple):
    """What a strategy's displays show: handed over by the strategy, read here."""

    title: str  # its repr
    servers: list[ServerRef]
    group: Any  # the servers' group, to ask them for their stats
    closed: bool
    trainers: list[tuple[str, str]]  # (name, address or "gone") of each trainer, by index
    dashboard_link: str


def server_rows(view: StrategyView) -> list[dict[str, Any]]:
    """One row per parameter server: address, state, variables, bytes, reads, updates."""
    if view.closed:
        return [{"task": ps.task_id, "device": ps.device, "address": ps.address, "status": "closed"}
                for ps in view.servers]
    results = protocol.stats_within(view.servers, view.group, display_timeout())
    rows = []
    for ps, res in zip(view.servers, results):
        row: dict[str, Any] = {"task": ps.task_id, "device": ps.device, "address": ps.address}
        if isinstance(res, BaseException):
            row["status"] = f"unreachable: {type(res).__name__}: {res}"
        else:
            row.update(status="ok", variables=res.num_variables, nbytes=res.nbytes, slot_nbytes=res.slot_nbytes,
                       reads=res.reads, updates=res.updates, bytes_read=res.bytes_read)
        rows.append(row)
    return rows


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def strategy_html(view: StrategyView) -> str:
    rows = []
    for r in server_rows(view):
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
    for r in server_rows(view):
        if r["status"] == "ok":
            lines.append(f"  {server_name(r)} {r['address']}: {r['variables']} variables, "
                         f"{format_bytes(bytes_held(r))}, {r['reads']:,} reads, {r['updates']:,} updates")
        else:
            lines.append(f"  {server_name(r)} {r['address']}: {r['status']}")
    lines += [f"  worker {i}: {name} {addr}" for i, (name, addr) in enumerate(view.trainers)]
    return "\n".join(lines)


def _where(v: Any) -> str:
    server = v.handle.server
    return "this process" if server.is_local else server.address


def variable_html(v: Any) -> str:
    rows = [[v.name, v.shape, v.dtype, format_bytes(v.nbytes), v.device, _where(v)]]
    return "<div><strong>daskps.Variable</strong>" + _table(
        ["name", "shape", "dtype", "bytes", "device", "address"], rows) + "</div>"


def sharded_html(sv: Any) -> str:
    n, offsets = len(sv.variables), sv.row_offsets
    spans = [f"{offsets[i]}:{offsets[i + 1]}" if sv.layout == "div" else f"{i}::{n}" for i in range(n)]
    rows = [[v.name, span, format_bytes(v.nbytes), v.device, _where(v)] for v, span in zip(sv.variables, spans)]
    return (
        f"<div><strong>daskps.ShardedVariable</strong> {html.escape(sv.name)} shape={sv.shape} "
        f"dtype={sv.dtype} ({format_bytes(sv.nbytes)} in {len(rows)} shards)"
        + _table(["shard", "rows", "bytes", "device", "address"], rows) + "</div>"
    )


def embedding_table_html(table: Any) -> str:
    """An EmbeddingTable: its settings, and per server the rows it holds and what came and went."""
    rows = []
    for handle, counts in zip(table.handles, table.stats()):
        server = handle.server
        rows.append([server.device, "this process" if server.is_local else server.address,
                     *(f"{counts[f]:,}" for f in ("rows", "admitted", "evicted", "dropped", "pending"))])
    rules = f"admit_after={table.admit_after} evict_after_steps={table.evict_after_steps} capacity={table.capacity}"
    return (
        f"<div><strong>daskps.EmbeddingTable</strong> {html.escape(table.name)} dim={table.dim} "
        f"dtype={table.dtype} {html.escape(rules)}"
        + _table(["device", "address", "rows held", "admitted", "evicted", "gradient rows dropped", "pending keys"],
                 rows) + "</div>"
    )


def coordinator_html(s: dict[str, Any]) -> str:
    """A coordinator's ``summary()`` as HTML."""
    rows = [[s["scheduled"], s["in_flight"], s["done"], s["failed"], s["cancelled"], f"{s['per_second']:.1f}"]]
    error = "" if s["last_error"] is None else f"<div>last error: <code>{html.escape(s['last_error'])}</code></div>"
    return (
        "<div><strong>ClusterCoordinator</strong>"
        + _table(["scheduled", "in flight", "done", "failed", "cancelled", "done/s"], rows) + error + "</div>"
    )
