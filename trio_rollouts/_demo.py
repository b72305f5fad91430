"""The demo's model and trainer: asynchronous GRPO on arithmetic, on the embedded backend.

:func:`run_demo` is an end-to-end reinforcement-learning loop with nothing to install and
no GPU. The *model* is :class:`AnswerTablePolicy`, a numpy table of logits served through
:class:`~trio_rollouts.inference.EmbeddedInference`; the *environment* is
:class:`~trio_rollouts.envs.ArithmeticEnvironment`; rollouts stream from the grouped
pipeline with bounded lag (``lag`` batches outstanding); the *trainer* takes one
batch per step, computes GRPO advantages with :meth:`RolloutGroup.advantages`, and
applies one clipped policy-gradient step to the logits (using the rollouts'
log-probabilities) inside :meth:`RolloutStream.weight_update`, which pauses generation
as ``DemoConfig.update_mode`` says and moves the stream to the next policy epoch. Groups
carry the epoch they started under (``start_epoch``) and rollouts real ``policy_epoch``
boundaries, so the trainer measures how stale they are, and
``DemoConfig.max_staleness`` bounds it. On a virtual clock (trio's ``MockClock``) the
simulated latency costs no real time and a seed fixes every number; on the real clock
the loop is the same, but which weights a group is sampled with depends on timing.

With ``DemoConfig.checkpoint_dir`` the run is resumable: the problems come from a
:class:`~trio_rollouts.PromptSource` (seeded, shuffled epochs), and every
``checkpoint_every`` steps (and at the last) the trainer saves, in one file replaced
atomically, the policy's logits, the step, the stream's policy epoch, the source's state,
the metrics so far and the settings; a run started on a directory holding a checkpoint
goes on from it (see :func:`run_demo`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO, Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import trio

from ._models import (
    ChatMessage,
    GroupedRolloutRequest,
    Problem,
    Rollout,
    RolloutGroup,
    TokenRollout,
)
from ._prompt_file import write_groups
from ._prompts import PromptSource
from .envs.arithmetic import ArithmeticEnvironment
from .inference import WEIGHT_UPDATE_MODES, EmbeddedInference, LatencyModel, WeightUpdateMode

__all__ = [
    "AnswerTablePolicy",
    "DemoCheckpoint",
    "DemoCheckpointMismatch",
    "DemoConfig",
    "DemoResult",
    "StepMetrics",
    "load_demo_checkpoint",
    "run_demo",
]

_CANDIDATE_STREAM = 0x43414E44
_DISPATCH_STREAM = 0x44495350
_RESUME_STREAM = 0x52455355
#: The longest delay between a call's start and its requests reaching the engine.
_DISPATCH_SECONDS = 0.001
#: Steps over which StepMetrics.groups_per_second is measured.
_RATE_WINDOW = 5

FloatArray = npt.NDArray[np.float64]


def _softmax(logits: FloatArray) -> FloatArray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs: FloatArray = shifted / shifted.sum(axis=-1, keepdims=True)
    return probs


def _completion(answer: int) -> str:
    # Terse, as a model trained to answer with the number: the embedded engine spends a
    # token step (a scheduler round) per character.
    return str(answer)


def _distractors(problem: Problem, rng: np.random.Generator, count: int) -> list[int]:
    """``count`` plausible wrong answers: off by one, two or ten, the wrong operation,
    then random numbers near the answer."""
    answer = int(problem.answer)
    a, _, b = str(problem.prompt).removeprefix("What is ").removesuffix("?").split()
    x, y = int(a), int(b)
    plausible = [answer + d for d in (1, -1, 2, -2, 10, -10)] + [x + y, x - y, y - x, x * y]
    pool = list(dict.fromkeys(v for v in plausible if v != answer))
    rng.shuffle(pool)
    chosen = pool[:count]
    spread = max(10, abs(answer))
    while len(chosen) < count:
        value = answer + int(rng.integers(-spread, spread + 1))
        if value != answer and value not in chosen:
            chosen.append(value)
    return chosen


def _check_positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        msg = f"{attribute.name} must be > 0, got {value!r}"
        raise ValueError(msg)


@attrs.define(kw_only=True, eq=False)
class AnswerTablePolicy:
    """The demo's model: a lookup table, not a language model.

    For each problem it holds ``K`` candidate completions, the number ``N`` written out,
    for the right ``N`` and for ``K - 1`` plausible mistakes (off by one, two or ten, the
    wrong operation), and one logit per candidate; a candidate's probability is the softmax of
    its problem's logits. Called with a prompt, it returns the candidates and their
    probabilities, as :data:`~trio_rollouts.inference.Policy` says. Training moves the
    logits, so it learns which candidate is right *for each problem in its table*; it
    does not learn arithmetic and has nothing to say about any other prompt.
    """

    problems: list[Problem]
    candidates: list[list[str]]
    #: Index of the right candidate of each problem.
    correct: npt.NDArray[np.int64]
    #: ``(num_problems, K)`` logits.
    logits: FloatArray
    _row_of_prompt: dict[str, int] = attrs.field(init=False, repr=False)
    _row_of_problem_id: dict[str, int] = attrs.field(init=False, repr=False)
    _column_of: list[dict[str, int]] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._row_of_prompt = {str(p.prompt): row for row, p in enumerate(self.problems)}
        self._row_of_problem_id = {p.problem_id: row for row, p in enumerate(self.problems)}
        self._column_of = [{text: col for col, text in enumerate(c)} for c in self.candidates]

    @classmethod
    def initial(
        cls, problems: Sequence[Problem], num_candidates: int, seed: int, init_scale: float = 0.5
    ) -> AnswerTablePolicy:
        """A fresh table: seeded candidates in a seeded order, logits drawn from
        ``Normal(0, init_scale)``, so the policy starts near chance, ``1 / K``."""
        if num_candidates < 2:
            msg = f"num_candidates must be >= 2, got {num_candidates}"
            raise ValueError(msg)
        rng = np.random.default_rng([seed, _CANDIDATE_STREAM])
        candidates = []
        correct = []
        for problem in problems:
            answers = [int(problem.answer), *_distractors(problem, rng, num_candidates - 1)]
            order = rng.permutation(num_candidates)
            candidates.append([_completion(answers[i]) for i in order])
            correct.append(int(np.flatnonzero(order == 0)[0]))
        logits = rng.normal(0.0, init_scale, size=(len(problems), num_candidates))
        return cls(
            problems=list(problems),
            candidates=candidates,
            correct=np.asarray(correct, dtype=np.int64),
            logits=logits,
        )

    def __call__(self, prompt: list[ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
        row = self._row_of_prompt.get(prompt[-1].content)
        if row is None:
            msg = f"the demo policy knows only its own problems, not {prompt[-1].content!r:.80}"
            raise ValueError(msg)
        return self.candidates[row], _softmax(self.logits[row])

    def probabilities(self) -> FloatArray:
        """``(num_problems, K)``: every candidate's probability."""
        return _softmax(self.logits)

    def accuracy(self) -> float:
        """The probability that a sampled answer is right, averaged over the problems:
        the expected accuracy at temperature 1, computed exactly (no sampling noise)."""
        probs = self.probabilities()
        return float(probs[np.arange(len(self.problems)), self.correct].mean())

    def grpo_step(self, groups: Sequence[RolloutGroup], learning_rate: float, clip: float) -> None:
        """One policy-gradient step on the logits from a batch of groups.

        Per rollout: the GRPO advantage ``A`` (:meth:`RolloutGroup.advantages`), the
        candidate it chose, and the importance ratio ``rho = p_now / p_then`` of that
        candidate, ``p_then`` being the probability the rollout's log-probabilities
        record (the weights it was sampled with, possibly some updates ago). The
        gradient of the clipped surrogate ``min(rho * A, clip(rho, 1 +- clip) * A)`` is
        ``rho * A * (onehot - p_now)`` on the problem's logits, or nothing once the
        ratio is clipped; it is averaged over the group and added (ascent).
        """
        probs = self.probabilities()
        gradient = np.zeros_like(self.logits)
        for group in groups:
            advantages = group.advantages()
            for rollout, advantage in zip(group, advantages, strict=True):
                if advantage == 0.0:
                    continue
                if not isinstance(rollout, TokenRollout):
                    msg = f"the demo trainer needs token rollouts, got {type(rollout).__name__}"
                    raise TypeError(msg)
                row = self._row_of_problem_id[str(rollout.problem_id)]
                column = self._column_of[row][_generated_text(rollout)]
                ratio = probs[row, column] / math.exp(_logprob(rollout))
                if (advantage > 0 and ratio > 1 + clip) or (advantage < 0 and ratio < 1 - clip):
                    continue
                step = ratio * advantage / len(group)
                gradient[row] -= step * probs[row]
                gradient[row, column] += step
        self.logits += learning_rate * gradient


def _generated_text(rollout: TokenRollout) -> str:
    tokens = rollout.trajectory[0]
    mask = rollout.generation_mask[0] if rollout.generation_mask else [True] * len(tokens)
    # The embedded backend's tokens are characters: token id = code point.
    return "".join(chr(t) for t, generated in zip(tokens, mask, strict=True) if generated)


def _logprob(rollout: TokenRollout) -> float:
    return float(sum(rollout.logprobs[0])) if rollout.logprobs else 0.0


# --------------------------------------------------------------------------- the loop


@attrs.define(kw_only=True)
class _DemoEnvironment(ArithmeticEnvironment):
    """The arithmetic environment, each of whose calls reaches the engine after a short
    seeded delay (up to ``_DISPATCH_SECONDS``, drawn from the seed, the slot and the
    slot's call count), as a request's trip to a server takes.

    It keeps a virtual-clock run reproducible across weight updates. The embedded engine
    gives the ``n``-th request of a prompt text its ``n``-th random stream, and when a
    weight update ends the calls it held back all start at the same virtual instant
    (one by one in slot order, but each call sends its requests from tasks of its own,
    which Trio runs in an order it varies from run to run); two groups of the same
    problem (a regenerated slot draws its problem at random) started together would
    then swap samples. Delayed by distinct amounts, their requests arrive in an order
    that the seed fixes.

    With ``prompts`` (a resumable run), each call draws its problem from the source
    (:meth:`group_rollout`, after the delay, so the seed fixes the order of the draws
    too) instead of taking its slot's problem.
    """

    def _slot_generator(
        self, request: GroupedRolloutRequest
    ) -> Callable[[int, int], Awaitable[list[Rollout] | list[TokenRollout] | RolloutGroup]]:
        generate = super()._slot_generator(request)
        if self.prompts is not None:
            # ArithmeticEnvironment's slot schedule never calls get_prompt, so it would
            # never draw from the source: one group_rollout (one draw) per call instead.
            group_rollout = self.group_rollout
            generate = lambda batch_id, index_in_batch: group_rollout(request)  # noqa: E731
        # Calls per slot, for the batches that may still be generating (as the base
        # class counts attempts): each slot's calls run one after the other.
        window = max(1, self.parallel_generation_tasks // request.num_groups)
        calls: dict[int, dict[int, int]] = {}
        seed = self.seed

        async def dispatched(
            batch_id: int, index_in_batch: int
        ) -> list[Rollout] | list[TokenRollout] | RolloutGroup:
            of_batch = calls.setdefault(batch_id, {})
            call = of_batch.get(index_in_batch, 0)
            of_batch[index_in_batch] = call + 1
            for old in [b for b in calls if b <= batch_id - window]:
                del calls[old]
            rng = np.random.default_rng([seed, _DISPATCH_STREAM, batch_id, index_in_batch, call])
            await trio.sleep(_DISPATCH_SECONDS * float(rng.random()))
            return await generate(batch_id, index_in_batch)

        return dispatched


def _check_count(minimum: int) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            msg = f"{attribute.name} must be an int >= {minimum}, got {value!r}"
            raise ValueError(msg)

    return check


def _check_non_negative(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        msg = f"{attribute.name} must be >= 0, got {value!r}"
        raise ValueError(msg)


def _check_mode(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or value not in WEIGHT_UPDATE_MODES:
        allowed = ", ".join(repr(m) for m in ("drain", "restart", "keep", "abort"))
        msg = f"{attribute.name} must be one of {allowed}, got {value!r}"
        raise ValueError(msg)


def _check_optional_count(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        msg = f"{attribute.name} must be None or an int >= 0, got {value!r}"
        raise ValueError(msg)


def _to_optional_path(value: str | os.PathLike[str] | None) -> Path | None:
    return None if value is None else Path(value)


@attrs.frozen(kw_only=True)
class DemoConfig:
    """The demo's settings; the defaults learn from chance to above 0.9 accuracy.

    ``lag`` is how many batches are outstanding at once
    (``parallel_generation_tasks = lag * groups_per_step``): while the trainer works on
    one batch, the next ``lag`` are being generated, so a rollout is at most ``lag``
    updates old. ``train_seconds`` is how long computing one update "takes" on the run's
    clock: generation goes on meanwhile, with the old weights.

    The trainer then applies the update inside
    ``stream.weight_update(mode=update_mode)`` (see :meth:`RolloutStream.weight_update`):
    ``"keep"`` (the default) holds the calls in flight for the update and continues them
    under the new weights, so generation barely stops and a rollout can span an update,
    as with an engine whose weights are swapped in place; ``"abort"`` stops them with
    their partial output and continues them after it (a new prefill); ``"drain"`` lets
    them finish under the old weights first; ``"restart"`` cancels and regenerates them.
    ``max_staleness`` (``GroupedRolloutRequest.max_staleness``) regenerates any group
    that would reach the trainer more than that many policy epochs after the epoch it
    started under; ``0`` trains on-policy only. ``None``: no bound but ``lag``.

    ``checkpoint_dir`` makes the run resumable (see :func:`run_demo`): the problems are
    drawn from a :class:`~trio_rollouts.PromptSource` over the environment's problems
    (seeded by ``seed``, so the run differs from one without a checkpoint directory),
    and a checkpoint is saved there every ``checkpoint_every`` steps and at the last.
    A run may resume a checkpoint written with other ``steps``, ``checkpoint_dir`` and
    ``checkpoint_every``, never with other values of the other fields. On a virtual
    clock a seed (and the step a run resumed from) still fixes every number, unless
    calls in flight are cancelled (``"restart"``, or ``max_staleness``): the problems
    they drew are drawn again in the order the calls unwind, which Trio varies.
    """

    seed: int = attrs.field(default=0, validator=_check_count(0))
    steps: int = attrs.field(default=36, validator=_check_count(1))
    groups_per_step: int = attrs.field(default=8, validator=_check_count(1))
    group_size: int = attrs.field(default=8, validator=_check_count(2))
    lag: int = attrs.field(default=2, validator=_check_count(1))
    num_problems: int = attrs.field(default=32, validator=_check_count(1))
    num_candidates: int = attrs.field(default=8, validator=_check_count(2))
    learning_rate: float = attrs.field(default=2.0, validator=_check_positive)
    clip: float = attrs.field(default=0.2, validator=_check_positive)
    filter_groups: bool = True
    train_seconds: float = attrs.field(default=0.05, validator=_check_non_negative)
    latency: LatencyModel = attrs.field(
        factory=lambda: LatencyModel(first_token=0.03, per_token=0.01)
    )
    update_mode: WeightUpdateMode = attrs.field(default="keep", validator=_check_mode)
    max_staleness: int | None = attrs.field(default=None, validator=_check_optional_count)
    checkpoint_dir: Path | None = attrs.field(default=None, converter=_to_optional_path)
    checkpoint_every: int = attrs.field(default=5, validator=_check_count(1))


#: DemoConfig fields a resumed run may change: how long it runs, and where and how often
#: it saves checkpoints. Every other field must be the checkpoint's.
_RUN_FIELDS: Final = frozenset({"steps", "checkpoint_dir", "checkpoint_every"})


def _settings(config: DemoConfig) -> dict[str, Any]:
    """The fields a checkpoint must share with the run that resumes it, as plain data."""
    return {
        name: value
        for name, value in attrs.asdict(config, recurse=True).items()
        if name not in _RUN_FIELDS
    }


@attrs.frozen(kw_only=True)
class StepMetrics:
    """What one training step saw and did.

    - ``epoch``: the policy epoch after the step's weight update (``update.epoch``).
    - ``mean_reward``: mean reward of the step's rollouts.
    - ``accuracy``: :meth:`AnswerTablePolicy.accuracy` after the step's update.
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


# --------------------------------------------------------------------------- checkpoints

#: The format tag of a demo checkpoint.
_CHECKPOINT_FORMAT: Final = "trio-rollouts.demo-checkpoint/1"
#: The checkpoint's file in ``DemoConfig.checkpoint_dir``.
CHECKPOINT_FILE: Final = "checkpoint.json"
#: The stream counters a checkpoint carries over to the run that resumes it.
_TOTALS: Final = ("filtered", "weight_updates", "restarted", "stale", "mixed")


class DemoCheckpointMismatch(ValueError):
    """A checkpoint written with other settings than the run that would resume it.

    ``differences`` holds ``(field, value in the checkpoint, value in this run)`` for
    each :class:`DemoConfig` field that differs, the values as JSON."""

    def __init__(self, path: Path, differences: list[tuple[str, str, str]]) -> None:
        self.path = path
        self.differences = differences
        shown = "; ".join(
            f"{name} is {saved} in the checkpoint, {mine} in this run"
            for name, saved, mine in differences
        )
        super().__init__(
            f"{path} was written by a run with other settings: {shown}. Resume with the "
            "same settings (only steps, checkpoint_dir and checkpoint_every may differ), "
            "or use another checkpoint directory"
        )


def _show(value: object) -> str:
    return json.dumps(value, sort_keys=True)


@attrs.frozen(kw_only=True, eq=False)
class DemoCheckpoint:
    """A demo checkpoint, as :func:`load_demo_checkpoint` read it.

    ``step``: the last step it holds; ``policy_epoch``: the stream's epoch after that
    step's update; ``logits``: the policy's; ``prompts``: the
    :meth:`PromptSource.state_dict` of the problems; ``history``: every step's metrics
    so far; ``totals``: the stream's counters summed over the runs so far
    (``filtered``, ``weight_updates``, ``restarted``, ``stale``, ``mixed``), and
    ``elapsed``, the run's clock time so far.
    """

    path: Path
    step: int
    policy_epoch: int
    initial_accuracy: float
    logits: FloatArray
    prompts: dict[str, Any]
    history: tuple[StepMetrics, ...]
    totals: dict[str, int]
    elapsed: float
    groups_per_step: int

    @property
    def groups(self) -> int:
        """The groups trained on up to the checkpoint (the first ``groups`` lines of an
        ``out`` file written by the runs that led to it)."""
        return self.step * self.groups_per_step


def _invalid(path: Path, what: str) -> ValueError:
    return ValueError(f"{path} is not a valid demo checkpoint ({what}); remove it to start afresh")


def _natural(data: dict[str, Any], key: str, path: Path, minimum: int = 0) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _invalid(path, f"{key} must be an int >= {minimum}, got {value!r:.80}")
    return value


def _number(data: dict[str, Any], key: str, path: Path) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _invalid(path, f"{key} must be a number, got {value!r:.80}")
    return float(value)


def load_demo_checkpoint(config: DemoConfig) -> DemoCheckpoint | None:
    """The checkpoint in ``config.checkpoint_dir``, or ``None`` when there is none (or no
    directory is set).

    Raises :class:`DemoCheckpointMismatch` when it was written with other settings than
    ``config`` (naming each field that differs), and ``ValueError`` when it is not a
    demo checkpoint or is at a step past ``config.steps``.
    """
    if config.checkpoint_dir is None:
        return None
    path = config.checkpoint_dir / CHECKPOINT_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _invalid(path, f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != _CHECKPOINT_FORMAT:
        raise _invalid(path, f"no format {_CHECKPOINT_FORMAT!r}")
    saved = data.get("settings")
    if not isinstance(saved, dict):
        raise _invalid(path, "no settings")
    mine = _settings(config)
    missing = object()
    differences = [
        (
            name,
            "not set" if saved.get(name, missing) is missing else _show(saved[name]),
            _show(value),
        )
        for name, value in mine.items()
        if saved.get(name, missing) != value
    ]
    differences += [(name, _show(saved[name]), "not set") for name in saved if name not in mine]
    if differences:
        raise DemoCheckpointMismatch(path, differences)
    step = _natural(data, "step", path, 1)
    if step > config.steps:
        msg = (
            f"{path} holds step {step}, past this run's last step ({config.steps}); "
            f"run {step} steps or more, or use another checkpoint directory"
        )
        raise ValueError(msg)
    policy_epoch = _natural(data, "policy_epoch", path)
    try:
        logits = np.asarray(data.get("logits"), dtype=np.float64)
    except (TypeError, ValueError):
        raise _invalid(path, "logits must be a table of numbers") from None
    shape = (config.num_problems, config.num_candidates)
    if logits.shape != shape or not np.all(np.isfinite(logits)):
        raise _invalid(path, f"logits must be {shape[0]} x {shape[1]} finite numbers")
    prompts = data.get("prompts")
    if not isinstance(prompts, dict):
        raise _invalid(path, "no prompts state")
    history_data = data.get("history")
    fields = set(attrs.fields_dict(StepMetrics))
    if (
        not isinstance(history_data, list)
        or len(history_data) != step
        or not all(isinstance(m, dict) and set(m) == fields for m in history_data)
    ):
        raise _invalid(path, f"history must hold the metrics of steps 1 to {step}")
    try:
        history = tuple(StepMetrics(**m) for m in history_data)
    except TypeError as exc:
        raise _invalid(path, f"history: {exc}") from None
    totals_data = data.get("totals")
    if not isinstance(totals_data, dict):
        raise _invalid(path, "no totals")
    totals = {name: _natural(totals_data, name, path) for name in _TOTALS}
    return DemoCheckpoint(
        path=path,
        step=step,
        policy_epoch=policy_epoch,
        initial_accuracy=_number(data, "initial_accuracy", path),
        logits=logits,
        prompts=prompts,
        history=history,
        totals=totals,
        elapsed=_number(data, "elapsed", path),
        groups_per_step=config.groups_per_step,
    )


@trio.lowlevel.enable_ki_protection
def _save_checkpoint(directory: Path, data: dict[str, Any]) -> None:
    """Write the checkpoint atomically: to a temporary file in ``directory``, synced, then
    renamed over the old one, so that a crash at any instant leaves the old checkpoint
    or the new one, whole. Ctrl-C is held off until it is written (Trio delivers it at
    the next checkpoint). Not a (Trio) checkpoint."""
    text = json.dumps(data, separators=(",", ":"))
    # Named by the process (one writer per process), created as any file is (not 0600).
    partial = directory / f".{CHECKPOINT_FILE}.{os.getpid()}.partial"
    try:
        with open(partial, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, directory / CHECKPOINT_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    # The rename itself survives a power cut once the directory is synced (POSIX).
    with contextlib.suppress(OSError):
        directory_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(directory_fd)
        finally:
            os.close(directory_fd)


# --------------------------------------------------------------------------- run_demo


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
    env = _DemoEnvironment(
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
    totals = dict.fromkeys(_TOTALS, 0)
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
    start = trio.current_time()
    # When the last few steps' groups arrived, for a throughput that does not jump
    # between a step that waited and one whose batch was already buffered.
    arrivals = collections.deque([start], maxlen=_RATE_WINDOW + 1)
    filtered_before = 0
    counters = dict.fromkeys(_TOTALS, 0)
    first_step = len(history) + 1
    if first_step <= config.steps:
        async with env.get_grouped_rollouts(request) as stream:
            for step in range(first_step, config.steps + 1):
                # With enforce_order, receive() does not check for cancellation when the
                # batch is already held in order: check here, so that a cancelled run
                # takes (and writes) no further batch.
                await trio.lowlevel.checkpoint_if_cancelled()
                groups = [await stream.receive() for _ in range(config.groups_per_step)]
                now = trio.current_time()
                arrivals.append(now)
                window = now - arrivals[0]
                epoch = stream.policy_epoch
                rollouts = [rollout for group in groups for rollout in group]
                staleness = [epoch - group.start_epoch for group in groups]
                if out is not None:
                    write_groups(out, groups)
                # Computing the update "takes" train_seconds; generation goes on
                # meanwhile, with the old weights.
                await trio.sleep(config.train_seconds)
                entered = trio.current_time()
                async with stream.weight_update(mode=config.update_mode) as update:
                    # Generation has stopped as the mode says: change the weights.
                    policy.grpo_step(groups, config.learning_rate, config.clip)
                update_seconds = trio.current_time() - entered
                statistics = stream.statistics()
                counters = {name: getattr(statistics, name) for name in _TOTALS}
                step_metrics = StepMetrics(
                    step=step,
                    epoch=update.epoch,
                    mean_reward=float(np.mean([group.rewards().mean() for group in groups])),
                    accuracy=policy.accuracy(),
                    groups_per_second=(len(arrivals) - 1) * len(groups) / window
                    if window > 0
                    else math.inf,
                    filtered=statistics.filtered - filtered_before,
                    staleness_mean=float(np.mean(staleness)),
                    staleness_max=max(staleness),
                    mixed_epoch=sum(len(r.policy_epoch[0]) > 1 for r in rollouts if r.policy_epoch),
                    held=update.held,
                    pause_seconds=update.pause_seconds,
                    update_seconds=update_seconds,
                    elapsed=elapsed_before + (now - start),
                )
                filtered_before = statistics.filtered
                metrics.append(step_metrics)
                if (
                    directory is not None
                    and source is not None
                    and (step % config.checkpoint_every == 0 or step == config.steps)
                ):
                    # No await since the batch was taken and the update ended: the
                    # source, the weights and the metrics are of the same instant.
                    _save_checkpoint(
                        directory,
                        {
                            "format": _CHECKPOINT_FORMAT,
                            "step": step,
                            "policy_epoch": stream.policy_epoch,
                            "settings": _settings(config),
                            "initial_accuracy": initial_accuracy,
                            "logits": policy.logits.tolist(),
                            "prompts": source.state_dict(),
                            "history": [attrs.asdict(m) for m in metrics],
                            "totals": {n: totals[n] + counters[n] for n in _TOTALS},
                            "elapsed": elapsed_before + (trio.current_time() - start),
                        },
                    )
                if on_step is not None:
                    on_step(step_metrics)
            statistics = stream.statistics()
            counters = {name: getattr(statistics, name) for name in _TOTALS}
    steps = tuple(metrics)
    return DemoResult(
        config=config,
        initial_accuracy=initial_accuracy,
        steps=steps,
        groups=len(steps) * config.groups_per_step,
        rollouts=len(steps) * config.groups_per_step * config.group_size,
        filtered=totals["filtered"] + counters["filtered"],
        elapsed=elapsed_before + (trio.current_time() - start),
        weight_updates=totals["weight_updates"] + counters["weight_updates"],
        restarted=totals["restarted"] + counters["restarted"],
        stale=totals["stale"] + counters["stale"],
        mixed=totals["mixed"] + counters["mixed"],
        resumed_from=None if checkpoint is None else checkpoint.step,
    )
