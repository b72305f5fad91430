"""JSON lines: :func:`dump_jsonl` and :func:`load_jsonl`, streaming, one record a line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar, overload

from trio_rollouts.models._convert._converter import structure, unstructure
from trio_rollouts.models._convert._errors import ValidationError

__all__ = ["dump_jsonl", "load_jsonl"]

T = TypeVar("T")

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

_PathOrFile = str | os.PathLike[str] | IO[str]


class _Missing:
    """The default of ``load_jsonl``'s ``cls``, so that leaving it out is an error that
    says what it is rather than Python's bare "missing argument"."""

    def __repr__(self) -> str:
        return "<cls not given>"


_MISSING: Any = _Missing()


def _is_path(value: object) -> bool:
    return isinstance(value, (str, os.PathLike))


def dump_jsonl(objs: Iterable[object], path_or_file: _PathOrFile) -> int:
    """Write each object as one compact JSON line; return how many were written.

    A path is created or overwritten (UTF-8); an open text file is written to (and left
    open). The file is flushed after every line, so a reader (or a crash) sees whole
    records, except at most a last, truncated one, which :func:`load_jsonl` reports.
    Arguments of the wrong kind (the two swapped, say) are a ``TypeError`` that says so,
    before anything is written.
    """
    if _is_path(objs) and not _is_path(path_or_file):
        msg = (
            f"dump_jsonl(objs, path_or_file) takes the objects first and the file second; "
            f"got the path {objs!r} first (load_jsonl takes the file first)"
        )
        raise TypeError(msg)
    if isinstance(objs, (str, bytes)) or not isinstance(objs, Iterable):
        msg = f"dump_jsonl needs an iterable of objects first, got {type(objs).__name__}"
        raise TypeError(msg)
    if not _is_path(path_or_file) and not hasattr(path_or_file, "write"):
        msg = (
            "dump_jsonl needs a path or an open text file second, got "
            f"{type(path_or_file).__name__}"
        )
        raise TypeError(msg)
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, "w", encoding="utf-8") as file:
            return _write_lines(objs, file)
    return _write_lines(objs, path_or_file)


def _write_lines(objs: Iterable[object], file: IO[str]) -> int:
    count = 0
    for obj in objs:
        file.write(_encode(unstructure(obj)) + "\n")
        file.flush()
        count += 1
    return count


@overload
def load_jsonl(path_or_file: _PathOrFile, cls: type[T]) -> Iterator[T]: ...
@overload
def load_jsonl(path_or_file: _PathOrFile, cls: Any) -> Iterator[Any]: ...
def load_jsonl(path_or_file: _PathOrFile, cls: Any = _MISSING) -> Iterator[Any]:
    """Yield one ``cls`` per line of a JSON-lines file, reading one line at a time.

    Lines holding only whitespace are skipped. A line that is not valid JSON raises
    ``ValueError("line N: ...")``; a line that does not fit ``cls`` raises
    :class:`ValidationError` with ``line=N``. A last line without its newline that does
    not parse is reported as truncated (a writer interrupted mid-write), never dropped.
    A path is opened (UTF-8, a byte-order mark allowed) on the first ``next()`` and
    closed when the iterator ends or is closed; an open text file is read from its
    current position and left open. Errors name the file (a path, or an open file's
    ``name``), the line and, for invalid JSON, the column with the line around it.

    An empty file yields nothing: it is the file ``dump_jsonl([], path)`` writes. The
    arguments are checked before any reading: the two swapped (``load_jsonl(cls,
    path)``) are a ``TypeError`` that says so, and so is a missing ``cls`` (what each
    line is: ``load_jsonl(f, tr.RolloutGroup)``, ``load_jsonl(f, tr.Rollout |
    tr.TokenRollout)``).
    """
    if isinstance(path_or_file, type) or (
        not _is_path(path_or_file) and not hasattr(path_or_file, "readline")
    ):
        swapped = " (the arguments look swapped: the file comes first)" if _is_path(cls) else ""
        msg = (
            "load_jsonl(path_or_file, cls) needs a path or an open text file first, got "
            f"{path_or_file!r:.80}{swapped}"
        )
        raise TypeError(msg)
    if cls is _MISSING:
        msg = (
            "load_jsonl(path_or_file, cls) needs cls, the class each line is read as "
            "(that of the objects written): load_jsonl(f, tr.RolloutGroup) for the groups "
            "of trio-rollouts generate or demo, load_jsonl(f, tr.Rollout | tr.TokenRollout) "
            "for rollouts of either kind, load_jsonl(f, tr.PassAtKResult) for an "
            "evaluation's progress file"
        )
        raise TypeError(msg)
    return _load(path_or_file, cls)


def _load(path_or_file: _PathOrFile, cls: Any) -> Iterator[Any]:
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, encoding="utf-8-sig") as file:
            yield from _read_lines(file, cls, os.fspath(path_or_file))
    else:
        name = getattr(path_or_file, "name", None)
        yield from _read_lines(path_or_file, cls, name if isinstance(name, str) else None)


def _read_lines(file: IO[str], cls: Any, source: str | None) -> Iterator[Any]:
    where = "" if source is None else f"{source}, "
    for number, line in enumerate(file, start=1):
        if line.isspace():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            if line.endswith("\n"):
                column = exc.pos + 1  # in characters, from 1, within the line
                msg = (
                    f"{where}line {number}, column {column}: invalid JSON: {exc.msg}\n"
                    f"{_caret(line.rstrip(chr(10)), exc.pos)}"
                )
            else:
                msg = (
                    f"{where}line {number} is truncated: the file does not end with a "
                    f"newline and the line is not valid JSON ({exc.msg}); the writer was "
                    "probably interrupted mid-write"
                )
            raise ValueError(msg) from None
        try:
            obj = structure(data, cls)
        except ValidationError as exc:
            raise ValidationError(exc.errors, exc.target, number, source) from None
        yield obj


def _caret(line: str, pos: int, width: int = 60) -> str:
    """The part of ``line`` around ``pos``, and a caret under ``pos``."""
    start = max(0, pos - width // 2)
    shown = line[start : start + width]
    prefix = "..." if start else ""
    suffix = "..." if start + width < len(line) else ""
    return f"  {prefix}{shown}{suffix}\n  {' ' * (len(prefix) + pos - start)}^"
