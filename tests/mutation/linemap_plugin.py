"""A pytest plugin for ``coverage run``: each test's lines are recorded under the test's node id.

Used by ``tests/mutation/run_by_lines.py`` (see ``tests/README.md``). Coverage's own ``dynamic_context =
test_function`` looks for a test function on the current thread's stack, so lines that a Dask worker thread
runs for a test would be recorded under no test; switching the context here, for the whole process, keeps
them. The plugin also writes each test's outcome and duration to ``$LINEMAP_OUTCOMES`` (JSON).
"""

from __future__ import annotations

import json
import os

import coverage

_outcomes: dict[str, dict[str, object]] = {}


def pytest_runtest_setup(item):  # type: ignore[no-untyped-def]
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(item.nodeid)


def pytest_runtest_logreport(report):  # type: ignore[no-untyped-def]
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0})
    entry["duration"] = float(entry["duration"]) + report.duration  # type: ignore[arg-type]
    if report.failed:
        entry["outcome"] = "failed"
    elif report.skipped and report.when in ("setup", "call"):
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session):  # type: ignore[no-untyped-def]
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context("")
    path = os.environ.get("LINEMAP_OUTCOMES")
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=0, sort_keys=True)
