"""RewardOnlyAgent: one problem per group, concurrent completions, verifiable rewards."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy.typing as npt
import pytest
import trio
import trio.testing

import trio_rollouts as tr
from trio_rollouts.agents._reward_only import (
    REWARD_FUNCTIONS,
    RewardOnlyAgent,
    contains_reward,
    exact_match_reward,
    last_number_reward,
)
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    LatencyModel,
    render_plain_chat,
)
from trio_rollouts.models import Problem

PROBLEM = Problem(problem_id="p1", prompt="What is 2 + 2?", answer=4)
STEADY = LatencyModel(first_token=1.0, per_token=1.0, distribution="constant")


def fixed(completions: Sequence[str], probs: Sequence[float]) -> Any:
    def policy(prompt: list[tr.ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
        return completions, probs

    return policy


@attrs.define(kw_only=True)
class OneProblem(RewardOnlyAgent):
    """Always the same problem; the reward is ``score(problem, text)``."""

    problem: Problem = PROBLEM
    score: Any = last_number_reward
    scored: list[str] = attrs.field(factory=list)

    async def get_prompt(self, request: tr.GroupedRolloutRequest) -> Problem:
        return self.problem

    async def get_reward(self, problem: Problem, response: InferenceResponse) -> float:
        await trio.lowlevel.checkpoint()
        self.scored.append(response.response.content)
        value: float = self.score(problem, response.response.content)
        return value


@attrs.define(eq=False)
class TextOnly(InferenceInterface, tr.ReturnsRaw):
    """Returns raw text and nothing else: rollouts must be text rollouts."""

    text: str = "4"

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        await trio.lowlevel.checkpoint()
        return InferenceResponse(
            response=tr.ChatMessage(role="assistant", content=self.text),
            raw_text=render_plain_chat(request.prompt) + self.text,
            policy_epoch=[(0, 3)],
            num_evictions=1,
        )


@attrs.define(eq=False)
class TokensMissing(InferenceInterface, tr.ReturnsRaw, tr.ReturnsLogProbs):
    """Claims tokens but returns none (a server that ignores return_token_ids)."""

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        await trio.lowlevel.checkpoint()
        return InferenceResponse(
            response=tr.ChatMessage(role="assistant", content="4"), raw_text="x4"
        )


def request(interface: InferenceInterface, size: int = 4) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=size, inference_interface=interface
    )


# --------------------------------------------------------------------------- rewards


def test_exact_match_compares_the_stripped_text() -> None:
    problem = Problem(problem_id="p", prompt="q", answer="Paris")
    assert exact_match_reward(problem, " Paris\n") == 1.0
    assert exact_match_reward(problem, "Paris.") == 0.0


def test_contains_looks_for_the_answer_anywhere() -> None:
    problem = Problem(problem_id="p", prompt="q", answer="Paris")
    assert contains_reward(problem, "It is Paris, of course.") == 1.0
    assert contains_reward(problem, "paris") == 0.0


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("4", 1.0),
        ("2 + 2 = 4.", 1.0),
        ("I think 5, no, 4", 1.0),
        ("4, or maybe 5", 0.0),
        ("4.0", 1.0),
        ("no idea", 0.0),
        ("-4", 0.0),
    ],
)
def test_last_number_grades_the_last_number_written(completion: str, reward: float) -> None:
    assert last_number_reward(PROBLEM, completion) == reward


def test_last_number_reads_negatives_and_thousands_separators() -> None:
    assert last_number_reward(Problem(problem_id="p", prompt="q", answer=-6), "so -6") == 1.0
    assert last_number_reward(Problem(problem_id="p", prompt="q", answer="1234"), "1,234") == 1.0


def test_last_number_refuses_an_answer_that_is_not_a_number() -> None:
    with pytest.raises(ValueError, match=r"numeric answer, problem 'p' has 'Paris'"):
        last_number_reward(Problem(problem_id="p", prompt="q", answer="Paris"), "1")


def test_reward_functions_are_registered_by_their_cli_names() -> None:
    assert set(REWARD_FUNCTIONS) == {"exact-match", "contains", "last-number"}


# --------------------------------------------------------------------------- groups


async def test_a_tokens_interface_gives_token_rollouts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(seed=1, policy=fixed(["4", "5"], [0.5, 0.5]), latency=STEADY)
    group = await OneProblem(env_id="math").group_rollout(request(interface, size=6))
    prompt_length = len(render_plain_chat([tr.ChatMessage(role="user", content="What is 2 + 2?")]))
    assert len(group) == 6
    for rollout in group:
        assert isinstance(rollout, tr.TokenRollout)
        assert rollout.env_id == "math"
        assert rollout.problem_id == "p1"
        tokens, mask = rollout.trajectory[0], rollout.generation_mask[0]  # type: ignore[index]
        generated = "".join(chr(t) for t, m in zip(tokens, mask, strict=True) if m)
        assert mask.count(False) == prompt_length
        assert rollout.reward == (1.0 if generated == "4" else 0.0)
        assert rollout.logprobs is not None
        assert math.isclose(sum(rollout.logprobs[0]), math.log(0.5))
        assert rollout.policy_epoch == [[(0, 0)]]
        assert rollout.num_evictions == [0]
    assert {r.reward for r in group} == {0.0, 1.0}


async def test_a_text_interface_gives_text_rollouts() -> None:
    group = await OneProblem().group_rollout(request(TextOnly()))
    for rollout in group:
        assert isinstance(rollout, tr.Rollout)
        assert rollout.trajectory == ["<|user|>\nWhat is 2 + 2?\n<|assistant|>\n4"]
        assert rollout.reward == 1.0
        assert rollout.policy_epoch == [[(0, 3)]]
        assert rollout.num_evictions == [1]


async def test_rollouts_keep_the_completion_its_finish_reason_and_usage_in_extra(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # As the CLI's output rows do, for library users too.
    interface = EmbeddedInference(seed=1, policy=fixed(["4", "5"], [0.5, 0.5]), latency=STEADY)
    token_group = await OneProblem().group_rollout(request(interface, size=4))
    text_group = await OneProblem().group_rollout(request(TextOnly()))
    for rollout in [*token_group, *text_group]:
        assert set(rollout.extra) == {"completion", "finish_reason", "usage"}
        assert rollout.reward == (1.0 if rollout.extra["completion"] == "4" else 0.0)
    assert {r.extra["finish_reason"] for r in token_group} == {"stop"}


async def test_responses_without_token_ids_give_text_rollouts() -> None:
    group = await OneProblem().group_rollout(request(TokensMissing()))
    assert all(isinstance(r, tr.Rollout) and r.trajectory == ["x4"] for r in group)


async def test_completions_are_requested_in_order_so_a_seed_fixes_the_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def draw() -> EmbeddedInference:
        return EmbeddedInference(
            seed=7, policy=fixed(["1", "2", "3", "4"], [0.25] * 4), latency=LatencyModel()
        )

    first = await OneProblem().group_rollout(request(draw(), size=8))
    second = await OneProblem().group_rollout(request(draw(), size=8))
    assert [r.trajectory for r in first] == [r.trajectory for r in second]


async def test_a_reward_that_is_not_finite_names_the_problem() -> None:
    agent = OneProblem(env_id="math", score=lambda problem, text: math.nan)
    with pytest.raises(ValueError, match=r"problem_id='p1' \(env_id='math'\)"):
        await agent.group_rollout(request(TextOnly()))


async def test_a_failing_completion_cancels_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    @attrs.define(eq=False)
    class FailSecond(InferenceInterface, tr.ReturnsRaw):
        calls: int = 0
        finished: int = 0

        async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
            self.calls += 1
            if self.calls == 2:
                raise ConnectionError("boom")
            await trio.sleep(10)
            self.finished += 1
            raise AssertionError("unreachable")

    interface = FailSecond()
    with pytest.raises(ConnectionError, match="boom"):
        await OneProblem().group_rollout(request(interface))
    assert interface.calls == 4
    assert interface.finished == 0


async def test_cancelling_a_group_leaves_no_request_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(policy=fixed(["4"], [1.0]), latency=STEADY)
    with trio.move_on_after(0.5) as scope:
        await OneProblem().group_rollout(request(interface))
    assert scope.cancelled_caught
    # Nothing the group started is still scheduled: the run can go idle at once.
    await trio.testing.wait_all_tasks_blocked()


async def test_logprobs_that_do_not_match_the_generated_tokens_are_an_error() -> None:
    @attrs.define(eq=False)
    class ShortLogprobs(InferenceInterface, tr.ReturnsRaw, tr.ReturnsLogProbs):
        async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
            await trio.lowlevel.checkpoint()
            return InferenceResponse(
                response=tr.ChatMessage(role="assistant", content="4"),
                raw_text="q4",
                token_ids=[1, 2, 3],
                prompt_length=1,
                logprobs=[-0.1],
            )

    with pytest.raises(ValueError, match="1 logprobs for 2 generated tokens"):
        await OneProblem().group_rollout(request(ShortLogprobs()))


async def test_through_the_pipeline_groups_carry_their_slots(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(policy=fixed(["4", "5"], [0.5, 0.5]))
    req = tr.GroupedRolloutRequest(
        num_groups=3, rollouts_per_group=4, inference_interface=interface, enforce_order=True
    )
    async with OneProblem(parallel_generation_tasks=3).get_grouped_rollouts(req) as stream:
        groups = [group async for group in stream]
    assert [(g.batch_id, g.index_in_batch) for g in groups] == [(0, 0), (0, 1), (0, 2)]
    assert all(len(g) == 4 for g in groups)
