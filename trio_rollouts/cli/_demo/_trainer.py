"""The demo's trainer: step by step, it takes a batch of groups from the stream, trains
the policy on it inside :meth:`RolloutStream.weight_update`, and reports what the step saw
and did (:class:`StepMetrics`). It trains any :class:`TrainablePolicy` (the arithmetic
demo's :class:`~trio_rollouts.envs.AnswerTablePolicy`, the tool demo's
:class:`~trio_rollouts.envs.ToolUsePolicy`) with any :class:`TrainerSettings`."""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import IO, Protocol

import attrs
import numpy as np
import trio

from trio_rollouts.inference import WeightUpdateMode
from trio_rollouts.models._rollouts import RolloutGroup
from trio_rollouts.pipeline._stream import RolloutStream
from trio_rollouts.prompts._file import write_groups

__all__ = ["StepMetrics", "TrainablePolicy", "Trainer", "TrainerSettings"]

#: Steps over which StepMetrics.groups_per_second is measured.
_RATE_WINDOW = 5


class TrainablePolicy(Protocol):
    """What the trainer needs of a policy: a clipped GRPO step and an exact accuracy."""

    def grpo_step(
        self, groups: Sequence[RolloutGroup], learning_rate: float, clip: float
    ) -> None: ...

    def accuracy(self) -> float: ...


class TrainerSettings(Protocol):
    """What the trainer reads of a demo's settings (:class:`DemoConfig` has them)."""

    @property
    def groups_per_step(self) -> int: ...

    @property
    def train_seconds(self) -> float: ...

    @property
    def update_mode(self) -> WeightUpdateMode: ...

    @property
    def learning_rate(self) -> float: ...

    @property
    def clip(self) -> float: ...


@attrs.frozen(kw_only=True)
class StepMetrics:
    """What one training step saw and did.

    - ``epoch``: the policy epoch after the step's weight update (``update.epoch``).
    - ``mean_reward``: mean reward of the step's rollouts.
    - ``accuracy``: the policy's ``accuracy()`` after the step's update.
    - ``groups_per_second``: groups taken per second of the run's clock, over the last
      five steps.
    - ``filtered``: groups dropped (all rewards equal) and regenerated during the step.
    - ``staleness_mean`` / ``staleness_max``: over the step's groups,
      ``stream.policy_epoch - group.start_epoch`` when the trainer took them: how many
      updates older than the trainer's the weights were when the group's generation
      started (what ``max_staleness`` bounds). A rollout's own ``policy_epoch`` stamps
      are never older than its group's ``start_epoch``.
    - ``mixed_epoch``: rollouts whose generation spanned a weight update (more than one
      ``policy_epoch`` boundary).
    - ``held``: calls in flight that the step's update held (``keep``), aborted
      (``abort``), or cancelled (``restart``, or the staleness bound): ``update.held``.
    - ``pause_seconds``: from entering the update until generation had stopped and the
      body began (``update.pause_seconds``).
    - ``update_seconds``: the whole update, from entering it until generation went on:
      ``pause_seconds`` plus the body, where the weights change. No call starts
      meanwhile; this is the step's time spent paused.
    - ``elapsed``: when the step's batch had arrived, since the start of the run.
    """

    step: int
    epoch: int
    mean_reward: float
    accuracy: float
    groups_per_second: float
    filtered: int
    staleness_mean: float
    staleness_max: int
    mixed_epoch: int
    held: int
    pause_seconds: float
    update_seconds: float
    elapsed: float


@attrs.define(kw_only=True, eq=False)
class Trainer:
    """Trains ``policy`` one batch at a time (:meth:`step`), as ``config`` says, writing
    each batch to ``out`` when it is given.

    ``started`` is the run's clock when training began and ``elapsed_before`` the clock
    time of the runs this one resumes: :attr:`StepMetrics.elapsed` counts from the start
    of the first of them.
    """

    config: TrainerSettings
    policy: TrainablePolicy
    out: IO[str] | None
    started: float
    elapsed_before: float = 0.0
    #: The groups of the last step (empty before the first).
    batch: list[RolloutGroup] = attrs.field(init=False, factory=list)
    # When the last few steps' groups arrived, for a throughput that does not jump
    # between a step that waited and one whose batch was already buffered.
    _arrivals: collections.deque[float] = attrs.field(init=False)
    _filtered_before: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._arrivals = collections.deque([self.started], maxlen=_RATE_WINDOW + 1)

    def elapsed(self) -> float:
        """The run's clock time so far, the resumed runs' included."""
        return self.elapsed_before + (trio.current_time() - self.started)

    async def step(self, stream: RolloutStream, step: int) -> StepMetrics:
        """Train on the stream's next batch: take ``groups_per_step`` groups, write them
        to ``out``, wait ``train_seconds`` (computing the update; generation goes on
        meanwhile, with the old weights), then apply the policy's ``grpo_step`` inside
        ``stream.weight_update(mode=config.update_mode)``; :attr:`batch` is the batch.

        Cancellation: it checks for cancellation before it takes the batch, so a
        cancelled run takes (and writes) no further batch; cancelled after that, the
        batch stays written and the weights change only if the update's body ran (it
        does not await).
        """
        config = self.config
        # With enforce_order, receive() does not check for cancellation when the
        # batch is already held in order: check here.
        await trio.lowlevel.checkpoint_if_cancelled()
        groups = [await stream.receive() for _ in range(config.groups_per_step)]
        self.batch = groups
        now = trio.current_time()
        arrivals = self._arrivals
        arrivals.append(now)
        window = now - arrivals[0]
        epoch = stream.policy_epoch
        rollouts = [rollout for group in groups for rollout in group]
        staleness = [epoch - group.start_epoch for group in groups]
        if self.out is not None:
            write_groups(self.out, groups)
        await trio.sleep(config.train_seconds)
        entered = trio.current_time()
        async with stream.weight_update(mode=config.update_mode) as update:
            # Generation has stopped as the mode says: change the weights.
            self.policy.grpo_step(groups, config.learning_rate, config.clip)
        update_seconds = trio.current_time() - entered
        filtered = stream.statistics().filtered
        metrics = StepMetrics(
            step=step,
            epoch=update.epoch,
            mean_reward=float(np.mean([group.rewards().mean() for group in groups])),
            accuracy=self.policy.accuracy(),
            groups_per_second=(len(arrivals) - 1) * len(groups) / window
            if window > 0
            else math.inf,
            filtered=filtered - self._filtered_before,
            staleness_mean=float(np.mean(staleness)),
            staleness_max=max(staleness),
            mixed_epoch=sum(len(r.policy_epoch[0]) > 1 for r in rollouts if r.policy_epoch),
            held=update.held,
            pause_seconds=update.pause_seconds,
            update_seconds=update_seconds,
            elapsed=self.elapsed_before + (now - self.started),
        )
        self._filtered_before = filtered
        return metrics
