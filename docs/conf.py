"""Sphinx configuration of gpfast's documentation (build: ``python -m sphinx -W -b html docs docs/_build/html``)."""

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# The checkout's own gpfast is documented, not an installed copy elsewhere.
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(DOCS / "_ext"))

# Examples draw their plots off screen; the gallery captures them.
os.environ.setdefault("MPLBACKEND", "Agg")

import gpfast  # noqa: E402
from gpfast.estimator import solver as _solver  # noqa: E402
from gpfast.kernels import MATRIX_FREE_THRESHOLD  # noqa: E402

project = "gpfast"
author = "gpfast developers"
copyright = "gpfast developers (MIT licence)"
release = gpfast.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "sphinx_gallery.gen_gallery",
    "sphinxarg.ext",
    "gpfast_results",
]

# Thresholds quoted in the guide come from the code, so the prose cannot drift from the rule.
rst_prolog = f"""
.. |cholesky_max_n_cpu| replace:: {_solver.AUTO_CHOLESKY_MAX_N["cpu"]:,}
.. |cholesky_max_n_cuda| replace:: {_solver.AUTO_CHOLESKY_MAX_N["cuda"]:,}
.. |train_cholesky_max_n_cpu| replace:: {_solver.AUTO_TRAIN_CHOLESKY_MAX_N["cpu"]:,}
.. |train_cholesky_max_n_cuda| replace:: {_solver.AUTO_TRAIN_CHOLESKY_MAX_N["cuda"]:,}
.. |cholesky_workspace| replace:: {_solver.CHOLESKY_WORKSPACE_FACTOR}
.. |matrix_free_threshold| replace:: {MATRIX_FREE_THRESHOLD:,}
"""

exclude_patterns = ["_build", "auto_examples/*.ipynb", "auto_examples/*.py", "auto_examples/*.zip"]
templates_path = []
html_static_path = []

# The API pages list their members through autosummary; numpydoc's own member tables would list them twice.
autosummary_generate = True
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
autodoc_default_options = {"members": True, "inherited-members": False, "show-inheritance": True}
autodoc_typehints = "none"
# A docstring with no sections of its own is still valid; numpydoc checks only the ones it has.
numpydoc_validation_checks = set()

# Help texts and prose quote options such as --iters; typographic dashes would break them when copied.
smartquotes = False

html_theme = "pydata_sphinx_theme"
html_title = f"gpfast {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "header_links_before_dropdown": 9,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
}
html_show_sourcelink = False

sphinx_gallery_conf = {
    "examples_dirs": str(ROOT / "examples"),
    "gallery_dirs": "auto_examples",
    # Every script in examples/ runs during the build: an example that fails fails the build.
    "filename_pattern": r".*\.py$",
    "ignore_pattern": r"__init__\.py",
    "download_all_examples": False,
    "plot_gallery": "True",
    "abort_on_example_error": True,
    "image_scrapers": ("matplotlib",),
    "remove_config_comments": True,
    "within_subsection_order": "FileNameSortKey",
}


def _skip_metadata_routing(app, what, name, obj, skip, options):
    # scikit-learn generates set_*_request methods on every estimator class; their docstrings cite
    # scikit-learn's own glossary, which these pages do not have, and they are documented there.
    if name.startswith("set_") and name.endswith("_request"):
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _skip_metadata_routing)
