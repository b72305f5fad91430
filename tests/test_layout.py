"""The package's layout, as DESIGN.md's "Layout" section fixes it, checked from the source.

- no module under ``trio_rollouts/`` is over 700 lines;
- no import circle among the package's modules, counting every import the source holds:
  those under ``if TYPE_CHECKING:`` and those inside functions too;
- no private name (one leading underscore, not a dunder) imported from another module of
  the package;
- the top-level ``__all__`` exists, holds at most 40 names, each importable;
- every public name DESIGN.md places in ``trio_rollouts`` or ``trio_rollouts.inference``
  is importable there.

The import graph is built from the AST, without importing anything: ``import a.b`` is an
edge to ``a.b``; ``from pkg import name`` is an edge to ``pkg.name`` when that is a
module of the package, else to ``pkg`` (its ``__init__`` for a package); a package's
``__init__`` importing its own submodules makes edges like any other module. A failure
names the modules, the edges (with their line numbers) or the names at fault.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import attrs

import trio_rollouts

PACKAGE_DIR = Path(trio_rollouts.__file__).parent
PACKAGE = "trio_rollouts"
MAX_LINES = 700
MAX_TOP_LEVEL_NAMES = 40

#: What DESIGN.md says is importable from ``trio_rollouts``: "Public names", and the
#: later sections ("everything above is importable from ``trio_rollouts``"), for the
#: names it gives without another home (``inference.X``, ``envs.X``).
TOP_LEVEL_NAMES = """
ChatMessage LLMChatMessage GenerationArgs Request RolloutRequest GroupedRolloutRequest
Head2HeadRolloutRequest EvaluationRequest Rollout TokenRollout RolloutGroup ContrastiveRollout
EvaluationResult RewardEvaluationResult EvaluationResponse
structure unstructure ValidationError dump_jsonl load_jsonl
InferenceRequest InferenceResponse InferenceInterface ReturnsRaw ReturnsTokens ReturnsLogProbs
OpenAIInference EmbeddedInference LatencyModel
Agent RolloutGenerator TokenizedRolloutGenerator ContrastiveRolloutGenerator EvaluationAgent
GroupedRolloutGenerator WeightedTask WeightedMultiTask pass_at_k blocking_grouped_rollouts
FailurePolicy GroupTimeoutError FailureBudgetExceededError
WeightUpdateError RolloutStream
PromptSource Problem RewardOnlyAgent
AcceptsTokens TokenMismatchError
Renderer PlainRenderer HFRenderer AssistantTurn ToolCall
MultiTurnAgent Environment EnvironmentStep BaseEnvironment TemplateBreakError TokenFidelityError
StepTimeoutError
TrainingBatch SamplingSpan SamplingBiasWarning SamplingBiasError ReplicaProbe
GatewayAgent gateway run_reward RewardTimeoutError
""".split()

#: What DESIGN.md says is importable from ``trio_rollouts.inference``.
INFERENCE_NAMES = """
InferenceRequest InferenceResponse InferenceInterface ReturnsRaw ReturnsTokens ReturnsLogProbs
AcceptsTokens GeneratesGroups Pausable WeightUpdateError
OpenAIInference UnsupportedFieldError TokenMismatchError ReplicaProbe
EmbeddedInference LatencyModel EngineModel EngineStatistics render_plain_chat
""".split()


# --------------------------------------------------------------------------- the source


@attrs.frozen
class Edge:
    """``importer`` imports ``imported`` at ``line`` of its source."""

    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} (line {self.line})"


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def absolute_base(importer: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` reads from, relative imports resolved."""
    if node.level == 0:
        return node.module or ""
    package = importer if is_package(importer) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports_of(
    module: str, source: str | None = None
) -> Iterator[tuple[ast.Import | ast.ImportFrom, str, list[str]]]:
    """Each import statement anywhere in ``module`` (``TYPE_CHECKING`` blocks and
    function bodies included): the node, the module it reads from, the names it takes.
    ``source``: the module's text (default: read from its file)."""
    if source is None:
        source = MODULES[module].read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(MODULES[module]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            yield node, absolute_base(module, node), [alias.name for alias in node.names]


def edges_of(module: str, source: str | None = None) -> Iterator[Edge]:
    """The edges from ``module`` to the package's modules (``source`` as for
    :func:`imports_of`)."""
    for node, base, names in imports_of(module, source):
        if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
            continue
        if isinstance(node, ast.Import):
            targets = [base]
        else:
            targets = [f"{base}.{name}" if f"{base}.{name}" in MODULES else base for name in names]
        for target in targets:
            # A module that is not in the tree (``import trio_rollouts.x`` of a module
            # that does not exist) fails elsewhere; a module importing from itself is
            # no circle.
            if target in MODULES and target != module:
                yield Edge(module, target, node.lineno)


def import_graph() -> dict[str, dict[str, Edge]]:
    """``graph[a][b]``: the first import of ``b`` in ``a``."""
    graph: dict[str, dict[str, Edge]] = {module: {} for module in MODULES}
    for module in MODULES:
        for edge in edges_of(module):
            graph[module].setdefault(edge.imported, edge)
    return graph


def strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def shortest_cycle(graph: dict[str, dict[str, Edge]], component: list[str]) -> list[Edge]:
    """A shortest cycle through the component's first module, inside the component."""
    start = component[0]
    members = set(component)
    came_by: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor, edge in sorted(graph[node].items()):
                if successor not in members:
                    continue
                if successor == start:
                    cycle = [edge]
                    while cycle[0].importer != start:
                        cycle.insert(0, came_by[cycle[0].importer])
                    return cycle
                if successor not in came_by:
                    came_by[successor] = edge
                    following.append(successor)
        frontier = following
    msg = f"no cycle through {start} in its own component {component}"
    raise AssertionError(msg)


# --------------------------------------------------------------------------- the checks


def test_no_module_is_over_700_lines() -> None:
    too_long = {}
    for module, path in MODULES.items():
        with path.open(encoding="utf-8") as file:
            lines = sum(1 for _ in file)
        if lines > MAX_LINES:
            too_long[module] = lines
    assert too_long == {}, "modules over 700 lines: " + ", ".join(
        f"{module} ({lines})" for module, lines in sorted(too_long.items())
    )


def test_no_import_circle() -> None:
    graph = import_graph()
    report = []
    for component in strongly_connected(graph):
        cycle = shortest_cycle(graph, component)
        path = [edge.importer for edge in cycle] + [cycle[0].importer]
        report.append(
            f"{len(component)} modules in a circle: {component}\n"
            f"  for example {path}, by these imports:\n"
            + "\n".join(f"    {edge}" for edge in cycle)
        )
    assert report == [], "import circles (TYPE_CHECKING and function-level imports count):\n" + (
        "\n".join(report)
    )


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_is_imported_from_another_module() -> None:
    found = []
    for module in MODULES:
        for node, base, names in imports_of(module):
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            for name in names:
                # ``from pkg import _mod`` takes a private submodule: private too.
                if is_private(name) and base != module:
                    found.append(f"{module} (line {node.lineno}): from {base} import {name}")
    assert found == [], "private names imported across modules:\n" + "\n".join(found)


def test_the_top_level_all_holds_at_most_40_importable_names() -> None:
    names = getattr(trio_rollouts, "__all__", None)
    assert isinstance(names, list | tuple), "trio_rollouts.__all__ is missing"
    assert len(names) <= MAX_TOP_LEVEL_NAMES, (
        f"trio_rollouts.__all__ has {len(names)} names, more than {MAX_TOP_LEVEL_NAMES}"
    )
    duplicates = sorted({name for name in names if list(names).count(name) > 1})
    assert duplicates == [], f"trio_rollouts.__all__ repeats {duplicates}"
    missing = [name for name in names if not hasattr(trio_rollouts, name)]
    assert missing == [], f"trio_rollouts.__all__ names what trio_rollouts lacks: {missing}"


def not_importable(module_name: str, names: list[str]) -> list[str]:
    module = importlib.import_module(module_name)
    missing = []
    for name in names:
        try:
            exec(f"from {module_name} import {name}", {})
        except ImportError:
            missing.append(name)
        else:
            assert hasattr(module, name)
    return missing


def test_design_names_are_importable_from_the_top_level() -> None:
    missing = not_importable("trio_rollouts", TOP_LEVEL_NAMES)
    assert missing == [], f"DESIGN.md names not importable from trio_rollouts: {missing}"


def test_design_names_are_importable_from_inference() -> None:
    missing = not_importable("trio_rollouts.inference", INFERENCE_NAMES)
    assert missing == [], f"DESIGN.md names not importable from trio_rollouts.inference: {missing}"


# --------------------------------------------------------------------------- the checker


def test_the_graph_counts_type_checking_and_function_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import numpy\n"
        "if TYPE_CHECKING:\n"
        "    from trio_rollouts.models import Rollout\n"
        "def f() -> None:\n"
        "    import trio_rollouts.inference._interface\n"
        "    from trio_rollouts import agents, structure\n"
        "    from . import _rollouts\n"
        "    from ..inference import embedded\n"
    )
    edges = list(edges_of("trio_rollouts.models._requests", source))
    assert [(edge.imported, edge.line) for edge in edges] == [
        ("trio_rollouts.models", 4),
        ("trio_rollouts.inference._interface", 6),
        ("trio_rollouts.agents", 7),
        ("trio_rollouts", 7),
        ("trio_rollouts.models._rollouts", 8),
        ("trio_rollouts.inference.embedded", 9),
    ]


def test_a_package_init_importing_its_submodules_makes_edges() -> None:
    source = "from trio_rollouts.models._rollouts import Rollout as Rollout\n"
    [edge] = edges_of("trio_rollouts.models", source)
    assert str(edge) == "trio_rollouts.models -> trio_rollouts.models._rollouts (line 1)"


def test_the_circle_finder_reports_a_circle() -> None:
    def edge(a: str, b: str) -> Edge:
        return Edge(a, b, 1)

    graph = {
        "a": {"b": edge("a", "b")},
        "b": {"c": edge("b", "c")},
        "c": {"a": edge("c", "a"), "d": edge("c", "d")},
        "d": {},
    }
    [component] = strongly_connected(graph)
    assert component == ["a", "b", "c"]
    assert [str(e) for e in shortest_cycle(graph, component)] == [
        "a -> b (line 1)",
        "b -> c (line 1)",
        "c -> a (line 1)",
    ]
