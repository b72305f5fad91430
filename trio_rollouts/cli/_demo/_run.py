"""``run_demo``: the demo's whole run, from a fresh start or a checkpoint to its
:class:`DemoResult`: it builds the environment, the policy and the engine, resumes a
checkpoint when there is one, opens the stream, has the :class:`Trainer` take its steps,
and saves checkpoints as ``DemoConfig.checkpoint_every`` says."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import IO

import attrs
import numpy as np
import trio

from trio_rollouts.cli._demo._checkpoint import (
    TOTALS,
    DemoCheckpoint,
    load_demo_checkpoint,
    save_checkpoint,
)
from trio_rollouts.cli._demo._config import DemoConfig
from trio_rollouts.cli._demo._environment import DemoEnvironment
from trio_rollouts.cli._demo._trainer import StepMetrics, Trainer
from trio_rollouts.envs import AnswerTablePolicy
from trio_rollouts.inference import EmbeddedInference
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.pipeline._stream import RolloutStream
from trio_rollouts.prompts._source import PromptSource

__all__ = ["DemoResult", "run_demo", "stream_counters"]

_RESUME_STREAM = 0x52455355


@attrs.frozen(kw_only=True)
class DemoResult:
    """A finished demo: the accuracy before training, every step's metrics, and the
    stream's totals.

    ``filtered``, ``weight_updates``, ``restarted``, ``stale`` and ``mixed`` are the
    stream's counters at the end (:class:`RolloutStreamStatistics`): groups dropped for
    equal rewards, updates done, calls cancelled by ``restart`` updates, calls and
    groups regenerated for ``max_staleness``, and groups that spanned an update on a
    backend that does not stamp epochs (0 here: the embedded backend stamps them).

    A resumed run (``resumed_from``: the step of the checkpoint it went on from, else
    ``None``) covers the whole run as its checkpoints count it: the steps and counters
    up to the checkpoint, then this run's; what an interrupted run did after its last
    checkpoint is not counted (it was thrown away, and done again).
    """

    config: DemoConfig
    initial_accuracy: float
    steps: tuple[StepMetrics, ...]
    groups: int
    rollouts: int
    filtered: int
    elapsed: float
    weight_updates: int = 0
    restarted: int = 0
    stale: int = 0
    mixed: int = 0
    resumed_from: int | None = None

    @property
    def final_accuracy(self) -> float:
        return self.steps[-1].accuracy if self.steps else self.initial_accuracy

    @property
    def staleness_mean(self) -> float:
        """Mean over every group trained on of ``policy_epoch - start_epoch``."""
        return float(np.mean([m.staleness_mean for m in self.steps])) if self.steps else 0.0

    @property
    def staleness_max(self) -> int:
        return max((m.staleness_max for m in self.steps), default=0)

    @property
    def held(self) -> int:
        """Calls held, aborted or cancelled by the updates, in all."""
        return sum(m.held for m in self.steps)

    @property
    def pause_seconds(self) -> float:
        """Time spent waiting for generation to stop, summed over the updates."""
        return math.fsum(m.pause_seconds for m in self.steps)

    @property
    def paused_seconds(self) -> float:
        """Time spent paused: the updates' whole durations (``update_seconds``),
        summed; no call started meanwhile."""
        return math.fsum(m.update_seconds for m in self.steps)


async def run_demo(
    config: DemoConfig,
    *,
    on_start: Callable[[float], None] | None = None,
    on_step: Callable[[StepMetrics], None] | None = None,
    on_resume: Callable[[DemoCheckpoint], None] | None = None,
    out: IO[str] | None = None,
) -> DemoResult:
    """Train the demo policy for ``config.steps`` steps; return the metrics.

    ``on_start`` is called with the accuracy before training, ``on_step`` after every
    step; ``out``, when given, receives every group
    the trainer took, one whole JSON line each (:func:`~trio_rollouts.dump_jsonl`, with
    Ctrl-C held off mid-line).

    Checkpoints (``config.checkpoint_dir``, created if missing): after every
    ``checkpoint_every``-th step and the last, before ``on_step``, the trainer saves the
    policy's logits, the step, the stream's policy epoch, the prompt source's state, the
    metrics so far and the settings, all taken at one instant (the pipeline does not run
    meanwhile) and written atomically. When the directory holds a checkpoint (see
    :func:`load_demo_checkpoint`: it must have the same settings), the run restores all
    of that, calls ``on_resume`` with it (after ``on_start``, with the accuracy before
    the whole run's training), and trains from the next step to ``config.steps``: the
    problems not done at the checkpoint first, the stream starting at the saved policy
    epoch, the engine sampling with a seed of its own for the resumed part. ``out`` then
    receives the groups of the new steps only. The result covers the whole run.

    Cancellation: cancelling it stops the pipeline (every generation in flight is
    cancelled) and raises ``trio.Cancelled``; groups already written stay written, and
    so does the last checkpoint.
    """
    checkpoint = load_demo_checkpoint(config)
    directory = config.checkpoint_dir
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    env = DemoEnvironment(
        num_problems=config.num_problems,
        seed=config.seed,
        parallel_generation_tasks=config.lag * config.groups_per_step,
        buffer_size=config.lag * config.groups_per_step,
    )
    policy = AnswerTablePolicy.initial(env.problems, config.num_candidates, config.seed)
    source = None if directory is None else PromptSource(env.problems, seed=config.seed)
    env.prompts = source
    engine_seed = config.seed
    initial_accuracy = policy.accuracy()
    history: tuple[StepMetrics, ...] = ()
    totals = dict.fromkeys(TOTALS, 0)
    elapsed_before = 0.0
    if checkpoint is not None and source is not None:  # a checkpoint needs a directory
        source.load_state_dict(checkpoint.prompts)
        policy.logits = checkpoint.logits.copy()
        initial_accuracy = checkpoint.initial_accuracy
        history = checkpoint.history
        totals = dict(checkpoint.totals)
        elapsed_before = checkpoint.elapsed
        # A fresh engine would give each prompt's n-th request the same sample stream
        # as at the start of the run: the resumed part samples from streams of its own.
        sequence = np.random.SeedSequence([config.seed, _RESUME_STREAM, checkpoint.step])
        engine_seed = int(sequence.generate_state(1)[0])
    interface = EmbeddedInference(seed=engine_seed, policy=policy, latency=config.latency)
    request = GroupedRolloutRequest(
        num_groups=config.groups_per_step,
        rollouts_per_group=config.group_size,
        inference_interface=interface,
        streaming=True,
        enforce_order=True,
        filter_groups_with_same_reward=config.filter_groups,
        max_staleness=config.max_staleness,
        initial_epoch=None if checkpoint is None else checkpoint.policy_epoch,
    )
    if on_start is not None:
        on_start(initial_accuracy)
    if checkpoint is not None and on_resume is not None:
        on_resume(checkpoint)
    metrics: list[StepMetrics] = list(history)
    trainer = Trainer(
        config=config,
        policy=policy,
        out=out,
        started=trio.current_time(),
        elapsed_before=elapsed_before,
    )
    counters = dict.fromkeys(TOTALS, 0)
    first_step = len(history) + 1
    if first_step <= config.steps:
        async with env.get_grouped_rollouts(request) as stream:
            for step in range(first_step, config.steps + 1):
                step_metrics = await trainer.step(stream, step)
                counters = stream_counters(stream)
                metrics.append(step_metrics)
                if (
                    directory is not None
                    and source is not None
                    and (step % config.checkpoint_every == 0 or step == config.steps)
                ):
                    # No await since the batch was taken and the update ended: the
                    # source, the weights and the metrics are of the same instant.
                    save_checkpoint(
                        directory,
                        config,
                        step=step,
                        policy_epoch=stream.policy_epoch,
                        initial_accuracy=initial_accuracy,
                        logits=policy.logits,
                        prompts=source.state_dict(),
                        history=metrics,
                        totals={n: totals[n] + counters[n] for n in TOTALS},
                        elapsed=trainer.elapsed(),
                    )
                if on_step is not None:
                    on_step(step_metrics)
            counters = stream_counters(stream)
    steps = tuple(metrics)
    return DemoResult(
        config=config,
        initial_accuracy=initial_accuracy,
        steps=steps,
        groups=len(steps) * config.groups_per_step,
        rollouts=len(steps) * config.groups_per_step * config.group_size,
        filtered=totals["filtered"] + counters["filtered"],
        elapsed=trainer.elapsed(),
        weight_updates=totals["weight_updates"] + counters["weight_updates"],
        restarted=totals["restarted"] + counters["restarted"],
        stale=totals["stale"] + counters["stale"],
        mixed=totals["mixed"] + counters["mixed"],
        resumed_from=None if checkpoint is None else checkpoint.step,
    )


def stream_counters(stream: RolloutStream) -> dict[str, int]:
    """The stream's counters that a demo reports and a checkpoint carries over
    (``TOTALS``)."""
    statistics = stream.statistics()
    return {name: getattr(statistics, name) for name in TOTALS}
