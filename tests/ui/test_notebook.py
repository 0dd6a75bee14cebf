"""The example notebook runs headless, top to bottom, in a real Jupyter kernel."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.cluster  # every test here starts a cluster or a process

NOTEBOOK = ROOT / "examples" / "daskps_tour.ipynb"


def test_notebook_runs_and_shows_the_cluster(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    stored = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("outputs") for c in stored[:-1]), "the notebook is stored executed (all but the closing cell)"
    assert any("image/png" in o.get("data", {}) for c in stored for o in c.outputs), "its plots are in the file"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    html = [o["data"]["text/html"] for o in outputs if "data" in o and "text/html" in o["data"]]
    text = "".join(o.get("text", "") for o in outputs)
    assert any("daskps.ShardedVariable" in h and "table/part_1" in h for h in html)
    assert any("ParameterServerStrategy" in h and "/status" in h for h in html)
    assert any("ClusterCoordinator" in h and "done/s" in h for h in html)
    assert any("<progress" in h and "200/200 steps" in h and "loss=" in h for h in html)
    assert "individual-daskps" in text and "ckpt-1" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plots drawn again
