"""JSON lines: :func:`dump_jsonl` and :func:`load_jsonl`, streaming, one record a line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar, overload

from ._converter import structure, unstructure
from ._errors import ValidationError

__all__ = ["dump_jsonl", "load_jsonl"]

T = TypeVar("T")

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode

_PathOrFile = str | os.PathLike[str] | IO[str]


def dump_jsonl(objs: Iterable[object], path_or_file: _PathOrFile) -> int:
    """Write each object as one compact JSON line; return how many were written.

    A path is created or overwritten (UTF-8); an open text file is written to (and left
    open). The file is flushed after every line, so a reader (or a crash) sees whole
    records, except at most a last, truncated one, which :func:`load_jsonl` reports.
    """
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
def load_jsonl(path_or_file: _PathOrFile, cls: Any) -> Iterator[Any]:
    """Yield one ``cls`` per line of a JSON-lines file, reading one line at a time.

    Lines holding only whitespace are skipped. A line that is not valid JSON raises
    ``ValueError("line N: ...")``; a line that does not fit ``cls`` raises
    :class:`ValidationError` with ``line=N``. A last line without its newline that does
    not parse is reported as truncated (a writer interrupted mid-write), never dropped.
    A path is opened (UTF-8) on the first ``next()`` and closed when the iterator ends or
    is closed; an open text file is read from its current position and left open.
    """
    if isinstance(path_or_file, (str, os.PathLike)):
        with open(path_or_file, encoding="utf-8") as file:
            yield from _read_lines(file, cls)
    else:
        yield from _read_lines(path_or_file, cls)


def _read_lines(file: IO[str], cls: Any) -> Iterator[Any]:
    for number, line in enumerate(file, start=1):
        if line.isspace():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            if line.endswith("\n"):
                msg = f"line {number}: invalid JSON: {exc.msg} (column {exc.colno})"
            else:
                msg = (
                    f"line {number} is truncated: the file does not end with a newline and "
                    f"the line is not valid JSON ({exc.msg}); the writer was probably "
                    f"interrupted mid-write"
                )
            raise ValueError(msg) from None
        try:
            obj = structure(data, cls)
        except ValidationError as exc:
            raise ValidationError(exc.errors, exc.target, number) from None
        yield obj
