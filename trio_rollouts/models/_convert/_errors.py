"""Error paths: :class:`ValidationError`, what hooks raise on the way to it
(:class:`Invalid`, with paths relative to the value at hand), and the messages' pieces
(paths, bounded value reprs, type names)."""

from __future__ import annotations

import reprlib
import typing
from collections.abc import Sequence
from typing import Any

from cattrs.errors import BaseValidationError, ClassValidationError, IterableValidationError

from trio_rollouts.models._convert._types import NoneType, is_union

__all__ = [
    "DATA_ERRORS",
    "Invalid",
    "Problem",
    "ValidationError",
    "collect",
    "describe",
    "format_path",
    "problems_of",
    "type_name",
]

#: A location inside the data being structured: attribute names and list indices.
DataPath = tuple[str | int, ...]
Problem = tuple[str, DataPath]


class ValidationError(ValueError):
    """Data that does not fit the model it is structured as.

    ``errors`` lists every problem found as ``(message, path)`` pairs, the path written
    as ``$.rollouts[2].trajectory[0][5]`` (``$`` is the value passed to ``structure``).
    ``target`` names the type structured to, ``line`` is the 1-based line number when
    the data came from :func:`load_jsonl` (else ``None``), and ``source`` the file's name
    when it has one.
    """

    def __init__(
        self,
        errors: Sequence[tuple[str, str]],
        target: str | None = None,
        line: int | None = None,
        source: str | None = None,
    ) -> None:
        self.errors: list[tuple[str, str]] = list(errors)
        self.target = target
        self.line = line
        self.source = source
        count = len(self.errors)
        head = f"{count} validation error{'' if count == 1 else 's'}"
        if target is not None:
            head = f"{head} for {target}"
        if line is not None:
            head = f"line {line}: {head}"
        if source is not None:
            head = f"{source}, {head}"
        body = "".join(f"\n  {message} @ {path}" for message, path in self.errors)
        super().__init__(head + body)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.errors, self.target, self.line, self.source))


class Invalid(Exception):
    """Problems found while structuring, with paths relative to the value at hand.

    Hooks raise this instead of :class:`ValidationError` so that each enclosing list or
    record only prepends its own path segment; :func:`structure` formats once, at the top.
    """

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(problems)
        self.problems = problems

    @classmethod
    def at(cls, message: str, *path: str | int) -> Invalid:
        return cls([(message, path)])


#: What a hook may raise for bad data: ours, cattrs' trees, and the model constructors'
#: ValueError/TypeError (attrs validators, ``__attrs_post_init__``).
DATA_ERRORS = (Invalid, BaseValidationError, ValueError, TypeError)


def problems_of(exc: BaseException) -> list[Problem]:
    if isinstance(exc, Invalid):
        return exc.problems
    if isinstance(exc, IterableValidationError):
        problems: list[Problem] = []
        indexed, unplaced = exc.group_exceptions()
        for sub, index_note in indexed:
            problems += _prefixed(problems_of(sub), index_note.index)
        for sub in unplaced:
            problems += problems_of(sub)
        return problems
    if isinstance(exc, ClassValidationError):
        problems = []
        named, unplaced = exc.group_exceptions()
        for sub, name_note in named:
            problems += _prefixed(problems_of(sub), name_note.name)
        for sub in unplaced:
            problems += problems_of(sub)
        return problems
    if isinstance(exc, KeyError):
        # cattrs' generated structuring code signals a missing field with a KeyError.
        return [("required field missing", ())]
    return [(str(exc) or type(exc).__name__, ())]


def _prefixed(problems: list[Problem], segment: str | int) -> list[Problem]:
    return [(message, (segment, *path)) for message, path in problems]


def collect(
    problems: list[Problem] | None, exc: BaseException, segment: str | int
) -> list[Problem]:
    if problems is None:
        problems = []
    problems += _prefixed(problems_of(exc), segment)
    return problems


def format_path(path: DataPath) -> str:
    return "$" + "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path)


_short_repr = reprlib.Repr()
_short_repr.maxstring = 40
_short_repr.maxother = 40
_short_repr.maxlist = 4
_short_repr.maxdict = 4


def describe(value: object) -> str:
    """``str '3'``, ``list [1, 2, ...]``: a value's type and a bounded repr of it."""
    if value is None:
        return "None"
    return f"{type(value).__name__} {_short_repr.repr(value)}"


def type_name(tp: Any) -> str:
    """``list[int]``, ``Rollout | TokenRollout``: a type as a user would write it."""
    if tp is NoneType:
        return "None"
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if is_union(tp):
        return " | ".join(type_name(arg) for arg in args)
    if origin is not None and args:
        return f"{type_name(origin)}[{', '.join(type_name(arg) for arg in args)}]"
    return str(getattr(tp, "__name__", tp))
