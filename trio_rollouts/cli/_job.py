"""The job record: the settings of a job that writes its output over several runs
(``--resume``), kept beside the output as ``OUT.job.json`` so that a run resumes only the
job it belongs to.

A record holds only what changes results (the prompt file's hash, the model, the reward,
the sampling arguments, ...), never where or how fast requests went (replicas,
concurrency, timeouts), so a job may be resumed against other replicas of its server.
The output itself stays what ``load_jsonl`` reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import click

from trio_rollouts.cli._common import write_json

__all__ = [
    "JOB_FORMAT",
    "OutputFile",
    "check_job",
    "describe_differences",
    "differences",
    "job_path",
    "write_job",
]

#: The format tag of a job record.
JOB_FORMAT = "trio-rollouts.job/1"


def job_path(out: Path) -> Path:
    """Where the record of the job writing ``out`` is kept: ``OUT.job.json``."""
    return out.with_name(out.name + ".job.json")


def write_job(out: Path, command: str, settings: dict[str, Any]) -> None:
    """Record (atomically) that ``out`` is written by ``command`` with ``settings``."""
    write_json(job_path(out), {"format": JOB_FORMAT, "command": command, "settings": settings})


def _show(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def differences(first: dict[str, Any], second: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Each setting on which two jobs differ, with both full values as JSON (``"not
    set"`` where one has no such setting): ``[("group_size", "2", "3")]``."""
    missing = object()
    out = []
    for key in [*first, *(k for k in second if k not in first)]:
        mine, theirs = first.get(key, missing), second.get(key, missing)
        if mine != theirs:
            out.append(
                (
                    key,
                    "not set" if mine is missing else _show(mine),
                    "not set" if theirs is missing else _show(theirs),
                )
            )
    return out


def describe_differences(found: list[tuple[str, str, str]], first: str, second: str) -> str:
    """``differences`` as text: ``"group_size is 2 in the record, 3 in this run"``."""
    return "; ".join(f"{key} is {a} {first}, {b} {second}" for key, a, b in found)


def check_job(out: Path, command: str, settings: dict[str, Any]) -> None:
    """Refuse to resume ``out`` with settings other than its job's (a ``ClickException``
    naming every setting that differs, with both values). An output without a record
    (written before records were kept) gets one, with a warning that it was not
    checked."""
    path = job_path(out)
    if not path.exists():
        click.echo(
            f"warning: {out} has no job record ({path.name}); its settings cannot be "
            "checked, this run's are recorded",
            err=True,
        )
        write_job(out, command, settings)
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        msg = f"{path}: not valid JSON ({exc}); remove it to resume without a check"
        raise click.ClickException(msg) from None
    if not isinstance(data, dict) or data.get("format") != JOB_FORMAT:
        msg = f"{path}: not a job record of trio-rollouts (no format {JOB_FORMAT!r})"
        raise click.ClickException(msg)
    recorded = {"command": data.get("command"), **dict(data.get("settings") or {})}
    found = differences(recorded, {"command": command, **settings})
    if found:
        shown = describe_differences(found, "in the record", "in this run")
        msg = (
            f"{out} belongs to another job; its settings ({path.name}) differ from this "
            f"run's: {shown}. Resume with the same settings, or pass --overwrite to "
            "replace it, or choose another --out"
        )
        raise click.ClickException(msg)


class OutputFile:
    """The file a job appends its lines to, created only when the first line is written:
    a run that fails (or is interrupted) before it writes any leaves nothing behind, and
    the file that ``--overwrite`` would replace stays as it was. ``prepare`` runs just
    before the file is opened (writing the job's record, removing what the new file
    replaces). Use it as a context manager; it closes the file at exit."""

    def __init__(self, path: Path, *, append: bool, prepare: Callable[[], None]) -> None:
        self.path = path
        self._append = append
        self._prepare = prepare
        self._file: IO[str] | None = None

    @property
    def created(self) -> bool:
        """Whether the file was opened (created, or continued) by this run."""
        return self._file is not None

    def file(self) -> IO[str]:
        """The open file, created (after ``prepare``) at the first call."""
        if self._file is None:
            self._prepare()
            self._file = open(self.path, "a" if self._append else "w", encoding="utf-8")  # noqa: SIM115
        return self._file

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._file is not None:
            self._file.close()
