"""The command line's files: prompt files in, rollout groups out, and resuming a job.

A *prompt file* is JSON lines, one problem per line::

    {"problem_id": "gsm8k-17", "prompt": "What is 17 + 25?", "answer": 42}
    {"problem_id": "chat-3", "prompt": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Capital of France?"}],
     "answer": "Paris"}

- ``prompt`` (required): a string (one user message) or a non-empty list of chat
  messages, each ``{"role": str, "content": str}`` (other keys, such as ``name``, pass
  through to the server).
- ``problem_id`` (optional): a string or an integer, unique in the file; it defaults to
  the line number (``"line-7"``). ``--resume`` recognizes finished problems by it.
- ``answer`` (optional): any JSON value, what the reward function checks against;
  required by every ``--reward``.
- Other keys are ignored; blank lines are skipped.

An *output file* holds one :class:`~trio_rollouts.RolloutGroup` per line, written whole
(one ``write`` and a flush, with Trio's KeyboardInterrupt held off) so an interrupted job
leaves only complete lines; :func:`scan_output` reads one back for ``--resume``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import IO, Any

import attrs
import trio

from trio_rollouts._messages import ChatMessage
from trio_rollouts.models._convert import ValidationError, dump_jsonl, structure
from trio_rollouts.models._problems import Problem

__all__ = [
    "OutputState",
    "PromptFileError",
    "group_problem_id",
    "load_problems",
    "result_problem_id",
    "scan_output",
    "truncate_torn_line",
    "write_groups",
]


class PromptFileError(ValueError):
    """A prompt or output file that cannot be used; the message is one line naming the
    file, the line and the problem."""


def _prompt(value: object, where: str) -> str | list[ChatMessage]:
    if isinstance(value, str):
        if not value:
            msg = f"{where}: 'prompt' is an empty string"
            raise PromptFileError(msg)
        return value
    if isinstance(value, list) and value:
        try:
            messages = structure(value, list[ChatMessage])
        except ValidationError as exc:
            message, path = exc.errors[0]
            msg = (
                f"{where}: 'prompt' is not a list of {{role, content}} messages: {message} @ {path}"
            )
            raise PromptFileError(msg) from None
        return messages
    msg = (
        f"{where}: 'prompt' must be a string or a non-empty list of {{role, content}} "
        f"messages, got {json.dumps(value)[:60]}"
    )
    raise PromptFileError(msg)


def _problem(data: object, where: str, line: int, need_answer: bool) -> Problem:
    if not isinstance(data, dict):
        msg = f"{where}: a row must be a JSON object, got {type(data).__name__}"
        raise PromptFileError(msg)
    if "prompt" not in data:
        msg = f"{where}: no 'prompt' (a row needs a prompt; see the prompt file schema)"
        raise PromptFileError(msg)
    problem_id = data.get("problem_id", f"line-{line}")
    if isinstance(problem_id, int) and not isinstance(problem_id, bool):
        problem_id = str(problem_id)
    if not isinstance(problem_id, str) or not problem_id:
        msg = (
            f"{where}: 'problem_id' must be a non-empty string or an integer, "
            f"got {problem_id!r:.60}"
        )
        raise PromptFileError(msg)
    if need_answer and "answer" not in data:
        msg = f"{where}: no 'answer' (the reward function checks the completion against it)"
        raise PromptFileError(msg)
    return Problem(
        problem_id=problem_id, prompt=_prompt(data["prompt"], where), answer=data.get("answer")
    )


def _column(text: str, pos: int) -> str:
    """Where in a line (its newline cut off) a JSON error is: 1-based, as editors count."""
    if pos >= len(text):
        return f"at the end of the line (column {len(text) + 1})"
    return f"column {pos + 1}"


def load_problems(path: str | os.PathLike[str], *, need_answer: bool = True) -> list[Problem]:
    """Read a prompt file (see the module docstring); raise :class:`PromptFileError` for
    the first bad row or a duplicate ``problem_id``, or when the file has no rows."""
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as file:
            for line_number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                where = f"{name} line {line_number}"
                text = line.rstrip("\r\n")
                try:
                    data = json.loads(text)
                except json.JSONDecodeError as exc:
                    msg = f"{where}: not valid JSON ({exc.msg}, {_column(text, exc.pos)})"
                    raise PromptFileError(msg) from None
                problem = _problem(data, where, line_number, need_answer)
                first = seen.setdefault(problem.problem_id, line_number)
                if first != line_number:
                    msg = (
                        f"{where}: problem_id {problem.problem_id!r} is already used on "
                        f"line {first}; problem ids must be unique"
                    )
                    raise PromptFileError(msg)
                problems.append(problem)
    except UnicodeDecodeError as exc:
        msg = f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise PromptFileError(msg) from None
    if not problems:
        msg = f"{name}: no prompts (the file is empty)"
        raise PromptFileError(msg)
    return problems


# --------------------------------------------------------------------------- output


@attrs.frozen(kw_only=True)
class OutputState:
    """What an existing output file holds: the problem ids of its groups, how many
    groups, and, when its last line is torn (no newline, not a complete group), where the
    whole lines end and how many bytes follow."""

    problem_ids: frozenset[str]
    groups: int
    whole_bytes: int
    torn_bytes: int = 0
    missing_newline: bool = False


def group_problem_id(data: Any) -> str | None:
    """The ``problem_id`` of an output line of ``generate`` (a rollout group)."""
    if isinstance(data, dict) and isinstance(data.get("rollouts"), list) and data["rollouts"]:
        first = data["rollouts"][0]
        if isinstance(first, dict):
            problem_id = first.get("problem_id")
            return problem_id if isinstance(problem_id, str) else None
    return None


def result_problem_id(data: Any) -> str | None:
    """The ``problem_id`` of a progress line of ``eval`` (a pass@k result)."""
    if isinstance(data, dict) and isinstance(data.get("problem_id"), str):
        return str(data["problem_id"])
    return None


def scan_output(
    path: str | os.PathLike[str],
    *,
    problem_id_of: Callable[[Any], str | None] = group_problem_id,
    expected: str = "a rollout group with a problem_id; resume only into an output of "
    "'trio-rollouts generate'",
) -> OutputState:
    """Read an output file's problem ids for ``--resume``.

    ``problem_id_of`` finds a line's problem id (``None``: the line is not what the file
    should hold, which ``expected`` describes in the error). A last line without its
    newline that is not complete JSON is *torn* (a writer cut off mid-line): it is
    reported in :attr:`OutputState.torn_bytes`, not read. A complete line that is not
    what the file should hold is a :class:`PromptFileError`.
    """
    name = os.fspath(path)
    ids: set[str] = set()
    groups = 0
    offset = 0
    with open(path, "rb") as file:
        for line_number, raw in enumerate(file, start=1):
            complete = raw.endswith(b"\n")
            try:
                data = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                if not complete:
                    return OutputState(
                        problem_ids=frozenset(ids),
                        groups=groups,
                        whole_bytes=offset,
                        torn_bytes=len(raw),
                    )
                if not raw.strip():
                    offset += len(raw)
                    continue
                msg = (
                    f"{name} line {line_number} is not valid JSON ({exc}); it is not an "
                    "output of this tool, or was edited: fix or remove it to resume"
                )
                raise PromptFileError(msg) from None
            problem_id = problem_id_of(data)
            if problem_id is None:
                msg = f"{name} line {line_number} is not {expected}"
                raise PromptFileError(msg)
            ids.add(problem_id)
            groups += 1
            offset += len(raw)
            if not complete:
                return OutputState(
                    problem_ids=frozenset(ids),
                    groups=groups,
                    whole_bytes=offset,
                    missing_newline=True,
                )
    return OutputState(problem_ids=frozenset(ids), groups=groups, whole_bytes=offset)


def truncate_torn_line(path: str | os.PathLike[str], state: OutputState) -> None:
    """Cut a torn last line off (or add the newline a complete last line lacks)."""
    if state.torn_bytes:
        with open(path, "r+b") as file:
            file.truncate(state.whole_bytes)
    elif state.missing_newline:
        with open(path, "ab") as file:
            file.write(b"\n")


@trio.lowlevel.enable_ki_protection
def write_groups(file: IO[str], groups: Iterable[object]) -> int:
    """Append groups (or any records) as whole JSON lines: each line in one ``write``
    and flushed, with KeyboardInterrupt held off until the line is out (Trio delivers it
    at the next checkpoint instead), so Ctrl-C never leaves half a line. Not a
    checkpoint."""
    return dump_jsonl(groups, file)
