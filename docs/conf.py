"""Sphinx configuration for daskps' documentation.

Build it (from the repository root, with ``pip install ".[docs]"``)::

    python -m sphinx -W -b html docs docs/_build/html

The pages are MyST Markdown; ``examples/daskps_tour.ipynb`` (stored with its
outputs) is copied in and rendered by myst-nb, executed again (cached under
``docs/_build`` until it changes; ``-D nb_execution_mode=off`` skips that);
the API reference comes from the numpydoc docstrings through
autodoc/autosummary.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from pygments.lexers.python import PythonLexer

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the checkout's daskps, also when it is not installed

project = "daskps"
author = "the daskps authors"
copyright = "the daskps authors, Apache-2.0"

extensions = [
    "myst_nb",  # MyST Markdown pages and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
]

root_doc = "index"
exclude_patterns = ["_build", "jupyter_execute", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# benchmarks/README.md, included as the benchmark log, is a running log whose headings skip levels.
suppress_warnings = ["myst.header"]

# The tour notebook is stored executed; the build runs it again (about 15 s; cached under _build
# until the notebook changes). -D nb_execution_mode=off renders the stored outputs instead.
nb_execution_mode = "cache"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")

autosummary_generate = True
autodoc_default_options = {"members": False}
autodoc_typehints = "none"  # the numpydoc sections say the types
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

html_theme = "pydata_sphinx_theme"
html_title = "daskps"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_depth": 2,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}


def _copy_notebook(app) -> None:
    """examples/daskps_tour.ipynb, the notebook the tests run, is the docs' notebook page too."""
    target = DOCS / "generated" / "daskps_tour.ipynb"
    target.parent.mkdir(exist_ok=True)
    source = ROOT / "examples" / "daskps_tour.ipynb"
    if not target.exists() or target.read_bytes() != source.read_bytes():
        shutil.copyfile(source, target)


def setup(app):
    # Python that needs infrastructure the tests do not have (a Slurm system, Kubernetes,
    # TensorFlow): highlighted as Python, but fenced as ```python-not-run so that the test
    # that runs every ```python block does not take it (tests/docs/test_pages.py).
    app.add_lexer("python-not-run", PythonLexer)
    app.connect("builder-inited", _copy_notebook)
