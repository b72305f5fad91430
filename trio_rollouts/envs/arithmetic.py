"""Arithmetic with verifiable rewards: the environment of ``trio-rollouts demo``.

:class:`ArithmeticEnvironment` is a :class:`~trio_rollouts.envs.RewardOnlyAgent` over a
fixed, seeded set of problems such as ``"What is 17 + 25?"``. A completion earns 1.0 when
the last number it writes is the answer, else 0.0 (:func:`last_number_reward`): a reward
a program can check, as in math RL. Run through the grouped pipeline, the problem of
every group is a function of its slot ``(batch_id, index_in_batch)`` and of how often the
slot was regenerated, never of the order in which Trio happens to schedule the calls; so
a seeded backend makes the whole stream reproducible.
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable, Sequence

import attrs
import numpy as np

from trio_rollouts._checks import int_at_least
from trio_rollouts.agents._reward_only import RewardOnlyAgent, last_number_reward
from trio_rollouts.inference import InferenceResponse
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._requests import GroupedRolloutRequest
from trio_rollouts.models._rollouts import Rollout, RolloutGroup, TokenRollout

__all__ = ["OPERATIONS", "ArithmeticEnvironment", "make_problems"]

#: The operations a problem may use.
OPERATIONS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}

# Mixed into every seed, so the problem stream differs from other seeded streams.
_PROBLEM_STREAM = 0x41524954
_SLOT_STREAM = 0x534C4F54


def _to_operations(value: Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = tuple(value)
    ops = tuple(value)
    unknown = [op for op in ops if op not in OPERATIONS]
    if not ops or unknown:
        msg = f"operations must be a non-empty selection of {sorted(OPERATIONS)}, got {value!r}"
        raise ValueError(msg)
    return ops


def make_problems(
    num_problems: int,
    seed: int = 0,
    *,
    max_operand: int = 20,
    operations: Sequence[str] = ("+", "-", "*"),
) -> list[Problem]:
    """``num_problems`` distinct problems ``"What is a op b?"`` with ``0 <= a, b <=
    max_operand``, drawn with a numpy generator seeded by ``seed``; the answer is an int.

    Raises ``ValueError`` when there are fewer distinct problems than asked for.
    """
    ops = _to_operations(operations)
    possible = len(ops) * (max_operand + 1) ** 2
    if num_problems > possible:
        msg = (
            f"num_problems={num_problems} exceeds the {possible} distinct problems with "
            f"max_operand={max_operand} and operations={''.join(ops)!r}"
        )
        raise ValueError(msg)
    rng = np.random.default_rng([seed, _PROBLEM_STREAM])
    seen: set[tuple[int, str, int]] = set()
    problems: list[Problem] = []
    while len(problems) < num_problems:
        a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
        op = ops[int(rng.integers(len(ops)))]
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        problems.append(
            Problem(
                problem_id=f"arithmetic-{len(problems)}",
                prompt=f"What is {a} {op} {b}?",
                answer=OPERATIONS[op](a, b),
            )
        )
    return problems


@attrs.define(kw_only=True)
class ArithmeticEnvironment(RewardOnlyAgent):
    """Arithmetic problems with a verifiable reward.

    - ``num_problems`` problems, made by :func:`make_problems` from ``seed``,
      ``max_operand`` and ``operations`` (available as :attr:`problems`).
    - Reward: :func:`last_number_reward`: 1.0 when the completion's last number is the
      answer, else 0.0.

    Which problem a group gets. Called directly, :meth:`group_rollout` takes the problems
    in turn. In the grouped pipeline, slot ``(batch_id, index_in_batch)`` is unit ``u =
    batch_id * num_groups + index_in_batch`` and its first attempt gets problem
    ``order[u % num_problems]`` of a seeded permutation ``order``, so any
    ``num_problems`` consecutive units get distinct problems; a slot regenerated after
    filtering (attempt ``a >= 1``) gets a problem drawn from a generator seeded by
    ``(seed, batch_id, index_in_batch, a)``. Nothing depends on scheduling order.
    """

    num_problems: int = attrs.field(default=32, validator=int_at_least(1))
    seed: int = attrs.field(default=0, validator=int_at_least(0))
    max_operand: int = attrs.field(default=20, validator=int_at_least(1))
    operations: tuple[str, ...] = attrs.field(default=("+", "-", "*"), converter=_to_operations)
    env_id: str = attrs.field(default="arithmetic", validator=attrs.validators.instance_of(str))
    problems: list[Problem] = attrs.field(init=False)
    _order: list[int] = attrs.field(init=False, repr=False)
    _next_problem: int = attrs.field(init=False, default=0, repr=False)

    def __attrs_post_init__(self) -> None:
        self.problems = make_problems(
            self.num_problems, self.seed, max_operand=self.max_operand, operations=self.operations
        )
        order = np.random.default_rng([self.seed, _SLOT_STREAM]).permutation(self.num_problems)
        self._order = [int(i) for i in order]

    async def get_prompt(self, request: GroupedRolloutRequest) -> Problem:
        """The next problem in turn (problem 0, 1, 2, ..., then again from 0), or, when
        the environment has ``prompts`` (a :class:`~trio_rollouts.PromptSource`, say over
        its own ``problems``), the source's next draw.

        Cancellation: not a checkpoint; nothing to cancel.
        """
        if self.prompts is not None:
            return self.prompts.draw()
        problem = self.problems[self._next_problem % self.num_problems]
        self._next_problem += 1
        return problem

    async def get_reward(self, problem: Problem, response: InferenceResponse) -> float:
        """:func:`last_number_reward` of the completion. Not a checkpoint."""
        return last_number_reward(problem, response.response.content)

    def problem_for_slot(
        self, batch_id: int, index_in_batch: int, num_groups: int, attempt: int
    ) -> Problem:
        """The problem of a slot's ``attempt``-th generation (0 is the first)."""
        if attempt == 0:
            unit = batch_id * num_groups + index_in_batch
            return self.problems[self._order[unit % self.num_problems]]
        rng = np.random.default_rng([self.seed, batch_id, index_in_batch, attempt])
        return self.problems[int(rng.integers(self.num_problems))]

    def _slot_generator(
        self, request: GroupedRolloutRequest
    ) -> Callable[[int, int], Awaitable[list[Rollout] | list[TokenRollout] | RolloutGroup]]:
        if self.prompts is not None:
            # Problems come from the source: one draw per call, in get_prompt.
            group_rollout = self.group_rollout
            return lambda batch_id, index_in_batch: group_rollout(request)
        # Attempts per slot, for the batches that may still be generating: at most
        # parallel_generation_tasks // num_groups batches are outstanding at once.
        window = max(1, self.parallel_generation_tasks // request.num_groups)
        attempts: dict[int, dict[int, int]] = {}
        num_groups = request.num_groups

        def generate(
            batch_id: int, index_in_batch: int
        ) -> Awaitable[list[Rollout] | list[TokenRollout]]:
            of_batch = attempts.setdefault(batch_id, {})
            attempt = of_batch.get(index_in_batch, 0)
            of_batch[index_in_batch] = attempt + 1
            for old in [b for b in attempts if b <= batch_id - window]:
                del attempts[old]
            problem = self.problem_for_slot(batch_id, index_in_batch, num_groups, attempt)
            return self.rollouts_for(problem, request)

        return generate
