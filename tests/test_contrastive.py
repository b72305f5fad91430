"""Preference environments: best-versus-worst contrastive pairs and head-to-head matches."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import trio_rollouts as tr
from trio_rollouts.agents._evaluation import Problem
from trio_rollouts.envs._preference import (
    BestWorstContrastiveGenerator,
    HeadToHeadResult,
    HeadToHeadRolloutGenerator,
)
from trio_rollouts.inference import InferenceInterface, InferenceRequest, InferenceResponse
from trio_rollouts.testing import NullChatInference


@attrs.define(eq=False)
class ListedInterface(InferenceInterface, tr.ReturnsRaw):
    """Answers each prompt's ``k``-th call with ``answers(prompt)[k]`` (cycling), after
    ``latency`` seconds; records requests and calls in flight."""

    answers: Callable[[str], list[str]]
    latency: float = 0.0
    requests: list[InferenceRequest] = attrs.field(factory=list)
    calls_by_prompt: dict[str, int] = attrs.field(factory=dict)
    in_flight: int = 0
    max_in_flight: int = 0

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        self.requests.append(request)
        prompt = request.prompt[-1].content
        k = self.calls_by_prompt.get(prompt, 0)
        self.calls_by_prompt[prompt] = k + 1
        options = self.answers(prompt)
        text = options[k % len(options)]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await trio.sleep(self.latency)
        finally:
            self.in_flight -= 1
        return InferenceResponse(
            response=tr.ChatMessage(role="assistant", content=text),
            raw_text=f"{prompt} -> {text}",
            policy_epoch=[(0, 3)],
            num_evictions=1,
        )


def score_length(problem: Problem, text: str) -> float:
    """Longer answers are better; an answer equal to the reference scores 100."""
    return 100.0 if text == problem.answer else float(len(text))


PROBLEMS = [("p0", "q0", "exact"), ("p1", "q1", "exact"), ("p2", "q2", "exact")]


def rollout_request(interface: InferenceInterface, n: int, **kwargs: Any) -> tr.RolloutRequest:
    return tr.RolloutRequest(num_rollouts=n, inference_interface=interface, **kwargs)


def contrastive(**kwargs: Any) -> BestWorstContrastiveGenerator:
    kwargs.setdefault("problems", PROBLEMS)
    kwargs.setdefault("reward_fn", score_length)
    return BestWorstContrastiveGenerator(**kwargs)


# ------------------------------------------------------------------------ contrastive


async def test_the_best_completion_is_chosen_and_the_worst_rejected() -> None:
    interface = ListedInterface(answers=lambda prompt: ["bb", "a", "exact", "ccc"])
    pairs = await contrastive(samples_per_prompt=4).get_contrastive_rollouts(
        rollout_request(interface, 1)
    )
    assert len(pairs) == 1
    assert pairs[0].chosen_trajectory == ["q0 -> exact"]
    assert pairs[0].rejected_trajectory == ["q0 -> a"]
    assert pairs[0].extra == {
        "problem_id": "p0",
        "env_id": "contrastive",
        "chosen_reward": 100.0,
        "rejected_reward": 1.0,
    }


async def test_a_prompt_whose_completions_tie_gives_no_pair() -> None:
    def answers(prompt: str) -> list[str]:
        return ["xx", "yy"] if prompt == "q1" else ["x", "yy"]

    interface = ListedInterface(answers=answers)
    pairs = await contrastive(samples_per_prompt=2).get_contrastive_rollouts(
        rollout_request(interface, 3)
    )
    assert [p.extra["problem_id"] for p in pairs] == ["p0", "p2"]


async def test_n_samples_per_prompt_are_drawn_concurrently_with_the_request_args(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = ListedInterface(answers=lambda prompt: ["a", "bb", "ccc"], latency=1)
    start = trio.current_time()
    req = rollout_request(interface, 3, generation_args=tr.GenerationArgs(temperature=0.9))
    await contrastive(samples_per_prompt=3).get_contrastive_rollouts(req)
    assert trio.current_time() - start == 1
    assert len(interface.requests) == 9
    assert interface.calls_by_prompt == {"q0": 3, "q1": 3, "q2": 3}
    assert {r.generation_args.temperature for r in interface.requests} == {0.9}


async def test_calls_in_flight_are_bounded(autojump_clock: trio.testing.MockClock) -> None:
    interface = ListedInterface(answers=lambda prompt: ["a", "bb"], latency=1)
    generator = contrastive(samples_per_prompt=4, max_concurrent_requests=5)
    await generator.get_contrastive_rollouts(rollout_request(interface, 3))
    assert interface.max_in_flight == 5


async def test_consecutive_calls_take_consecutive_problems_cycling() -> None:
    interface = ListedInterface(answers=lambda prompt: ["a", "bb"])
    generator = contrastive(samples_per_prompt=2)
    first = await generator.get_contrastive_rollouts(rollout_request(interface, 2))
    second = await generator.get_contrastive_rollouts(rollout_request(interface, 2))
    assert [p.extra["problem_id"] for p in first + second] == ["p0", "p1", "p2", "p0"]


async def test_cancelling_leaves_no_sampling_call_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = ListedInterface(answers=lambda prompt: ["a", "bb"], latency=10)
    with trio.move_on_after(5) as scope:
        await contrastive(samples_per_prompt=4).get_contrastive_rollouts(
            rollout_request(interface, 3)
        )
    assert scope.cancelled_caught
    assert len(interface.requests) == 12
    assert interface.in_flight == 0


async def test_a_non_finite_reward_is_an_error() -> None:
    interface = ListedInterface(answers=lambda prompt: ["a"])
    generator = contrastive(reward_fn=lambda problem, text: math.inf, env_id="prefs")
    with pytest.raises(ValueError, match=r"problem_id='p0' \(env_id='prefs'\)"):
        await generator.get_contrastive_rollouts(rollout_request(interface, 1))


async def test_contrastive_sampling_needs_raw_text() -> None:
    with pytest.raises(TypeError, match="ReturnsRaw"):
        await contrastive().get_contrastive_rollouts(rollout_request(NullChatInference(), 1))


def test_one_sample_per_prompt_cannot_make_a_pair() -> None:
    with pytest.raises(ValueError, match="samples_per_prompt must be >= 2"):
        contrastive(samples_per_prompt=1)


# ------------------------------------------------------------------------ head to head


def fixed(text: str, latency: float = 0.0) -> ListedInterface:
    return ListedInterface(answers=lambda prompt: [text], latency=latency)


def h2h_request(interfaces: list[InferenceInterface], n: int) -> tr.Head2HeadRolloutRequest:
    return tr.Head2HeadRolloutRequest(num_rollouts=n, inference_interface=interfaces)


def head_to_head(**kwargs: Any) -> HeadToHeadRolloutGenerator:
    kwargs.setdefault("problems", PROBLEMS)
    kwargs.setdefault("reward_fn", score_length)
    return HeadToHeadRolloutGenerator(**kwargs)


async def test_the_interface_with_the_highest_reward_wins() -> None:
    interfaces: list[InferenceInterface] = [fixed("aa"), fixed("exact"), fixed("bbbb")]
    results = await head_to_head().get_head2head_rollouts(h2h_request(interfaces, 2))
    assert [r.winner for r in results] == [1, 1]
    assert results[0].rewards == [2.0, 100.0, 4.0]
    assert [r.problem_id for r in results] == ["p0", "p1"]


async def test_a_shared_best_reward_is_a_tie() -> None:
    interfaces: list[InferenceInterface] = [fixed("aa"), fixed("bb"), fixed("c")]
    (result,) = await head_to_head().get_head2head_rollouts(h2h_request(interfaces, 1))
    assert result.winner is None


async def test_each_interface_gets_the_same_prompt_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interfaces = [fixed("a", latency=1), fixed("bb", latency=1)]
    start = trio.current_time()
    await head_to_head().get_head2head_rollouts(h2h_request(list(interfaces), 3))
    assert trio.current_time() - start == 1
    for interface in interfaces:
        assert [r.prompt[-1].content for r in interface.requests] == ["q0", "q1", "q2"]


async def test_per_interface_rollouts_carry_text_reward_and_epochs() -> None:
    interfaces: list[InferenceInterface] = [fixed("a"), fixed("bb")]
    (result,) = await head_to_head(env_id="duel").get_head2head_rollouts(h2h_request(interfaces, 1))
    first, second = result.rollouts
    assert first.trajectory == ["q0 -> a"]
    assert second.trajectory == ["q0 -> bb"]
    assert (first.reward, second.reward) == (1.0, 2.0)
    assert first.env_id == "duel"
    assert first.problem_id == "p0"
    assert first.policy_epoch == [[(0, 3)]]
    assert first.num_evictions == [1]


async def test_cancelling_a_match_leaves_no_call_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interfaces = [fixed("a", latency=10), fixed("bb", latency=10)]
    with trio.move_on_after(1):
        await head_to_head().get_head2head_rollouts(h2h_request(list(interfaces), 3))
    assert all(i.in_flight == 0 for i in interfaces)
    assert sum(len(i.requests) for i in interfaces) == 6


async def test_every_interface_must_return_raw_text() -> None:
    interfaces: list[InferenceInterface] = [fixed("a"), NullChatInference()]
    with pytest.raises(TypeError, match=r"inference_interface\[1\] must return raw text"):
        await head_to_head().get_head2head_rollouts(h2h_request(interfaces, 1))


def test_a_winner_must_be_an_interface_index() -> None:
    rollout = tr.Rollout(trajectory=["x"], reward=1.0)
    with pytest.raises(ValueError, match=r"winner must be in \[0, 1\), got 1"):
        HeadToHeadResult(problem_id="p", rollouts=[rollout], winner=1)
