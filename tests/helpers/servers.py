"""What the parameter servers hold, asked on their workers."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from .waiting import wait_until


def _holders_on(keys, dask_worker=None):
    """On a ps worker: who the servers there count as holding each of ``keys`` (absent: not held),
    as ``{"coordinator": n, "trainer": n}`` (a trainer's holder id names its worker: ``...@address``)."""
    from daskps.server.parameter_server import ParameterServer

    out = {}
    for actor in dask_worker.state.actors.values():
        if isinstance(actor, ParameterServer):
            for key in keys:
                held = actor.holders(key)
                if not held:
                    continue
                counts = {}
                for holder, n in held.items():
                    kind = "trainer" if "@" in holder else "coordinator"
                    counts[kind] = counts.get(kind, 0) + n
                out[key] = {kind: n for kind, n in counts.items() if n > 0}
    return out


def holders(client, keys):
    """``{key: {"coordinator": n, "trainer": n}}`` for those of ``keys`` some server still holds."""
    out = {}
    for found in client.run(_holders_on, list(keys)).values():
        out.update(found)
    return out


def wait_for_coordinator_release(client, keys):
    """Wait until the coordinator's releases of ``keys`` have reached their servers (they travel
    asynchronously); return who holds each key then."""
    return wait_until(lambda: (lambda h: h if all("coordinator" not in h.get(k, {}) for k in keys) else None)(
        holders(client, keys)), what=f"the coordinator's release of {keys}")


@contextlib.contextmanager
def serving_end(server, host: str = "127.0.0.1"):
    """A direct channel's serving end for ``server`` (held weakly there: keep it) on an event loop of its
    own; yields ``(address, close)``, and closes it all on the way out."""
    from daskps.server import serving

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    address, close = serving.open_channel(server, host, loop)
    try:
        yield address, close
    finally:
        close()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
