"""Multi-turn episodes, token-exact: :class:`MultiTurnAgent`.

An episode is a token stream, not a message list (:mod:`._element`): its ids start as the
renderer's render of the environment's first messages; each turn generates from exactly
those ids and appends the ids the model sampled *verbatim*; the environment answers the
parsed turn; and only what comes between two assistant turns is rendered. So the trainer
gets the ids the model saw and sampled, never a re-tokenization of them.

When a bridge cannot be proved (the renderer says ``None``) or the tool set changes,
the episode either starts a new trajectory element from a full render
(``on_break="split"``) or raises :class:`TemplateBreakError`. How faithful each turn's
ids are (``fidelity``) follows from the backend: ``"exact"`` when it generates from ids
(:class:`~trio_rollouts.inference.AcceptsTokens`), ``"server_tokens"`` when it renders
the chat itself but returns the ids (:class:`~trio_rollouts.inference.ReturnsTokens`),
``"retokenized"`` when it returns text only.

This module holds the agent: its settings, the problem draw and the group
(:meth:`MultiTurnAgent.group_rollout`). One episode's loop is in :mod:`._episode`, the
first turns' group call in :mod:`._first_turns`.

Concurrency: a group's episodes run in one nursery (the first failure cancels the
others and the group fails as one, for :class:`~trio_rollouts.FailurePolicy` to retry
or skip); ``environment_concurrency`` bounds the ``reset``/``step`` calls in flight
across the agent; ``step_timeout`` bounds each ``step``; every environment is closed
exactly once, on every route, shielded and bounded.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal

import attrs
import trio

from trio_rollouts._checks import int_at_least, optional_int_at_least, seconds
from trio_rollouts._concurrency import gather
from trio_rollouts.agents._base import GroupedRolloutGenerator, check_problems, draw_problem
from trio_rollouts.agents._environment import Environment
from trio_rollouts.episodes._checks import (
    check_min_fidelity,
    check_on_break,
    check_renderer,
    check_vocabulary,
)
from trio_rollouts.episodes._element import (
    RANK,
    backend_fidelity,
    request_start_epoch,
    takes_messages,
)
from trio_rollouts.episodes._episode import GroupEpisodes
from trio_rollouts.episodes._errors import TokenFidelityError, fidelity_error, what_lacked
from trio_rollouts.episodes._first_turns import FirstTurns
from trio_rollouts.inference._interface import GeneratesGroups
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import Rollout, RolloutGroup, TokenRollout
from trio_rollouts.pipeline._cuts import cuts_possible, run_members
from trio_rollouts.renderers import Renderer

__all__ = ["DEFAULT_MAX_EPISODE_TOKENS", "DEFAULT_STEP_TIMEOUT", "MultiTurnAgent"]

#: ``MultiTurnAgent.step_timeout`` by default: five minutes. A tool call (a sandboxed
#: run, a test suite, a web request) still running after that is almost always hung, and
#: a hung step holds its group, and the group's slot in the pipeline, forever; past it
#: the step fails with the transient ``StepTimeoutError`` and the failure policy retries
#: the group.
DEFAULT_STEP_TIMEOUT = 300.0
#: ``MultiTurnAgent.max_episode_tokens`` by default: 32,768 ids, the context most RL
#: models are served with (Qwen2.5's and Qwen3's native length, vLLM's
#: ``max_model_len`` for them; Llama 3.1's 128k holds it too). No model generates past
#: its context, and without a bound each verbose tool result grows every later prompt.
DEFAULT_MAX_EPISODE_TOKENS = 32_768


def _check_environment(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not callable(value):
        msg = (
            "environment must be a callable that makes one Environment per episode "
            f"(problem -> Environment, such as an Environment class), got {value!r:.60}"
        )
        raise TypeError(msg)


@attrs.define(kw_only=True)
class MultiTurnAgent(GroupedRolloutGenerator):
    """Runs ``rollouts_per_group`` episodes of one problem concurrently and returns one
    :class:`~trio_rollouts.TokenRollout` per episode, token-exact (see the module
    docstring and the docs page "Multi-turn agents and tools").

    Problems come from ``prompts`` (a :class:`~trio_rollouts.PromptSource`, one draw
    per group), or from an override of :meth:`get_problem`.

    An episode: ``ids = renderer.render(env.reset(), tools=env.tools)``; each turn
    generates from ``prompt_ids=ids`` with the request's generation arguments
    (``max_tokens`` capped by what ``max_episode_tokens`` leaves), appends the sampled ids
    with mask 1, parses them (:meth:`Renderer.parse`), calls ``env.step``, and appends
    the bridge with mask 0 (after ``close_ids`` when the turn was cut by ``max_tokens``).
    It ends when a step is ``done`` (finish ``"done"``, its reward), at ``max_turns``
    (``"max_turns"``) or when ``max_episode_tokens`` is reached (``"max_tokens"``); an
    episode ended by a limit gets ``env.final_reward()``. ``env.step`` is called for
    every turn, the last included, and its ``done`` wins over the limits.

    The rollout: one trajectory element per segment (normally one); ``generation_mask``
    True exactly on sampled ids; ``logprobs`` one per sampled id (``None`` when any turn
    has none); ``policy_epoch``/``kv_cache_epoch`` boundaries at positions in the element
    (the backend's stamps per turn, else the group's ``start_epoch``); ``fidelity`` the
    lowest of the turns'; ``extra["episode"]``: ``turns``, ``finish``, ``breaks``,
    ``tool_calls`` (a count), ``parse_errors``, ``truncated_turns`` and ``per_turn`` (one
    record per turn: its span, finish reason, calls, a non-final step's reward and
    ``info``).

    Cancellation: :meth:`group_rollout` runs the episodes in one nursery; cancelling it
    cancels every model call and environment step, closes every environment (shielded,
    at most 5 seconds each) and returns only when all of that has ended.
    """

    #: Makes one environment per episode: ``problem -> Environment`` (sync).
    environment: Callable[[Problem], Environment] = attrs.field(validator=_check_environment)
    #: The model family's chat template, in ids.
    renderer: Renderer = attrs.field(validator=check_renderer)
    #: At most this many assistant turns per episode.
    max_turns: int = attrs.field(default=8, validator=int_at_least(1))
    #: At most this many ids per trajectory element; by default
    #: :data:`DEFAULT_MAX_EPISODE_TOKENS` (32,768, the context most RL models are served
    #: with: set your server's ``max_model_len`` when it is another); ``None``: no bound.
    max_episode_tokens: int | None = attrs.field(
        default=DEFAULT_MAX_EPISODE_TOKENS, validator=optional_int_at_least(1)
    )
    #: Seconds one ``env.step`` may take; by default :data:`DEFAULT_STEP_TIMEOUT` (five
    #: minutes: a step still running then is almost always hung, and holds its group
    #: forever); ``None``: no deadline. Past it the step is cancelled and the episode
    #: fails with :class:`StepTimeoutError` (transient: the group is retried).
    step_timeout: float | None = attrs.field(
        default=DEFAULT_STEP_TIMEOUT, validator=seconds(positive=True)
    )
    #: At most this many ``reset``/``step`` calls at once across the agent (``None``: no
    #: bound). Waiting for one does not count against ``step_timeout``.
    environment_concurrency: int | None = attrs.field(
        default=None, validator=optional_int_at_least(1)
    )
    #: At most this many environments alive at once across the agent (``None``: no
    #: bound), each counted from the factory call until its ``aclose`` has returned:
    #: sandboxes held while the model generates count. An episode waits for one before
    #: its environment is made; the wait counts against no deadline of the episode's.
    live_environments: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    #: What a template break does: ``"split"`` (a new trajectory element from a full
    #: render) or ``"raise"`` (:class:`TemplateBreakError`).
    on_break: Literal["split", "raise"] = attrs.field(default="split", validator=check_on_break)
    #: The least faithful ids a turn may have (:class:`TokenFidelityError` below it).
    min_fidelity: str = attrs.field(default="server_tokens", validator=check_min_fidelity)
    #: The environment's name, stamped on every rollout (``env_id``).
    env_id: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    # Whether renderer.bridge takes the conversation at hand (messages=).
    _bridge_takes_messages: bool = attrs.field(init=False, default=False, repr=False)
    # The environment_concurrency and live_environments limiters of the current Trio
    # run, and that run.
    _limiter: trio.CapacityLimiter | None = attrs.field(init=False, default=None, repr=False)
    _live: trio.CapacityLimiter | None = attrs.field(init=False, default=None, repr=False)
    _limiter_run: object = attrs.field(init=False, default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        self._bridge_takes_messages = takes_messages(self.renderer)
        check_problems(self, MultiTurnAgent)

    def _slot_generator(
        self, request: GroupedRolloutRequest
    ) -> Callable[[int, int], Awaitable[Sequence[Rollout | TokenRollout] | RolloutGroup]]:
        """As every agent's, once the renderer is checked against the request's backend
        (:func:`check_vocabulary`): when the stream opens, before any work."""
        check_vocabulary(self.renderer, request.inference_interface, type(self).__name__)
        return super()._slot_generator(request)

    async def get_problem(self, request: GroupedRolloutRequest) -> Problem:
        """The problem of one group: the next draw from ``prompts``. Override it to take
        problems from elsewhere.

        Cancellation: a schedule point after the draw, never cancelled (so the groups
        of one run draw their problems in the order the pipeline starts them, whatever
        order Trio runs their tasks in, and a drawn problem is never lost)."""
        return await draw_problem(self)

    async def group_rollout(self, request: GroupedRolloutRequest) -> list[TokenRollout]:
        """Run ``request.rollouts_per_group`` episodes of one problem concurrently.

        Raises :class:`TokenFidelityError` before any work when the backend cannot give
        ``min_fidelity``, and ``TypeError`` when its token ids are not the renderer's
        (:func:`check_vocabulary`). The first failing episode cancels the others and is
        raised as itself, with a note naming the problem, the episode and the turn;
        episodes that failed at the same instant (the same bug in each) are named in a
        note on it and kept with it, so the failure policy classifies the group by all
        of them.

        Cancellation: cancels every model call and environment step; returns (or
        raises) only when every episode has ended and every environment was closed.
        """
        interface = request.inference_interface
        check_vocabulary(self.renderer, interface, type(self).__name__)
        fidelity = backend_fidelity(interface)
        if RANK[fidelity] < RANK[self.min_fidelity]:
            message = fidelity_error(interface, fidelity, self.min_fidelity, what_lacked(fidelity))
            raise TokenFidelityError(message)
        problem = await self.get_problem(request)
        if not isinstance(problem, Problem):
            msg = f"get_problem must return a Problem, got {type(problem).__name__}"
            raise TypeError(msg)
        start_epoch = request_start_epoch(request)
        environment_limiter, live_limiter = self._limiters()
        episode = GroupEpisodes(
            agent=self,
            problem=problem,
            request=request,
            start_epoch=start_epoch,
            fidelity=fidelity,
            bridge_with_messages=self._bridge_takes_messages,
            environment_limiter=environment_limiter,
            live_limiter=live_limiter,
        )
        size = request.rollouts_per_group
        extra = request.extra_rollouts
        cuttable = not request.group_calls and cuts_possible(request.max_staleness, interface)
        if (
            request.group_calls
            and size + extra > 1
            and isinstance(interface, GeneratesGroups)
            # live_environments is shared by every group: siblings waiting for each
            # other while holding slots could wait forever.
            and self.live_environments is None
        ):
            episode.first_turns = FirstTurns(interface, size + extra)
        try:
            if extra or cuttable:
                # Episodes that may be cut (see pipeline/_cuts.py): the first to finish are kept.
                kept = await run_members(size, extra, episode.run)
                return [rollout for _, rollout in kept]
            return await gather(
                [
                    functools.partial(episode.run, member)
                    for member in range(request.rollouts_per_group)
                ]
            )
        finally:
            episode.warn_closes_that_failed()

    def _limiters(self) -> tuple[trio.CapacityLimiter | None, trio.CapacityLimiter | None]:
        """The limiters of ``environment_concurrency`` and ``live_environments`` for the
        current Trio run (new ones per run: the sync bridge and Ray run the agent in runs
        of their own; ``None``: no bound)."""
        run = trio.lowlevel.current_root_task()
        if self._limiter_run is not run:
            self._limiter_run = run
            self._limiter = self._live = None
            if self.environment_concurrency is not None:
                self._limiter = trio.CapacityLimiter(self.environment_concurrency)
            if self.live_environments is not None:
                self._live = trio.CapacityLimiter(self.live_environments)
        return self._limiter, self._live
