"""Environments: what a multi-turn episode talks to.

An :class:`Environment` gives an episode its first messages (:meth:`Environment.reset`),
answers each assistant turn (:meth:`Environment.step`, with an :class:`EnvironmentStep`:
messages such as tool results, and whether the episode is done with which reward), gives
the reward of an episode a limit ended (:meth:`Environment.final_reward`), and releases
what it holds (:meth:`Environment.aclose`, which the agent always calls, on every
route). :class:`BaseEnvironment` supplies the defaults. The agent that runs episodes is
:class:`~trio_rollouts.MultiTurnAgent` (``_episodes.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import trio

from trio_rollouts._checks import is_real
from trio_rollouts._messages import ChatMessage
from trio_rollouts.renderers import AssistantTurn

__all__ = [
    "BaseEnvironment",
    "Environment",
    "EnvironmentStep",
    "check_reward",
    "checked_messages",
]


def check_reward(value: object, where: str) -> float:
    """A reward as a float: a finite real number (``TypeError`` or ``ValueError`` naming
    ``where`` and the value otherwise)."""
    if not is_real(value):
        msg = f"{where} must be a real number, got {value!r:.80}"
        raise TypeError(msg)
    reward = float(value)  # type: ignore[arg-type]
    if not math.isfinite(reward):
        msg = f"{where} must be a finite number, got {value!r}"
        raise ValueError(msg)
    return reward


def checked_messages(value: object, where: str) -> list[ChatMessage]:
    """``value`` as a list of messages (``TypeError`` naming ``where`` otherwise)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        msg = f"{where} must be a sequence of ChatMessage, got {value!r:.80}"
        raise TypeError(msg)
    for i, message in enumerate(value):
        if not isinstance(message, ChatMessage):
            hint = (
                ": build it as trio_rollouts.ChatMessage(role=..., content=...), extra keys "
                "such as tool_call_id in extra={...}"
                if isinstance(message, dict)
                else ""
            )
            msg = (
                f"{where}[{i}] must be a ChatMessage, got {type(message).__name__} "
                f"{message!r:.60}{hint}"
            )
            raise TypeError(msg)
    return list(value)


def _messages(value: object) -> tuple[ChatMessage, ...]:
    messages = tuple(checked_messages(value, "messages"))
    for i, message in enumerate(messages):
        if message.role == "assistant":
            msg = (
                f"messages[{i}] is an assistant message: an environment answers the model's "
                "turns, it does not write them (send a 'user' or 'tool' message)"
            )
            raise ValueError(msg)
    return messages


def _check_info(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        msg = f"info must be a dict with str keys (JSON-ready), got {value!r:.80}"
        raise TypeError(msg)
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        msg = f"info must be JSON-ready (it is kept in the rollout's record): {error}"
        raise TypeError(msg) from error


def _check_done(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        msg = f"done must be a bool, got {value!r:.40}"
        raise TypeError(msg)


def _check_step_reward(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        if instance.done:
            msg = "reward is required when done=True (the episode's reward), got None"
            raise ValueError(msg)
        return
    check_reward(value, "reward")


@attrs.frozen(kw_only=True)
class EnvironmentStep:
    """What an environment answers to one assistant turn.

    - ``messages``: what the model sees next (tool results as ``"tool"`` messages, a
      user's reply, an error to correct); never an assistant message.
    - ``done``: whether the episode ends here; then ``reward`` (a finite number) is
      required (``ValueError`` at construction otherwise), and it wins over the agent's
      limits (``max_turns``, ``max_episode_tokens``).
    - ``reward`` on a step that is not done: a per-step reward, kept in the rollout's
      record (``extra["episode"]["per_turn"][i]["reward"]``); the episode's reward stays
      the final one.
    - ``info``: anything JSON-ready the environment wants kept with the turn
      (``extra["episode"]["per_turn"][i]["info"]``): test results, the tool's exit code.

    An assistant message in ``messages`` is a ``ValueError``, a message that is not a
    :class:`~trio_rollouts.ChatMessage` a ``TypeError``, both naming its index.
    """

    messages: tuple[ChatMessage, ...] = attrs.field(default=(), converter=_messages)
    done: bool = attrs.field(default=False, validator=_check_done)
    reward: float | None = attrs.field(default=None, validator=_check_step_reward)
    info: dict[str, Any] = attrs.field(factory=dict, validator=_check_info)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (a game, a tool sandbox, a simulated user).

    - ``tools``: the OpenAI tool schemas the model may call, or ``None``. Read after
      :meth:`reset` and after each :meth:`step`; a change (by ``==``) is a template
      break (see :class:`~trio_rollouts.MultiTurnAgent`).
    - :meth:`reset`: the first messages of the episode.
    - :meth:`step`: answer one assistant turn, parsed from the sampled ids.
    - :meth:`final_reward`: the reward of an episode ended by a limit rather than by a
      step with ``done=True``.
    - :meth:`aclose`: release everything (sandbox, process, connection). The agent calls
      it exactly once per environment it made, on every route (done, limit, failure,
      cancellation), shielded from cancellation and bounded by 5 seconds.

    Cancellation: :meth:`reset`, :meth:`step` and :meth:`final_reward` are cancelled when
    the stream shuts down or a sibling episode of the group fails, and :meth:`step` also at
    the agent's ``step_timeout``; they must let ``trio.Cancelled`` propagate.
    :meth:`aclose` runs shielded from those cancellations, and is cancelled only after 5
    seconds. Only :meth:`reset` and :meth:`step` count against the agent's
    ``environment_concurrency``, and only :meth:`step` has a deadline.
    """

    @property
    def tools(self) -> list[dict[str, Any]] | None: ...

    async def reset(self) -> Sequence[ChatMessage]: ...

    async def step(self, turn: AssistantTurn) -> EnvironmentStep: ...

    async def final_reward(self) -> float: ...

    async def aclose(self) -> None: ...


class BaseEnvironment:
    """The defaults of an :class:`Environment`: no tools, a final reward of 0.0 and
    nothing to release. Subclass it (calling ``super().__init__()``), implement
    :meth:`reset` and :meth:`step`, and override what else you need (``tools`` may be a
    class attribute, an instance attribute or a property)."""

    #: The tool schemas offered to the model (``None``: no tools).
    tools: list[dict[str, Any]] | None = None

    def __init__(self) -> None:
        """Nothing to set up; subclasses call it all the same, as for any base class."""

    async def reset(self) -> Sequence[ChatMessage]:
        """The first messages of the episode. Subclasses must implement it."""
        msg = f"{type(self).__name__} must implement reset() (the episode's first messages)"
        raise NotImplementedError(msg)

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        """Answer one assistant turn. Subclasses must implement it."""
        msg = f"{type(self).__name__} must implement step() (the answer to an assistant turn)"
        raise NotImplementedError(msg)

    async def final_reward(self) -> float:
        """0.0: an episode ended by a limit earns nothing unless overridden.

        Cancellation: a checkpoint."""
        await trio.lowlevel.checkpoint()
        return 0.0

    async def aclose(self) -> None:
        """Nothing to release.

        Cancellation: a checkpoint (the agent calls it shielded)."""
        await trio.lowlevel.checkpoint()
