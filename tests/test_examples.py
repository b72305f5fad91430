"""The scripts in ``examples/`` run, and each one is the docs' code, verbatim.

A docs block belongs to an example when the line before its fence is
``<!-- example: examples/NAME.py -->``. The script is its own docstring, then the code of
its blocks in page order, separated by two blank lines. The docs are the source: after
editing a block, rewrite the scripts with ``python tests/test_examples.py`` (it keeps
each script's docstring). The blocks also run in the docs test, on a mock clock; here
each script runs as a user runs it, ``python examples/NAME.py``, in real time.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs_examples import PAGES, examples

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

EXAMPLE_MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<path>[\w./-]+\.py)\s*-->\s*$")

#: A line that each script prints (a regular expression, matched against each line).
EXPECTED_LINE = {
    "quickstart.py": r"2 \d \d+\+\d+ \[[-0-9. ]+\] \[[-0-9. ]+\]",
    "sync_bridge_loop.py": r"40 groups delivered",
    "weight_update_loop.py": r"epoch 5, 5 updates, 40 groups, \d+ stale, 0 mixed, unaccounted 0",
    "logging_loop.py": r"last step: 4, \d+ keys, reward [\d.]+, unaccounted 0",
    "math_reward.py": r"6 groups scored in worker processes, mean reward [\d.]+",
}

#: The module an example needs from an optional extra: without it, the run is skipped.
NEEDS = {"math_reward.py": "math_verify"}


def marked_blocks() -> dict[str, list[str]]:
    """The code of the blocks of each example (by file name), in page order."""
    blocks: dict[str, list[str]] = {}
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for block in examples(page):
            fence = block.line - 2  # the fence's index in lines
            before = next((line for line in reversed(lines[:fence]) if line.strip()), "")
            marker = EXAMPLE_MARKER.match(before)
            if marker is None:
                continue
            where = f"{page.name}:{block.line}"
            path = Path(marker["path"])
            assert path.parent == Path("examples"), f"{where}: {path} is not in examples/"
            assert block.skip_reason is None, f"{where}: an example's block must run"
            blocks.setdefault(path.name, []).append(block.code.strip("\n"))
    return blocks


def docstring_of(script: Path) -> str:
    """The script's docstring statement, as written."""
    source = script.read_text(encoding="utf-8")
    first = ast.parse(source).body[0]
    assert isinstance(first, ast.Expr), f"{script} starts with no docstring"
    assert isinstance(first.value, ast.Constant), f"{script} starts with no docstring"
    assert first.end_lineno is not None
    return "\n".join(source.splitlines()[: first.end_lineno])


def script_text(docstring: str, blocks: list[str]) -> str:
    return docstring + "\n\n" + "\n\n\n".join(blocks) + "\n"


def test_every_example_has_blocks_in_the_docs_and_an_expected_line() -> None:
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert scripts == sorted(marked_blocks())
    assert scripts == sorted(EXPECTED_LINE)


@pytest.mark.parametrize("name", sorted(EXPECTED_LINE))
def test_the_example_is_the_docs_code(name: str) -> None:
    script = EXAMPLES / name
    expected = script_text(docstring_of(script), marked_blocks()[name])
    actual = script.read_text(encoding="utf-8")
    diff = "".join(
        difflib.unified_diff(
            actual.splitlines(keepends=True),
            expected.splitlines(keepends=True),
            f"examples/{name}",
            "from the docs",
        )
    )
    assert actual == expected, (
        f"examples/{name} differs from its blocks in the docs; rewrite it with "
        f"'python tests/test_examples.py':\n{diff}"
    )


@pytest.mark.parametrize("name", sorted(EXPECTED_LINE))
def test_the_example_runs(name: str, tmp_path: Path) -> None:
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"examples/{name} exited with {done.returncode}:\n{done.stderr}"
    pattern = re.compile(EXPECTED_LINE[name])
    lines = done.stdout.splitlines()
    assert any(pattern.fullmatch(line) for line in lines), (
        f"examples/{name} printed no line matching {EXPECTED_LINE[name]!r}:\n{done.stdout}"
    )


def main() -> None:
    """Rewrite the scripts from the docs, keeping each script's docstring."""
    for name, blocks in sorted(marked_blocks().items()):
        script = EXAMPLES / name
        if script.exists():
            docstring = docstring_of(script)
        else:
            docstring = f'"""TODO: what examples/{name} shows, and where in the docs."""'
        script.write_text(script_text(docstring, blocks), encoding="utf-8")
        print(f"wrote {script.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
