"""tinker-cookbook's environments on this library's agents (extra ``[tinker]``).

tinker-cookbook (``tinker_cookbook.rl``) has two kinds of environment, and each maps onto
a route of this library that keeps the ids the model sampled:

- A ``MessageEnv`` speaks messages: ``initial_observation()`` gives the first messages,
  ``step(message)`` answers an assistant message with a ``MessageStepResult`` (a reward,
  ``episode_done`` and ``next_messages``, the whole conversation so far).
  :func:`from_message_env` makes it an :class:`~trio_rollouts.Environment`, so a
  :class:`~trio_rollouts.MultiTurnAgent` renders it with its renderer and keeps the
  stream token-exact (the agent only renders what comes *between* turns). That needs the
  conversation to grow by appending: each ``next_messages`` must be the previous
  conversation, the assistant message it was sent, and new messages. An environment that
  rewrites earlier messages (drops old reasoning, summarises, edits a turn) is refused
  with :class:`HistoryRewrittenError`: the model never saw that conversation, so no
  token stream of it is the one sampled.
- An ``Env`` speaks token ids: ``initial_observation()`` gives a ``tinker.ModelInput``
  and a stop condition, ``step(action)`` answers the sampled ids with a ``StepResult``
  whose ``next_observation`` is the next prompt. :class:`EnvAgent` runs it on a backend
  that generates from ids (:class:`~trio_rollouts.inference.AcceptsTokens`, via
  ``InferenceRequest.prompt_ids``): every prompt is the observation's ids, every action
  the ids the backend returned, so the rollout is exact by construction.

Rewards, as tinker-cookbook counts them (a trajectory's return is the sum of its
per-step rewards): an episode's reward is the sum of every step's reward, and each
step's own reward is kept in the rollout's per-turn record
(``extra["episode"]["per_turn"][i]``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from trio_rollouts import (
    AssistantTurn,
    BaseEnvironment,
    ChatMessage,
    EnvironmentStep,
    GroupedRolloutGenerator,
    GroupedRolloutRequest,
    Problem,
    TemplateBreakError,
    TokenRollout,
)
from trio_rollouts._checks import optional_int_at_least
from trio_rollouts._concurrency import gather
from trio_rollouts.agents._base import check_problems, draw_problem
from trio_rollouts.agents._environment import check_reward
from trio_rollouts.episodes import Element, request_start_epoch, start_element, token_rollout
from trio_rollouts.inference import (
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    TokenMismatchError,
    accepts_tokens,
)
from trio_rollouts.pipeline._sampling import request_seed, seeded

try:
    import tinker
    from tinker_cookbook.renderers.base import Message, ToolCall, UnparsedToolCall
    from tinker_cookbook.rl.message_env import MessageEnv, MessageStepResult
    from tinker_cookbook.rl.types import (
        ActionExtra,
        Env,
        InitialObservationOverflow,
        StepResult,
    )
except ImportError as error:  # pragma: no cover - depends on the environment
    msg = (
        "trio_rollouts.integrations.tinker needs tinker-cookbook: install the extra, "
        f"pip install 'trio-rollouts[tinker]' ({error})"
    )
    raise ImportError(msg) from error

__all__ = [
    "EnvAgent",
    "HistoryRewrittenError",
    "MessageEnvironment",
    "from_message_env",
    "tinker_message",
]


class HistoryRewrittenError(TemplateBreakError):
    """A ``MessageEnv``'s ``next_messages`` is not the conversation so far plus the
    assistant message it was sent plus new messages: it rewrote the history, so the
    conversation it asks the model to go on from is not the token stream the model saw,
    and the trajectory cannot be token-exact. Not transient (a
    :class:`~trio_rollouts.TemplateBreakError`)."""


# --------------------------------------------------------------------------- messages


def _text(content: object, where: str) -> tuple[str, str | None]:
    """A tinker ``Content`` as ``(text, reasoning)``: a string, or text and thinking
    parts (the thinking parts' text is the reasoning); other parts are a ``TypeError``."""
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        msg = f"{where}['content'] must be a str or a list of content parts, got {content!r:.80}"
        raise TypeError(msg)
    texts: list[str] = []
    thoughts: list[str] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(part["text"])
        elif kind == "thinking":
            thoughts.append(part["thinking"])
        else:
            msg = (
                f"{where}['content'][{i}] is a {kind or type(part).__name__!s} part: only text "
                "and thinking parts have ids a renderer makes (images and audio do not)"
            )
            raise TypeError(msg)
    return "".join(texts), "".join(thoughts) if thoughts else None


def _chat_message(message: object, where: str) -> ChatMessage:
    """A tinker ``Message`` as a :class:`~trio_rollouts.ChatMessage`: ``tool_call_id``
    and ``name`` in ``extra``, an assistant message's tool calls in the OpenAI shape and
    its thinking as ``reasoning_content``."""
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        msg = f"{where} must be a tinker Message (a dict with role, content), got {message!r:.80}"
        raise TypeError(msg)
    content, reasoning = _text(message["content"], where)
    extra: dict[str, Any] = {
        key: message[key] for key in ("tool_call_id", "name") if key in message
    }
    calls = message.get("tool_calls")
    if calls:
        extra["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in calls
        ]
    if reasoning is not None:
        extra["reasoning_content"] = reasoning
    return ChatMessage(role=message["role"], content=content, extra=extra)


def tinker_message(turn: AssistantTurn) -> Message:
    """The assistant turn as the tinker ``Message`` a ``MessageEnv.step`` takes, as a
    tinker renderer's ``parse_response`` makes it: thinking and text parts when there is
    reasoning, ``tool_calls`` for the calls that parsed, ``unparsed_tool_calls`` (raw
    text and error) for those that did not."""
    message: Message = {"role": "assistant", "content": turn.content}
    if turn.reasoning is not None:
        message["content"] = [
            {"type": "thinking", "thinking": turn.reasoning},
            {"type": "text", "text": turn.content},
        ]
    parsed = [call for call in turn.tool_calls if call.arguments is not None and call.name]
    broken = [call for call in turn.tool_calls if call not in parsed]
    if parsed:
        message["tool_calls"] = [
            ToolCall(
                id=call.id,
                function=ToolCall.FunctionBody(
                    name=call.name or "", arguments=json.dumps(call.arguments, ensure_ascii=False)
                ),
            )
            for call in parsed
        ]
    if broken:
        message["unparsed_tool_calls"] = [
            UnparsedToolCall(raw_text=call.raw, error=call.parse_error or "no tool name")
            for call in broken
        ]
    return message


def _first_difference(old: Sequence[object], new: Sequence[object]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b),
        min(len(old), len(new)),
    )


# --------------------------------------------------------------------------- MessageEnv


@attrs.define(eq=False)
class MessageEnvironment(BaseEnvironment):
    """One tinker-cookbook ``MessageEnv`` as an :class:`~trio_rollouts.Environment`
    (what :func:`from_message_env` makes per episode).

    - :meth:`reset`: the env's ``initial_observation()``, as
      :class:`~trio_rollouts.ChatMessage` objects.
    - :meth:`step`: the turn as a tinker assistant message (:func:`tinker_message`) to
      the env's ``step``; the messages after the conversation so far and that message
      come back as the step's messages. A ``next_messages`` that does not start with
      both is a :class:`HistoryRewrittenError` naming the first message that differs.
      ``episode_done`` ends the episode (its ``next_messages`` are not read).
    - Rewards: each step's reward is the step's ``reward`` (kept per turn) and, with its
      ``metrics`` and ``logs``, in ``info`` (``{"step_reward", "metrics", "logs"}``);
      the episode's reward, when a step is done and from :meth:`final_reward` when a
      limit of the agent ends it, is the sum of every step's reward.

    ``tools`` is ``None``: tinker environments put tool schemas in their messages (a
    system message their renderer made), which are rendered as they are.
    """

    #: The tinker-cookbook environment of this episode.
    message_env: MessageEnv = attrs.field()
    # The conversation as the env wrote it, with the assistant messages it was sent.
    _history: list[Message] = attrs.field(init=False, factory=list)
    _rewards: list[float] = attrs.field(init=False, factory=list)

    @message_env.validator
    def _check_message_env(self, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, MessageEnv):
            msg = (
                "message_env must be a tinker_cookbook.rl.message_env.MessageEnv, got "
                f"{type(value).__name__} {value!r:.60}"
            )
            raise TypeError(msg)

    def __attrs_post_init__(self) -> None:
        super().__init__()

    @property
    def _name(self) -> str:
        return type(self.message_env).__name__

    async def reset(self) -> list[ChatMessage]:
        """The env's first messages.

        Cancellation: as the env's ``initial_observation()`` (cancelled with it)."""
        messages = await self.message_env.initial_observation()
        where = f"{self._name}.initial_observation()"
        if not isinstance(messages, list):
            msg = f"{where} must return a list of tinker Messages, got {messages!r:.80}"
            raise TypeError(msg)
        converted = [_chat_message(m, f"{where}[{i}]") for i, m in enumerate(messages)]
        self._history = list(messages)
        return converted

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        """The env's answer to ``turn``.

        Raises :class:`HistoryRewrittenError` when the env's ``next_messages`` rewrote
        the conversation, ``TypeError``/``ValueError`` naming the env for a result that
        is not a ``MessageStepResult`` with a finite reward.

        Cancellation: as the env's ``step()`` (cancelled with it, and at the agent's
        ``step_timeout``)."""
        message = tinker_message(turn)
        result = await self.message_env.step(message)
        if not isinstance(result, MessageStepResult):
            msg = f"{self._name}.step() must return a MessageStepResult, got {result!r:.80}"
            raise TypeError(msg)
        reward = check_reward(result.reward, f"{self._name}.step() reward")
        self._rewards.append(reward)
        info = {"step_reward": reward, "metrics": dict(result.metrics), "logs": dict(result.logs)}
        if result.episode_done:
            return EnvironmentStep(done=True, reward=sum(self._rewards), info=info)
        expected = [*self._history, message]
        now = result.next_messages
        if not isinstance(now, list) or now[: len(expected)] != expected:
            index = _first_difference(expected, now if isinstance(now, list) else [])
            msg = (
                f"{self._name}.step() rewrote the conversation history: its next_messages "
                f"differ from the conversation so far (plus the assistant message it was "
                f"sent) at message {index} of {len(expected)}, so the conversation it goes "
                "on from is not what the model saw and the trajectory cannot be "
                "token-exact. Return the previous messages unchanged and append new ones, "
                "or run the env at the token level (tinker's EnvFromMessageEnv in EnvAgent, "
                "which starts a new trajectory element at each rewrite)"
            )
            raise HistoryRewrittenError(msg)
        new = now[len(expected) :]
        where = f"{self._name}.step() next_messages"
        answer = [_chat_message(m, f"{where}[{len(expected) + i}]") for i, m in enumerate(new)]
        self._history = list(now)
        return EnvironmentStep(messages=answer, reward=reward, info=info)

    async def final_reward(self) -> float:
        """The sum of the step rewards so far (an episode a limit of the agent ended).

        Cancellation: a checkpoint."""
        await trio.lowlevel.checkpoint()
        return sum(self._rewards)


@attrs.frozen
class _MessageEnvFactory:
    """What :func:`from_message_env` returns: ``problem -> MessageEnvironment``."""

    factory: Callable[[Problem], MessageEnv]

    def __call__(self, problem: Problem) -> MessageEnvironment:
        message_env = self.factory(problem)
        if not isinstance(message_env, MessageEnv):
            msg = (
                f"the factory given to from_message_env ({self.factory!r:.60}) must return a "
                f"tinker MessageEnv, got {type(message_env).__name__} {message_env!r:.60}"
            )
            raise TypeError(msg)
        return MessageEnvironment(message_env)


def from_message_env(
    factory: Callable[[Problem], MessageEnv],
) -> Callable[[Problem], MessageEnvironment]:
    """The ``environment=`` of a :class:`~trio_rollouts.MultiTurnAgent` that runs
    tinker-cookbook ``MessageEnv`` objects: ``factory(problem)`` makes one per episode,
    run as a :class:`MessageEnvironment` (see there for rewards and the rewritten-history
    error). A ``factory`` that is not callable is a ``TypeError``, as is a factory that
    returns something other than a ``MessageEnv`` (when the episode starts)."""
    if not callable(factory):
        msg = (
            "from_message_env takes a callable problem -> MessageEnv (such as a MessageEnv "
            f"subclass), got {factory!r:.60}"
        )
        raise TypeError(msg)
    return _MessageEnvFactory(factory)


# --------------------------------------------------------------------------- Env


def _check_env(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not callable(value):
        msg = (
            "env_factory must be a callable that makes one tinker Env per episode (problem -> Env, "
            f"such as an Env subclass), got {value!r:.60}"
        )
        raise TypeError(msg)


def _observation_ids(observation: object, where: str) -> list[int]:
    """A ``tinker.ModelInput``'s token ids (``TypeError``/``ValueError`` naming
    ``where`` for anything else, an image chunk or no ids)."""
    if not isinstance(observation, tinker.ModelInput):
        msg = f"{where} must be a tinker.ModelInput, got {type(observation).__name__}"
        raise TypeError(msg)
    try:
        ids: list[int] = observation.to_ints()
    except ValueError as error:
        msg = f"{where} holds chunks that are not token ids (images?): {error}"
        raise TypeError(msg) from error
    if not ids:
        msg = f"{where} is empty: a prompt needs at least one token id"
        raise ValueError(msg)
    return ids


def _sampled(
    interface: InferenceInterface, sent: list[int], response: InferenceResponse
) -> tuple[list[int], list[float] | None]:
    """The ids ``response`` sampled after the prompt ``sent``, and their logprobs
    (``None`` unless one per id): a prompt echoed differently is a
    :class:`~trio_rollouts.inference.TokenMismatchError`."""
    ids, length = response.token_ids, response.prompt_length
    if ids is None or length is None or not 0 <= length <= len(ids):
        msg = (
            f"{type(interface).__name__} returned token_ids={ids!r:.40} with "
            f"prompt_length={length!r} for an id prompt; an AcceptsTokens backend returns both"
        )
        raise ValueError(msg)
    if ids[:length] != sent:
        index = _first_difference(sent, ids[:length])
        msg = (
            f"{type(interface).__name__} generated from other ids than the observation's: "
            f"they differ first at index {index} (sent {len(sent)} ids, it echoed {length})"
        )
        raise TokenMismatchError(msg, sent=sent, echoed=ids[:length], index=index)
    logprobs = response.logprobs
    sampled = ids[length:]
    return sampled, logprobs if logprobs is not None and len(logprobs) == len(sampled) else None


def _stop_reason(metrics: dict[str, float | int]) -> str | None:
    """tinker's stop reason, from the one-hot ``stop/<reason>`` metric of a step."""
    for key, value in metrics.items():
        if key.startswith("stop/") and value:
            return key.removeprefix("stop/")
    return None


@attrs.define(kw_only=True)
class EnvAgent(GroupedRolloutGenerator):
    """Runs ``rollouts_per_group`` episodes of tinker-cookbook token-level ``Env``
    objects for one problem concurrently, on a backend that generates from token ids
    (:class:`~trio_rollouts.inference.AcceptsTokens`), and returns one
    :class:`~trio_rollouts.TokenRollout` per episode, exact by construction.

    An episode: ``env = env_factory(problem)``; each turn sends the observation's ids as
    ``InferenceRequest.prompt_ids`` (with the request's generation arguments; a run seed
    is applied per member and turn as in the library's agents), calls
    ``env.step(sampled ids, extra={"stop_reason": "length" or "stop"})``, and goes on
    from ``next_observation`` until ``episode_done`` (finish ``"done"``) or
    ``max_turns`` (``"max_turns"``). An ``InitialObservationOverflow`` is an episode of
    no turns (finish ``"overflow"``, one empty trajectory element) with its reward, as
    tinker-cookbook keeps it.

    The rollout, as tinker-cookbook's own ``trajectory_to_data`` cuts it: while each
    observation extends the previous one and the action sampled from it, the episode is
    one trajectory element (observation ids mask 0, sampled ids mask 1 with their
    logprobs); an observation that does not (the env rewrote its context) starts a new
    element (``extra["episode"]["breaks"]`` counts them). ``reward`` is the sum of the
    step rewards; ``extra["episode"]``: ``turns``, ``finish``, ``breaks``,
    ``stop_reason`` (tinker's, from a ``stop/<reason>`` metric, or ``None``) and
    ``per_turn`` (``element``, ``start``, ``end``, ``finish_reason``, ``reward``,
    ``metrics``, ``logs`` per turn). ``fidelity`` is ``"exact"``.

    The env's stop condition is not sent (the library's requests have no stop
    sequences): the backend stops where the model's end-of-turn id is its end of
    sequence, as a chat model served by vLLM does. Problems come from ``prompts`` or an
    override of :meth:`get_problem`; ``extra_rollouts`` is not used (a group waits for
    all its members).

    Cancellation: :meth:`group_rollout` runs the episodes in one nursery; cancelling it
    cancels every model call and env step and returns only when all have ended. The
    first failing episode cancels the others and is raised as itself.
    """

    #: Makes one tinker ``Env`` per episode: ``problem -> Env`` (sync).
    env_factory: Callable[[Problem], Env] = attrs.field(validator=_check_env)
    #: At most this many turns per episode (``None``: until the env is done).
    max_turns: int | None = attrs.field(default=8, validator=optional_int_at_least(1))
    #: The environment's name, stamped on every rollout (``env_id``).
    env_id: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    def __attrs_post_init__(self) -> None:
        check_problems(self, EnvAgent)

    async def get_problem(self, request: GroupedRolloutRequest) -> Problem:
        """The problem of one group: the next draw from ``prompts``. Override it to take
        problems from elsewhere.

        Cancellation: a schedule point after the draw, never cancelled (a drawn problem
        is never lost)."""
        return await draw_problem(self)

    async def group_rollout(self, request: GroupedRolloutRequest) -> list[TokenRollout]:
        """Run ``request.rollouts_per_group`` episodes of one problem concurrently.

        Raises ``TypeError`` before any work when the backend does not generate from
        token ids.

        Cancellation: cancels every model call and env step; returns (or raises) only
        when every episode has ended."""
        interface = request.inference_interface
        if not accepts_tokens(interface):
            msg = (
                f"{type(self).__name__} sends token-id prompts, and {type(interface).__name__} "
                "does not generate from them: use a backend that does (EmbeddedInference, "
                "OpenAIInference with token_prompts=True against vLLM or SGLang)"
            )
            raise TypeError(msg)
        problem = await self.get_problem(request)
        if not isinstance(problem, Problem):
            msg = f"get_problem must return a Problem, got {type(problem).__name__}"
            raise TypeError(msg)
        start_epoch = request_start_epoch(request)
        episode = functools.partial(self._episode, request, problem, start_epoch)
        return await gather(
            [functools.partial(episode, member) for member in range(request.rollouts_per_group)]
        )

    async def _episode(
        self, request: GroupedRolloutRequest, problem: Problem, start_epoch: int, member: int
    ) -> TokenRollout:
        """One episode of one env, as the class docstring says."""
        env = self.env_factory(problem)
        name = type(env).__name__
        if not isinstance(env, Env):
            msg = f"env_factory must return a tinker Env, got {name} {env!r:.60}"
            raise TypeError(msg)
        first = await env.initial_observation()
        elements: list[Element] = []
        per_turn: list[dict[str, Any]] = []
        rewards: list[float] = []
        breaks = 0
        stop_reason = None
        if isinstance(first, InitialObservationOverflow):
            rewards.append(check_reward(first.reward, f"{name} InitialObservationOverflow reward"))
            elements.append(Element.scaffold([]))
            finish = "overflow"
            stop_reason = _stop_reason(first.metrics)
        else:
            observation: object = first[0]
            interface = request.inference_interface
            finish = "max_turns"
            while self.max_turns is None or len(per_turn) < self.max_turns:
                turn = len(per_turn)
                where = "initial_observation()" if not turn else f"step {turn} next_observation"
                ids = _observation_ids(observation, f"{name}.{where}")
                element = elements[-1] if elements else None
                if element is not None and ids[: len(element.ids)] == element.ids:
                    element.extend(ids[len(element.ids) :])
                else:
                    breaks += element is not None
                    element = start_element(elements, ids)
                args = seeded(
                    request.generation_args,
                    request_seed(request, interface, problem.problem_id, member, turn),
                )
                response = await interface.agenerate(
                    InferenceRequest(prompt=[], generation_args=args, prompt_ids=ids)
                )
                sampled, logprobs = _sampled(interface, ids, response)
                start = element.take(sampled, logprobs, response, args, start_epoch)
                extra: ActionExtra = {
                    "stop_reason": "length" if response.finish_reason == "length" else "stop"
                }
                result = await env.step(sampled, extra=extra)
                if not isinstance(result, StepResult):
                    msg = f"{name}.step() must return a StepResult, got {result!r:.80}"
                    raise TypeError(msg)
                rewards.append(check_reward(result.reward, f"{name}.step() reward"))
                per_turn.append(
                    {
                        "element": len(elements) - 1,
                        "start": start,
                        "end": len(element.ids),
                        "finish_reason": response.finish_reason,
                        "reward": rewards[-1],
                        "metrics": dict(result.metrics),
                        "logs": dict(result.logs),
                    }
                )
                if result.episode_done:
                    finish = "done"
                    stop_reason = _stop_reason(result.metrics)
                    break
                observation = result.next_observation
        episode = {
            "turns": len(per_turn),
            "finish": finish,
            "breaks": breaks,
            "stop_reason": stop_reason,
            "per_turn": per_turn,
        }
        return token_rollout(
            elements,
            start_epoch=start_epoch,
            reward=sum(rewards),
            fidelity="exact",
            env_id=self.env_id,
            problem_id=problem.problem_id,
            extra={"episode": episode},
        )
