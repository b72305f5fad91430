"""A training loop that logs each step's reward statistics and the pipeline's counters
(``stream.statistics()``) to a JSONL file, and to TensorBoard and Weights & Biases when
they are installed. The embedded backend stands in for the model server; its simulated
policy gets better at each step.

Run: python examples/logging_loop.py
The code is the examples of docs/logging.md, verbatim.
"""

import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np

import trio_rollouts as tr
from trio_rollouts.envs import ArithmeticEnvironment
from trio_rollouts.envs.arithmetic import OPERATIONS
from trio_rollouts.inference import EmbeddedInference


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of an unstructured record, flat: a nested dict's entries are named
    ``outer/inner``; strings and lists (``last_errors``) are left out."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(scalars(value, f"{name}/"))
        elif isinstance(value, (int, float)):
            flat[name] = float(value)
    return flat


class Logger(Protocol):
    def log(self, step: int, record: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """One JSON object per step and line: easy to tail, to grep, and to load with
    ``pandas.read_json(path, lines=True)``."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def log(self, step: int, record: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **record}) + "\n")
        self.file.flush()  # a crashed run keeps every step it logged

    def close(self) -> None:
        self.file.close()


@attrs.define
class Student:
    """Stands in for the model being trained (the embedded backend's policy): it answers
    right with probability ``skill``, else one off."""

    skill: float = 0.2

    def __call__(self, prompt: list[tr.ChatMessage]) -> tuple[list[str], list[float]]:
        a, op, b = re.findall(r"(\d+) (\S) (\d+)", prompt[-1].content)[0]
        answer = OPERATIONS[op](int(a), int(b))
        right, wrong = f"It is {answer}.", f"It is {answer + 1}."
        return [right, wrong], [self.skill, 1.0 - self.skill]


def reward_stats(batch: list[tr.RolloutGroup]) -> dict[str, float]:
    """What the policy does: the batch's rewards, and how many of its groups have no
    learning signal (every rollout the same reward, so every advantage 0)."""
    rewards = np.concatenate([group.rewards() for group in batch])
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/group_std_mean": float(np.mean([group.reward_std() for group in batch])),
        "reward/zero_std_groups": float(np.mean([group.reward_std() == 0 for group in batch])),
    }


def train(steps: int, loggers: list[Logger]) -> None:
    student = Student()
    model = EmbeddedInference(seed=0, policy=student)  # in practice: OpenAIInference
    agent = ArithmeticEnvironment(parallel_generation_tasks=8)  # one batch ahead
    request = tr.GroupedRolloutRequest(
        num_groups=8,  # groups per training step
        rollouts_per_group=4,
        inference_interface=model,
        streaming=True,
        enforce_order=True,
    )
    started = time.monotonic()
    with tr.blocking_grouped_rollouts(agent, request) as stream:
        for step in range(steps):
            batch = stream.take(request.num_groups, timeout=600)
            rewards = reward_stats(batch)
            age = max(stream.policy_epoch - group.start_epoch for group in batch)
            new_skill = min(0.95, student.skill + 0.15)  # stands in for the optimizer step
            with stream.weight_update("drain") as update:
                student.skill = new_skill  # stands in for pushing the weights
            stats = stream.statistics()
            record = {
                **rewards,
                **scalars(tr.unstructure(stats), "pipeline/"),
                "pipeline/unaccounted": float(stats.unaccounted),
                "batch/age_max": float(age),  # weight updates behind the trainer
                "update/pause_seconds": update.pause_seconds,
                "update/held": float(update.held),
                "time/elapsed": time.monotonic() - started,
            }
            for logger in loggers:
                logger.log(step, record)
            print(
                f"step {step}: reward {rewards['reward/mean']:.2f}, "
                f"{stats.delivered} groups delivered, {stats.filtered} filtered, "
                f"{stats.skipped} skipped"
            )


class TensorBoardLogger:
    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, step: int, record: dict[str, float]) -> None:
        for name, value in record.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


def tensorboard_logger(log_dir: Path) -> TensorBoardLogger | None:
    """A TensorBoard logger writing to ``log_dir/tensorboard``, or None when neither
    PyTorch's TensorBoard support nor tensorboardX is installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            return None
    return TensorBoardLogger(SummaryWriter(log_dir=str(log_dir / "tensorboard")))


class WandbLogger:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, step: int, record: dict[str, float]) -> None:
        self.run.log(record, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_logger(log_dir: Path) -> WandbLogger | None:
    """A Weights & Biases logger (an offline run in ``log_dir``), or None when wandb is
    not installed."""
    try:
        import wandb
    except ImportError:
        return None
    return WandbLogger(wandb.init(project="trio-rollouts", dir=str(log_dir), mode="offline"))


log_dir = Path(tempfile.mkdtemp(prefix="trio-rollouts-"))  # yours: runs/<run name>
loggers: list[Logger] = [JsonlLogger(log_dir / "metrics.jsonl")]
for make_logger in (tensorboard_logger, wandb_logger):
    logger = make_logger(log_dir)
    if logger is not None:
        loggers.append(logger)
try:
    train(5, loggers)
finally:
    for logger in loggers:
        logger.close()

with (log_dir / "metrics.jsonl").open(encoding="utf-8") as lines:
    last = json.loads(lines.readlines()[-1])
print(f"logged to {', '.join(type(logger).__name__ for logger in loggers)} in {log_dir}")
print(
    f"last step: {last['step']}, {len(last)} keys, reward {last['reward/mean']:.2f}, "
    f"unaccounted {last['pipeline/unaccounted']:.0f}"
)
