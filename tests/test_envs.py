"""The arithmetic environment: seeded problems, a verifiable reward, slot-pinned problems."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy.typing as npt
import pytest
import trio
import trio.testing

import trio_rollouts as tr
import trio_rollouts.envs
from trio_rollouts.envs import ArithmeticEnvironment, make_problems
from trio_rollouts.envs.arithmetic import OPERATIONS
from trio_rollouts.inference import EmbeddedInference, InferenceResponse, LatencyModel

PROMPT = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


def answer_policy(prompt: list[tr.ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
    """Half the time the right answer, else one more."""
    a, op, b = PROMPT.fullmatch(prompt[-1].content).groups()  # type: ignore[union-attr]
    right = OPERATIONS[op](int(a), int(b))
    return [str(right), str(right + 1)], [0.5, 0.5]


def test_the_package_exports_the_environments() -> None:
    for name in ("ArithmeticEnvironment", "RewardOnlyAgent", "make_problems", "REWARD_FUNCTIONS"):
        assert hasattr(trio_rollouts.envs, name)


def test_problems_are_distinct_and_their_answers_right() -> None:
    problems = make_problems(200, seed=3)
    assert len({p.prompt for p in problems}) == 200
    assert len({p.problem_id for p in problems}) == 200
    for problem in problems:
        a, op, b = PROMPT.fullmatch(str(problem.prompt)).groups()  # type: ignore[union-attr]
        assert problem.answer == OPERATIONS[op](int(a), int(b))


def test_the_seed_fixes_the_problems() -> None:
    assert make_problems(10, seed=1) == make_problems(10, seed=1)
    assert make_problems(10, seed=1) != make_problems(10, seed=2)


def test_operations_and_operands_are_respected() -> None:
    problems = make_problems(30, seed=0, max_operand=9, operations="+")
    for problem in problems:
        a, op, b = PROMPT.fullmatch(str(problem.prompt)).groups()  # type: ignore[union-attr]
        assert op == "+"
        assert int(a) <= 9
        assert int(b) <= 9


def test_asking_for_more_problems_than_exist_is_an_error() -> None:
    with pytest.raises(ValueError, match="exceeds the 4 distinct problems"):
        make_problems(5, max_operand=1, operations="+")


def test_an_unknown_operation_is_an_error() -> None:
    with pytest.raises(ValueError, match="operations must be"):
        ArithmeticEnvironment(operations=("/",))


async def test_the_reward_is_one_for_the_right_last_number() -> None:
    env = ArithmeticEnvironment(num_problems=3)
    problem = env.problems[0]

    def response(text: str) -> InferenceResponse:
        return InferenceResponse(response=tr.ChatMessage(role="assistant", content=text))

    assert await env.get_reward(problem, response(f"It is {problem.answer}.")) == 1.0
    assert await env.get_reward(problem, response(f"{problem.answer} or 1000")) == 0.0


async def test_direct_calls_take_the_problems_in_turn() -> None:
    env = ArithmeticEnvironment(num_problems=3)
    req = tr.GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=2, inference_interface=EmbeddedInference()
    )
    taken = [await env.get_prompt(req) for _ in range(4)]
    assert taken == [*env.problems, env.problems[0]]


def test_any_num_problems_consecutive_slots_get_distinct_problems() -> None:
    env = ArithmeticEnvironment(num_problems=12, seed=5)
    units = [env.problem_for_slot(b, i, 4, 0).problem_id for b in range(9) for i in range(4)]
    for start in range(len(units) - 12):
        assert len(set(units[start : start + 12])) == 12


def test_a_regenerated_slot_gets_a_seeded_problem() -> None:
    env = ArithmeticEnvironment(num_problems=50, seed=5)
    attempts = [env.problem_for_slot(3, 1, 4, a) for a in range(1, 6)]
    assert attempts == [env.problem_for_slot(3, 1, 4, a) for a in range(1, 6)]
    assert len({p.problem_id for p in attempts}) > 1


async def stream_of(seed: int, batches: int) -> list[tuple[str | None, list[float]]]:
    env = ArithmeticEnvironment(num_problems=16, seed=seed, parallel_generation_tasks=8)
    interface = EmbeddedInference(seed=seed, policy=answer_policy)
    req = tr.GroupedRolloutRequest(
        num_groups=4,
        rollouts_per_group=4,
        inference_interface=interface,
        streaming=True,
        enforce_order=True,
        filter_groups_with_same_reward=True,
    )
    seen = []
    async with env.get_grouped_rollouts(req) as stream:
        for _ in range(batches * 4):
            group = await stream.receive()
            seen.append((group[0].problem_id, group.rewards().tolist()))
    return seen


async def test_the_stream_does_not_depend_on_scheduling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Trio shuffles the order of runnable tasks; problems are pinned to slots and the
    # backend's samples to each prompt's request order, so two runs see the same groups.
    assert await stream_of(seed=2, batches=6) == await stream_of(seed=2, batches=6)


@pytest.mark.parametrize("distribution", ["constant", "exponential"])
async def test_a_slots_first_problem_does_not_depend_on_timing(
    autojump_clock: trio.testing.MockClock, distribution: str
) -> None:
    env = ArithmeticEnvironment(num_problems=10, seed=4, parallel_generation_tasks=6)
    latency = LatencyModel(distribution=distribution)  # type: ignore[arg-type]
    req = tr.GroupedRolloutRequest(
        num_groups=3,
        rollouts_per_group=2,
        inference_interface=EmbeddedInference(policy=answer_policy, latency=latency),
        streaming=True,
    )
    async with env.get_grouped_rollouts(req) as stream:
        groups = [await stream.receive() for _ in range(12)]
    for group in groups:
        expected = env.problem_for_slot(group.batch_id, group.index_in_batch, 3, 0)
        assert group[0].problem_id == expected.problem_id


async def test_groups_are_token_rollouts_of_the_environment(
    autojump_clock: trio.testing.MockClock,
) -> None:
    env = ArithmeticEnvironment(num_problems=8, parallel_generation_tasks=4)
    req = tr.GroupedRolloutRequest(
        num_groups=4,
        rollouts_per_group=3,
        inference_interface=EmbeddedInference(policy=answer_policy),
        enforce_order=True,
    )
    async with env.get_grouped_rollouts(req) as stream:
        groups = [group async for group in stream]
    ids = {p.problem_id for p in env.problems}
    for group in groups:
        assert len({r.problem_id for r in group}) == 1
        for rollout in group:
            assert isinstance(rollout, tr.TokenRollout)
            assert rollout.env_id == "arithmetic"
            assert rollout.problem_id in ids
    assert len({g[0].problem_id for g in groups}) == 4
