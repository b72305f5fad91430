"""The Python examples of the docs run, against the embedded backend and against a server
that returns only text.

Conventions (for whoever writes a page in ``docs/`` or the README):

- Every fenced block tagged ``python`` is run. The blocks of one page run in order in
  one namespace, as in a notebook: a later block may use what an earlier one defined.
- A block is skipped only when the line before its fence is
  ``<!-- docs-test: skip (reason) -->``; the reason is required (an HTML comment, so no
  renderer shows it). ``<!-- docs-test: embedded-only (reason) -->`` skips it in the
  text-only run alone (for an example that needs token ids or logprobs, and says so). Skip fragments (``async for group in stream: ...``) and examples
  that need what a test run lacks (a model server, Ray).
- A block with top-level ``await`` / ``async with`` runs inside ``trio.run``, as an
  example meant for code that already runs in Trio.
- Every ``trio.run`` (the example's own, and those the library makes, e.g. the sync
  bridge's thread) runs on a :class:`trio.testing.MockClock` with autojump, so latency
  models, sleeps and timeouts cost no real time.
- Each page runs twice: as written (the ``embedded`` run), and with
  ``EmbeddedInference`` replaced by :class:`TextOnlyInference` (the ``text-only`` run):
  same constructor, same answers, but no token ids, prompt length, logprobs or policy
  epochs, and not ``ReturnsTokens`` — what a server like ``transformers serve`` or
  api.openai.com gives. So an example builds its interface as
  ``EmbeddedInference(...)`` (imported from ``trio_rollouts.inference`` or as
  ``tr.EmbeddedInference``) and must cope with either answer, or say in its text what it
  needs and carry a skip marker for the text-only run's sake.

A failing example fails with a traceback that points into the Markdown file, at the
line of the page.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import cloudpickle
import pytest
import trio
import trio.testing

import trio_rollouts
import trio_rollouts.inference
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsRaw,
)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<directive>.*?)-->\s*$")
SKIP = re.compile(r"^\s*(?P<kind>skip|embedded-only)\s*\((?P<reason>.*\S.*)\)\s*$")


@attrs.frozen
class Example:
    """One ``python`` block of a page: its code, the line its code starts on, and the
    reason it is skipped (``None``: it runs)."""

    page: Path
    line: int
    code: str
    skip_reason: str | None
    #: The reason it runs in the embedded run only (``None``: it runs in both).
    embedded_only: str | None = None

    def runs_in(self, backend: str) -> bool:
        return self.skip_reason is None and (backend == "embedded" or not self.embedded_only)


def examples(page: Path) -> list[Example]:
    """The page's ``python`` blocks, in order (code dedented to the fence's indent)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Example] = []
    previous = ""  # the last non-blank line outside a block
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            if lines[index].strip():
                previous = lines[index]
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        start = index + 1
        index = start
        while index < len(lines) and not re.match(
            rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[index]
        ):
            index += 1
        body = [line.removeprefix(indent) for line in lines[start:index]]
        index += 1  # past the closing fence
        if opening["info"].strip() == "python":
            where = f"{page.name}:{start}"
            kind, reason = marker_of(previous, where)
            found.append(
                Example(
                    page,
                    start + 1,
                    "\n".join(body) + "\n",
                    reason if kind == "skip" else None,
                    reason if kind == "embedded-only" else None,
                )
            )
        previous = ""
    return found


def marker_of(line: str, where: str) -> tuple[str | None, str | None]:
    """The marker on the line before a fence: its kind (``skip``, ``embedded-only``)
    and reason, or ``(None, None)``."""
    marker = MARKER.match(line)
    if marker is None:
        if "docs-test" in line:
            msg = f"{where}: a malformed docs-test marker: {line.strip()!r}"
            raise ValueError(msg)
        return None, None
    skip = SKIP.match(marker["directive"])
    if skip is None:
        msg = (
            f"{where}: {line.strip()!r} is not '<!-- docs-test: skip (reason) -->'; "
            "a skip needs its reason"
        )
        raise ValueError(msg)
    return skip["kind"], skip["reason"].strip()


# ----------------------------------------------------------------------- the backends


@attrs.define(kw_only=True, eq=False)
class TextOnlyInference(InferenceInterface, ReturnsRaw):
    """Answers as a server that returns only text (``transformers serve``, llama.cpp,
    Ollama, api.openai.com): the message, ``raw_text`` and ``finish_reason``, and no
    token ids, prompt length, logprobs or policy-epoch stamps. It is ``ReturnsRaw`` but
    not ``ReturnsTokens``. The answers come from an :class:`EmbeddedInference`, so the
    examples' rewards mean the same in both runs."""

    simulation: EmbeddedInference

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        full = await self.simulation.agenerate(request)
        return InferenceResponse(
            response=full.response, raw_text=full.raw_text, finish_reason=full.finish_reason
        )

    def set_generation_epoch(self, epoch: int) -> None:
        """A text-only server gets new weights too; it only does not report epochs."""
        self.simulation.set_generation_epoch(epoch)


def text_only_server(**options: Any) -> TextOnlyInference:
    """Stands in for ``EmbeddedInference(**options)`` in the text-only run."""
    return TextOnlyInference(simulation=EmbeddedInference(**options))


BACKENDS: dict[str, Callable[..., InferenceInterface]] = {
    "embedded": EmbeddedInference,
    "text-only": text_only_server,
}


# ----------------------------------------------------------------------- running


def run_example(example: Example, namespace: dict[str, Any]) -> None:
    # Blank lines before the code make the traceback's line numbers the page's.
    source = "\n" * (example.line - 1) + example.code
    code = compile(
        source, str(example.page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
    )
    if code.co_flags & inspect.CO_COROUTINE:

        async def top_level_await() -> None:
            await eval(code, namespace)  # the docs' own code

        trio.run(top_level_await)
    else:
        exec(code, namespace)  # the docs' own code


def run_page(page: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> int:
    """Run the page's examples in order in one fresh module; return how many ran."""
    real_run = trio.run

    def run_on_mock_clock(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("clock", trio.testing.MockClock(autojump_threshold=0))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(trio, "run", run_on_mock_clock)
    monkeypatch.setattr(trio_rollouts.inference, "EmbeddedInference", BACKENDS[backend])
    monkeypatch.setattr(trio_rollouts, "EmbeddedInference", BACKENDS[backend])
    module = types.ModuleType(f"docs_example_{page.stem.replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    # The module exists in this process only: what run_reward sends to a worker process
    # goes by value, as a notebook's functions do (they live in __main__).
    cloudpickle.register_pickle_by_value(module)
    ran = 0
    try:
        for example in examples(page):
            if example.runs_in(backend):
                try:
                    run_example(example, module.__dict__)
                except Exception as exc:
                    exc.add_note(
                        f"in the example at {page.name}:{example.line} ({backend} run). A "
                        "sketch, or an example that needs a server, is skipped by the line "
                        "'<!-- docs-test: skip (reason) -->' just before its fence."
                    )
                    raise
                ran += 1
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    return ran


def page_runs() -> Iterator[Any]:
    for page in PAGES:
        runnable = [e for e in examples(page) if e.skip_reason is None]
        if not runnable:
            continue
        name = page.relative_to(ROOT).as_posix()
        yield pytest.param(page, "embedded", id=f"embedded-{name}")
        # The text-only run differs only where an example builds an EmbeddedInference,
        # and runs only the examples that are not embedded-only.
        if any("EmbeddedInference" in e.code and not e.embedded_only for e in runnable):
            yield pytest.param(page, "text-only", id=f"text-only-{name}")


#: The module a page's examples need from an optional extra: without it, the page is skipped.
NEEDS = {"rewards.md": "math_verify"}


@pytest.mark.parametrize(("page", "backend"), list(page_runs()))
def test_the_examples_of_a_page_run(
    page: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if page.name in NEEDS:
        pytest.importorskip(NEEDS[page.name])
    assert run_page(page, monkeypatch, backend) > 0


def test_every_skipped_example_gives_its_reason() -> None:
    skipped = [e for page in PAGES for e in examples(page) if e.skip_reason is not None]
    assert skipped
    assert all(len(e.skip_reason or "") >= 10 for e in skipped), [
        f"{e.page.name}:{e.line}" for e in skipped if len(e.skip_reason or "") < 10
    ]


@pytest.mark.parametrize("guide", ["quickstart.md", "agents.md", "concepts.md", "sync-bridge.md"])
def test_each_guide_has_examples_that_run(guide: str) -> None:
    assert any(e.skip_reason is None for e in examples(ROOT / "docs" / guide))


def test_a_skip_marker_without_a_reason_is_an_error(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: skip -->\n```python\nraise SystemExit\n```\n")
    with pytest.raises(ValueError, match="needs its reason"):
        examples(page)


def test_a_marker_applies_to_the_next_block_only(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: skip (a fragment of the page) -->\n```python\nx = 1\n```\n\n"
        "Text.\n\n```python\ny = 2\n```\n\n```console\n$ ls\n```\n"
    )
    assert [(e.line, e.skip_reason) for e in examples(page)] == [
        (3, "a fragment of the page"),
        (9, None),
    ]


def test_a_failing_example_points_at_its_line_of_the_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```python\nx = 1\nraise ValueError(x)\n```\n")
    with pytest.raises(ValueError, match="1") as info:
        run_page(page, monkeypatch, "embedded")
    assert info.traceback[-1].path == page
    assert info.traceback[-1].lineno + 1 == 5  # pytest counts lines from 0


def test_the_text_only_backend_returns_text_and_nothing_else() -> None:
    interface = text_only_server(seed=0)
    response = interface.generate(
        interface.prepare_request("Is 7 prime?", trio_rollouts.GenerationArgs())
    )
    assert not isinstance(interface, trio_rollouts.ReturnsTokens)
    assert response.response.content
    assert response.raw_text is not None
    assert response.raw_text.endswith(response.response.content)
    assert (response.token_ids, response.prompt_length, response.logprobs) == (None, None, None)
    assert (response.policy_epoch, response.kv_cache_epoch) == ([], [])


def test_an_embedded_only_block_is_skipped_in_the_text_only_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: embedded-only (needs token ids) -->\n```python\nx = 1\n```\n")
    (example,) = examples(page)
    assert (example.skip_reason, example.embedded_only) == (None, "needs token ids")
    assert example.runs_in("embedded")
    assert not example.runs_in("text-only")
