"""The API reference (``docs/api.md``) has an entry for every public name, and the ledger
of ``docs/failures.md`` is the one ``RolloutStreamStatistics.unaccounted`` computes.

A module's public names are read from its source, not imported, so the Ray names are
checked without Ray: the names it re-exports explicitly (``from ._x import Name as
Name``), the public names it assigns, and its ``__all__``.

An entry is an autodoc directive with the full name (``.. autoclass::
trio_rollouts.inference.Timeout``), or a ``py:`` directive (``.. py:data:: Policy``)
after the ``.. py:currentmodule::`` (or ``.. automodule::``) of its module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API_PAGE = ROOT / "docs" / "api.md"

#: The public modules and their source files.
MODULES = {
    "trio_rollouts": "trio_rollouts/__init__.py",
    "trio_rollouts.inference": "trio_rollouts/inference/__init__.py",
    "trio_rollouts.envs": "trio_rollouts/envs/__init__.py",
    "trio_rollouts.testing": "trio_rollouts/testing.py",
    "trio_rollouts.ray": "trio_rollouts/ray/__init__.py",
    "trio_rollouts.gateway": "trio_rollouts/gateway/__init__.py",
    "trio_rollouts.pipeline": "trio_rollouts/pipeline/__init__.py",
}

#: Public by convention but not API.
NOT_API = {"__version__"}

DIRECTIVE = re.compile(
    r"^\s*\.\. (?P<kind>auto\w+|py:\w+)::\s*(?P<name>[\w.]+)(?:\(.*\))?\s*$", flags=re.MULTILINE
)


def exported_names(source: Path) -> set[str]:
    """The public names a module's source exports (without importing it)."""
    names: set[str] = set()
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom):
            names.update(alias.asname for alias in node.names if alias.asname == alias.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if not isinstance(target, ast.Name):
                    continue
                if target.id == "__all__" and node.value is not None:
                    names.update(ast.literal_eval(node.value))
                else:
                    names.add(target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return {name for name in names if not name.startswith("_")} - NOT_API


def documented_names(page: Path) -> set[str]:
    """The full names that the page's directives document."""
    documented: set[str] = set()
    current = ""
    for match in DIRECTIVE.finditer(page.read_text(encoding="utf-8")):
        kind, name = match["kind"], match["name"]
        if kind in ("py:currentmodule", "py:module", "automodule"):
            current = name
            documented.add(name)
        elif kind.startswith("auto"):
            documented.add(name)
        else:
            documented.add(f"{current}.{name}" if current else name)
    return documented


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_exported_name_has_an_entry_in_the_api_reference(module: str) -> None:
    exported = exported_names(ROOT / MODULES[module])
    assert exported, f"no public names found in {MODULES[module]}"
    documented = documented_names(API_PAGE)
    missing = sorted(name for name in exported if f"{module}.{name}" not in documented)
    assert missing == [], f"docs/api.md has no entry for these names of {module}: {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_public_module_has_an_entry(module: str) -> None:
    assert module in documented_names(API_PAGE)


def test_the_names_read_from_the_source_are_the_names_the_module_has() -> None:
    """The source reading agrees with an import, where one is cheap (not Ray)."""
    import trio_rollouts.envs
    import trio_rollouts.inference
    import trio_rollouts.testing

    for module in (
        trio_rollouts,
        trio_rollouts.inference,
        trio_rollouts.envs,
        trio_rollouts.testing,
    ):
        exported = exported_names(ROOT / MODULES[module.__name__])
        # A subpackage re-exported by name (``from . import gateway as gateway``) is
        # documented as such; modules are not compared here.
        exported = {
            name
            for name in exported
            if not isinstance(getattr(module, name, None), type(trio_rollouts))
        }
        public = {
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and not isinstance(value, type(trio_rollouts))
        }
        assert exported == public - NOT_API, module.__name__


def test_the_checker_reads_directives_and_current_modules(tmp_path: Path) -> None:
    page = tmp_path / "api.md"
    page.write_text(
        "```{eval-rst}\n.. autoclass:: pkg.A\n   :members: x\n\n"
        ".. py:currentmodule:: pkg.sub\n\n.. py:data:: B\n\n   Text.\n```\n"
    )
    assert documented_names(page) == {"pkg.A", "pkg.sub", "pkg.sub.B"}


# ----------------------------------------------------------------------- the ledger


def ledger_terms_in_code() -> list[str]:
    """The terms ``unaccounted`` subtracts from ``started``, in source order."""
    source = (ROOT / "trio_rollouts" / "pipeline" / "_ledger.py").read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == "unaccounted":
            (statement,) = (n for n in node.body if isinstance(n, ast.Return))
            assert isinstance(statement.value, ast.BinOp)
            terms = [n for n in ast.walk(statement.value.right) if isinstance(n, ast.Attribute)]
            return [n.attr for n in sorted(terms, key=lambda n: (n.lineno, n.col_offset))]
    raise AssertionError("RolloutStreamStatistics.unaccounted not found")


def test_the_ledger_of_the_failures_page_matches_unaccounted() -> None:
    page = (ROOT / "docs" / "failures.md").read_text(encoding="utf-8")
    section = page.split("## The ledger", 1)[1].split("\n## ", 1)[0]
    terms = ledger_terms_in_code()
    table = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    assert table == terms, "the table's counters are the terms of unaccounted, in its order"
    equation = re.search(r"`started == (?P<sum>[^`]+)`", section, flags=re.DOTALL)
    assert equation is not None, "the page states started == ... as one code span"
    assert [term.strip() for term in equation["sum"].split("+")] == terms
