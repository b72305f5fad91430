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


# ------------------------------------------------------------------------ a policy that learns


async def learn(steps: int, autojump_seed: int = 0) -> tuple[float, float, list[float]]:
    """The demo's loop, built from public names: ArithmeticEnvironment, AnswerTablePolicy
    on EmbeddedInference, GRPO steps inside weight updates."""
    env = ArithmeticEnvironment(num_problems=8, seed=autojump_seed, parallel_generation_tasks=16)
    policy = trio_rollouts.envs.AnswerTablePolicy.initial(env.problems, 4, seed=0)
    interface = EmbeddedInference(policy=policy, seed=0)
    request = tr.GroupedRolloutRequest(
        num_groups=8, rollouts_per_group=8, inference_interface=interface, streaming=True
    )
    before = policy.accuracy()
    rewards = []
    async with env.get_grouped_rollouts(request) as stream:
        for _ in range(steps):
            groups = [await stream.receive() for _ in range(8)]
            rewards.append(float(sum(g.reward_mean() for g in groups) / len(groups)))
            async with stream.weight_update("keep"):
                policy.grpo_step(groups, learning_rate=2.0, clip=0.2)
    return before, policy.accuracy(), rewards


async def test_answer_table_policy_learns_arithmetic_on_the_embedded_backend(
    autojump_clock: trio.testing.MockClock,
) -> None:
    before, after, rewards = await learn(12)
    assert before < 0.4
    assert after > before + 0.3
    assert sum(rewards[-3:]) > sum(rewards[:3])


def test_answer_table_policy_refuses_a_prompt_it_was_not_made_for() -> None:
    policy = trio_rollouts.envs.AnswerTablePolicy.initial(make_problems(2, 0), 4, seed=0)
    with pytest.raises(ValueError, match="AnswerTablePolicy knows only the problems"):
        policy([tr.ChatMessage(role="user", content="What is the capital of France?")])


async def test_the_default_policy_scores_nothing_and_the_pipeline_warns_early(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The default policy answers "The answer is A." and the like: every reward is 0.
    env = ArithmeticEnvironment(num_problems=8, seed=0, parallel_generation_tasks=8)
    request = tr.GroupedRolloutRequest(
        num_groups=8, rollouts_per_group=4, inference_interface=EmbeddedInference(seed=0),
        streaming=True,
    )  # fmt: skip
    stds: list[float] = []

    async def take_40() -> None:
        async with env.get_grouped_rollouts(request) as stream:
            async for group in stream:
                stds.append(group.reward_std())
                if len(stds) == 40:
                    break

    with pytest.warns(RuntimeWarning, match=r"the first 32 groups each had one reward") as w:
        await take_40()
    assert stds == [0.0] * 40
    assert len(w) == 1  # once per stream
    assert "AnswerTablePolicy" in str(w[0].message)


async def test_with_filtering_the_warning_comes_long_before_the_filter_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    env = ArithmeticEnvironment(
        num_problems=8, seed=0, parallel_generation_tasks=8, max_consecutive_filtered=200
    )
    request = tr.GroupedRolloutRequest(
        num_groups=8, rollouts_per_group=4, inference_interface=EmbeddedInference(seed=0),
        streaming=True, filter_groups_with_same_reward=True,
    )  # fmt: skip
    with (
        pytest.warns(RuntimeWarning, match=r"the first 32 groups"),
        pytest.raises(RuntimeError, match="groups in a row had identical rewards"),
    ):
        async with env.get_grouped_rollouts(request) as stream:
            await stream.receive()
