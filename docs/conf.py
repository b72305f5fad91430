"""Sphinx configuration. Builds offline: no intersphinx, no remote assets."""

from __future__ import annotations

import trio_rollouts

project = "trio_rollouts"
author = "The trio_rollouts developers"
copyright = "2026, The trio_rollouts developers"
release = trio_rollouts.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
nitpicky = False
html_theme = "furo"
html_title = "trio_rollouts"
