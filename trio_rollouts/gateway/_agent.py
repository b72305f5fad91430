"""Agents the library did not write, as a :class:`~trio_rollouts.GroupedRolloutGenerator`:
:class:`GatewayAgent`.

A group is one problem, one gateway (:func:`~trio_rollouts.gateway.serve` on the request's
inference interface) and ``rollouts_per_group`` *members* run concurrently, each in a
session of its own. A member is the user's agent, pointed at its session's ``base_url``:

- an async ``function(base_url, problem) -> reward | None`` run in this Trio run (an
  ``openai.AsyncOpenAI`` client works on Trio), or
- a ``command``, run as a subprocess that knows nothing of this library: the OpenAI SDKs
  read ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``; the problem is in
  ``TRIO_ROLLOUTS_PROBLEM`` and on stdin, as JSON; the last line of its stdout that is a
  JSON number, or a JSON object with a ``"reward"``, is its reward.

A member that gives no reward is scored by ``reward_fn(problem, session.messages)``. Its
rollout is the session's (:meth:`GatewaySession.rollout`): the ids the model saw and
sampled, token-exact where the backend generates from ids.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import numbers
import os
import shlex
import signal
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Literal

import attrs
import trio

from trio_rollouts._checks import seconds
from trio_rollouts._concurrency import flatten_exception_groups, gather
from trio_rollouts._messages import ChatMessage
from trio_rollouts.agents._base import GroupedRolloutGenerator
from trio_rollouts.episodes import check_min_fidelity, check_on_break, check_renderer
from trio_rollouts.gateway._gateway import Gateway, GatewaySession, serve
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import TokenRollout
from trio_rollouts.pipeline._failure import StepTimeoutError
from trio_rollouts.pipeline._sampling import request_seed
from trio_rollouts.renderers import Renderer

__all__ = [
    "KILL_GRACE",
    "OUTPUT_LIMIT",
    "AgentCommandError",
    "AgentFunction",
    "CommandTimeoutError",
    "GatewayAgent",
    "problem_json",
    "reward_from_stdout",
]

#: What a ``function`` member is: ``async (base_url, problem) -> reward or None``.
AgentFunction = Callable[[str, Problem], Awaitable[float | None]]
#: What a ``reward_fn`` is: ``(problem, messages) -> reward`` (an async function's
#: awaitable is awaited).
RewardFunction = Callable[[Problem, list[ChatMessage]], float | Awaitable[float]]

#: The last this many bytes of a command's stdout, and of its stderr, are kept.
OUTPUT_LIMIT: Final = 64 * 1024
#: Seconds a cancelled command's process group has between SIGTERM and SIGKILL.
KILL_GRACE: Final = 2.0
#: Lines of a failed command's stderr its error shows.
_STDERR_LINES: Final = 20
#: Environment variables a command gets from its member (``env`` may not set them).
_MEMBER_VARIABLES: Final = (
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "OPENAI_API_KEY",
    "TRIO_ROLLOUTS_PROBLEM",
)
#: Linux refuses to exec with one environment string longer than this (MAX_ARG_STRLEN).
_MAX_VARIABLE: Final = 128 * 1024 - 64


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


# --------------------------------------------------------------------------- checks


def _check_function(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        msg = (
            "function must be an async function (base_url: str, problem: Problem) -> "
            f"float | None, or None, got {value!r:.80}"
        )
        raise TypeError(msg)


def _check_command(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None or isinstance(value, str):
        return
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, Sequence):
        msg = (
            "command must be a list of arguments (such as [sys.executable, 'agent.py']), a "
            f"str split with shlex.split, or None, got {value!r:.80}"
        )
        raise TypeError(msg)
    for i, argument in enumerate(value):
        if not isinstance(argument, (str, os.PathLike)):
            msg = f"command[{i}] must be a str (or a path), got {argument!r:.80}"
            raise TypeError(msg)


def _check_reward_fn(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        msg = (
            f"reward_fn must be a function (problem, messages) -> float, or None, got {value!r:.80}"
        )
        raise TypeError(msg)


def _check_env(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Mapping):
        msg = f"env must be a mapping of str to str (extra environment), got {value!r:.80}"
        raise TypeError(msg)
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            msg = f"env must map str to str, got {key!r:.40}: {item!r:.40}"
            raise TypeError(msg)
        if key in _MEMBER_VARIABLES:
            msg = (
                f"env may not set {key}: each member's command gets it from its session "
                f"(the variables set per member: {', '.join(_MEMBER_VARIABLES)})"
            )
            raise ValueError(msg)


def _check_optional_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, str):
        msg = f"{attribute.name} must be a str or None, got {value!r:.80}"
        raise TypeError(msg)


def _argv(command: str | Sequence[str | os.PathLike[str]]) -> tuple[str, ...]:
    if isinstance(command, str):
        try:
            argv = tuple(shlex.split(command))
        except ValueError as error:
            msg = f"command {command!r:.80} cannot be split with shlex.split: {error}"
            raise ValueError(msg) from None
    else:
        argv = tuple(os.fspath(argument) for argument in command)
    if not argv:
        msg = f"command must name a program, got {command!r:.80}"
        raise ValueError(msg)
    return argv


# --------------------------------------------------------------------------- the agent


@attrs.define(kw_only=True)
class GatewayAgent(GroupedRolloutGenerator):
    """Runs an agent the library did not write (a function or a command) behind the
    gateway and returns one token-exact :class:`~trio_rollouts.TokenRollout` per member.

    Give exactly one of ``function`` and ``command``:

    - ``function``: ``async (base_url, problem) -> float | None``, called once per member
      in this Trio run with its session's ``base_url`` (``.../sessions/<id>/v1``; send
      ``api_key``, or any key when it is ``None``);
    - ``command``: an argument list (``[sys.executable, "agent.py"]``) or a string split
      with :func:`shlex.split` (never run through a shell), run once per member with
      ``OPENAI_BASE_URL`` (and ``OPENAI_API_BASE``) set to the session's ``base_url``,
      ``OPENAI_API_KEY`` to its key, ``TRIO_ROLLOUTS_PROBLEM`` to the problem as JSON
      (:func:`problem_json`: ``problem_id``, ``prompt`` as a string or a list of
      messages, ``answer`` when it is not ``None``) and the gateway's host added to
      ``NO_PROXY``; ``env``, then ``os.environ``, give the rest (``env`` may not set
      those four). Its stdin is the same JSON. Its reward is the last line of its stdout
      that is a JSON number or a JSON object with a ``"reward"`` (``null``: none; see
      :func:`reward_from_stdout`); the last :data:`OUTPUT_LIMIT` bytes of stdout and of
      stderr are kept. Stderr is captured, not passed through: a failing command's
      error shows its last lines, and the stderr of many members at once would
      interleave on one terminal. A non-zero exit is an :class:`AgentCommandError`.
      Each command runs in a process group of its own (``start_new_session``), and
      nothing in the group outlives its member: when the command ends, what it left
      running gets SIGKILL; when the member is cancelled (the group failed or was
      cancelled, the stream closed, ``command_timeout``), the group gets SIGTERM, then
      SIGKILL once the command has exited or after :data:`KILL_GRACE` seconds. A
      process that leaves the group (``setsid``) is its own. POSIX only.

    A member's reward: what the function returned or the command printed, else
    ``reward_fn(problem, session.messages)`` (the conversation the session saw, replies
    included; after a break, that of its last element); with neither, a ``ValueError``.
    Rewards must be finite real numbers. The rollout is ``session.rollout(reward,
    env_id=env_id)`` (``extra["gateway"]`` holds the session's counts: calls, breaks,
    tool calls, per-turn records); a member that made no call to its session fails.

    The gateway of a group: ``serve(request.inference_interface, renderer, host=host,
    api_key=api_key, generation_args=request.generation_args, min_fidelity=min_fidelity,
    on_break=on_break, model=model)`` on a free port, open while the group runs. A
    backend less faithful than ``min_fidelity`` (``"server_tokens"`` by default, as for
    :class:`~trio_rollouts.MultiTurnAgent`) fails the group with
    :class:`~trio_rollouts.TokenFidelityError` before any member starts.

    Problems come from ``prompts`` (one draw per group) or an override of
    :meth:`get_problem`, as for :class:`~trio_rollouts.MultiTurnAgent`.

    Errors and cancellation: the members of a group run in one nursery. The first that
    fails cancels the others and is raised as itself with a note ``in member K of N of
    problem 'ID', <where>`` (``K`` from 0); members that failed at the same instant are
    named in a note on it. Cancelling :meth:`group_rollout` cancels every member: a
    function at its next checkpoint (it must let ``trio.Cancelled`` propagate), a
    command by killing its process group as said; each session is left (its calls in
    flight cancelled, waited for at most 5 s, shielded), then the gateway stops. It
    returns (or raises) only when all of that has ended.
    """

    #: The model family's chat template, in ids.
    renderer: Renderer = attrs.field(validator=check_renderer)
    #: The agent as an async function ``(base_url, problem) -> reward | None``.
    function: AgentFunction | None = attrs.field(default=None, validator=_check_function)
    #: The agent as a command: an argument list, or a str split with ``shlex.split``.
    command: str | Sequence[str] | None = attrs.field(default=None, validator=_check_command)
    #: ``(problem, messages) -> reward`` for members that give no reward (sync or async).
    reward_fn: RewardFunction | None = attrs.field(default=None, validator=_check_reward_fn)
    #: The environment's name, stamped on every rollout.
    env_id: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    #: The key the gateway requires (``None``: none; clients send any key).
    api_key: str | None = attrs.field(default=None, validator=_check_optional_str)
    #: Where the gateway listens (loopback by default; its port is a free one).
    host: str = attrs.field(default="127.0.0.1", validator=attrs.validators.instance_of(str))
    #: The model name the gateway lists at ``/models``.
    model: str = attrs.field(default="trio-rollouts", validator=attrs.validators.instance_of(str))
    #: The least faithful ids a turn may have (as :class:`~trio_rollouts.MultiTurnAgent`).
    min_fidelity: str = attrs.field(default="server_tokens", validator=check_min_fidelity)
    #: What a template break does: ``"split"`` (a new element) or ``"raise"``.
    on_break: Literal["split", "raise"] = attrs.field(default="split", validator=check_on_break)
    #: Seconds one member's command may run (``None``: no bound); past it the command is
    #: killed and the member fails with :class:`CommandTimeoutError`. Commands only.
    command_timeout: float | None = attrs.field(default=None, validator=seconds(positive=True))
    #: Extra environment for commands (over ``os.environ``). Commands only.
    env: Mapping[str, str] = attrs.field(factory=dict, validator=_check_env)
    # The command's argument list.
    _argv: tuple[str, ...] | None = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        if (self.function is None) == (self.command is None):
            given = "both" if self.function is not None else "neither"
            msg = (
                f"{type(self).__name__} needs exactly one of function= (an async function "
                "(base_url, problem) -> reward | None) and command= (an argument list); "
                f"{given} was given (function={self.function!r:.60}, "
                f"command={self.command!r:.60})"
            )
            raise ValueError(msg)
        if self.command is not None:
            self._argv = _argv(self.command)
        else:
            if self.command_timeout is not None:
                msg = (
                    f"command_timeout={self.command_timeout!r} bounds a command; a function "
                    "member has none (bound the group with FailurePolicy(group_timeout=...))"
                )
                raise ValueError(msg)
            if self.env:
                msg = f"env={dict(self.env)!r:.80} is a command's environment; there is no command"
                raise ValueError(msg)
        if self.prompts is None and type(self).get_problem is GatewayAgent.get_problem:
            msg = (
                f"{type(self).__name__} needs problems: pass prompts= (a PromptSource) or "
                "override get_problem(request)"
            )
            raise TypeError(msg)

    async def get_problem(self, request: GroupedRolloutRequest) -> Problem:
        """The problem of one group: the next draw from ``prompts``. Override it to take
        problems from elsewhere.

        Cancellation: a checkpoint."""
        await trio.lowlevel.checkpoint()
        if self.prompts is None:
            msg = f"{type(self).__name__} has no prompts; pass prompts= or override get_problem"
            raise ValueError(msg)
        return self.prompts.draw()

    async def group_rollout(self, request: GroupedRolloutRequest) -> list[TokenRollout]:
        """Run ``request.rollouts_per_group`` members of one problem concurrently behind
        one gateway; return their rollouts in member order.

        Errors and cancellation: see the class docstring."""
        problem = await self.get_problem(request)
        if not isinstance(problem, Problem):
            msg = f"get_problem must return a Problem, got {type(problem).__name__}"
            raise TypeError(msg)
        count = request.rollouts_per_group
        # serve() runs the server in a nursery, which wraps what the block raises in an
        # ExceptionGroup: the group's failure leaves as itself, as MultiTurnAgent's.
        with flatten_exception_groups():
            async with serve(
                request.inference_interface,
                self.renderer,
                host=self.host,
                port=0,
                api_key=self.api_key,
                generation_args=request.generation_args,
                min_fidelity=self.min_fidelity,
                on_break=self.on_break,
                model=self.model,
            ) as gateway:
                return await gather(
                    [
                        functools.partial(self._member, gateway, request, problem, member, count)
                        for member in range(count)
                    ]
                )

    async def _member(
        self,
        gateway: Gateway,
        request: GroupedRolloutRequest,
        problem: Problem,
        member: int,
        count: int,
    ) -> TokenRollout:
        """One member: its session, its agent, its reward, its rollout; an error gets a
        note naming the problem, the member and where."""
        where = "opening its session"
        try:
            # What a member raises leaves as itself (a function's nursery, the command's
            # own, would wrap it in a group), so that its note is on the failure.
            with flatten_exception_groups():
                # A run seed gives each member's session its own (its calls derive theirs).
                seed = None
                if request.seed is not None:
                    interface = request.inference_interface
                    seed = request_seed(request, interface, problem.problem_id, member)
                async with gateway.session(problem, seed=seed) as session:
                    if self._argv is None:
                        where = "in its function"
                        reward = await self._call_function(session, problem)
                    else:
                        where = f"running its command {shlex.join(self._argv)}"
                        reward = await self._run_command(self._argv, session, problem)
                if reward is None:
                    where = "in reward_fn"
                    reward = await self._reward_of_messages(problem, session.messages)
                where = "taking its rollout"
                if session.calls == 0:
                    msg = (
                        f"the member made no call to its session ({session.base_url}): point "
                        "the agent's OpenAI client at it (OPENAI_BASE_URL for a command)"
                    )
                    raise RuntimeError(msg)
                return session.rollout(reward, env_id=self.env_id)
        except Exception as exc:
            exc.add_note(
                f"in member {member} of {count} of problem {problem.problem_id!r}, {where}"
            )
            raise

    async def _call_function(self, session: GatewaySession, problem: Problem) -> float | None:
        function = self.function
        if function is None:  # pragma: no cover - __attrs_post_init__ saw to it
            msg = "no function"
            raise RuntimeError(msg)
        awaitable = function(session.base_url, problem)
        if not inspect.isawaitable(awaitable):
            msg = (
                "function must be an async function (base_url, problem) -> float | None; "
                f"{self.function!r:.60} returned a {type(awaitable).__name__}, not an awaitable"
            )
            raise TypeError(msg)
        value = await awaitable
        return None if value is None else _checked_reward(value, "the function's return value")

    async def _reward_of_messages(self, problem: Problem, messages: list[ChatMessage]) -> float:
        if self.reward_fn is None:
            how = "its function returned None" if self.function else "its command printed none"
            msg = (
                f"no reward for problem {problem.problem_id!r}: {how} and the agent has no "
                "reward_fn (return or print a reward, or pass reward_fn=(problem, messages) "
                "-> float)"
            )
            raise ValueError(msg)
        value: object = self.reward_fn(problem, list(messages))
        if inspect.isawaitable(value):
            value = await value
        return _checked_reward(value, "reward_fn's value")

    async def _run_command(
        self, argv: tuple[str, ...], session: GatewaySession, problem: Problem
    ) -> float | None:
        payload = problem_json(problem)
        if len(payload) > _MAX_VARIABLE:
            msg = (
                f"problem {problem.problem_id!r} is {len(payload)} bytes as JSON, more than "
                "an environment variable can hold (TRIO_ROLLOUTS_PROBLEM, 128 KiB on Linux)"
            )
            raise ValueError(msg)
        environment = dict(os.environ)
        environment.update(self.env)
        environment.update(
            OPENAI_BASE_URL=session.base_url,
            OPENAI_API_BASE=session.base_url,
            OPENAI_API_KEY=session.api_key,
            TRIO_ROLLOUTS_PROBLEM=payload,
        )
        _bypass_proxies(environment, self.host)
        timeout = self.command_timeout
        stdout, stderr = _Tail(), _Tail()
        with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
            returncode = await _run(argv, environment, payload.encode(), stdout, stderr)
        if scope.cancelled_caught:
            msg = (
                f"command {shlex.join(argv)} ran past command_timeout={timeout} s and was "
                f"killed with its process group{_stderr_lines(stderr.text())}"
            )
            raise CommandTimeoutError(msg)
        if returncode != 0:
            raise _command_error(argv, returncode, stderr.text())
        return reward_from_stdout(stdout.text())


# --------------------------------------------------------------------------- rewards


def _checked_reward(value: object, where: str) -> float:
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
        return _checked_reward(value, f"the reward of the command's stdout line {text!r:.80}")
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


def _bypass_proxies(environment: dict[str, str], host: str) -> None:
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
