"""Weighted multi-task mixing: one grouped pipeline whose slots are served by several agents.

A :class:`WeightedMultiTask` is itself a :class:`GroupedRolloutGenerator`: it reuses the
grouped pipeline unchanged and only decides, through the pipeline's ``_slot_generator``
and ``_slot_environment`` hooks, which sub-agent serves each slot ``(batch_id,
index_in_batch)``. So streaming, ordering, filtering, bounds, errors and cancellation are
exactly those of a single agent. The decision is a pure function of the slot: slot ``i``
of batch ``b`` is unit ``u = b * num_groups + i`` of one *smooth weighted sequence*, in
which after every unit each environment's count is strictly within one group of its exact
share ``u * w_i / W``. A filtered group is regenerated in its own slot, so by the same
environment. The sequence is earliest-deadline-first scheduling in exact integer
arithmetic (see :class:`_WeightedSequence`); it exists because the two obvious batch-level
rules fail: per-batch largest remainder with carried credit drifts more than a batch
behind with ``num_groups=1`` and several environments, and largest remainder on the
cumulative target can take a group *back* (the Alabama paradox).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Awaitable, Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any

import attrs

from trio_rollouts._checks import check_bool as _check_bool
from trio_rollouts._concurrency import gather
from trio_rollouts.agents._base import Agent, EvaluationAgent, GroupedRolloutGenerator
from trio_rollouts.models._evaluation import EvaluationResponse, EvaluationResult
from trio_rollouts.models._requests import EvaluationRequest, GroupedRolloutRequest
from trio_rollouts.models._rollouts import Rollout, RolloutGroup, TokenRollout

__all__ = ["MultiTaskEvaluationResponse", "WeightedMultiTask", "WeightedTask"]

_GroupResult = Sequence[Rollout | TokenRollout] | RolloutGroup

# --------------------------------------------------------------------------- tasks


def _check_agent(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Agent):
        msg = f"agent must be an Agent (a trio_rollouts agent class), got {value!r:.80}"
        raise TypeError(msg)


def _check_weight_value(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        msg = f"{name} must be a finite number >= 0, got {type(value).__name__} {value!r:.80}"
        raise TypeError(msg)
    if not math.isfinite(value) or value < 0:
        msg = (
            f"{name} must be a finite number >= 0 (0 means no rollout work), got {value!r}; "
            "negative, NaN and infinite weights are not allowed"
        )
        raise ValueError(msg)


def _check_weight(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _check_weight_value("weight", value)


def _check_env_id(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        msg = f"env_id must be a non-empty str, got {value!r:.80}"
        raise TypeError(msg)
    if not value:
        msg = "env_id must be a non-empty str, got ''"
        raise ValueError(msg)


def _default_env_id(task: WeightedTask) -> str:
    env_id = getattr(task.agent, "env_id", None)
    if isinstance(env_id, str) and env_id:
        return env_id
    return type(task.agent).__name__


@attrs.frozen
class WeightedTask:
    """One environment of a :class:`WeightedMultiTask`: an agent and its share of the work.

    - ``weight``: the environment's share of rollout groups is ``weight / (sum of the
      weights of the tasks that get work)``. ``0`` means no rollout work (the task may
      still be evaluated). Weights are taken at their shortest decimal representation,
      so ``0.3`` and ``0.1`` are exactly ``3 : 1``.
    - ``evaluation_only``: the task gets no rollout work whatever its weight; it is
      evaluated by :meth:`WeightedMultiTask.run_evaluation`.
    - ``env_id``: the environment's name in groups and statistics. By default the agent's
      own ``env_id`` attribute when it has a non-empty one, else the agent's class name.

    A task that gets rollout work (positive weight, not ``evaluation_only``) needs a
    :class:`GroupedRolloutGenerator` agent (``TypeError`` otherwise).
    """

    agent: Agent = attrs.field(validator=_check_agent)
    weight: float = attrs.field(validator=_check_weight)
    evaluation_only: bool = attrs.field(default=False, kw_only=True, validator=_check_bool)
    env_id: str = attrs.field(
        default=attrs.Factory(_default_env_id, takes_self=True),
        kw_only=True,
        validator=_check_env_id,
    )

    def __attrs_post_init__(self) -> None:
        if self.gets_rollout_work and not isinstance(self.agent, GroupedRolloutGenerator):
            msg = (
                f"task {self.env_id!r} has weight {self.weight!r} but its agent "
                f"{type(self.agent).__name__} is not a GroupedRolloutGenerator; give it "
                "weight 0 or evaluation_only=True to use it for evaluation only"
            )
            raise TypeError(msg)

    @property
    def gets_rollout_work(self) -> bool:
        """Whether the task serves rollout groups (a positive weight, not evaluation-only)."""
        return self.weight > 0 and not self.evaluation_only


def _exact_weight(weight: float) -> Fraction:
    if isinstance(weight, numbers.Integral):
        return Fraction(int(weight))
    # The shortest repr is what the user wrote: 0.3 is 3/10, not 0.299999999999999988898.
    return Fraction(repr(float(weight)))


# --------------------------------------------------------------------------- schedule


class _WeightedSequence:
    """An endless sequence of environment indices that tracks their weights as closely as
    possible: after ``t`` units every environment's count ``C_i`` satisfies
    ``|C_i - t * p_i| < 1`` (``p_i`` its exact share).

    Read the constraint as jobs: environment ``i``'s ``k``-th unit may not come before
    ``C_i`` would lead its share by 1 (it is *released* once ``k - 1 < t * p_i``) and must
    come before it lags by 1 (its *deadline* is ``t = k / p_i``). Serving the released
    unit with the earliest deadline (EDF; ties to the lower index) meets every deadline
    whenever any order does, and one does (Tijdeman 1980, "The chairman assignment
    problem": discrepancy at most ``1 - 1/(2n - 2)``). Integer arithmetic keeps it exact.
    """

    __slots__ = ("_counts", "_t", "_total", "_weights")

    def __init__(self, weights: Sequence[int], counts: Sequence[int] | None = None) -> None:
        self._weights = tuple(weights)
        self._total = sum(self._weights)
        self._counts = list(counts) if counts is not None else [0] * len(self._weights)
        self._t = sum(self._counts)

    @classmethod
    def from_weights(cls, weights: Iterable[float]) -> _WeightedSequence:
        """A sequence for positive weights, made integers with the same ratios."""
        exact = [_exact_weight(w) for w in weights]
        scale = math.lcm(*(w.denominator for w in exact))
        ints = [w.numerator * (scale // w.denominator) for w in exact]
        divisor = math.gcd(*ints)
        return cls([w // divisor for w in ints])

    @property
    def weights(self) -> tuple[int, ...]:
        return self._weights

    def counts(self) -> tuple[int, ...]:
        """How many units each environment got so far."""
        return tuple(self._counts)

    def next(self) -> int:
        """The environment of the next unit."""
        t = self._t + 1
        total = self._total
        counts = self._counts
        best = -1
        for i, weight in enumerate(self._weights):
            count = counts[i]
            if count * total >= t * weight:
                continue  # not released: serving it now would lead its share by 1
            # Earliest deadline (k / p_i, k = count + 1) first.
            if best < 0 or (count + 1) * self._weights[best] < (counts[best] + 1) * weight:
                best = i
        counts[best] += 1
        self._t = t
        return best


#: Replaying a batch the window no longer holds starts from a checkpoint at most this
#: many units back; a checkpoint is kept every that many units.
_CHECKPOINT_UNITS = 4096


class _SlotSchedule:
    """Which environment serves each slot of one run: slot ``(b, i)`` is unit
    ``b * num_groups + i`` of a :class:`_WeightedSequence`.

    Batches are computed in ``batch_id`` order and kept in a window of recent batches; a
    straggler batch older than the window is recomputed from the nearest checkpoint, so
    the answer never depends on the order of queries. Memory: the window, plus one
    checkpoint (the counts, a small tuple) per ``_CHECKPOINT_UNITS`` groups of the run.
    """

    __slots__ = (
        "_batches",
        "_checkpoint_every",
        "_checkpoints",
        "_frontier",
        "_next_batch",
        "_num_groups",
        "_stragglers",
        "_window",
    )

    def __init__(self, weights: Sequence[int], num_groups: int, window: int) -> None:
        self._frontier = _WeightedSequence(weights)
        self._num_groups = num_groups
        self._window = max(window, 1)
        self._batches: dict[int, tuple[int, ...]] = {}
        self._stragglers: dict[int, tuple[int, ...]] = {}
        self._next_batch = 0
        self._checkpoint_every = max(1, _CHECKPOINT_UNITS // num_groups)
        self._checkpoints: dict[int, tuple[int, ...]] = {}

    def batch(self, batch_id: int) -> tuple[int, ...]:
        """The environment index of every slot of batch ``batch_id``."""
        found = self._batches.get(batch_id)
        if found is not None:
            return found
        if batch_id >= self._next_batch:
            return self._advance_to(batch_id)
        return self._replay(batch_id)

    def _advance_to(self, batch_id: int) -> tuple[int, ...]:
        sequence = self._frontier
        size = self._num_groups
        while self._next_batch <= batch_id:
            b = self._next_batch
            if b % self._checkpoint_every == 0:
                self._checkpoints[b] = sequence.counts()
            self._batches[b] = tuple(sequence.next() for _ in range(size))
            self._batches.pop(b - self._window, None)
            self._next_batch = b + 1
        return self._batches[batch_id]

    def _replay(self, batch_id: int) -> tuple[int, ...]:
        found = self._stragglers.get(batch_id)
        if found is not None:
            return found
        start = batch_id - batch_id % self._checkpoint_every
        sequence = _WeightedSequence(self._frontier.weights, self._checkpoints[start])
        for _ in range((batch_id - start) * self._num_groups):
            sequence.next()
        batch = tuple(sequence.next() for _ in range(self._num_groups))
        if len(self._stragglers) >= self._window:
            self._stragglers.clear()
        self._stragglers[batch_id] = batch
        return batch


def batch_splits(weights: Sequence[float], num_groups: int, num_batches: int) -> list[list[int]]:
    """How many groups of each of the first ``num_batches`` batches go to each weight.

    ``weights`` must be finite and >= 0 with at least one positive (zeros get nothing).
    This is the split :class:`WeightedMultiTask` uses; it is exposed for planning and
    tests. After every batch each count is strictly within one group of its exact share.
    """
    for i, weight in enumerate(weights):
        _check_weight_value(f"weights[{i}]", weight)
    for name, value, minimum in (("num_groups", num_groups, 1), ("num_batches", num_batches, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            msg = f"{name} must be an int >= {minimum}, got {value!r}"
            raise ValueError(msg)
    positive = [i for i, w in enumerate(weights) if w > 0]
    if not positive:
        msg = f"weights need at least one positive weight, got {list(weights)!r}"
        raise ValueError(msg)
    sequence = _WeightedSequence.from_weights([weights[i] for i in positive])
    out = []
    for _ in range(num_batches):
        counts = [0] * len(weights)
        for _ in range(num_groups):
            counts[positive[sequence.next()]] += 1
        out.append(counts)
    return out


# --------------------------------------------------------------------------- evaluation


@attrs.define(kw_only=True)
class MultiTaskEvaluationResponse(EvaluationResponse[EvaluationResult]):
    """What :meth:`WeightedMultiTask.run_evaluation` returns: each evaluated environment's
    response by its task's ``env_id``, in task order, in :attr:`responses`.

    ``results`` stays empty: the results live in each environment's response.
    """

    results: list[EvaluationResult] = attrs.field(factory=list)
    responses: dict[str, EvaluationResponse[Any]] = attrs.field(factory=dict)

    def metrics(self) -> dict[str, float]:
        """Every environment's metrics, named ``"env_id/metric"``."""
        return {
            f"{env_id}/{name}": value
            for env_id, response in self.responses.items()
            for name, value in response.metrics().items()
        }


# --------------------------------------------------------------------------- the mixture


def _to_tasks(value: object) -> tuple[WeightedTask, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        msg = f"tasks must be a list of WeightedTask, got {value!r:.80}"
        raise TypeError(msg)
    return tuple(value)


def _check_tasks(
    instance: object, attribute: attrs.Attribute[Any], value: tuple[object, ...]
) -> None:
    if not value:
        msg = "tasks must not be empty: a WeightedMultiTask needs at least one WeightedTask"
        raise ValueError(msg)
    seen: dict[str, int] = {}
    tasks: list[WeightedTask] = []
    for i, task in enumerate(value):
        if not isinstance(task, WeightedTask):
            msg = f"tasks[{i}] must be a WeightedTask, got {type(task).__name__} {task!r:.80}"
            raise TypeError(msg)
        if task.env_id in seen:
            msg = (
                f"tasks[{i}] has env_id {task.env_id!r}, already used by "
                f"tasks[{seen[task.env_id]}]; env ids must be unique (pass "
                "WeightedTask(..., env_id='...') to rename one)"
            )
            raise ValueError(msg)
        seen[task.env_id] = i
        tasks.append(task)
    if not any(task.gets_rollout_work for task in tasks):
        weights = {task.env_id: task.weight for task in tasks}
        msg = (
            f"tasks need at least one positive weight on a task that is not evaluation_only, "
            f"got weights {weights!r}"
        )
        raise ValueError(msg)


async def _serve(
    agent: GroupedRolloutGenerator,
    env_id: str,
    request: GroupedRolloutRequest,
    slot: tuple[int, int] | None,
) -> _GroupResult:
    """One sub-agent call: name the environment on a failure, stamp ``env_id`` on success."""
    try:
        result = await agent.group_rollout(request)
    except Exception as exc:
        # A note, not a wrapper: ``except ValueError`` around the stream still works.
        where = "" if slot is None else f" for slot batch_id={slot[0]}, index_in_batch={slot[1]}"
        exc.add_note(
            f"raised by environment {env_id!r} ({type(agent).__name__}.group_rollout){where}"
        )
        raise
    rollouts = result.rollouts if isinstance(result, RolloutGroup) else result
    if isinstance(rollouts, list):  # anything else is the pipeline's error to report
        for rollout in rollouts:
            if isinstance(rollout, (Rollout, TokenRollout)) and not rollout.env_id:
                rollout.env_id = env_id
    return result


@attrs.define(kw_only=True)
class WeightedMultiTask(GroupedRolloutGenerator, EvaluationAgent):
    """Mix several environments into one stream of groups, each served at its weight.

    ``get_grouped_rollouts(request)`` runs the grouped pipeline once for the mixture:
    ``request.num_groups``, ``parallel_generation_tasks`` and ``buffer_size`` bound the
    whole mixture (the sub-agents' own pipeline settings, ``failure_policy`` included, are
    not used), and every sub-agent's ``group_rollout`` receives the mixture's request.
    Each batch is split among the tasks that get work by weight, smoothed across batches:
    after every batch, each environment's count of groups is strictly within one group of
    its exact share (so a 3:1 mixture with ``num_groups=4`` gives exactly 3 and 1 in every
    batch, and an environment whose share of one batch is below one group is still
    served, in later batches). See :func:`batch_splits` for the split alone.

    Groups carry their environment: a rollout whose ``env_id`` is empty is stamped with
    its task's ``env_id`` (a non-empty one, as a nested mixture sets, is kept). A
    sub-agent's exception propagates as itself, with a note naming the environment and
    the slot. ``stream.statistics().per_env`` counts started, delivered, filtered and
    failed groups by ``env_id`` (environments that got no work do not appear).

    ``group_rollout(request)`` on the mixture itself serves each call from the next
    environment of the same smooth weighted sequence over calls, so a mixture can be a
    task of another mixture; use ``get_grouped_rollouts`` for slot-exact routing and
    per-environment statistics.
    """

    tasks: tuple[WeightedTask, ...] = attrs.field(
        converter=_to_tasks, validator=_check_tasks, on_setattr=attrs.setters.frozen
    )
    #: The mixture's own name: the env_id of its evaluation response, and its default
    #: env_id when it is a task of another mixture.
    env_id: str = attrs.field(default="WeightedMultiTask", validator=_check_env_id)

    _call_sequence: _WeightedSequence | None = attrs.field(
        default=None, init=False, repr=False, eq=False
    )
    # The schedule _slot_generator made for a request, for _slot_environment of the same
    # request to share (the pipeline asks for both at its start).
    _last_schedule: tuple[GroupedRolloutRequest, _SlotSchedule] | None = attrs.field(
        default=None, init=False, repr=False, eq=False
    )

    def _routes(self) -> list[tuple[GroupedRolloutGenerator, str]]:
        """The tasks that get rollout work, as (agent, env_id), in task order."""
        routes = []
        for task in self.tasks:
            if task.gets_rollout_work:
                if not isinstance(task.agent, GroupedRolloutGenerator):  # pragma: no cover
                    msg = f"task {task.env_id!r} gets work but is no GroupedRolloutGenerator"
                    raise TypeError(msg)
                routes.append((task.agent, task.env_id))
        return routes

    def _weights(self) -> tuple[int, ...]:
        working = [task.weight for task in self.tasks if task.gets_rollout_work]
        return _WeightedSequence.from_weights(working).weights

    def _new_schedule(self, request: GroupedRolloutRequest) -> _SlotSchedule:
        outstanding = max(1, self.parallel_generation_tasks // request.num_groups)
        return _SlotSchedule(self._weights(), request.num_groups, window=2 * outstanding + 16)

    def _slot_generator(
        self, request: GroupedRolloutRequest
    ) -> Callable[[int, int], Awaitable[_GroupResult]]:
        """Route slot ``(batch_id, index)`` to its environment's ``group_rollout``."""
        schedule = self._new_schedule(request)
        self._last_schedule = (request, schedule)
        routes = self._routes()

        def generate(batch_id: int, index: int) -> Awaitable[_GroupResult]:
            agent, env_id = routes[schedule.batch(batch_id)[index]]
            return _serve(agent, env_id, request, (batch_id, index))

        return generate

    def _draws_prompts(self) -> bool:
        """Whether this agent or any sub-agent with rollout work draws from a prompt
        source (each call's draws are then recorded; a call of a sub-agent with
        ``prompts`` must draw exactly one)."""
        return self.prompts is not None or any(
            agent._draws_prompts() for agent, _ in self._routes()
        )

    def _slot_environment(self, request: GroupedRolloutRequest) -> Callable[[int, int], str]:
        """The ``env_id`` of slot ``(batch_id, index)``, for per-environment statistics."""
        last = self._last_schedule
        # Sharing is only an economy: every schedule of a request routes alike.
        schedule = last[1] if last is not None and last[0] is request else None
        if schedule is None:
            schedule = self._new_schedule(request)
        self._last_schedule = None
        env_ids = [env_id for _, env_id in self._routes()]
        return lambda batch_id, index: env_ids[schedule.batch(batch_id)[index]]

    async def group_rollout(self, request: GroupedRolloutRequest) -> _GroupResult:
        """Serve one group from the next environment of the weighted sequence over calls.

        The environment is chosen when the call starts, so concurrent calls split by
        weight in call order. Errors and ``env_id`` stamping as for slots.
        Cancellation: cancelling it cancels the sub-agent's call.
        """
        if self._call_sequence is None:
            self._call_sequence = _WeightedSequence(self._weights())
        agent, env_id = self._routes()[self._call_sequence.next()]
        return await _serve(agent, env_id, request, None)

    async def run_evaluation(self, request: EvaluationRequest) -> MultiTaskEvaluationResponse:
        """Evaluate every task whose agent is an :class:`EvaluationAgent`, concurrently.

        Every such task is evaluated, ``evaluation_only`` and weight-0 ones included;
        tasks whose agent cannot evaluate are skipped. Each receives ``request`` as is
        (its ``num_prompts`` and ``rank_info`` apply to every environment). Returns one
        response per evaluated environment, by task ``env_id`` in task order, in a
        :class:`MultiTaskEvaluationResponse` (``response.responses["math"]``).

        A failing evaluation cancels the others and propagates as itself, with a note
        naming its environment. Cancellation: cancelling this cancels every sub-agent's
        evaluation; it returns or raises only after all of them have exited.
        """
        evaluated = [
            (task.env_id, task.agent)
            for task in self.tasks
            if isinstance(task.agent, EvaluationAgent)
        ]

        def call(
            env_id: str, agent: EvaluationAgent
        ) -> Callable[[], Awaitable[EvaluationResponse[Any]]]:
            async def evaluate() -> EvaluationResponse[Any]:
                try:
                    return await agent.run_evaluation(request)
                except Exception as exc:
                    exc.add_note(f"raised by the evaluation of environment {env_id!r}")
                    raise

            return evaluate

        responses = await gather([call(env_id, agent) for env_id, agent in evaluated])
        return MultiTaskEvaluationResponse(
            env_id=self.env_id,
            rank_info=request.rank_info,
            responses={env_id: r for (env_id, _), r in zip(evaluated, responses, strict=True)},
        )
