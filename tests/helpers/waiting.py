"""Waiting in tests: a condition polled until it holds, a call run in a thread with a time limit."""

from __future__ import annotations

import gc
import threading
import time


def wait_until(check, timeout: float = 20.0, what: str = "condition"):
    """Poll ``check()`` until it is truthy (releases travel asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        value = check()
        if value or time.monotonic() > deadline:
            assert value, f"{what} not reached in {timeout}s"
            return value
        time.sleep(0.05)


def in_thread(fn, timeout):
    """Run ``fn`` in a daemon thread; return ('ok', value), ('raised', exc) or ('blocked', None)."""
    out = {}

    def target():
        try:
            out["r"] = ("ok", fn())
        except BaseException as exc:  # noqa: BLE001
            out["r"] = ("raised", exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    return out.get("r", ("blocked", None))

