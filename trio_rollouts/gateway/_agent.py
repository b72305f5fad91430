"""Agents the library did not write, as a :class:`~trio_rollouts.GroupedRolloutGenerator`:
:class:`GatewayAgent`.

A group is one problem, one gateway (:func:`~trio_rollouts.gateway.serve` on the request's
inference interface) and ``rollouts_per_group`` *members* run concurrently, each in a
session of its own. A member is the user's agent, pointed at its session's ``base_url``:

- an async ``function(base_url, problem) -> reward | None`` run in this Trio run (an
  ``openai.AsyncOpenAI`` client works on Trio), or, written for asyncio (the Agents
  SDK's ``Runner.run``), in an asyncio loop of its own on a worker thread, or
- a ``command``, run as a subprocess that knows nothing of this library: the OpenAI SDKs
  read ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``; the problem is in
  ``TRIO_ROLLOUTS_PROBLEM`` and on stdin, as JSON; the last line of its stdout that is a
  JSON number, or a JSON object with a ``"reward"``, is its reward.

A member that gives no reward is scored by ``reward_fn(problem, session.messages)``. Its
rollout is the session's (:meth:`GatewaySession.rollout`): the ids the model saw and
sampled, token-exact where the backend generates from ids.
"""

from __future__ import annotations

import functools
import inspect
import os
import shlex
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Literal

import attrs

from trio_rollouts._checks import check_optional_str, seconds
from trio_rollouts._concurrency import flatten_exception_groups, gather
from trio_rollouts._messages import ChatMessage
from trio_rollouts.agents._base import GroupedRolloutGenerator, check_problems, draw_problem
from trio_rollouts.episodes import check_min_fidelity, check_on_break, check_renderer
from trio_rollouts.gateway._asyncio import (
    AsyncioCancelTimeoutError,
    asyncio_error_hint,
    run_in_asyncio,
    written_for_asyncio,
)
from trio_rollouts.gateway._command import (
    KILL_GRACE,
    MAX_VARIABLE,
    OUTPUT_LIMIT,
    AgentCommandError,
    CommandTimeoutError,
    bypass_proxies,
    checked_reward,
    problem_json,
    reward_from_stdout,
    run_command,
)
from trio_rollouts.gateway._gateway import Gateway, GatewaySession, serve
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import TokenRollout
from trio_rollouts.pipeline._sampling import request_seed
from trio_rollouts.renderers import Renderer

__all__ = [
    "ASYNCIO_CANCEL_TIMEOUT",
    "KILL_GRACE",
    "OUTPUT_LIMIT",
    "AgentCommandError",
    "AgentFunction",
    "AsyncioCancelTimeoutError",
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

#: Seconds a cancelled asyncio function's loop has to end, by default.
ASYNCIO_CANCEL_TIMEOUT: Final = 5.0
#: Environment variables a command gets from its member (``env`` may not set them).
_MEMBER_VARIABLES: Final = (
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "OPENAI_API_KEY",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_KEY",
    "TRIO_ROLLOUTS_PROBLEM",
)
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


def _check_asyncio(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, bool):
        msg = (
            "asyncio must be True (run the function in an asyncio loop of its own), False "
            f"(in this Trio run) or None (detect it from its code), got {value!r:.80}"
        )
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
      with its session's ``base_url`` (``.../sessions/<id>/v1``; send ``api_key``, or any
      key when it is ``None``): in this Trio run, or in an asyncio loop of its own on a
      worker thread when ``asyncio=True``, or ``None`` and its code uses asyncio (see
      :mod:`trio_rollouts.gateway._asyncio`; a Trio run's ``no running event loop``
      error gets a note saying to pass ``asyncio=True``);
    - ``command``: an argument list (``[sys.executable, "agent.py"]``) or a string split
      with :func:`shlex.split` (never run through a shell), run once per member with
      ``OPENAI_BASE_URL`` (and ``OPENAI_API_BASE``) set to the session's ``base_url``,
      ``OPENAI_API_KEY`` to its key, ``ANTHROPIC_BASE_URL`` to its
      ``anthropic_base_url`` and ``ANTHROPIC_API_KEY`` to its key (Anthropic's SDKs and
      Claude-Code-style agents), ``TRIO_ROLLOUTS_PROBLEM`` to the problem as JSON
      (:func:`problem_json`: ``problem_id``, ``prompt`` as a string or a list of
      messages, ``answer`` when it is not ``None``) and the gateway's host added to
      ``NO_PROXY``; ``env``, then ``os.environ``, give the rest (``env`` may not set
      those). Its stdin is the same JSON. Its reward is the last line of its stdout
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
    Trio function at its next checkpoint (it must let ``trio.Cancelled`` propagate); an
    asyncio function by cancelling its task, then waiting (shielded, at most
    ``asyncio_cancel_timeout``) for its loop to close, so no tool of it finishes
    afterwards, else failing with :class:`AsyncioCancelTimeoutError` (a sync tool
    blocking the loop; its thread is abandoned); a command by killing its process group
    as said. Each session is left (its calls in flight cancelled, waited for at most 5 s,
    shielded), then the gateway stops. It returns (or raises) only when all of that has
    ended.
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
    api_key: str | None = attrs.field(default=None, validator=check_optional_str)
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
    #: How the function runs: ``True`` in an asyncio loop of its own on a worker thread,
    #: ``False`` in this Trio run, ``None`` as its code says. Functions only.
    asyncio: bool | None = attrs.field(default=None, validator=_check_asyncio)
    #: Seconds a cancelled asyncio function has to end before the member fails with
    #: :class:`AsyncioCancelTimeoutError` and its thread is abandoned.
    asyncio_cancel_timeout: float = attrs.field(
        default=ASYNCIO_CANCEL_TIMEOUT, validator=seconds(positive=True, optional=False)
    )
    # Whether the function runs in an asyncio loop of its own.
    _on_asyncio: bool = attrs.field(init=False, default=False, repr=False)
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
            if self.asyncio is not None:
                msg = (
                    f"asyncio={self.asyncio!r} says how a function runs; a command runs as a "
                    "process of its own (pass asyncio=None)"
                )
                raise ValueError(msg)
        else:
            if self.function is not None:  # always: narrows the type
                self._on_asyncio = (
                    written_for_asyncio(self.function) if self.asyncio is None else self.asyncio
                )
            if self.command_timeout is not None:
                msg = (
                    f"command_timeout={self.command_timeout!r} bounds a command; a function "
                    "member has none (bound the group with FailurePolicy(group_timeout=...))"
                )
                raise ValueError(msg)
            if self.env:
                msg = f"env={dict(self.env)!r:.80} is a command's environment; there is no command"
                raise ValueError(msg)
        check_problems(self, GatewayAgent)

    async def get_problem(self, request: GroupedRolloutRequest) -> Problem:
        """The problem of one group: the next draw from ``prompts``. Override it to take
        problems from elsewhere.

        Cancellation: a schedule point after the draw, never cancelled (a drawn problem
        is never lost)."""
        return await draw_problem(self)

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
                        where = "in its function" + " (on asyncio)" * self._on_asyncio
                        reward = await self._call_function(session, problem, member)
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

    async def _call_function(
        self, session: GatewaySession, problem: Problem, member: int
    ) -> float | None:
        function = self.function
        if function is None:  # pragma: no cover - __attrs_post_init__ saw to it
            msg = "no function"
            raise RuntimeError(msg)
        call = functools.partial(_await_function, function, session.base_url, problem)
        if self._on_asyncio:
            value = await run_in_asyncio(
                call,
                cancel_timeout=self.asyncio_cancel_timeout,
                name=f"trio_rollouts asyncio member {member} of {problem.problem_id!r}",
            )
        else:
            try:
                value = await call()
            except Exception as exc:
                hint = asyncio_error_hint(exc)
                if hint is not None:
                    exc.add_note(hint)
                raise
        return None if value is None else checked_reward(value, "the function's return value")

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
        return checked_reward(value, "reward_fn's value")

    async def _run_command(
        self, argv: tuple[str, ...], session: GatewaySession, problem: Problem
    ) -> float | None:
        payload = problem_json(problem)
        if len(payload) > MAX_VARIABLE:
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
            ANTHROPIC_BASE_URL=session.anthropic_base_url,
            ANTHROPIC_API_KEY=session.api_key,
            TRIO_ROLLOUTS_PROBLEM=payload,
        )
        bypass_proxies(environment, self.host)
        return await run_command(argv, environment, payload, self.command_timeout)


async def _await_function(function: AgentFunction, base_url: str, problem: Problem) -> object:
    """Call a member's function and await what it returns (in Trio or on asyncio)."""
    awaitable = function(base_url, problem)
    if not inspect.isawaitable(awaitable):
        msg = (
            "function must be an async function (base_url, problem) -> float | None; "
            f"{function!r:.60} returned a {type(awaitable).__name__}, not an awaitable"
        )
        raise TypeError(msg)
    return await awaitable
