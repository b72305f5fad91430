"""verifiers' classic environments behind the gateway (extra ``[verifiers]``).

A verifiers environment (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv`` and their
subclasses, from ``import verifiers as vf``) runs unmodified: it renders nothing and keeps
no token ids, it calls an OpenAI client and scores what came back with its ``Rubric``.
:class:`VerifiersAgent` points that client at the gateway, so the ids the model saw and
sampled are the gateway's, verbatim, and the reward is the rubric's:

.. code-block:: python

    env = vf.load_environment("my-env")  # or vf.ToolEnv(dataset=..., tools=[...], rubric=...)
    agent = VerifiersAgent(env=env, renderer=renderer)  # problems: env's dataset
    async with agent.get_grouped_rollouts(request) as stream: ...

A group is one dataset row and ``rollouts_per_group`` members, as verifiers' own
``Environment.run_group``: one gateway (:func:`~trio_rollouts.gateway.serve`) and one
session per member; in one asyncio loop of the group's own, on a worker thread
(:func:`~trio_rollouts.gateway._asyncio.run_in_asyncio`: verifiers is asyncio code), each
member's ``env.rollout(row, client, model, sampling_args)`` with a client on its session,
then ``env.rubric.score_group(states)`` over all members at once (group reward functions
see every member) and ``env.rubric.cleanup(state)``, the steps ``run_group`` takes. Each
member's rollout is its session's token-exact :class:`~trio_rollouts.TokenRollout` with
verifiers' reward; ``extra["verifiers"]`` holds the rest of verifiers' record.

Problems: :func:`verifiers_problems` makes one :class:`~trio_rollouts.Problem` per row
of the env's dataset, the row itself in ``answer`` (what ``rollout`` takes).

verifiers 0.4 ships only its v1 stack (``verifiers.v1``: tasksets, harness programs in
runtimes, its own interception server); the classic environments are in 0.3.1 and
earlier (the extra requires ``verifiers>=0.2.1,<0.4``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import attrs

from trio_rollouts import (
    ChatMessage,
    GroupedRolloutGenerator,
    GroupedRolloutRequest,
    Problem,
    PromptSource,
    TokenRollout,
)
from trio_rollouts._checks import check_optional_str, seconds
from trio_rollouts._concurrency import flatten_exception_groups
from trio_rollouts.agents._base import draw_problem
from trio_rollouts.agents._environment import check_reward
from trio_rollouts.episodes import check_min_fidelity, check_on_break, check_renderer
from trio_rollouts.gateway import GatewaySession, serve
from trio_rollouts.gateway._asyncio import run_in_asyncio
from trio_rollouts.pipeline._sampling import request_seed
from trio_rollouts.renderers import Renderer

try:
    import openai
    import verifiers as vf
except ImportError as error:  # pragma: no cover - depends on the environment
    msg = (
        "trio_rollouts.integrations.verifiers needs verifiers: install the extra, "
        f"pip install 'trio-rollouts[verifiers]' ({error})"
    )
    raise ImportError(msg) from error

if not hasattr(vf, "Environment"):  # pragma: no cover - depends on the environment
    msg = (
        f"verifiers {getattr(vf, '__version__', '?')} has no classic environments "
        "(vf.Environment, vf.ToolEnv, ...): verifiers 0.4 keeps only its v1 stack "
        "(verifiers.v1), which this adapter does not run. Install the extra, "
        "pip install 'trio-rollouts[verifiers]' (verifiers>=0.2.1,<0.4)"
    )
    raise ImportError(msg)

__all__ = [
    "ASYNCIO_CANCEL_TIMEOUT",
    "VerifiersAgent",
    "VerifiersRolloutError",
    "verifiers_problems",
    "verifiers_prompts",
]

#: Seconds a cancelled group's asyncio loop has to end, by default.
ASYNCIO_CANCEL_TIMEOUT: Final = 5.0
#: The errors of a chain that a recorded verifiers error's text shows.
_CAUSES: Final = 4


class VerifiersRolloutError(RuntimeError):
    """verifiers recorded an error in a member's state (``state["error"]``: a model call
    that failed, a tool error the env stops on, ...) and ended its rollout early, and the
    agent's ``on_error`` is ``"raise"``. The message names the problem, the member,
    verifiers' stop condition and the error chain; ``__cause__`` is verifiers' error. Not
    transient by default (add it to ``FailurePolicy(retry_on=...)`` to retry the group).

    Attributes: ``problem_id``, ``member`` (from 0), ``stop_condition``."""

    def __init__(
        self, message: str, *, problem_id: str = "", member: int = 0, stop_condition: str = ""
    ) -> None:
        super().__init__(message)
        self.problem_id = problem_id
        self.member = member
        self.stop_condition = stop_condition


# --------------------------------------------------------------------------- problems


def verifiers_problems(
    env: Any, *, split: Literal["train", "eval"] = "train", n: int = -1, seed: int | None = None
) -> list[Problem]:
    """One :class:`~trio_rollouts.Problem` per row of ``env``'s dataset (``split="train"``,
    ``env.get_dataset(n, seed)``) or eval dataset (``"eval"``, ``env.get_eval_dataset``),
    the rows as verifiers formatted them (its ``prompt`` with the env's system prompt and
    few-shot messages, ``example_id``, ``answer``, ``info``, other columns):

    - ``problem_id``: ``str(row["example_id"])``;
    - ``prompt``: the row's prompt messages as :class:`~trio_rollouts.ChatMessage` (text
      parts joined; for logs: the row is what the env is given);
    - ``answer``: the row, a dict: :class:`VerifiersAgent` hands it to ``env.rollout``.

    ``ValueError`` naming the split when the env has no such dataset."""
    _check_env(None, None, env)
    if split not in ("train", "eval"):
        msg = f"split must be 'train' (env.dataset) or 'eval' (env.eval_dataset), got {split!r}"
        raise ValueError(msg)
    built = env.build_dataset() if split == "train" else env.build_eval_dataset()
    if built is None:
        other = "eval" if split == "train" else "train"
        msg = (
            f"{type(env).__name__} has no {split} dataset (its {split}_dataset is None): "
            f"use split={other!r}, or give the env a {split} dataset"
        )
        raise ValueError(msg)
    rows = env.get_dataset(n, seed) if split == "train" else env.get_eval_dataset(n, seed)
    return [
        _problem(dict(row), f"{type(env).__name__} {split} row {i}") for i, row in enumerate(rows)
    ]


def verifiers_prompts(
    env: Any,
    *,
    split: Literal["train", "eval"] = "train",
    n: int = -1,
    shuffle: bool = True,
    seed: int = 0,
) -> PromptSource:
    """A :class:`~trio_rollouts.PromptSource` of :func:`verifiers_problems` (``n`` rows of
    ``split``, drawn in an order seeded by ``seed``, or in dataset order when ``shuffle``
    is false)."""
    return PromptSource(verifiers_problems(env, split=split, n=n), shuffle=shuffle, seed=seed)


def _problem(row: dict[str, Any], where: str) -> Problem:
    if "example_id" not in row or "prompt" not in row:
        msg = f"{where} has no 'example_id' or 'prompt' column: got columns {sorted(row)}"
        raise ValueError(msg)
    prompt = row["prompt"]
    if isinstance(prompt, str):
        shown: str | list[ChatMessage] = prompt
    elif isinstance(prompt, Sequence) and prompt:
        shown = [_chat_message(m, f"{where} prompt[{i}]") for i, m in enumerate(prompt)]
    else:
        msg = f"{where} prompt must be a str or a non-empty list of messages, got {prompt!r:.80}"
        raise ValueError(msg)
    return Problem(problem_id=str(row["example_id"]), prompt=shown, answer=row)


def _chat_message(message: object, where: str) -> ChatMessage:
    dump = getattr(message, "model_dump", None)
    value = dump() if callable(dump) else message
    if not isinstance(value, Mapping) or not isinstance(value.get("role"), str):
        msg = f"{where} must be a message with a role, got {message!r:.80}"
        raise TypeError(msg)
    content = value.get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, Mapping)]
        content = "".join(text for text in texts if isinstance(text, str))
    return ChatMessage(role=value["role"], content="" if content is None else str(content))


def _row(problem: Problem) -> dict[str, Any]:
    """The verifiers row of ``problem`` (its ``answer``), a copy."""
    row = problem.answer
    if not isinstance(row, Mapping) or "prompt" not in row:
        msg = (
            f"problem {problem.problem_id!r}: answer must be the verifiers dataset row the "
            "env's rollout takes (a mapping with 'prompt', 'answer', 'example_id', ...), "
            f"as verifiers_problems(env) makes it, got {row!r:.80}"
        )
        raise TypeError(msg)
    return copy.deepcopy(dict(row))


# --------------------------------------------------------------------------- checks


def _check_env(instance: object, attribute: attrs.Attribute[Any] | None, value: object) -> None:
    if not isinstance(value, vf.Environment):
        msg = (
            "env must be a classic verifiers environment (vf.SingleTurnEnv, vf.MultiTurnEnv, "
            "vf.ToolEnv or a subclass, or what vf.load_environment returns), got "
            f"{type(value).__name__} {value!r:.60}"
        )
        raise TypeError(msg)


def _check_sampling_args(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not (
        isinstance(value, Mapping) and all(isinstance(key, str) for key in value)
    ):
        msg = (
            "sampling_args must be a mapping of verifiers sampling arguments (such as "
            f"{{'max_tokens': 512}}) or None, got {value!r:.80}"
        )
        raise TypeError(msg)


def _check_on_error(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("raise", "keep"):
        msg = (
            "on_error must be 'raise' (a member whose state has an error fails the group) or "
            f"'keep' (its rollout is kept, scored as verifiers scores it), got {value!r:.40}"
        )
        raise ValueError(msg)


# --------------------------------------------------------------------------- the agent


@attrs.define(kw_only=True, init=False)
class VerifiersAgent(GroupedRolloutGenerator):
    """Runs a classic verifiers environment unmodified behind the gateway and returns one
    token-exact :class:`~trio_rollouts.TokenRollout` per member, with verifiers' reward.

    A group: ``problem = get_problem(request)`` (a draw from ``prompts``, by default
    ``verifiers_prompts(env)``: the env's train dataset, shuffled with seed 0), whose
    ``answer`` is the verifiers row; the gateway ``serve(request.inference_interface,
    renderer, host=host, api_key=api_key, generation_args=request.generation_args,
    min_fidelity=min_fidelity, on_break=on_break, model=model)`` on a free port; one
    session per member (seeded from ``request.seed`` as
    :class:`~trio_rollouts.GatewayAgent` seeds them). Then, in one asyncio loop of the
    group's own on a worker thread, what verifiers' ``Environment.run_group`` does with
    one client per member:

    1. each member's ``env.rollout(row, client, model, sampling_args)`` concurrently,
       ``client`` a ``vf.OpenAIChatCompletionsClient`` over ``openai.AsyncOpenAI`` on its
       session's ``base_url`` (no retries: a failed call is verifiers' to record), and
       ``sampling_args`` the env's ``sampling_args`` updated with :attr:`sampling_args`
       (as ``env.generate`` merges them). The gateway's ``generation_args`` (the
       trainer's) win; the body's fill only the fields they leave unset;
    2. a member whose state holds an error (``state["error"]``, what verifiers records
       for a failed model call, a tool error it stops on, ...) fails the group with
       :class:`VerifiersRolloutError` when ``on_error="raise"``; with ``"keep"`` it is
       scored and kept;
    3. ``env.rubric.score_group(states)`` (``dummy_score_group`` when the env does not
       score rollouts): every reward function, group ones with all members at once;
    4. ``env.rubric.cleanup(state)`` for each (also when 2 or 3 raised).

    Each member's rollout is its session's (:meth:`~trio_rollouts.gateway.GatewaySession.rollout`):
    the ids the model saw and sampled, verbatim (a conversation verifiers sent that does
    not extend the last one would be a counted break, ``extra["gateway"]["breaks"]``;
    verifiers' environments append, so there is none), ``reward`` ``state["reward"]``,
    ``env_id`` :attr:`env_id` (default ``env.env_id``), and ``extra["verifiers"]``:
    ``reward``, ``metrics`` (each reward function's and metric's value, by name),
    ``stop_condition``, ``is_truncated``, ``error`` (its text, or ``None``),
    ``example_id`` and ``completion`` (verifiers' completion messages, as dicts). A member
    that made no model call fails the group (there are no ids to train on).

    Errors and cancellation: a member whose ``rollout`` raises cancels the others and is
    raised as itself, with a note ``in member K of N of problem 'ID'``. Cancelling
    :meth:`group_rollout` cancels the group's asyncio task (every member's rollout, its
    model calls and tools, then the cleanups verifiers runs in ``finally``) and waits,
    shielded, at most :attr:`asyncio_cancel_timeout` for the loop to close; after that
    no tool of the group runs (past the bound: ``AsyncioCancelTimeoutError``, the thread
    abandoned). Then the sessions are left and the gateway stops. It returns or raises
    only when all of that has ended.

    Each group has an asyncio loop of its own, so objects the env made at construction
    and uses in rollouts (a judge rubric's client) meet several loops, one per group,
    concurrently: verifiers' ``generate`` runs every group in one loop. ``extra_rollouts``
    is not used: group reward functions need every member.
    """

    #: The verifiers environment, run as it is.
    env: Any = attrs.field(validator=_check_env)
    #: The model family's chat template, in ids.
    renderer: Renderer = attrs.field(validator=check_renderer)
    #: Sampling arguments over the env's own (``env.sampling_args``), sent in each body.
    sampling_args: Mapping[str, Any] | None = attrs.field(
        default=None, validator=_check_sampling_args
    )
    #: What a member whose verifiers state holds an error does: fail the group, or be kept.
    on_error: Literal["raise", "keep"] = attrs.field(default="raise", validator=_check_on_error)
    #: The environment's name on every rollout (``None``: ``env.env_id``).
    env_id: str | None = attrs.field(default=None, validator=check_optional_str)
    #: The key the gateway requires (``None``: none; the clients send one anyway).
    api_key: str | None = attrs.field(default=None, validator=check_optional_str)
    #: Where the gateway listens (loopback by default; its port is a free one).
    host: str = attrs.field(default="127.0.0.1", validator=attrs.validators.instance_of(str))
    #: The model name verifiers sends (and the gateway lists at ``/models``).
    model: str = attrs.field(default="trio-rollouts", validator=attrs.validators.instance_of(str))
    #: The least faithful ids a turn may have (as :class:`~trio_rollouts.MultiTurnAgent`).
    min_fidelity: str = attrs.field(default="server_tokens", validator=check_min_fidelity)
    #: What a template break does: ``"split"`` (a new element) or ``"raise"``.
    on_break: Literal["split", "raise"] = attrs.field(default="split", validator=check_on_break)
    #: Seconds a cancelled group's asyncio loop has to end before it is abandoned.
    asyncio_cancel_timeout: float = attrs.field(
        default=ASYNCIO_CANCEL_TIMEOUT, validator=seconds(positive=True, optional=False)
    )

    def __init__(self, *env: Any, **fields: Any) -> None:
        """``VerifiersAgent(env, renderer=...)`` or ``VerifiersAgent(env=env, ...)``: the
        env may be given by position; every other field by keyword."""
        if len(env) > 1 or (env and "env" in fields):
            msg = (
                f"VerifiersAgent takes the env once, by position or as env=, and every "
                f"other field by keyword; got {len(env)} positional argument(s)"
                + (" and env=" if "env" in fields else "")
            )
            raise TypeError(msg)
        if env:
            fields["env"] = env[0]
        self.__attrs_init__(**fields)

    def __attrs_post_init__(self) -> None:
        if self.prompts is None and type(self).get_problem is VerifiersAgent.get_problem:
            try:
                self.prompts = verifiers_prompts(self.env)
            except ValueError as exc:
                msg = (
                    f"{exc}. Without prompts=, {type(self).__name__} draws the env's train "
                    "rows: pass prompts=verifiers_prompts(env, split='eval') for its eval rows"
                )
                raise ValueError(msg) from None

    async def get_problem(self, request: GroupedRolloutRequest) -> Problem:
        """The problem of one group: the next draw from ``prompts``. Override it to take
        problems from elsewhere (its ``answer`` must be a verifiers row).

        Cancellation: a schedule point after the draw, never cancelled (a drawn problem
        is never lost)."""
        return await draw_problem(self)

    async def group_rollout(self, request: GroupedRolloutRequest) -> list[TokenRollout]:
        """Run ``request.rollouts_per_group`` members of one problem and score them as a
        group; return their rollouts in member order.

        Errors and cancellation: see the class docstring."""
        problem = await self.get_problem(request)
        if not isinstance(problem, Problem):
            msg = f"get_problem must return a Problem, got {type(problem).__name__}"
            raise TypeError(msg)
        row = _row(problem)
        count = request.rollouts_per_group
        sampling_args = copy.deepcopy(dict(self.env.sampling_args or {}))
        sampling_args.update(self.sampling_args or {})
        # serve() runs the server in a nursery, which wraps what the block raises in an
        # ExceptionGroup: the group's failure leaves as itself.
        with flatten_exception_groups():
            async with (
                serve(
                    request.inference_interface,
                    self.renderer,
                    host=self.host,
                    port=0,
                    api_key=self.api_key,
                    generation_args=request.generation_args,
                    min_fidelity=self.min_fidelity,
                    on_break=self.on_break,
                    model=self.model,
                ) as gateway,
                contextlib.AsyncExitStack() as stack,
            ):
                sessions: list[GatewaySession] = []
                for member in range(count):
                    seed = None
                    if request.seed is not None:
                        interface = request.inference_interface
                        seed = request_seed(request, interface, problem.problem_id, member)
                    session = gateway.session(problem, seed=seed)
                    sessions.append(await stack.enter_async_context(session))
                group = _Group(
                    env=self.env,
                    row=row,
                    problem_id=problem.problem_id,
                    base_urls=[session.base_url for session in sessions],
                    api_key=sessions[0].api_key,
                    model=self.model,
                    sampling_args=sampling_args,
                    on_error=self.on_error,
                )
                outcomes = await run_in_asyncio(
                    group.run,
                    cancel_timeout=self.asyncio_cancel_timeout,
                    name=f"trio_rollouts verifiers group of problem {problem.problem_id!r}",
                )
        env_id = self.env.env_id if self.env_id is None else self.env_id
        return [
            _rollout(session, outcome, str(env_id or ""), problem.problem_id, member, count)
            for member, (session, outcome) in enumerate(zip(sessions, outcomes, strict=True))
        ]


def _rollout(
    session: GatewaySession,
    outcome: _Outcome,
    env_id: str,
    problem_id: str,
    member: int,
    count: int,
) -> TokenRollout:
    """A member's rollout: its session's, with verifiers' reward and record."""
    try:
        if session.calls == 0:
            record = outcome.record
            msg = (
                f"the env made no model call for this member (verifiers' stop condition "
                f"{record['stop_condition']!r}, error {record['error']!r}): there are no "
                "ids to train on"
            )
            raise RuntimeError(msg)
        rollout = session.rollout(outcome.reward, env_id=env_id)
    except Exception as exc:
        exc.add_note(f"in member {member} of {count} of problem {problem_id!r}, taking its rollout")
        raise
    rollout.extra["verifiers"] = outcome.record
    return rollout


# --------------------------------------------------------------------------- on asyncio


@attrs.frozen
class _Outcome:
    """What the asyncio side gives back for one member: plain data, no verifiers state."""

    reward: float
    record: dict[str, Any]


@attrs.frozen(kw_only=True)
class _Group:
    """One group's verifiers side, run by :meth:`run` in the group's asyncio loop."""

    env: Any
    row: dict[str, Any]
    problem_id: str
    base_urls: list[str]
    api_key: str
    model: str
    sampling_args: dict[str, Any]
    on_error: str

    async def run(self) -> list[_Outcome]:
        """``run_group``'s steps with one client per member (see :class:`VerifiersAgent`).

        Cancellation: cancels every member's rollout; the clients are closed and the
        rubric's cleanups run on the way out."""
        async with contextlib.AsyncExitStack() as stack:
            clients = []
            for url in self.base_urls:
                client = vf.OpenAIChatCompletionsClient(
                    openai.AsyncOpenAI(base_url=url, api_key=self.api_key, max_retries=0)
                )
                stack.push_async_callback(client.close)
                clients.append(client)
            states: list[Any] = await self._rollouts(clients)
            # The rubric's cleanups run after scoring, as run_group's, and also when
            # scoring (or a recorded error) raises.
            for state in reversed(states):  # the stack unwinds last in, first out
                stack.push_async_callback(self.env.rubric.cleanup, state)
            if self.on_error == "raise":
                self._raise_recorded(states)
            if self.env.score_rollouts:
                await self.env.rubric.score_group(states)
            else:
                await self.env.rubric.dummy_score_group(states)
            return [
                self._outcome(
                    state, f"verifiers' reward of member {i} of problem {self.problem_id!r}"
                )
                for i, state in enumerate(states)
            ]

    async def _rollouts(self, clients: list[Any]) -> list[Any]:
        count = len(clients)

        async def member(i: int) -> Any:
            try:
                return await self.env.rollout(
                    copy.deepcopy(self.row), clients[i], self.model, self.sampling_args
                )
            except Exception as exc:
                exc.add_note(
                    f"in member {i} of {count} of problem {self.problem_id!r}, in "
                    f"{type(self.env).__name__}.rollout"
                )
                raise

        # The first member that raises cancels the others (as Trio's nurseries), and is
        # raised as itself.
        with flatten_exception_groups():
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(member(i)) for i in range(count)]
        return [task.result() for task in tasks]

    def _raise_recorded(self, states: list[Any]) -> None:
        for i, state in enumerate(states):
            error = state.get("error")
            if error is None:
                continue
            condition = str(state.get("stop_condition"))
            msg = (
                f"verifiers recorded an error in member {i} of {len(states)} of problem "
                f"{self.problem_id!r} and stopped its rollout (stop condition "
                f"{condition!r}): {_error_text(error)}; pass on_error='keep' to keep such "
                "rollouts, scored as verifiers scores them"
            )
            raise VerifiersRolloutError(
                msg, problem_id=self.problem_id, member=i, stop_condition=condition
            ) from error

    def _outcome(self, state: Any, where: str) -> _Outcome:
        reward = check_reward(state.get("reward"), where)
        metrics = state.get("metrics") or {}
        error = state.get("error")
        completion = state.get("completion")
        record = {
            "reward": reward,
            "metrics": {str(name): _number(value) for name, value in metrics.items()},
            "stop_condition": state.get("stop_condition"),
            "is_truncated": bool(state.get("is_truncated")),
            "error": None if error is None else _error_text(error),
            "example_id": self.row.get("example_id"),
            "completion": (
                [_message_dict(message) for message in completion]
                if isinstance(completion, list)
                else completion
            ),
        }
        return _Outcome(reward=reward, record=record)


def _number(value: object) -> object:
    """A metric's value as a float when it is a number (numpy's too), else as it is."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return value


def _message_dict(message: object) -> object:
    """A verifiers message as a JSON-ready dict (its fields that are set)."""
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        return dump(mode="json", exclude_none=True)
    return dict(message) if isinstance(message, Mapping) else str(message)


def _error_text(error: BaseException) -> str:
    """``error`` and its causes, as ``Type: message <- Type: message``."""
    parts: list[str] = []
    current: BaseException | None = error
    while current is not None and len(parts) < _CAUSES:
        parts.append(f"{type(current).__name__}: {current}".rstrip(": "))
        current = current.__cause__ or current.__context__
    return " <- ".join(parts)
