"""Sphinx configuration. Builds offline: no intersphinx, no remote assets."""

from __future__ import annotations

import re
from typing import Any

import attrs
from sphinx.application import Sphinx
from sphinx.util import logging

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

logger = logging.getLogger(__name__)

#: How a factory default reads in a signature: an empty literal for the builtin
#: containers, ``Name()`` for a class, and ``<factory>`` (as dataclasses write it) for
#: a function; the class's docstring says what that function computes.
_EMPTY_LITERALS = {list: "[]", dict: "{}", tuple: "()", set: "set()", frozenset: "frozenset()"}


def _factory_default(factory: Any) -> str:
    """``factory`` is an ``attrs.Factory`` (a class at run time; its stubs type it as a
    function, hence ``Any``)."""
    made_by = factory.factory
    if made_by in _EMPTY_LITERALS:
        return _EMPTY_LITERALS[made_by]
    if isinstance(made_by, type) and not factory.takes_self:
        return f"{made_by.__name__}()"
    return "<factory>"


def render_attrs_factory_defaults(
    app: Sphinx,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str | None, str | None] | None:
    """attrs writes ``default=NOTHING`` into the ``__init__`` it generates for a field
    with ``factory=...``; autodoc would show ``api_key=NOTHING``. Show what the factory
    makes instead, and warn (an error under ``-W``) if a ``NOTHING`` is left."""
    if signature is None or "NOTHING" not in signature:
        return None
    if what == "class" and attrs.has(obj):
        factory_type: type = attrs.Factory  # type: ignore[assignment]
        for field in attrs.fields(obj):
            if field.init and isinstance(field.default, factory_type):
                parameter = re.escape(field.alias or field.name)
                shown = _factory_default(field.default)
                signature = re.sub(
                    rf"\b({parameter}\b[^,()=]*=\s*)NOTHING\b", rf"\g<1>{shown}", signature
                )
    if "NOTHING" in signature:
        logger.warning("%s: a default still renders as NOTHING in %s", name, signature)
    return signature, return_annotation


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("autodoc-process-signature", render_attrs_factory_defaults)
    return {"parallel_read_safe": True}
