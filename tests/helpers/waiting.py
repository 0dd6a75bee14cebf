"""Waiting in tests: a condition polled until it holds, a call run in a thread with a time limit."""

from __future__ import annotations

import gc
import threading
import time

COLLECT_EVERY = 0.5


def wait_until(check, timeout: float = 20.0, what: str = "condition", *, failure=None,
               interval: float = 0.05, collect: bool = True):
    """Poll ``check()`` every ``interval`` seconds until it is truthy, and return its value; fail after ``timeout``.

    The one polling loop of the suite: anything that arrives asynchronously (a report through the
    scheduler, a release, a count on a server) is waited for here. ``collect`` runs the garbage
    collector before the first look and at most every ``COLLECT_EVERY`` seconds after (releases are
    triggered by finalizers; a full collection costs 40-200 ms of CPU once Keras, JAX or PyTorch are
    imported, which polling every 10-50 ms would spend over and over); the assertion says ``failure``
    (or what ``failure()`` returns, then), or that ``what`` was not reached.
    """
    deadline = time.monotonic() + timeout
    collected = -COLLECT_EVERY
    while True:
        if collect and time.monotonic() - collected >= COLLECT_EVERY:
            gc.collect()
            collected = time.monotonic()
        value = check()
        if value or time.monotonic() > deadline:
            assert value, (failure() if callable(failure) else failure) or f"{what} not reached in {timeout}s"
            return value
        time.sleep(interval)


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

