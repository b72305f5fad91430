"""The tool demo (``trio-rollouts demo --task tool``): asynchronous GRPO on multi-turn
episodes with a calculator, on the embedded backend.

The *environment* is :class:`~trio_rollouts.envs.CalculatorEnvironment`, run by a
:class:`~trio_rollouts.MultiTurnAgent` with a :class:`~trio_rollouts.PlainRenderer` over
problems of :func:`~trio_rollouts.envs.make_problems` (a seeded
:class:`~trio_rollouts.PromptSource`); the *model* is
:class:`~trio_rollouts.envs.ToolUsePolicy`, which at first calls the calculator about
``1 / K`` of the time and otherwise answers a wrong number, so reward comes only through
the tool. The trainer is the arithmetic demo's (:class:`Trainer`): one batch per step,
one clipped GRPO step inside ``stream.weight_update``. Each step reports the mean reward,
the tool-call rate measured (episodes with at least one tool call) and the policy's
exact one, its exact accuracy, and the mean number of turns (:class:`ToolStepMetrics`).

On a virtual clock a seed fixes every number: each call reaches the engine after a
seeded delay (:func:`dispatch_delayed`), every request carries a seed of its own
(``GroupedRolloutRequest.seed``: a group's episodes send identical requests at one
instant, which would otherwise share out the engine's sample streams in an order Trio
varies), and a group's episodes are returned in a canonical order (sorted by their ids,
logprobs and epochs).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import IO, Any

import attrs
import numpy as np
import trio

from trio_rollouts._checks import int_at_least, non_negative_seconds
from trio_rollouts.cli._demo._config import check_mode, check_positive, count_at_least
from trio_rollouts.cli._demo._environment import dispatch_delayed
from trio_rollouts.cli._demo._run import stream_counters
from trio_rollouts.cli._demo._trainer import StepMetrics, Trainer
from trio_rollouts.envs import CalculatorEnvironment, ToolUsePolicy, make_problems
from trio_rollouts.episodes import MultiTurnAgent
from trio_rollouts.inference import EmbeddedInference, LatencyModel, WeightUpdateMode
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import RolloutGroup, TokenRollout
from trio_rollouts.prompts._source import PromptSource
from trio_rollouts.renderers import PlainRenderer

__all__ = ["ToolDemoAgent", "ToolDemoConfig", "ToolDemoResult", "ToolStepMetrics", "run_tool_demo"]


@attrs.frozen(kw_only=True)
class ToolDemoConfig:
    """The tool demo's settings; the defaults learn to call the calculator (tool-call rate
    and accuracy from about ``1 / K`` and ``1 / K ** 2`` to above 0.9) in a few seconds.

    As :class:`DemoConfig`: ``lag`` batches are outstanding at once, ``train_seconds`` is
    how long an update takes on the run's clock, ``update_mode`` and ``max_staleness``
    are the stream's. ``num_candidates`` is ``K`` of :class:`ToolUsePolicy`,
    ``max_turns`` the agent's.
    """

    seed: int = attrs.field(default=0, validator=int_at_least(0))
    steps: int = attrs.field(default=16, validator=int_at_least(1))
    groups_per_step: int = attrs.field(default=4, validator=int_at_least(1))
    group_size: int = attrs.field(default=8, validator=int_at_least(2))
    lag: int = attrs.field(default=2, validator=int_at_least(1))
    num_problems: int = attrs.field(default=32, validator=int_at_least(1))
    num_candidates: int = attrs.field(default=4, validator=int_at_least(2))
    max_turns: int = attrs.field(default=4, validator=int_at_least(1))
    learning_rate: float = attrs.field(default=2.0, validator=check_positive)
    clip: float = attrs.field(default=0.2, validator=check_positive)
    filter_groups: bool = True
    train_seconds: float = attrs.field(default=0.05, validator=non_negative_seconds)
    latency: LatencyModel = attrs.field(
        factory=lambda: LatencyModel(first_token=0.03, per_token=0.01)
    )
    update_mode: WeightUpdateMode = attrs.field(default="keep", validator=check_mode)
    max_staleness: int | None = attrs.field(
        default=None, validator=count_at_least(0, optional=True)
    )


@attrs.frozen(kw_only=True)
class ToolStepMetrics:
    """What one step of the tool demo saw and did.

    - ``mean_reward``: mean reward of the step's episodes (the measured accuracy).
    - ``tool_call_rate``: the share of the step's episodes with at least one tool call.
    - ``policy_tool_call_rate`` / ``accuracy``: :meth:`ToolUsePolicy.tool_call_rate` and
      :meth:`ToolUsePolicy.accuracy` after the step's update (exact).
    - ``mean_turns``: mean assistant turns per episode.
    - ``training``: the trainer's :class:`StepMetrics` (epoch, staleness, pauses, ...).

    With ``filter_groups`` the step's episodes are those of the groups kept: groups
    whose episodes all earned the same reward were dropped and generated again.
    """

    step: int
    mean_reward: float
    tool_call_rate: float
    policy_tool_call_rate: float
    accuracy: float
    mean_turns: float
    training: StepMetrics


@attrs.frozen(kw_only=True)
class ToolDemoResult:
    """A finished tool demo: the policy before training, every step's metrics and the
    stream's totals (as :class:`DemoResult`'s)."""

    config: ToolDemoConfig
    initial_tool_call_rate: float
    initial_accuracy: float
    steps: tuple[ToolStepMetrics, ...]
    groups: int
    rollouts: int
    filtered: int
    elapsed: float
    weight_updates: int = 0
    restarted: int = 0
    stale: int = 0

    @property
    def final_tool_call_rate(self) -> float:
        return self.steps[-1].policy_tool_call_rate if self.steps else self.initial_tool_call_rate

    @property
    def final_accuracy(self) -> float:
        return self.steps[-1].accuracy if self.steps else self.initial_accuracy

    @property
    def staleness_mean(self) -> float:
        """Mean over every group trained on of ``policy_epoch - start_epoch``."""
        if not self.steps:
            return 0.0
        return float(np.mean([m.training.staleness_mean for m in self.steps]))

    @property
    def staleness_max(self) -> int:
        return max((m.training.staleness_max for m in self.steps), default=0)


def _canonical(rollout: Any) -> tuple[Any, ...]:
    return (
        tuple(map(tuple, rollout.trajectory)),
        tuple(map(tuple, rollout.logprobs or ())),
        tuple(tuple(map(tuple, e)) for e in rollout.policy_epoch or ()),
        tuple(tuple(map(tuple, e)) for e in rollout.kv_cache_epoch or ()),
    )


@attrs.define(kw_only=True)
class ToolDemoAgent(MultiTurnAgent):
    """The demo's :class:`MultiTurnAgent`: each call reaches the engine after a seeded
    delay (:func:`dispatch_delayed`, seeded by ``seed``), and a group's episodes come
    back in a canonical order, so a virtual-clock run is reproducible."""

    seed: int = attrs.field(default=0, validator=int_at_least(0))

    def _slot_generator(
        self, request: GroupedRolloutRequest
    ) -> Callable[[int, int], Awaitable[Sequence[Any] | RolloutGroup]]:
        window = max(1, self.parallel_generation_tasks // request.num_groups)
        return dispatch_delayed(super()._slot_generator(request), seed=self.seed, window=window)

    async def group_rollout(self, request: GroupedRolloutRequest) -> list[TokenRollout]:
        """The group's episodes (:meth:`MultiTurnAgent.group_rollout`), sorted."""
        return sorted(await super().group_rollout(request), key=_canonical)


def _step_metrics(
    groups: Sequence[RolloutGroup], policy: ToolUsePolicy, training: StepMetrics
) -> ToolStepMetrics:
    episodes = [rollout.extra["episode"] for group in groups for rollout in group]
    return ToolStepMetrics(
        step=training.step,
        mean_reward=training.mean_reward,
        tool_call_rate=float(np.mean([episode["tool_calls"] > 0 for episode in episodes])),
        policy_tool_call_rate=policy.tool_call_rate(),
        accuracy=policy.accuracy(),
        mean_turns=float(np.mean([episode["turns"] for episode in episodes])),
        training=training,
    )


async def run_tool_demo(
    config: ToolDemoConfig,
    *,
    on_start: Callable[[float, float], None] | None = None,
    on_step: Callable[[ToolStepMetrics], None] | None = None,
    out: IO[str] | None = None,
) -> ToolDemoResult:
    """Train :class:`ToolUsePolicy` to use the calculator for ``config.steps`` steps.

    ``on_start`` is called with the policy's tool-call rate and accuracy before
    training, ``on_step`` after every step; ``out``, when given, receives every group
    the trainer took, one JSON line each.

    Cancellation: cancelling it stops the pipeline (every episode in flight is
    cancelled and its environment closed) and raises ``trio.Cancelled``.
    """
    problems = make_problems(config.num_problems, config.seed)
    policy = ToolUsePolicy.initial(problems, config.num_candidates, config.seed)
    outstanding = config.lag * config.groups_per_step
    agent = ToolDemoAgent(
        environment=CalculatorEnvironment,
        renderer=PlainRenderer(),
        prompts=PromptSource(problems, seed=config.seed),
        max_turns=config.max_turns,
        env_id="calculator",
        seed=config.seed,
        parallel_generation_tasks=outstanding,
        buffer_size=outstanding,
    )
    interface = EmbeddedInference(seed=config.seed, policy=policy, latency=config.latency)
    request = GroupedRolloutRequest(
        num_groups=config.groups_per_step,
        rollouts_per_group=config.group_size,
        inference_interface=interface,
        streaming=True,
        enforce_order=True,
        filter_groups_with_same_reward=config.filter_groups,
        max_staleness=config.max_staleness,
        # Every request seeded: identical requests at one instant no longer share out
        # the engine's sample streams in an order Trio varies.
        seed=config.seed,
    )
    initial_rate, initial_accuracy = policy.tool_call_rate(), policy.accuracy()
    if on_start is not None:
        on_start(initial_rate, initial_accuracy)
    trainer = Trainer(config=config, policy=policy, out=out, started=trio.current_time())
    metrics: list[ToolStepMetrics] = []
    async with agent.get_grouped_rollouts(request) as stream:
        for step in range(1, config.steps + 1):
            training = await trainer.step(stream, step)
            step_metrics = _step_metrics(trainer.batch, policy, training)
            metrics.append(step_metrics)
            if on_step is not None:
                on_step(step_metrics)
        statistics = stream_counters(stream)
    steps = tuple(metrics)
    return ToolDemoResult(
        config=config,
        initial_tool_call_rate=initial_rate,
        initial_accuracy=initial_accuracy,
        steps=steps,
        groups=len(steps) * config.groups_per_step,
        rollouts=len(steps) * config.groups_per_step * config.group_size,
        filtered=statistics["filtered"],
        elapsed=trainer.elapsed(),
        weight_updates=statistics["weight_updates"],
        restarted=statistics["restarted"],
        stale=statistics["stale"],
    )
