"""The README's code that starts a cluster runs as it stands: saved as a script and run with ``python``,
or, where the README marks a block "In a notebook or IPython:", in a Jupyter kernel.

Dask's worker processes are spawned and import the user's script again, so a script that starts a cluster
needs ``if __name__ == "__main__":``; the README's scripts must have it, and these tests run them the way a
new user would.
"""

from __future__ import annotations

import re
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers.docs import CLUSTER_BLOCKS, GUARD, NOTEBOOK_MARK, README, STARTS_A_CLUSTER, python_blocks  # noqa: F401
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.cluster  # every test here starts a cluster or a process


def _params(notebook: bool) -> list:
    found = [pytest.param(b, id=f"README.md:{b.line}") for b in CLUSTER_BLOCKS if b.notebook == notebook]
    kind = "notebook code" if notebook else "a script"
    skip = pytest.mark.skip(reason=f"no README block that starts a cluster is {kind}")
    return found or [pytest.param(None, marks=skip, id="none")]


def test_blocks_that_start_a_cluster_are_guarded_scripts_or_marked_for_notebooks():
    assert CLUSTER_BLOCKS, "the README's first example starts a LocalPSCluster: the extractor found none"
    assert len(CLUSTER_BLOCKS) == README.read_text().count("```python\n"), "a ```python block the extractor missed"
    for block in CLUSTER_BLOCKS:
        assert STARTS_A_CLUSTER.search(block.code), f"README.md:{block.line} starts no cluster: move it to docs/"
        assert block.notebook or GUARD in block.code, (
            f"README.md:{block.line} starts a cluster: it needs {GUARD} or a line {NOTEBOOK_MARK!r} before it")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", _params(notebook=False))
def test_script_block_runs_with_python(block, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(block.code)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"README.md:{block.line} failed:\n{out.stderr[-3000:]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", _params(notebook=True))
def test_notebook_block_runs_in_a_kernel(block, tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(block.code)])
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()


@pytest.mark.timeout(300)
def test_the_script_against_a_scheduler_started_the_same_second_as_its_workers(tmp_path):
    """The README's existing-cluster line, run as a newcomer does: connected while the workers are starting.

    The script is started first and the workers once it says it is waiting, so the wait is always taken.
    """
    import os

    from tests.helpers.cluster import _start, start_dask_scheduler

    first = next(b for b in CLUSTER_BLOCKS if not b.notebook)
    guard = first.code.index(GUARD)
    script = tmp_path / "script.py"
    script.write_text(first.code[:guard] + GUARD + "\n    import sys\n    main(sys.argv[1])\n")  # "replace the last two lines"
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    procs: list[subprocess.Popen] = []
    try:
        address = start_dask_scheduler(tmp_path, procs, env)
        with stdout.open("w") as out, stderr.open("w") as err:
            run = subprocess.Popen([sys.executable, str(script), address], cwd=tmp_path, stdout=out, stderr=err)
        procs.append(run)

        def says_it_waits() -> bool:
            assert run.poll() is None, f"the script ended before waiting:\n{stderr.read_text()[-3000:]}"
            return "waiting up to 60 s (daskps.workers-timeout)" in stderr.read_text()

        wait_until(says_it_waits, 60, failure="the script did not say it waits for workers", collect=False)
        procs += [_start(["distributed.cli.dask_worker", address, "--host", "127.0.0.1", "--nthreads", "1",
                          "--resources", resource, "--no-dashboard"], env)
                  for resource in ("ps=1", "ps=1", "worker=1", "worker=1")]
        assert run.wait(timeout=240) == 0, stderr.read_text()[-3000:]
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
    assert re.search(r"loss \d\.\d+ -> \d\.\d+", stdout.read_text()), stdout.read_text()
