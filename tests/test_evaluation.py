"""Evaluation: pass@k, sharding by rank, merging ranks, and the pass@k agent."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_rollouts as tr
from trio_rollouts.agents._evaluation import (
    PassAtKEvaluationAgent,
    PassAtKEvaluationResponse,
    PassAtKResult,
    merge_evaluation_responses,
    pass_at_k,
    shard_indices,
)
from trio_rollouts.agents._multitask import WeightedMultiTask, WeightedTask
from trio_rollouts.inference import InferenceInterface, InferenceRequest, InferenceResponse
from trio_rollouts.models import Problem
from trio_rollouts.models._convert import structure, unstructure
from trio_rollouts.testing import ScriptedAgent, rollouts

# ------------------------------------------------------------------------ pass@k


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 80).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))
    )
)
def test_pass_at_k_is_the_unbiased_estimator(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-12)


def test_pass_at_k_known_values() -> None:
    assert pass_at_k(1, 1, 1) == 1.0
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(2, 1, 1) == 0.5
    assert pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong samples: always a correct one
    assert pass_at_k(np.int64(4), np.int64(1), np.int64(2)) == 0.5


def test_pass_at_k_is_stable_for_large_n() -> None:
    n, c, k = 200_000, 3, 50
    value = pass_at_k(n, c, k)
    assert value == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-9)
    assert 0 < value < 1


@pytest.mark.parametrize(
    ("n", "c", "k", "match"),
    [
        (0, 0, 1, "n .* must be >= 1, got n=0"),
        (5, 6, 1, r"c .* must be in \[0, n=5\], got c=6"),
        (5, -1, 1, r"c .* must be in \[0, n=5\], got c=-1"),
        (5, 2, 0, r"k must be in \[1, n=5\], got k=0"),
        (5, 2, 6, r"k must be in \[1, n=5\], got k=6"),
        (5.0, 2, 1, "n must be an int, got float 5.0"),
        (5, True, 1, "c must be an int, got bool True"),
        (5, 2, "1", "k must be an int, got str '1'"),
    ],
)
def test_pass_at_k_checks_its_inputs(n: Any, c: Any, k: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


# ------------------------------------------------------------------------ sharding


def test_shards_are_contiguous_blocks_with_the_extra_prompts_first() -> None:
    assert [shard_indices(10, (r, 3)) for r in range(3)] == [range(4), range(4, 7), range(7, 10)]
    assert shard_indices(10, None) == range(10)
    assert [len(shard_indices(2, (r, 4))) for r in range(4)] == [1, 1, 0, 0]


@given(num_prompts=st.integers(0, 200), world=st.integers(1, 16))
def test_shards_cover_every_prompt_once_in_order(num_prompts: int, world: int) -> None:
    shards = [shard_indices(num_prompts, (rank, world)) for rank in range(world)]
    assert [i for shard in shards for i in shard] == list(range(num_prompts))
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("rank_info", [(3, 3), (-1, 2), (0, 0), (0,), "0,1", (0.0, 1)])
def test_a_bad_rank_info_is_rejected(rank_info: Any) -> None:
    with pytest.raises(ValueError, match="rank_info"):
        shard_indices(5, rank_info)


def test_a_negative_prompt_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_prompts must be an int >= 0, got -1"):
        shard_indices(-1, None)


# ------------------------------------------------------------------------ a scripted model


def correct_sample(prompt: str, k: int) -> bool:
    return (sum(map(ord, prompt)) + k) % 3 == 0


@attrs.define(eq=False)
class AnsweringInterface(InferenceInterface, tr.ReturnsRaw):
    """Answers ``"right"`` or ``"wrong"``: the ``k``-th sampled call for a prompt is right
    when ``correct_sample(prompt, k)``; a greedy call (temperature 0.0) is right when
    the prompt ends in an even digit. Records requests and calls in flight."""

    latency: float = 0.0
    error_on_call: int | None = None
    requests: list[InferenceRequest] = attrs.field(factory=list)
    sampled: dict[str, int] = attrs.field(factory=dict)
    in_flight: int = 0
    max_in_flight: int = 0
    exited: int = 0

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        self.requests.append(request)
        call = len(self.requests)
        prompt = request.prompt[-1].content
        if request.generation_args.temperature == 0.0:
            right = int(prompt[-1]) % 2 == 0
        else:
            k = self.sampled.get(prompt, 0)
            self.sampled[prompt] = k + 1
            right = correct_sample(prompt, k)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await trio.sleep(self.latency)
            if call == self.error_on_call:
                raise ConnectionError("model server went away")
        finally:
            self.in_flight -= 1
            self.exited += 1
        text = "right" if right else "wrong"
        return InferenceResponse(
            response=tr.ChatMessage(role="assistant", content=text), raw_text=prompt + text
        )


PROBLEMS = [(f"p{i}", f"question {i}", "right") for i in range(20)]


def reward(problem: Problem, response: str) -> float:
    return 1.0 if response == problem.answer else 0.0


def agent(**kwargs: Any) -> PassAtKEvaluationAgent:
    kwargs.setdefault("problems", PROBLEMS)
    kwargs.setdefault("reward_fn", reward)
    return PassAtKEvaluationAgent(**kwargs)


def eval_request(
    interface: InferenceInterface, num_prompts: int, **kwargs: Any
) -> tr.EvaluationRequest:
    return tr.EvaluationRequest(inference_interface=interface, num_prompts=num_prompts, **kwargs)


# ------------------------------------------------------------------------ the agent


async def test_each_prompt_gets_n_samples_and_one_greedy_call() -> None:
    interface = AnsweringInterface()
    await agent(n=4, k=2).run_evaluation(eval_request(interface, 3))
    temperatures = [r.generation_args.temperature for r in interface.requests]
    assert len(temperatures) == 3 * 5
    assert temperatures.count(0.0) == 3


async def test_the_greedy_call_sends_temperature_zero_and_keeps_the_other_args() -> None:
    interface = AnsweringInterface()
    evaluator = agent(n=2, k=1, sampling_args=tr.GenerationArgs(temperature=1.0, top_k=40))
    req = eval_request(
        interface, 1, generation_args=tr.GenerationArgs(max_tokens=64, temperature=0.7)
    )
    await evaluator.run_evaluation(req)
    args = sorted((r.generation_args for r in interface.requests), key=lambda a: a.temperature or 0)
    assert args == [
        tr.GenerationArgs(temperature=0.0, top_k=40, max_tokens=64),
        tr.GenerationArgs(temperature=0.7, top_k=40, max_tokens=64),
        tr.GenerationArgs(temperature=0.7, top_k=40, max_tokens=64),
    ]


async def test_without_greedy_no_temperature_zero_call_is_made() -> None:
    interface = AnsweringInterface()
    response = await agent(n=3, greedy=False).run_evaluation(eval_request(interface, 2))
    assert all(r.generation_args.temperature != 0.0 for r in interface.requests)
    assert all(r.greedy_correct is None for r in response.results)
    assert "greedy_accuracy" not in response.metrics()


async def test_results_count_correct_samples_per_prompt_in_prompt_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = AnsweringInterface(latency=1)
    response = await agent(n=5, k=3).run_evaluation(eval_request(interface, 6))
    assert [r.problem_id for r in response.results] == [f"p{i}" for i in range(6)]
    for i, result in enumerate(response.results):
        prompt = f"question {i}"
        expected = [1.0 if correct_sample(prompt, k) else 0.0 for k in range(5)]
        assert result.sample_rewards == expected
        assert len(result.sample_responses) == 5
        assert [r == "right" for r in result.sample_responses] == [e == 1.0 for e in expected]
        assert (result.n, result.c) == (5, sum(expected))
        assert result.greedy_correct == (i % 2 == 0)
        assert result.response == ("right" if i % 2 == 0 else "wrong")
        assert result.reward == (1.0 if i % 2 == 0 else 0.0)


async def test_metrics_average_pass_at_1_to_k_over_prompts() -> None:
    response = await agent(n=5, k=3).run_evaluation(eval_request(AnsweringInterface(), 6))
    metrics = response.metrics()
    for j in (1, 2, 3):
        expected = np.mean([pass_at_k(r.n, r.c, j) for r in response.results])
        assert metrics[f"pass@{j}"] == pytest.approx(expected)
    assert "pass@4" not in metrics
    assert metrics["greedy_accuracy"] == 0.5
    assert metrics["num_prompts"] == 6.0


def test_metrics_of_no_prompts_report_only_the_count() -> None:
    assert PassAtKEvaluationResponse(env_id="e", results=[], k=2).metrics() == {"num_prompts": 0.0}


async def test_calls_run_concurrently_up_to_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = AnsweringInterface(latency=1)
    start = trio.current_time()
    await agent(n=4, max_concurrent_requests=7).run_evaluation(eval_request(interface, 7))
    assert interface.max_in_flight == 7
    assert trio.current_time() - start == math.ceil(7 * 5 / 7)


async def test_cancelling_mid_evaluation_leaves_no_call_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = AnsweringInterface(latency=1)
    task = trio.lowlevel.current_task()
    nurseries = len(task.child_nurseries)
    with trio.move_on_after(2.5) as scope:
        await agent(n=4, max_concurrent_requests=5).run_evaluation(eval_request(interface, 10))
    assert scope.cancelled_caught
    assert interface.in_flight == 0
    assert interface.exited == len(interface.requests) == 15
    assert len(task.child_nurseries) == nurseries


async def test_a_failing_call_cancels_the_others_and_propagates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = AnsweringInterface(latency=1, error_on_call=3)
    with pytest.raises(ConnectionError, match="went away"):
        await agent(n=2, max_concurrent_requests=4).run_evaluation(eval_request(interface, 5))
    assert interface.in_flight == 0


async def test_a_non_finite_reward_is_an_error_naming_the_problem() -> None:
    evaluator = agent(reward_fn=lambda problem, text: math.nan, env_id="math")
    with pytest.raises(ValueError, match=r"returned nan for problem_id='p0' \(env_id='math'\)"):
        await evaluator.run_evaluation(eval_request(AnsweringInterface(), 1))


async def test_an_async_reward_function_and_a_bool_verdict_work() -> None:
    async def verify(problem: Problem, text: str) -> bool:
        await trio.lowlevel.checkpoint()
        return text == problem.answer

    sync = await agent(n=3).run_evaluation(eval_request(AnsweringInterface(), 4))
    verdicts = await agent(n=3, reward_fn=verify).run_evaluation(
        eval_request(AnsweringInterface(), 4)
    )
    assert verdicts.results == sync.results


async def test_problems_may_come_from_a_function_of_the_index() -> None:
    def problem(i: int) -> tuple[str, str, str]:
        return (f"gen{i}", f"question {i}", "right")

    response = await agent(problems=problem).run_evaluation(eval_request(AnsweringInterface(), 3))
    assert [r.problem_id for r in response.results] == ["gen0", "gen1", "gen2"]


async def test_more_prompts_than_problems_is_rejected_before_any_call() -> None:
    interface = AnsweringInterface()
    with pytest.raises(ValueError, match=r"num_prompts \(21\) exceeds the 20 problems"):
        await agent().run_evaluation(eval_request(interface, 21))
    assert interface.requests == []


def test_k_above_n_is_rejected() -> None:
    with pytest.raises(ValueError, match="k must be <= n"):
        agent(n=2, k=3)


def test_a_malformed_problem_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"problems\[0\] must be a Problem"):
        agent(problems=[("only", "two")])
    with pytest.raises(ValueError, match="problems must not be empty"):
        agent(problems=[])


async def test_the_response_round_trips_as_its_registered_class() -> None:
    response = await agent(n=3, k=2).run_evaluation(eval_request(AnsweringInterface(), 3))
    data = unstructure(response)
    assert data["type_name"] == "PassAtKEvaluationResponse"
    back = structure(data, tr.EvaluationResponse)
    assert isinstance(back, PassAtKEvaluationResponse)
    assert all(isinstance(r, PassAtKResult) for r in back.results)
    assert back == response


# ------------------------------------------------------------------------ merging ranks


async def test_merged_shards_equal_the_unsharded_run_for_every_world_size() -> None:
    evaluator = agent(n=4, k=3)
    for num_prompts in (0, 1, 3, 7, 13):
        whole = await evaluator.run_evaluation(eval_request(AnsweringInterface(), num_prompts))
        for world in range(1, 9):
            shards = [
                await evaluator.run_evaluation(
                    eval_request(AnsweringInterface(), num_prompts, rank_info=(rank, world))
                )
                for rank in range(world)
            ]
            merged = merge_evaluation_responses(shards)
            assert merged == whole, (num_prompts, world)
            assert merged.metrics() == whole.metrics()


def test_merging_responses_of_different_environments_is_rejected() -> None:
    a = PassAtKEvaluationResponse(env_id="a", results=[], k=1)
    b = PassAtKEvaluationResponse(env_id="b", results=[], k=1)
    with pytest.raises(ValueError, match=r"disagree on env_id: responses\[0\] has 'a'"):
        merge_evaluation_responses([a, b])


def test_merging_responses_of_different_classes_is_rejected() -> None:
    a = PassAtKEvaluationResponse(env_id="a", results=[], k=1)
    b = tr.EvaluationResponse(env_id="a", results=[])
    with pytest.raises(ValueError, match=r"responses\[1\] is a EvaluationResponse"):
        merge_evaluation_responses([a, b])


def test_merging_nothing_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one response"):
        merge_evaluation_responses([])


# ------------------------------------------------------------------------ in a mixture


async def test_a_pass_at_k_environment_is_evaluated_by_a_mixture() -> None:
    async def group(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.lowlevel.checkpoint()
        return rollouts([0.0, 1.0])

    multi = WeightedMultiTask(
        tasks=[
            WeightedTask(ScriptedAgent(script=group), 1, env_id="train"),
            WeightedTask(agent(n=2, k=2, env_id="math"), 0, evaluation_only=True),
        ]
    )
    response = await multi.run_evaluation(eval_request(AnsweringInterface(), 4))
    assert list(response.responses) == ["math"]
    assert set(response.metrics()) == {
        "math/pass@1",
        "math/pass@2",
        "math/greedy_accuracy",
        "math/num_prompts",
    }


async def test_merging_checks_ranks_and_takes_them_in_any_order() -> None:
    evaluator = agent(n=4, k=3)
    whole = await evaluator.run_evaluation(eval_request(AnsweringInterface(), 7))
    shards = [
        await evaluator.run_evaluation(eval_request(AnsweringInterface(), 7, rank_info=(rank, 3)))
        for rank in range(3)
    ]
    assert [s.rank_info for s in shards] == [(0, 3), (1, 3), (2, 3)]
    assert merge_evaluation_responses(shards[::-1]) == whole
    with pytest.raises(ValueError, match=r"missing rank\(s\) 1 of world_size 3"):
        merge_evaluation_responses([shards[0], shards[2]])
    with pytest.raises(ValueError, match=r"responses\[0\] and responses\[2\] are both rank 0"):
        merge_evaluation_responses([shards[0], shards[1], shards[0]])
    other = await evaluator.run_evaluation(eval_request(AnsweringInterface(), 7, rank_info=(1, 2)))
    with pytest.raises(ValueError, match=r"responses\[1\] is a rank of world_size 2"):
        merge_evaluation_responses([shards[0], other])
    with pytest.raises(ValueError, match=r"responses\[1\] has no rank_info"):
        merge_evaluation_responses([shards[0], whole])


async def test_one_rank_of_two_is_not_a_whole_evaluation() -> None:
    # The silent case this check exists for: num_prompts 6 from one rank of two.
    evaluator = agent(n=2, k=1)
    shard = await evaluator.run_evaluation(eval_request(AnsweringInterface(), 12, rank_info=(0, 2)))
    with pytest.raises(ValueError, match=r"missing rank\(s\) 1 of world_size 2"):
        merge_evaluation_responses([shard])
