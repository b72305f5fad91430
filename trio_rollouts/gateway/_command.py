"""A :class:`~trio_rollouts.GatewayAgent` member run as a command: a subprocess in a
process group of its own, its reward read from its stdout, nothing of it outliving its
member (:func:`run_command`)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import numbers
import os
import shlex
import signal
import subprocess
from collections.abc import Sequence
from typing import Any, Final

import attrs
import trio

from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts.models._problems import Problem
from trio_rollouts.pipeline._failure import StepTimeoutError

__all__ = [
    "KILL_GRACE",
    "MAX_VARIABLE",
    "OUTPUT_LIMIT",
    "AgentCommandError",
    "CommandTimeoutError",
    "bypass_proxies",
    "checked_reward",
    "problem_json",
    "reward_from_stdout",
    "run_command",
]

#: The last this many bytes of a command's stdout, and of its stderr, are kept.
OUTPUT_LIMIT: Final = 64 * 1024
#: Seconds a cancelled command's process group has between SIGTERM and SIGKILL.
KILL_GRACE: Final = 2.0
#: Lines of a failed command's stderr its error shows.
_STDERR_LINES: Final = 20
#: Linux refuses to exec with one environment string longer than this (MAX_ARG_STRLEN).
MAX_VARIABLE: Final = 128 * 1024 - 64


class AgentCommandError(RuntimeError):
    """A :class:`GatewayAgent` command exited with a non-zero status (or was killed by a
    signal). The message names the command, the exit status and the last lines of its
    stderr. Not transient by default.

    Attributes: ``command`` (the argument list), ``returncode`` (negative: the signal
    that killed it), ``stderr`` (the last :data:`OUTPUT_LIMIT` bytes, decoded)."""

    def __init__(
        self,
        message: str,
        *,
        command: Sequence[str] = (),
        returncode: int = 0,
        stderr: str = "",
    ) -> None:
        super().__init__(message)
        self.command = list(command)
        self.returncode = returncode
        self.stderr = stderr


class CommandTimeoutError(StepTimeoutError):
    """A :class:`GatewayAgent` command ran past ``command_timeout`` and was killed with
    its whole process group. A :class:`~trio_rollouts.StepTimeoutError`, so transient
    by default: the failure policy retries the group when it allows retries."""


async def run_command(
    argv: tuple[str, ...],
    environment: dict[str, str],
    payload: str,
    command_timeout: float | None,
) -> float | None:
    """Run ``argv`` with ``environment``, ``payload`` on its stdin; return the reward its
    stdout gives (:func:`reward_from_stdout`). :class:`CommandTimeoutError` past
    ``command_timeout`` seconds, :class:`AgentCommandError` for a non-zero exit.

    Cancellation: kills the command's process group (SIGTERM, SIGKILL after
    :data:`KILL_GRACE` seconds) and returns once the command has exited."""
    stdout, stderr = _Tail(), _Tail()
    timeout = math.inf if command_timeout is None else command_timeout
    with trio.move_on_after(timeout) as scope:
        returncode = await _run(argv, environment, payload.encode(), stdout, stderr)
    if scope.cancelled_caught:
        msg = (
            f"command {shlex.join(argv)} ran past command_timeout={command_timeout} s and was "
            f"killed with its process group{_stderr_lines(stderr.text())}"
        )
        raise CommandTimeoutError(msg)
    if returncode != 0:
        raise _command_error(argv, returncode, stderr.text())
    return reward_from_stdout(stdout.text())


# --------------------------------------------------------------------------- rewards


def checked_reward(value: object, where: str) -> float:
    """``value`` as a float: a finite real number (numpy's too; never a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        msg = f"{where} must be a real number (the reward), got {value!r:.80}"
        raise TypeError(msg)
    reward = float(value)
    if not math.isfinite(reward):
        msg = f"{where} must be a finite number (the reward), got {value!r}"
        raise ValueError(msg)
    return reward


def reward_from_stdout(stdout: str) -> float | None:
    """A command's reward: its stdout's last line that is a JSON number, or a JSON object
    with a ``"reward"`` key (whose ``null`` means "no reward"); ``None`` when there is no
    such line. Other lines, JSON or not, are skipped. ``TypeError`` or ``ValueError``
    when the reward found is not a finite number (naming the line)."""
    for line in reversed(stdout.splitlines()):
        text = line.strip()
        if not text:
            continue
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict) and "reward" in value:
            value = value["reward"]
            if value is None:
                return None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        return checked_reward(value, f"the reward of the command's stdout line {text!r:.80}")
    return None


# --------------------------------------------------------------------------- the command


def problem_json(problem: Problem) -> str:
    """``problem`` as the JSON a command gets (``TRIO_ROLLOUTS_PROBLEM`` and stdin):
    ``problem_id``; ``prompt``, a string or a list of messages (``role``, ``content`` and
    their extra keys); ``answer`` when it is not ``None`` (numpy values as numbers,
    anything else JSON cannot hold as its ``str``)."""
    prompt: str | list[dict[str, Any]]
    if isinstance(problem.prompt, str):
        prompt = problem.prompt
    else:
        prompt = [
            {**message.extra, "role": message.role, "content": message.content}
            for message in problem.prompt
        ]
    document: dict[str, Any] = {"problem_id": problem.problem_id, "prompt": prompt}
    if problem.answer is not None:
        document["answer"] = problem.answer
    return json.dumps(document, ensure_ascii=False, default=_jsonable)


def _jsonable(value: object) -> object:
    to_list = getattr(value, "tolist", None)  # numpy scalars and arrays
    if callable(to_list):
        return to_list()
    return str(value)


def bypass_proxies(environment: dict[str, str], host: str) -> None:
    """Add the gateway's host to ``NO_PROXY``/``no_proxy``: an HTTP proxy inherited from
    the environment must not carry a member's calls to loopback away."""
    for name in ("NO_PROXY", "no_proxy"):
        current = environment.get(name, "")
        hosts = [h.strip() for h in current.split(",") if h.strip()]
        if host not in hosts and "*" not in hosts:
            environment[name] = ",".join([*hosts, host])


@attrs.define(eq=False)
class _Tail:
    """The last :data:`OUTPUT_LIMIT` bytes of a stream."""

    data: bytearray = attrs.field(factory=bytearray)
    dropped: int = 0

    def add(self, chunk: bytes | bytearray) -> None:
        self.data += chunk
        excess = len(self.data) - OUTPUT_LIMIT
        if excess > 0:
            del self.data[:excess]
            self.dropped += excess

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        if self.dropped:
            _, _, text = text.partition("\n")  # the first line is cut: drop it
        return text


async def _read(stream: trio.abc.ReceiveStream | None, tail: _Tail) -> None:
    if stream is None:  # pragma: no cover - stdout and stderr are pipes
        return
    async with stream:
        async for chunk in stream:
            tail.add(chunk)


def _signal_group(pgid: int, signum: int) -> None:
    """``killpg``, for a group that may be gone already."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


async def _kill_group(process: trio.Process) -> None:
    """``deliver_cancel`` of a member's command: SIGTERM to its process group, then
    SIGKILL to whatever is left of the group once the command has exited (``run_process``
    cancels this then) or after :data:`KILL_GRACE` seconds."""
    try:
        _signal_group(process.pid, signal.SIGTERM)
        await trio.sleep(KILL_GRACE)
    finally:
        _signal_group(process.pid, signal.SIGKILL)


async def _run(
    argv: tuple[str, ...], environment: dict[str, str], stdin: bytes, stdout: _Tail, stderr: _Tail
) -> int:
    """Run a member's command in a process group of its own; keep the tails of its
    stdout and stderr; return its exit status. Nothing of the group outlives this: after
    the command exits, the rest of its group gets SIGKILL (which also closes the pipes
    they held); when this is cancelled, :func:`_kill_group` runs.

    Cancellation: kills the process group (see :func:`_kill_group`) and returns once the
    command has exited."""
    returncode: list[int] = []

    async def run(task_status: trio.TaskStatus[trio.Process]) -> None:
        async with trio.open_nursery() as inner:
            process: trio.Process = await inner.start(
                functools.partial(
                    trio.run_process,
                    list(argv),
                    stdin=stdin,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    check=False,
                    start_new_session=True,
                    env=environment,
                    deliver_cancel=_kill_group,
                )
            )
            task_status.started(process)
        # The command has exited: what it left in its group dies with it.
        _signal_group(process.pid, signal.SIGKILL)
        returncode.append(await process.wait())

    with flatten_exception_groups():
        async with trio.open_nursery() as nursery:
            process = await nursery.start(run)
            nursery.start_soon(_read, process.stdout, stdout)
            nursery.start_soon(_read, process.stderr, stderr)
    return returncode[0]


def _stderr_lines(text: str) -> str:
    """The last lines of a command's stderr, for its error."""
    lines = text.rstrip("\n").splitlines()[-_STDERR_LINES:]
    if not lines:
        return " (its stderr was empty)"
    return "; the last lines of its stderr:\n" + "\n".join(lines)


def _command_error(argv: tuple[str, ...], code: int, stderr: str) -> AgentCommandError:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        status = f"was killed by {name}"
    else:
        status = f"exited with status {code}"
    msg = f"command {shlex.join(argv)} {status}{_stderr_lines(stderr)}"
    return AgentCommandError(msg, command=argv, returncode=code, stderr=stderr)
