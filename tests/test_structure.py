"""The package's structure, as the pipeline's docstring and DESIGN.md's layout promise it.

- No runtime import cycle between the package's modules (imports under
  ``TYPE_CHECKING`` aside), and no function-local import of the package (the way a cycle
  hides).
- No module imports or reads another module's private names: modules talk through
  methods and functions without a leading underscore.
- Every test that the numbered invariants of ``docs/reference-design.md`` name exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trio_rollouts"


def _modules() -> dict[str, ast.Module]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = ast.parse(path.read_text(encoding="utf-8"))
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _runtime_imports(module: str, tree: ast.Module, is_package: bool) -> set[str]:
    """The package modules ``module`` imports when it is imported."""
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If):
                if not _is_type_checking(node):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node, is_package)
                if target.startswith("trio_rollouts"):
                    found.add(target)
                    for alias in node.names:
                        found.add(f"{target}.{alias.name}")
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("trio_rollouts"))

    visit(tree.body)
    return found


def test_no_runtime_import_cycle() -> None:
    modules = _modules()
    packages = {name for name in modules if (PACKAGE.parent / name.replace(".", "/")).is_dir()}
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        targets = set()
        for target in _runtime_imports(name, tree, name in packages):
            # Importing a.b.c imports the package a.b first (unless the importer is
            # inside it, when it is already being imported).
            parts = target.split(".")
            for end in range(2, len(parts) + 1):
                ancestor = ".".join(parts[:end])
                if ancestor == name or name.startswith(ancestor + "."):
                    continue
                if ancestor in modules:
                    targets.add(ancestor)
        graph[name] = targets
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                walk(target, [*path, target])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert cycles == []


def test_no_function_local_import_of_the_package() -> None:
    local: list[str] = []
    for name, tree in _modules().items():
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (
                    node.level > 0 or (node.module or "").startswith("trio_rollouts")
                ):
                    local.append(f"{name}.{function.name}")
    assert local == []


def _defined_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries
    return names


#: Underscored names of the standard library that are documented API: sys._current_frames
#: (the only way to show another thread's stack, which AsyncioCancelTimeoutError does).
_DOCUMENTED_STDLIB = frozenset({"_current_frames"})


def test_no_module_uses_another_modules_private_names() -> None:
    used: list[str] = []
    for name, tree in _modules().items():
        own = _defined_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                used.extend(
                    f"{name} imports {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                )
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in own
                and node.attr not in _DOCUMENTED_STDLIB
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                used.append(f"{name} reads .{node.attr}")
    assert used == []


def test_the_pipelines_invariants_name_tests_that_exist() -> None:
    page = (ROOT / "docs" / "reference-design.md").read_text(encoding="utf-8")
    section = page.split("## The invariants", 1)[1].split("\n## ", 1)[0]
    invariants = re.findall(r"^(\d+)\. ", section, flags=re.MULTILINE)
    assert invariants == [str(n) for n in range(1, len(invariants) + 1)]
    assert len(invariants) >= 12
    named = set(re.findall(r"`(test_\w+)`", section))
    tests = "".join(path.read_text(encoding="utf-8") for path in (ROOT / "tests").glob("*.py"))
    missing = sorted(n for n in named if not n.endswith("_py") and f"def {n}(" not in tests)
    assert named
    assert missing == []
