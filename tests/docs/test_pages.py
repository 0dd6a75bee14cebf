"""The documentation runs as written, and builds with warnings as errors.

Every ```python block of ``docs/**/*.md`` runs here, page by page, as a reader
copies them: a block that opens with imports starts a script, the blocks after
it are pasted into that script in order, as written, and each script runs with
``python`` in the page's directory (a page's later blocks sit inside the guard
of the block that starts its cluster, so the file is a script Dask's worker
processes can import). Blocks fenced
otherwise (``console``, ``text``, ``python-not-run``) are not run, except the
console blocks listed in ``CONSOLE`` (a cluster of ``dask`` processes), which
run as written with bash before the page's Python. README.md's blocks are run
as scripts by ``tests/docs/test_readme.py``.

Also here, the frictions a newcomer met (issue 22): the existing-cluster path,
a dataset passed to ``schedule`` where its iterator belongs, the demo's
checkpoints left out of git.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import daskps as dps
from tests.helpers.cluster import dask_cli_cluster
from tests.helpers.docs import python_blocks
from tests.helpers.paths import ROOT
from tests.helpers.waiting import wait_until

DOCS = ROOT / "docs"
PYTHON_FENCE = re.compile(r"^\s*```python\s*$", re.MULTILINE)
CONSOLE_FENCE = re.compile(r"^```console\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# Pages whose console block (by position among the page's console blocks) runs before their Python.
CONSOLE = {"howto/cluster.md": 0, "user-guide/security.md": 0}
# What each page's run waits for once its console block ran: a file the commands write, the workers.
CONSOLE_READY = {"howto/cluster.md": ("cluster.json", 4), "user-guide/security.md": ("tls-cluster.json", 2)}
# Pages about notebooks: their blocks are one notebook's cells (no guard: worker processes import no notebook).
NOTEBOOK_PAGES = {"howto/notebook.md"}
# Pages that need an optional library: skipped, saying so, where it is missing.
NEEDS = {"user-guide/models.md": ["jax", "torch", "keras"], "user-guide/keras.md": ["jax", "keras", "dask.array"], "user-guide/datasets.md": ["dask.dataframe", "pyarrow"],
         "user-guide/security.md": ["cryptography"], "user-guide/dashboard.md": ["tensorboardX"],
         "howto/export.md": ["torch", "keras", "jax"]}

# What some pages print, as their comments say (a page that runs but prints otherwise is wrong too).
PRINTS = {
    "getting-started.md": [r"loss \d\.\d+ -> 0\.[01]\d*\n"],
    "user-guide/strategy.md": [r"\[0\. 2\. 4\.\]\n", r"ClosedError: "],
    "user-guide/coordinator.md": [r"\[0, 10, 20, 30, 40\] \[10\. 10\.\]\n", r"join raised: bad batch\n",
                                  r"w\[0\] = 1\.0000\n"],
    "user-guide/checkpoints.md": [r"no checkpoint: starting afresh\n(.*\n)?epoch 1: .*ckpt-1\nepoch 2: .*ckpt-2\n",
                                  r"resumed from resume-checkpoints/ckpt-2: epoch 2, step 100\n(.*\n)?epoch 3: .*ckpt-3\n"
                                  r"epoch 4: .*ckpt-4\n"],
    "user-guide/datasets.md": [r"True\n", r"\n10000 rows read\n", r"10000 rows evaluated\n", r"OutOfRangeError: "],
    "howto/cluster.md": [r"\[20\. 20\. 20\. 20\.\]\n"],
    "user-guide/security.md": [r"tls://127\.0\.0\.1:\d+\n", r"\[10\. 10\. 10\.\]\n", r"\[0\. 1\. 2\.\]\n"],
    "porting.md": [r"epoch 2: loss 0\.[0-2]"],
    "user-guide/embeddings.md": [r"loss 0\.69\d -> 0\.[0-5]\d+\n", r"pooled == numpy: True\n"],
    "howto/export.md": [r"torch: True\n", r"keras: True\n", r"jax: True 6\.0\n", r"shards: 2\n",
                        r"from the checkpoint: \[10\.0, 11\.0\] \[0\.5, -0\.5\]\n"],
    "user-guide/keras.md": [r"\['accuracy', 'learning_rate', 'loss', 'val_accuracy', 'val_loss'\]\n",
                            r"val_accuracy 0\.9\d\n", r"True\n200\n", r"\(2000, 2\) \(500, 500, 500, 500\) 0\.\d+\n", r"\nTrue\n"],
}

def _pages() -> list[str]:
    skip = {"_build", "generated", "jupyter_execute"}
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if not skip & set(p.parts))


PAGES_WITH_PYTHON = [p for p in _pages() if PYTHON_FENCE.search((DOCS / p).read_text())]


def _run_console_block(page: str, cwd: Path) -> subprocess.Popen:
    block = CONSOLE_FENCE.findall((DOCS / page).read_text())[CONSOLE[page]]
    script = "\n".join(line[2:] for line in block.splitlines() if line.startswith("$ ")) + "\nwait\n"
    bin_dir = str(Path(sys.executable).parent)  # `dask` of this environment, as the page's reader has it
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    return subprocess.Popen(["bash", "-e", "-c", script], cwd=cwd, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for_cluster(page: str, cwd: Path, security=None) -> None:
    name, workers = CONSOLE_READY[page]
    wait_until(lambda: (cwd / name).exists(), 90,
               failure=lambda: f"{page}: the console block wrote no {name}", interval=0.2, collect=False)


def starts_a_script(code: str) -> bool:
    """Whether a block reads as a script of its own: its first line that is not a comment is an import at the
    top level (a reader copies it into a file of its own; ``test_a_block_that_starts_with_imports_runs_on_its_own``
    checks it needs nothing the page's earlier blocks defined)."""
    lines = [line for line in code.splitlines() if line.strip()]
    if not lines or lines[0].startswith("# continues"):
        return False
    first = next((line for line in lines if not line.lstrip().startswith("#")), "")
    return first.startswith(("import ", "from "))


def page_scripts(page: str) -> list[str]:
    """The page's ```python blocks as a reader's scripts, in order: a block that starts a script (imports
    first) begins a new file, and the blocks after it, up to the next such block, are pasted into it as
    written (a page's later blocks sit inside the guard of the block that starts its cluster, so the file
    runs as pasted: Dask's worker processes import it again)."""
    scripts: list[list[str]] = []
    for block in python_blocks((DOCS / page).read_text()):
        if not scripts or starts_a_script(block.code):
            scripts.append([])
        scripts[-1].append(block.code)
    return ["\n".join(blocks) for blocks in scripts]


@pytest.mark.cluster
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", PAGES_WITH_PYTHON)
def test_every_python_block_of_the_page_runs_in_order_as_its_scripts(page, tmp_path):
    for module in NEEDS.get(page, []):
        pytest.importorskip(module, reason=f"{page} needs {module} (in the test extra)")
    if page in NOTEBOOK_PAGES:  # a page about notebooks: its blocks are the cells of one, run in a kernel
        import nbformat
        from nbclient import NotebookClient

        cells = [nbformat.v4.new_code_cell(b.code) for b in python_blocks((DOCS / page).read_text())]
        nb = nbformat.v4.new_notebook(cells=cells)
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
        printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", ()))
        for expected in PRINTS.get(page, []):
            assert re.search(expected, printed), f"{page} printed no match for {expected!r}:\n{printed}"
        return
    scripts = page_scripts(page)
    assert len(python_blocks((DOCS / page).read_text())) == len(PYTHON_FENCE.findall((DOCS / page).read_text()))
    console = _run_console_block(page, tmp_path) if page in CONSOLE else None
    printed = []
    try:
        if console is not None:
            _wait_for_cluster(page, tmp_path)
        for i, script in enumerate(scripts, 1):
            # what the blocks write (checkpoints, runs/) lands beside the scripts, for the page's later ones
            (tmp_path / f"page{i}.py").write_text(script)
            out = subprocess.run([sys.executable, f"page{i}.py"], cwd=tmp_path, capture_output=True, text=True,
                                 timeout=540)
            assert out.returncode == 0, f"{page}, script {i} of {len(scripts)} (its blocks pasted in order), " \
                                        f"failed:\n{out.stderr[-4000:]}"
            printed.append(out.stdout)
    finally:
        if console is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(console.pid, signal.SIGTERM)
            console.wait(30)
    for expected in PRINTS.get(page, []):
        assert re.search(expected, "".join(printed)), f"{page} printed no match for {expected!r}:\n{printed}"


def _free_names(source: str) -> set[str]:
    """Names ``source`` reads that it neither defines nor imports (nor are builtins)."""
    import builtins
    import symtable

    top = symtable.symtable(source, "<block>", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    used: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table is top or symbol.is_global()):
                used.add(symbol.get_name())
        for child in table.get_children():
            walk(child)

    walk(top)
    return used - defined - set(dir(builtins)) - {"__name__", "__file__"}


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("page", ["README.md", *(f"docs/{p}" for p in _pages())])
def test_a_block_that_starts_with_imports_runs_on_its_own(page):
    """A block that opens with imports reads as a script of its own: a reader copies it into a file, so it
    may use nothing the page's earlier blocks defined (the page test shares one namespace and cannot see
    that). A block that does continue says so on its first line (``# continues ...``)."""
    for i, block in enumerate(PYTHON_BLOCK.findall((ROOT / page).read_text())):
        if starts_a_script(block):
            assert not _free_names(block), f"{page}, python block {i + 1}: {sorted(_free_names(block))} undefined"


def test_every_page_with_code_has_python_blocks_that_ran():
    """The parametrization above is every page with a ```python block; the others hold none by design."""
    assert {"getting-started.md", "user-guide/checkpoints.md", "howto/cluster.md"} <= set(PAGES_WITH_PYTHON)
    for page in _pages():
        text = (DOCS / page).read_text()
        assert "```{code-block} python" not in text and "```{code} python" not in text, (
            f"{page}: use a ```python fence (run) or ```python-not-run (not run), not a code-block directive")


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_the_docs_build_with_warnings_as_errors(tmp_path):
    for module in ("sphinx", "myst_nb", "pydata_sphinx_theme", "numpydoc"):
        pytest.importorskip(module, reason=f'building the docs needs {module}: pip install ".[docs]"')
    # As the documented command does, the tour notebook is executed again (about 15 s), not read from a cache.
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
           "-D", "nb_execution_mode=force", "-d", str(tmp_path / "doctrees"), "docs", str(tmp_path / "html")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=840)
    assert out.returncode == 0, out.stderr[-5000:]
    html = (tmp_path / "html" / "user-guide" / "checkpoints.html").read_text()
    assert "save_counter" in html
    assert (tmp_path / "html" / "reference" / "generated" / "daskps.ClusterCoordinator.html").exists()
    assert (tmp_path / "html" / "generated" / "daskps_tour.html").exists()


# ------------------------------------------------------------------ frictions a newcomer met (issue 22)


@pytest.mark.cluster
def test_a_cluster_a_client_and_an_address_all_make_a_strategy(tmp_path):
    """The existing-cluster path the docs give: ParameterServerStrategy takes a running cluster's address,
    a distributed.Client or a cluster object, and trains the same."""
    with dask_cli_cluster(tmp_path, ["ps=1", "worker=1"]) as client:
        for given in (client.scheduler.address, client):
            with dps.ParameterServerStrategy(given) as strategy:
                assert strategy.cluster_resolver.cluster_spec()["ps"] and strategy.client is not None
                coordinator = dps.ClusterCoordinator(strategy)
                with strategy.scope():
                    w = dps.Variable(np.zeros(2, np.float32), name="w")
                for _ in range(3):
                    coordinator.schedule(lambda w=w: w.assign_add(np.ones(2, np.float32)))
                coordinator.join()
                np.testing.assert_array_equal(w.numpy(), [3.0, 3.0])
        assert client.status == "running"  # a strategy closes only a client it made from an address
    with pytest.raises(TypeError, match="a Dask cluster"):
        dps.ParameterServerStrategy(42)


def test_a_local_cluster_object_is_its_own_cluster_resolver(cluster, client):
    with dps.ParameterServerStrategy(cluster) as strategy:
        assert strategy.client is client  # the cluster's own client: the strategy does not close it
        assert (strategy.cluster_resolver.num_ps, strategy.cluster_resolver.num_workers) == (2, 2)
    assert client.status == "running"


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_first_script_runs_on_an_existing_cluster_with_the_one_line_the_docs_give(tmp_path):
    """getting-started.md: "replace the last two lines with main("tcp://scheduler:8786")"."""
    text = (DOCS / "getting-started.md").read_text()
    script = text.split("Save this as `first.py`", 1)[1].split("```python\n", 1)[1].split("```\n", 1)[0]
    line = re.search(r'```text\n(\s*main\("tcp://scheduler:8786"\))\n```', text).group(1)
    guard, local = script.rstrip("\n").rsplit("\n", 2)[-2:]
    assert "LocalPSCluster" in guard and local.strip() == "main(cluster)"
    with dask_cli_cluster(tmp_path, ["ps=1", "worker=1", "worker=1"]) as client:
        edited = script.rstrip("\n").rsplit("\n", 2)[0] + "\n" + line.replace(
            "tcp://scheduler:8786", client.scheduler.address) + "\n"
        (tmp_path / "first.py").write_text(edited)
        out = subprocess.run([sys.executable, "first.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    start, end = map(float, re.fullmatch(r"loss (\S+) -> (\S+)\n", out.stdout).groups())
    assert end < min(start, 0.2)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_softmax_example_takes_a_scheduler_address(tmp_path):
    script = ROOT / "examples" / "train_softmax.py"
    with dask_cli_cluster(tmp_path, ["ps=1", "ps=1", "worker=1"]) as client:
        out = subprocess.run([sys.executable, str(script), "--scheduler", client.scheduler.address],
                             capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1]) > 0.9


def test_schedule_given_a_dataset_says_to_pass_its_iterator(coordinator):
    dataset = coordinator.create_per_worker_dataset(lambda: iter(range(10)))
    before = coordinator.summary()["scheduled"]
    with pytest.raises(TypeError, match=r"^args\[0\] is a PerWorkerDataset; pass iter\(dataset\) instead"):
        coordinator.schedule(next, args=(dataset,))
    with pytest.raises(TypeError, match=r"^kwargs\['data'\]\[1\] is a PerWorkerDataset; pass iter\(dataset\)"):
        coordinator.schedule(lambda data: None, kwargs={"data": [0, dataset]})
    assert coordinator.summary()["scheduled"] == before  # nothing was queued
    assert coordinator.schedule(next, args=(iter(dataset),)).fetch() == 0  # the iterator, as the message says


@pytest.mark.cluster
def test_git_ignores_what_the_demo_and_the_docs_build_write():
    for path in ("daskps-demo-checkpoints/ckpt-1/manifest.json", "docs/_build/html/index.html",
                 "docs/generated/daskps_tour.ipynb", "docs/reference/generated/daskps.Variable.rst"):
        out = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert out.returncode == 0, f"{path} is not ignored by .gitignore"
