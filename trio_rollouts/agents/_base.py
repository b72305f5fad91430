"""Agents: the classes users subclass to produce rollouts, groups and evaluations.

Every agent is an attrs class; users subclass with ``@attrs.define`` and add their own
fields. Agents only say *what* one rollout or one group is; running many of them
concurrently, with bounds and clean shutdown, is the library's job (``trio_rollouts.pipeline`` for
groups, :func:`~trio_rollouts._concurrency.gather` for flat lists).
"""

from __future__ import annotations

import abc
import contextlib
import warnings
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio

from trio_rollouts._checks import int_at_least as _int_at_least
from trio_rollouts._concurrency import gather
from trio_rollouts.inference._interface import require_raw
from trio_rollouts.models._evaluation import EvaluationResponse
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._requests import EvaluationRequest, GroupedRolloutRequest, RolloutRequest
from trio_rollouts.models._rollouts import ContrastiveRollout, Rollout, RolloutGroup, TokenRollout
from trio_rollouts.pipeline._failure import FailurePolicy
from trio_rollouts.pipeline._run import PipelineConfig, open_pipeline
from trio_rollouts.pipeline._stream import RolloutStream
from trio_rollouts.prompts._source import PromptSource

__all__ = [
    "Agent",
    "ContrastiveRolloutGenerator",
    "EvaluationAgent",
    "GroupedRolloutGenerator",
    "RolloutGenerator",
    "TokenizedRolloutGenerator",
    "check_grouped_request",
    "draws_prompts",
]


@attrs.define(kw_only=True)
class Agent(abc.ABC):  # noqa: B024 - the root of the abstract family, as in the origin
    """Base of every agent."""


@attrs.define(kw_only=True)
class RolloutGenerator(Agent):
    """An agent that produces :class:`Rollout` objects: rollout strings with a reward."""

    @abc.abstractmethod
    async def rollout(self, request: RolloutRequest) -> Rollout:
        """Produce one rollout."""

    async def get_reward_rollouts(self, request: RolloutRequest) -> list[Rollout]:
        """Run ``request.num_rollouts`` :meth:`rollout` calls concurrently; return them in
        call order.

        The first failure cancels the other calls and is raised as itself.
        Cancellation: cancelling this cancels every call; it returns (or raises) only after
        all of them have exited.
        """
        require_raw(request.inference_interface, type(self).__name__)
        return await gather([lambda: self.rollout(request)] * request.num_rollouts)


@attrs.define(kw_only=True)
class TokenizedRolloutGenerator(Agent):
    """An agent that produces :class:`TokenRollout` objects: token ids, an optional
    generation mask and log-probabilities, with rewards."""

    @abc.abstractmethod
    async def rollout(self, request: RolloutRequest) -> TokenRollout:
        """Produce one tokenized rollout."""

    async def get_reward_rollouts(self, request: RolloutRequest) -> list[TokenRollout]:
        """Run ``request.num_rollouts`` :meth:`rollout` calls concurrently; return them in
        call order. Errors and cancellation as :meth:`RolloutGenerator.get_reward_rollouts`.
        """
        require_raw(request.inference_interface, type(self).__name__)
        return await gather([lambda: self.rollout(request)] * request.num_rollouts)


@attrs.define(kw_only=True)
class ContrastiveRolloutGenerator(Agent):
    """An agent that produces preference pairs (chosen and rejected trajectories)."""

    @abc.abstractmethod
    async def get_contrastive_rollouts(self, request: RolloutRequest) -> list[ContrastiveRollout]:
        """Produce preference pairs for ``request``."""


@attrs.define(kw_only=True)
class EvaluationAgent(Agent):
    """An agent that evaluates an inference interface and returns a scored response."""

    @abc.abstractmethod
    async def run_evaluation(self, request: EvaluationRequest) -> EvaluationResponse[Any]:
        """Evaluate ``request.inference_interface`` on this rank's prompts."""


@attrs.define(kw_only=True)
class GroupedRolloutGenerator(Agent):
    """An agent that produces groups of rollouts for one prompt each, as GRPO needs.

    Subclasses implement :meth:`group_rollout`; :meth:`get_grouped_rollouts` runs it
    concurrently, bounded by ``parallel_generation_tasks`` calls in flight and
    ``buffer_size`` finished groups waiting for the consumer.
    """

    #: At most this many ``group_rollout`` calls run at once.
    parallel_generation_tasks: int = attrs.field(default=512, validator=_int_at_least(1))
    #: At most this many finished groups wait for the consumer in the stream's buffer.
    buffer_size: int = attrs.field(default=10, validator=_int_at_least(0))
    #: With filtering, more filtered groups in a row than this is an error.
    max_consecutive_filtered: int = attrs.field(default=10_000, validator=_int_at_least(1))
    #: Deadlines, retries and skip-or-raise for failing groups (by default, raise at once).
    failure_policy: FailurePolicy = attrs.field(factory=FailurePolicy)
    #: Where groups' problems come from, when the agent draws them from a checkpointable
    #: :class:`~trio_rollouts.PromptSource` (``self.prompts.draw()`` once per
    #: ``group_rollout`` call); the pipeline then keeps the source's books.
    prompts: PromptSource | None = attrs.field(default=None)

    @prompts.validator
    def _check_prompts(self, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None and not isinstance(value, PromptSource):
            msg = f"prompts must be a PromptSource or None, got {type(value).__name__}"
            raise TypeError(msg)

    @failure_policy.validator
    def _check_failure_policy(self, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, FailurePolicy):
            msg = f"failure_policy must be a FailurePolicy, got {value!r}"
            raise TypeError(msg)

    @abc.abstractmethod
    async def group_rollout(
        self, request: GroupedRolloutRequest
    ) -> Sequence[Rollout | TokenRollout] | RolloutGroup:
        """Produce the rollouts of one group (``request.rollouts_per_group`` of them).

        Cancellation: the pipeline cancels calls in flight when it shuts down or fails;
        implementations must let ``trio.Cancelled`` propagate.
        """

    def _slot_generator(
        self, request: GroupedRolloutRequest
    ) -> Callable[[int, int], Awaitable[Sequence[Rollout | TokenRollout] | RolloutGroup]]:
        """What the pipeline calls for slot ``(batch_id, index_in_batch)``.

        Agents that route slots to other agents (multi-task mixing) override this; plain
        agents only implement :meth:`group_rollout`. (A sync function returning the
        coroutine keeps one coroutine frame off the per-group hot path.)
        """
        group_rollout = self.group_rollout
        return lambda batch_id, index_in_batch: group_rollout(request)

    def _draws_prompts(self) -> bool:
        """Whether the pipeline must record the prompt draws of this agent's calls."""
        return self.prompts is not None

    def _slot_environment(self, request: GroupedRolloutRequest) -> Callable[[int, int], str] | None:
        """The environment (``env_id``) each slot belongs to, for per-environment
        statistics; ``None`` (the default) keeps no per-environment counters."""
        return None

    def get_grouped_rollouts(
        self, request: GroupedRolloutRequest
    ) -> contextlib.AbstractAsyncContextManager[RolloutStream]:
        """Generate groups for ``request``; use as ``async with ... as stream``.

        Checked at once, before any work: ``num_groups >= 1``, ``rollouts_per_group >= 1``,
        ``parallel_generation_tasks >= num_groups``, ``buffer_size >= 0``, filtering needs
        ``rollouts_per_group >= 2`` (``ValueError``); the interface must be ``ReturnsRaw``
        (``TypeError``). A ``parallel_generation_tasks`` that is not a multiple of
        ``num_groups`` warns (``RuntimeWarning``) that capacity is unused.

        Groups come in batches of ``num_groups`` that share a ``batch_id`` (0, 1, ...).
        Non-streaming: exactly one batch, then the stream ends. Streaming: batches until
        the consumer leaves, with at most ``parallel_generation_tasks // num_groups``
        batches outstanding (not fully taken). ``enforce_order`` yields whole batches in
        ``batch_id`` order, groups by ``index_in_batch``; otherwise each group as soon as
        it is finished. ``filter_groups_with_same_reward`` drops groups whose rewards have
        population std <= 1e-6 and regenerates them in the same slot.

        Errors: an exception from :meth:`group_rollout` cancels all work and leaves the
        ``async with`` as itself (an ``ExceptionGroup`` only if several calls failed).
        Groups taken earlier stay taken.

        Cancellation: leaving the ``async with`` by any route (break, return, exception,
        an outer cancel scope) cancels every call in flight; ``__aexit__`` returns only
        after every call has exited and every task the pipeline started has ended.
        """
        check_grouped_request(self, request)
        config = PipelineConfig(
            request=request,
            generate=self._slot_generator(request),
            name=type(self).__name__,
            batches_ahead=self.parallel_generation_tasks // request.num_groups,
            buffer_size=self.buffer_size,
            max_consecutive_filtered=self.max_consecutive_filtered,
            failure_policy=self.failure_policy,
            env_of_slot=self._slot_environment(request),
            draws_prompts=draws_prompts(self),
            prompts_required=self.prompts is not None,
        )
        return open_pipeline(config)


def check_grouped_request(agent: GroupedRolloutGenerator, request: GroupedRolloutRequest) -> None:
    """Every check that must pass before any work starts (invariant 1)."""
    if not isinstance(request, GroupedRolloutRequest):
        msg = f"request must be a GroupedRolloutRequest, got {type(request).__name__}"
        raise TypeError(msg)
    require_raw(request.inference_interface, type(agent).__name__)
    groups = request.num_groups
    tasks = agent.parallel_generation_tasks
    if groups < 1:
        msg = f"num_groups must be >= 1, got {groups}"
        raise ValueError(msg)
    if request.rollouts_per_group < 1:
        msg = f"rollouts_per_group must be >= 1, got {request.rollouts_per_group}"
        raise ValueError(msg)
    if tasks < groups:
        msg = (
            f"parallel_generation_tasks ({tasks}) must be >= num_groups ({groups}): "
            f"one batch of {groups} groups must fit in flight"
        )
        raise ValueError(msg)
    if agent.buffer_size < 0:
        msg = f"buffer_size must be >= 0, got {agent.buffer_size}"
        raise ValueError(msg)
    if request.filter_groups_with_same_reward and request.rollouts_per_group < 2:
        msg = (
            "filter_groups_with_same_reward needs rollouts_per_group >= 2 (a group of one "
            f"rollout always has the same reward), got {request.rollouts_per_group}"
        )
        raise ValueError(msg)
    if tasks % groups:
        msg = (
            f"parallel_generation_tasks ({tasks}) is not a multiple of num_groups "
            f"({groups}); {tasks % groups} generation task(s) will be unused"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def check_problems(agent: GroupedRolloutGenerator, cls: type[Any]) -> None:
    """At construction: a ``TypeError`` when ``agent`` has no ``prompts`` and its
    ``get_problem`` is still ``cls``'s, which draws from them (:func:`draw_problem`)."""
    if agent.prompts is None and getattr(type(agent), "get_problem", None) is cls.get_problem:
        msg = (
            f"{type(agent).__name__} needs problems: pass prompts= (a PromptSource) or "
            "override get_problem(request)"
        )
        raise TypeError(msg)


async def draw_problem(agent: GroupedRolloutGenerator) -> Problem:
    """The next draw from ``agent.prompts``: what an agent's ``get_problem`` does when
    its problems come from its prompt source (a ``ValueError`` naming the agent when it
    has none).

    Cancellation: a schedule point after the draw, never cancelled (so the groups of one
    run draw their problems in the order the pipeline starts them, whatever order Trio
    runs their tasks in, and a drawn problem is never lost)."""
    if agent.prompts is None:
        msg = f"{type(agent).__name__} has no prompts; pass prompts= or override get_problem"
        raise ValueError(msg)
    problem = agent.prompts.draw()
    await trio.lowlevel.cancel_shielded_checkpoint()
    return problem


def draws_prompts(agent: GroupedRolloutGenerator) -> bool:
    """Whether ``agent``'s calls draw from prompt sources (its own, or a sub-agent's):
    what the pipeline records, and what Ray must shard across actors."""
    return agent._draws_prompts()
