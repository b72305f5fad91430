"""The demo's checkpoint format: one JSON file, ``CHECKPOINT_FILE`` in
``DemoConfig.checkpoint_dir``, written atomically (:func:`save_checkpoint`) and read back
with every field checked (:func:`load_demo_checkpoint`).

A checkpoint holds the policy's logits, the step, the stream's policy epoch, the prompt
source's state, the metrics so far, the stream's counters, the run's clock time and the
settings; a run resumes it only with the same settings, except those in ``_RUN_FIELDS``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
import trio

from trio_rollouts.cli._demo._config import DemoConfig
from trio_rollouts.cli._demo._trainer import StepMetrics
from trio_rollouts.envs._answer_table import FloatArray

__all__ = [
    "CHECKPOINT_FILE",
    "TOTALS",
    "DemoCheckpoint",
    "DemoCheckpointMismatch",
    "load_demo_checkpoint",
    "save_checkpoint",
]

#: The format tag of a demo checkpoint.
_CHECKPOINT_FORMAT: Final = "trio-rollouts.demo-checkpoint/1"
#: The checkpoint's file in ``DemoConfig.checkpoint_dir``.
CHECKPOINT_FILE: Final = "checkpoint.json"
#: The stream counters a checkpoint carries over to the run that resumes it.
TOTALS: Final = ("filtered", "weight_updates", "restarted", "stale", "mixed")

#: DemoConfig fields a resumed run may change: how long it runs, and where and how often
#: it saves checkpoints. Every other field must be the checkpoint's.
_RUN_FIELDS: Final = frozenset({"steps", "checkpoint_dir", "checkpoint_every"})


def _settings(config: DemoConfig) -> dict[str, Any]:
    """The fields a checkpoint must share with the run that resumes it, as plain data."""
    return {
        name: value
        for name, value in attrs.asdict(config, recurse=True).items()
        if name not in _RUN_FIELDS
    }


class DemoCheckpointMismatch(ValueError):
    """A checkpoint written with other settings than the run that would resume it.

    ``differences`` holds ``(field, value in the checkpoint, value in this run)`` for
    each :class:`DemoConfig` field that differs, the values as JSON."""

    def __init__(self, path: Path, differences: list[tuple[str, str, str]]) -> None:
        self.path = path
        self.differences = differences
        shown = "; ".join(
            f"{name} is {saved} in the checkpoint, {mine} in this run"
            for name, saved, mine in differences
        )
        super().__init__(
            f"{path} was written by a run with other settings: {shown}. Resume with the "
            "same settings (only steps, checkpoint_dir and checkpoint_every may differ), "
            "or use another checkpoint directory"
        )


def _show(value: object) -> str:
    return json.dumps(value, sort_keys=True)


@attrs.frozen(kw_only=True, eq=False)
class DemoCheckpoint:
    """A demo checkpoint, as :func:`load_demo_checkpoint` read it.

    ``step``: the last step it holds; ``policy_epoch``: the stream's epoch after that
    step's update; ``logits``: the policy's; ``prompts``: the
    :meth:`PromptSource.state_dict` of the problems; ``history``: every step's metrics
    so far; ``totals``: the stream's counters summed over the runs so far
    (``filtered``, ``weight_updates``, ``restarted``, ``stale``, ``mixed``), and
    ``elapsed``, the run's clock time so far.
    """

    path: Path
    step: int
    policy_epoch: int
    initial_accuracy: float
    logits: FloatArray
    prompts: dict[str, Any]
    history: tuple[StepMetrics, ...]
    totals: dict[str, int]
    elapsed: float
    groups_per_step: int

    @property
    def groups(self) -> int:
        """The groups trained on up to the checkpoint (the first ``groups`` lines of an
        ``out`` file written by the runs that led to it)."""
        return self.step * self.groups_per_step


def _invalid(path: Path, what: str) -> ValueError:
    return ValueError(f"{path} is not a valid demo checkpoint ({what}); remove it to start afresh")


def _natural(data: dict[str, Any], key: str, path: Path, minimum: int = 0) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _invalid(path, f"{key} must be an int >= {minimum}, got {value!r:.80}")
    return value


def _number(data: dict[str, Any], key: str, path: Path) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _invalid(path, f"{key} must be a number, got {value!r:.80}")
    return float(value)


def load_demo_checkpoint(config: DemoConfig) -> DemoCheckpoint | None:
    """The checkpoint in ``config.checkpoint_dir``, or ``None`` when there is none (or no
    directory is set).

    Raises :class:`DemoCheckpointMismatch` when it was written with other settings than
    ``config`` (naming each field that differs), and ``ValueError`` when it is not a
    demo checkpoint or is at a step past ``config.steps``.
    """
    if config.checkpoint_dir is None:
        return None
    path = config.checkpoint_dir / CHECKPOINT_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _invalid(path, f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != _CHECKPOINT_FORMAT:
        raise _invalid(path, f"no format {_CHECKPOINT_FORMAT!r}")
    saved = data.get("settings")
    if not isinstance(saved, dict):
        raise _invalid(path, "no settings")
    mine = _settings(config)
    missing = object()
    differences = [
        (
            name,
            "not set" if saved.get(name, missing) is missing else _show(saved[name]),
            _show(value),
        )
        for name, value in mine.items()
        if saved.get(name, missing) != value
    ]
    differences += [(name, _show(saved[name]), "not set") for name in saved if name not in mine]
    if differences:
        raise DemoCheckpointMismatch(path, differences)
    step = _natural(data, "step", path, 1)
    if step > config.steps:
        msg = (
            f"{path} holds step {step}, past this run's last step ({config.steps}); "
            f"run {step} steps or more, or use another checkpoint directory"
        )
        raise ValueError(msg)
    policy_epoch = _natural(data, "policy_epoch", path)
    try:
        logits = np.asarray(data.get("logits"), dtype=np.float64)
    except (TypeError, ValueError):
        raise _invalid(path, "logits must be a table of numbers") from None
    shape = (config.num_problems, config.num_candidates)
    if logits.shape != shape or not np.all(np.isfinite(logits)):
        raise _invalid(path, f"logits must be {shape[0]} x {shape[1]} finite numbers")
    prompts = data.get("prompts")
    if not isinstance(prompts, dict):
        raise _invalid(path, "no prompts state")
    history_data = data.get("history")
    fields = set(attrs.fields_dict(StepMetrics))
    if (
        not isinstance(history_data, list)
        or len(history_data) != step
        or not all(isinstance(m, dict) and set(m) == fields for m in history_data)
    ):
        raise _invalid(path, f"history must hold the metrics of steps 1 to {step}")
    try:
        history = tuple(StepMetrics(**m) for m in history_data)
    except TypeError as exc:
        raise _invalid(path, f"history: {exc}") from None
    totals_data = data.get("totals")
    if not isinstance(totals_data, dict):
        raise _invalid(path, "no totals")
    totals = {name: _natural(totals_data, name, path) for name in TOTALS}
    return DemoCheckpoint(
        path=path,
        step=step,
        policy_epoch=policy_epoch,
        initial_accuracy=_number(data, "initial_accuracy", path),
        logits=logits,
        prompts=prompts,
        history=history,
        totals=totals,
        elapsed=_number(data, "elapsed", path),
        groups_per_step=config.groups_per_step,
    )


@trio.lowlevel.enable_ki_protection
def save_checkpoint(
    directory: Path,
    config: DemoConfig,
    *,
    step: int,
    policy_epoch: int,
    initial_accuracy: float,
    logits: FloatArray,
    prompts: dict[str, Any],
    history: Sequence[StepMetrics],
    totals: dict[str, int],
    elapsed: float,
) -> None:
    """Write the checkpoint of ``step`` atomically: to a temporary file in ``directory``,
    synced, then renamed over the old one, so that a crash at any instant leaves the old
    checkpoint or the new one, whole. Ctrl-C is held off until it is written (Trio
    delivers it at the next checkpoint). Not a (Trio) checkpoint."""
    data = {
        "format": _CHECKPOINT_FORMAT,
        "step": step,
        "policy_epoch": policy_epoch,
        "settings": _settings(config),
        "initial_accuracy": initial_accuracy,
        "logits": logits.tolist(),
        "prompts": prompts,
        "history": [attrs.asdict(m) for m in history],
        "totals": totals,
        "elapsed": elapsed,
    }
    text = json.dumps(data, separators=(",", ":"))
    # Named by the process (one writer per process), created as any file is (not 0600).
    partial = directory / f".{CHECKPOINT_FILE}.{os.getpid()}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, directory / CHECKPOINT_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    # The rename itself survives a power cut once the directory is synced (POSIX).
    with contextlib.suppress(OSError):
        directory_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(directory_fd)
        finally:
            os.close(directory_fd)
