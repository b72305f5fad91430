"""One episode of :class:`~trio_rollouts.MultiTurnAgent`: the environment-stepping loop.

:class:`GroupEpisodes` is what the episodes of one group share (the problem, the request,
the start epoch, the limiters, the first turns' group call); its :meth:`~GroupEpisodes.run`
is one episode's life: wait for a live environment, make it, run the episode
(:class:`EpisodeRun`), and close the environment on every route, shielded and bounded.

:class:`EpisodeRun` is the loop on the token stream (:mod:`._element`): render the reset
messages; then, each turn, generate from the element's ids, append the sampled ids,
parse them, call ``env.step``, and bridge to the next turn (or start a new element after
a break), until a step is ``done``, ``max_turns`` or ``max_episode_tokens``.

The agent's settings are read through :class:`EpisodeSettings`, so this module needs
nothing of the agent's class.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import attrs
import trio

from trio_rollouts._concurrency import real_leaves
from trio_rollouts._context import calling
from trio_rollouts._messages import ChatMessage
from trio_rollouts.agents._environment import (
    BaseEnvironment,
    Environment,
    EnvironmentStep,
    check_reward,
    checked_messages,
)
from trio_rollouts.episodes._element import (
    RANK,
    Element,
    bridge_ids,
    call_start_epoch_or,
    close_ids,
    numbered,
    read_turn,
    start_element,
    token_rollout,
    turn_record,
)
from trio_rollouts.episodes._errors import TemplateBreakError, TokenFidelityError, fidelity_error
from trio_rollouts.episodes._first_turns import FirstTurns
from trio_rollouts.inference._interface import (
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
)
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import TokenRollout
from trio_rollouts.pipeline._failure import StepTimeoutError
from trio_rollouts.pipeline._sampling import request_seed, seeded
from trio_rollouts.renderers import AssistantTurn, Renderer
from trio_rollouts.renderers._base import check_roles

__all__ = ["ACLOSE_SECONDS", "EpisodeRun", "EpisodeSettings", "GroupEpisodes", "turn_message"]

#: How long :meth:`Environment.aclose` may take (shielded) before it is abandoned.
ACLOSE_SECONDS = 5.0

#: What an Environment has (see ``GroupEpisodes.live``).
_ENVIRONMENT_PARTS = ("reset", "step", "final_reward", "aclose", "tools")


class EpisodeSettings(Protocol):
    """The settings of :class:`~trio_rollouts.MultiTurnAgent` an episode follows (see
    the agent's fields)."""

    @property
    def environment(self) -> Callable[[Problem], Environment]: ...
    @property
    def renderer(self) -> Renderer: ...
    @property
    def max_turns(self) -> int: ...
    @property
    def max_episode_tokens(self) -> int | None: ...
    @property
    def step_timeout(self) -> float | None: ...
    @property
    def on_break(self) -> str: ...
    @property
    def min_fidelity(self) -> str: ...
    @property
    def env_id(self) -> str: ...


def turn_message(renderer: Renderer, turn: AssistantTurn, sampled: Sequence[int]) -> ChatMessage:
    """The turn as the conversation keeps it: the structured message
    (:meth:`AssistantTurn.to_message`), or, when a tool call could not be read, the
    text the model wrote (its ids less trailing stop ids, decoded): structured, a broken
    call would be written back as a call the model never wrote (no name, its raw text
    as a string of arguments)."""
    if all(call.arguments is not None for call in turn.tool_calls):
        return turn.to_message()
    ids = list(sampled)
    stops = set(renderer.stop_token_ids)
    while ids and ids[-1] in stops:
        ids.pop()
    return ChatMessage(role="assistant", content=renderer.decode(ids))


@attrs.define(eq=False, kw_only=True)
class GroupEpisodes:
    """What the episodes of one group share; :meth:`run` is one episode."""

    agent: EpisodeSettings
    problem: Problem
    request: GroupedRolloutRequest
    start_epoch: int
    #: What the backend's markers promise for every turn (a turn may still come back
    #: less faithful: see ``EpisodeRun.generate``).
    fidelity: str
    #: Whether the renderer's bridge takes the conversation (``messages=``).
    bridge_with_messages: bool
    #: The agent's ``environment_concurrency`` and ``live_environments`` limiters of
    #: this Trio run (``None``: no bound).
    environment_limiter: trio.CapacityLimiter | None
    live_limiter: trio.CapacityLimiter | None
    #: What aclose() raised in episodes cancelled by a sibling's failure or a shutdown:
    #: one warning for the group, not one per episode.
    closes_that_failed: list[str] = attrs.field(factory=list)
    #: The episodes' first turns as one group call (``None``: one call per episode).
    first_turns: FirstTurns | None = None

    def warn_closes_that_failed(self) -> None:
        """Warn once (``RuntimeWarning``) of the ``aclose()`` errors of episodes that
        were cancelled."""
        if self.closes_that_failed:
            count, first = len(self.closes_that_failed), self.closes_that_failed[0]
            msg = (
                f"{count} episode(s) of problem {self.problem.problem_id!r} were cancelled "
                f"and then their environment's aclose() raised; the first: {first}"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    async def run(self, member: int) -> TokenRollout:
        """One episode: wait for a live environment (``live_environments``), make the
        environment, run it, close it on every route; an error gets a note naming the
        problem, the episode and where it happened.

        Cancellation: cancels the episode's model calls and step; closes the environment
        (shielded, at most :data:`ACLOSE_SECONDS`) before it returns."""
        limiter = self.live_limiter
        if limiter is None:
            return await self.live(member)
        async with limiter:
            return await self.live(member)

    async def live(self, member: int) -> TokenRollout:
        """Episode ``member`` once its environment may live: make it, run the episode,
        close it."""
        try:
            env = self.agent.environment(self.problem)
        except Exception as exc:
            exc.add_note(self.note(member, "making its environment"))
            raise
        # A BaseEnvironment needs no look; for anything else, a plain attribute check
        # rather than isinstance(env, Environment), a runtime protocol check that costs
        # as much as the rest of a one-turn episode's bookkeeping.
        if not isinstance(env, BaseEnvironment):
            missing = [name for name in _ENVIRONMENT_PARTS if not hasattr(env, name)]
            if missing:
                msg = (
                    f"environment({self.problem.problem_id!r}) returned a "
                    f"{type(env).__name__}, not an Environment: it has no "
                    f"{', '.join(missing)} (subclass BaseEnvironment)"
                )
                raise TypeError(msg)
        run = EpisodeRun(self, env, member)
        try:
            try:
                # The model calls are episode ``member``'s turns: the placement keeps
                # an episode on one replica.
                with calling(episode=member):
                    rollout = await run.episode()
            finally:
                if self.first_turns is not None:
                    self.first_turns.withdraw(member)
        except BaseException as exc:
            if isinstance(exc, Exception):
                exc.add_note(self.note(member, run.where))
            await self.close(env, exc)
            raise
        try:
            await self.close(env, None)
        except Exception as exc:
            exc.add_note(self.note(member, "closing its environment"))
            raise
        return rollout

    def note(self, member: int, where: str) -> str:
        """The note on an episode's error: which episode of which problem, and where."""
        return (
            f"in episode {member} of {self.request.rollouts_per_group} of problem "
            f"{self.problem.problem_id!r}, {where}"
        )

    async def close(self, env: Environment, failure: BaseException | None) -> None:
        """``env.aclose()``, shielded and bounded by :data:`ACLOSE_SECONDS`. Its own
        error is raised when the episode succeeded, noted on the episode's error when
        it failed, and warned of once per group when it was cancelled."""
        with trio.move_on_after(ACLOSE_SECONDS, shield=True) as scope:
            try:
                await env.aclose()
            except Exception as error:
                if failure is None:
                    raise
                message = f"{type(env).__name__}.aclose() raised {error!r}"
                if real_leaves(failure):
                    failure.add_note(f"then {message}")
                else:
                    # A cancellation's note would vanish with it when its scope catches it.
                    self.closes_that_failed.append(message)
        if scope.cancelled_caught:
            msg = (
                f"{type(env).__name__}.aclose() did not finish within {ACLOSE_SECONDS} s "
                "and was cancelled; what it holds may not have been released"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=2)


@attrs.define(eq=False)
class EpisodeRun:
    """The state of one episode while it runs; :meth:`episode` runs it."""

    shared: GroupEpisodes
    env: Environment
    member: int
    elements: list[Element] = attrs.field(factory=list)
    conversation: list[ChatMessage] = attrs.field(factory=list)
    tools: list[dict[str, Any]] | None = None
    fidelity: str = "exact"
    turns: int = 0
    breaks: int = 0
    parse_errors: int = 0
    truncated_turns: int = 0
    #: Where the episode is (for the note on an error).
    where: str = "in reset()"
    #: One record per assistant turn (``extra["episode"]["per_turn"]``).
    per_turn: list[dict[str, Any]] = attrs.field(factory=list)
    #: The epoch the episode started under: its group's, or a later one for an episode
    #: generated again after a cut (``pipeline/_cuts.py``).
    start_epoch: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.start_epoch = call_start_epoch_or(self.shared.start_epoch)

    async def episode(self) -> TokenRollout:
        """Run the episode to its end and return its rollout (see
        :class:`~trio_rollouts.MultiTurnAgent`)."""
        agent = self.shared.agent
        renderer = agent.renderer
        budget = agent.max_episode_tokens
        interface = self.shared.request.inference_interface
        self.fidelity = self.shared.fidelity
        messages = checked_messages(await self.limited(self.env.reset), "reset()")
        check_roles(renderer, messages, "reset()")
        self.conversation = list(messages)
        self.tools = self.env.tools
        self.where = "rendering reset()'s messages"
        first = renderer.render(messages, tools=self.tools)
        if budget is not None and len(first) >= budget:
            msg = (
                f"max_episode_tokens={budget} leaves no room for a turn: the first render "
                f"of problem {self.shared.problem.problem_id!r} is {len(first)} ids (it must "
                "be more than that)"
            )
            raise ValueError(msg)
        self.elements.append(Element.scaffold(first))
        finish: str
        reward: float | None = None
        while True:
            element = self.elements[-1]
            if budget is not None and budget - len(element.ids) < 1:
                finish = "max_tokens"
                break
            self.where = f"turn {self.turns + 1}, generating"
            response, sampled, kind = await self.generate(interface, element, budget)
            self.turns += 1
            start = len(self.elements[-1].ids) - len(sampled)
            self.where = f"turn {self.turns}, parsing"
            turn = numbered(renderer, renderer.parse(sampled), self.turns)
            self.parse_errors += turn.parse_error is not None
            self.where = f"turn {self.turns}, in step()"
            step = await self.step(turn)
            self.record(turn, response, start, step)
            self.where = f"turn {self.turns}, bridging to the next"
            if step.done:
                finish, reward = "done", step.reward
                break
            if budget is not None and len(self.elements[-1].ids) >= budget:
                finish = "max_tokens"
                break
            if self.turns >= agent.max_turns:
                finish = "max_turns"
                break
            cut = response.finish_reason == "length"
            if not self.go_on(sampled, turn, cut, kind == "retokenized", step):
                finish = "max_tokens"
                break
        if reward is None:
            self.where = "in final_reward()"
            reward = check_reward(await self.env.final_reward(), "final_reward()")
        return self.rollout(float(reward), finish)

    def record(
        self, turn: AssistantTurn, response: InferenceResponse, start: int, step: EnvironmentStep
    ) -> None:
        """The turn's entry in ``extra["episode"]["per_turn"]``."""
        entry = turn_record(
            turn, response, len(self.elements) - 1, start, len(self.elements[-1].ids)
        )
        entry["reward"] = None if step.done else step.reward
        entry["info"] = step.info
        self.per_turn.append(entry)

    async def generate(
        self, interface: InferenceInterface, element: Element, budget: int | None
    ) -> tuple[InferenceResponse, list[int], str]:
        """One turn: generate, check the ids, append the sampled ones; return the
        response, the sampled ids and the turn's fidelity."""
        request = self.shared.request
        args = request.generation_args
        if budget is not None:
            left = budget - len(element.ids)
            args = attrs.evolve(
                args, max_tokens=left if args.max_tokens is None else min(args.max_tokens, left)
            )
        kind = self.shared.fidelity
        if request.seed is not None:
            seed = request_seed(
                request, interface, self.shared.problem.problem_id, self.member, self.turns
            )
            args = seeded(args, seed)
        inference_request = InferenceRequest(
            prompt=list(self.conversation),
            tools=self.tools,
            generation_args=args,
            prompt_ids=list(element.ids) if kind == "exact" else None,
        )
        first = self.shared.first_turns
        if first is not None and self.turns == 0:
            response, choice_seed = await first.generate(self.member, inference_request)
            if choice_seed is not None:
                args = seeded(args, choice_seed)
        else:
            response = await interface.agenerate(inference_request)
        token_ids = response.token_ids
        if token_ids is None:
            kind = "retokenized"  # whatever the markers promised: the text is all there is
        agent = self.shared.agent
        if RANK[kind] < RANK[agent.min_fidelity]:
            lacked = "returned no token ids for this turn"
            raise TokenFidelityError(fidelity_error(interface, kind, agent.min_fidelity, lacked))
        kind, sampled, logprobs, server_prompt = read_turn(
            interface, agent.renderer, element.ids, response, kind
        )
        if server_prompt is not None:
            element = self.server_break(server_prompt)
        if kind != "exact":
            self.fidelity = min(self.fidelity, kind, key=RANK.__getitem__)
        element.take(sampled, logprobs, response, args, self.start_epoch)
        return response, sampled, kind

    def server_break(self, server_prompt: list[int]) -> Element:
        """The server rendered another prompt than the episode's ids: a break. The new
        element starts from what the model saw (an element with no sampled ids yet is
        replaced)."""
        self.broke(
            "the server rendered a prompt that differs from the episode's ids (its chat "
            "template is not the renderer's, or it re-tokenized the conversation)"
        )
        return start_element(self.elements, server_prompt)

    def broke(self, why: str) -> None:
        """Count a template break, or raise it (``on_break="raise"``)."""
        if self.shared.agent.on_break == "raise":
            msg = f"turn {self.turns + 1} of problem {self.shared.problem.problem_id!r}: {why}"
            raise TemplateBreakError(msg)
        self.breaks += 1

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        """``env.step(turn)``, within ``environment_concurrency`` and ``step_timeout``
        (waiting for a slot does not count against the deadline)."""
        step = await self.limited(functools.partial(self.timed_step, turn))
        if not isinstance(step, EnvironmentStep):
            msg = (
                f"{type(self.env).__name__}.step() returned a {type(step).__name__}, not an "
                "EnvironmentStep"
            )
            raise TypeError(msg)
        return step

    async def timed_step(self, turn: AssistantTurn) -> EnvironmentStep:
        """``env.step(turn)`` within ``step_timeout``: past it, cancelled and a
        ``StepTimeoutError`` (transient: the group is retried)."""
        timeout = self.shared.agent.step_timeout
        if timeout is None:
            return await self.env.step(turn)
        with trio.move_on_after(timeout):
            return await self.env.step(turn)
        msg = (
            f"{type(self.env).__name__}.step() ran past step_timeout={timeout} s on turn "
            f"{self.turns} of problem {self.shared.problem.problem_id!r} and was cancelled"
        )
        raise StepTimeoutError(msg)

    async def limited(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """Call and await ``call`` (``reset``, a timed ``step``) within
        ``environment_concurrency``: the coroutine is made only once a slot is held, so an
        episode cancelled while it waits for one leaves no coroutine that was never
        awaited."""
        limiter = self.shared.environment_limiter
        if limiter is None:
            return await call()
        async with limiter:
            return await call()

    def go_on(
        self,
        sampled: list[int],
        turn: AssistantTurn,
        truncated: bool,
        retokenized: bool,
        step: EnvironmentStep,
    ) -> bool:
        """Append what comes before the next turn (close ids after a truncated turn, or a
        retokenized one, whose text never shows the stop token; then the bridge, or a new
        element after a break); ``False`` when that would leave no room for a turn within
        ``max_episode_tokens`` (then nothing is appended)."""
        agent = self.shared.agent
        renderer = agent.renderer
        budget = agent.max_episode_tokens
        element = self.elements[-1]
        # The turn as a structured message (content, tool calls, reasoning): what every
        # template renders, and what a chat server is sent; as written if a call broke.
        self.conversation.append(turn_message(renderer, turn, sampled))
        new_messages = list(step.messages)
        check_roles(renderer, new_messages, "step().messages")
        tools = self.env.tools
        close = close_ids(renderer, sampled, truncated or retokenized)
        bridge = None
        if tools != self.tools:
            why = "the environment's tools changed"
        else:
            bridge = bridge_ids(
                renderer,
                element.ids + close,
                new_messages,
                tools=tools,
                conversation=self.conversation,
                with_messages=self.shared.bridge_with_messages,
            )
            why = (
                "the renderer could not prove a bridge: the template's render of the "
                "conversation does not extend the episode's ids (it rewrites history)"
            )
        self.conversation.extend(new_messages)
        if bridge is None:
            # No room for a turn after the full render: the episode ends here, so no new
            # element starts and nothing broke (no break counted, none raised).
            ids = renderer.render(self.conversation, tools=tools)
            if budget is not None and len(ids) >= budget:
                return False
            if new_messages and tools == self.tools:
                before = self.conversation[: len(self.conversation) - len(new_messages)]
                if renderer.render(before, tools=tools) == ids:
                    roles = ", ".join(sorted({repr(m.role) for m in new_messages}))
                    why = (
                        f"the step's messages (roles {roles}) render to no text: the "
                        "template drops them, so the model would never see them (send them "
                        "in a role the template renders)"
                    )
            self.broke(why)
            self.tools = tools
            # Appended even after a turn that sampled nothing: that element stays.
            self.elements.append(Element.scaffold(ids))
        else:
            if budget is not None and len(element.ids) + len(close) + len(bridge) >= budget:
                return False
            element.extend(close)
            element.extend(bridge)
        self.truncated_turns += truncated
        return True

    def rollout(self, reward: float, finish: str) -> TokenRollout:
        """The episode's :class:`~trio_rollouts.TokenRollout`, ``extra["episode"]``
        holding its record."""
        return token_rollout(
            self.elements,
            start_epoch=self.start_epoch,
            reward=reward,
            fidelity=self.fidelity,
            env_id=self.shared.agent.env_id,
            problem_id=self.shared.problem.problem_id,
            extra={
                "episode": {
                    "turns": self.turns,
                    "finish": finish,
                    "breaks": self.breaks,
                    "tool_calls": sum(len(t["tool_calls"]) for t in self.per_turn),
                    "parse_errors": self.parse_errors,
                    "truncated_turns": self.truncated_turns,
                    "per_turn": self.per_turn,
                }
            },
        )
