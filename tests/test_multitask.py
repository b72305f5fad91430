"""Weighted multi-task mixing: WeightedTask, WeightedMultiTask and the weighted split."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from _fakes import request
from hypothesis import given, settings
from hypothesis import strategies as st

import trio_rollouts as tr
from trio_rollouts.agents._multitask import (
    MultiTaskEvaluationResponse,
    WeightedMultiTask,
    WeightedTask,
    _SlotSchedule,
    _WeightedSequence,
    batch_splits,
)
from trio_rollouts.models._convert import structure, unstructure
from trio_rollouts.testing import NullInference, ScriptedAgent, rollouts


async def instant(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
    await trio.lowlevel.checkpoint()
    return [tr.Rollout(trajectory=["x"], reward=r) for r in (0.0, 1.0)]  # env_id left empty


async def forever(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


def env(script=instant, **kwargs: Any) -> ScriptedAgent:  # type: ignore[no-untyped-def]
    return ScriptedAgent(script=script, **kwargs)


def mixture(
    weights: dict[str, float], script=instant, **kwargs: Any
) -> tuple[WeightedMultiTask, dict[str, ScriptedAgent]]:  # type: ignore[no-untyped-def]
    agents = {env_id: env(script) for env_id in weights}
    tasks = [WeightedTask(agents[e], w, env_id=e) for e, w in weights.items()]
    return WeightedMultiTask(tasks=tasks, **kwargs), agents


def envs_by_batch(groups: list[tr.RolloutGroup]) -> dict[int, Counter[str]]:
    out: dict[int, Counter[str]] = {}
    for group in groups:
        out.setdefault(group.batch_id, Counter())[group[0].env_id] += 1
    return out


# ------------------------------------------------------------------------ construction


@pytest.mark.parametrize(
    ("weight", "shown"), [(-1, "-1"), (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")]
)
def test_a_negative_or_non_finite_weight_is_rejected(weight: float, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"weight must be a finite number >= 0.*got {shown}"):
        WeightedTask(env(), weight)


@pytest.mark.parametrize("weight", ["1", True, None])
def test_a_weight_that_is_not_a_number_is_a_type_error(weight: object) -> None:
    with pytest.raises(TypeError, match="weight must be a finite number"):
        WeightedTask(env(), weight)  # type: ignore[arg-type]


def test_no_positive_weight_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"at least one positive weight.*'a': 0, 'b': 2"):
        WeightedMultiTask(
            tasks=[
                WeightedTask(env(), 0, env_id="a"),
                WeightedTask(env(), 2, env_id="b", evaluation_only=True),
            ]
        )


def test_duplicate_env_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"tasks\[1\] has env_id 'ScriptedAgent', already used"):
        WeightedMultiTask(tasks=[WeightedTask(env(), 1), WeightedTask(env(), 1)])


def test_no_tasks_is_rejected() -> None:
    with pytest.raises(ValueError, match="tasks must not be empty"):
        WeightedMultiTask(tasks=[])


def test_tasks_must_be_weighted_tasks() -> None:
    with pytest.raises(TypeError, match=r"tasks\[0\] must be a WeightedTask"):
        WeightedMultiTask(tasks=[env()])  # type: ignore[list-item]


def test_a_working_task_needs_a_grouped_agent() -> None:
    @attrs.define
    class OnlyEvaluates(tr.EvaluationAgent):
        async def run_evaluation(self, request: tr.EvaluationRequest) -> Any:
            raise NotImplementedError

    with pytest.raises(TypeError, match="not a GroupedRolloutGenerator"):
        WeightedTask(OnlyEvaluates(), 1)
    WeightedTask(OnlyEvaluates(), 1, evaluation_only=True)
    WeightedTask(OnlyEvaluates(), 0)


def test_env_id_defaults_to_the_agents_env_id_then_its_class_name() -> None:
    @attrs.define
    class Named(tr.GroupedRolloutGenerator):
        env_id: str = "math"

        async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
            raise NotImplementedError

    assert WeightedTask(Named(), 1).env_id == "math"
    assert WeightedTask(env(), 1).env_id == "ScriptedAgent"
    assert WeightedTask(Named(), 1, env_id="algebra").env_id == "algebra"
    with pytest.raises(ValueError, match="env_id must be a non-empty str"):
        WeightedTask(env(), 1, env_id="")


def test_tasks_cannot_be_replaced_after_construction() -> None:
    multi, _ = mixture({"a": 1})
    with pytest.raises(attrs.exceptions.FrozenAttributeError):
        multi.tasks = ()


def test_a_mixture_is_a_grouped_generator_and_an_evaluation_agent() -> None:
    multi, _ = mixture({"a": 1})
    assert isinstance(multi, tr.GroupedRolloutGenerator)
    assert isinstance(multi, tr.EvaluationAgent)
    assert multi.parallel_generation_tasks == 512


# ------------------------------------------------------------------------ the split


def test_weights_three_to_one_give_three_and_one_in_every_batch() -> None:
    assert batch_splits([3, 1], num_groups=4, num_batches=50) == [[3, 1]] * 50


def test_decimal_weights_are_exact_ratios() -> None:
    assert batch_splits([0.3, 0.1], num_groups=4, num_batches=50) == [[3, 1]] * 50


def test_weights_six_to_four_with_two_groups_serve_both() -> None:
    splits = batch_splits([0.6, 0.4], num_groups=2, num_batches=5)
    assert splits[0] == [1, 1]
    assert [sum(s[i] for s in splits) for i in range(2)] == [6, 4]


def test_two_equal_environments_with_one_group_alternate() -> None:
    assert batch_splits([1, 1], num_groups=1, num_batches=6) == [[1, 0], [0, 1]] * 3


def test_a_share_that_floors_to_zero_is_still_served() -> None:
    splits = batch_splits([1, 99], num_groups=4, num_batches=25)
    assert sum(s[0] for s in splits) == 1  # 25 batches * 4 groups / 100


def test_batch_splits_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match=r"weights\[1\] must be a finite number >= 0"):
        batch_splits([1, -2], num_groups=1, num_batches=1)
    with pytest.raises(ValueError, match="at least one positive weight"):
        batch_splits([0, 0], num_groups=1, num_batches=1)
    with pytest.raises(ValueError, match="num_groups must be an int >= 1, got 0"):
        batch_splits([1], num_groups=0, num_batches=1)


def test_zero_weights_get_nothing() -> None:
    splits = batch_splits([0, 2, 0, 1], num_groups=3, num_batches=10)
    assert all(s[0] == 0 and s[2] == 0 for s in splits)


weights_lists = st.lists(
    st.one_of(
        st.integers(0, 20),
        st.sampled_from([0.1, 0.2, 0.3, 0.6, 0.4, 1e-3, 0.25]),
        st.floats(0, 100, allow_nan=False, allow_infinity=False),
    ),
    min_size=1,
    max_size=8,
).filter(lambda ws: any(w > 0 for w in ws))


@settings(max_examples=300, deadline=None)
@given(weights=weights_lists, num_groups=st.integers(1, 9), num_batches=st.integers(1, 60))
def test_every_count_stays_within_one_group_of_its_exact_share(
    weights: list[float], num_groups: int, num_batches: int
) -> None:
    exact = [Fraction(w) if isinstance(w, int) else Fraction(repr(w)) for w in weights]
    total = sum(exact)
    counts = [0] * len(weights)
    for b, split in enumerate(batch_splits(weights, num_groups, num_batches), start=1):
        assert sum(split) == num_groups
        assert min(split) >= 0
        for i, n in enumerate(split):
            counts[i] += n
            target = b * num_groups * exact[i] / total
            assert abs(counts[i] - target) < 1  # so also within one batch, as promised
            if exact[i] == 0:
                assert counts[i] == 0


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    num_groups=st.integers(1, 5),
    window=st.integers(1, 4),
    queries=st.lists(st.integers(0, 40), max_size=60),
)
def test_a_slot_schedule_answers_in_any_query_order(
    weights: list[int], num_groups: int, window: int, queries: list[int]
) -> None:
    reference = _SlotSchedule(weights, num_groups, window=1000)
    expected = {b: reference.batch(b) for b in range(41)}
    schedule = _SlotSchedule(weights, num_groups, window=window)
    for b in queries:
        assert schedule.batch(b) == expected[b]


def test_a_straggler_far_behind_the_window_is_replayed_from_a_checkpoint() -> None:
    reference = _SlotSchedule([3, 2, 2], 1, window=100_000)
    schedule = _SlotSchedule([3, 2, 2], 1, window=2)
    schedule.batch(20_000)
    assert schedule.batch(9_000) == reference.batch(9_000)
    assert schedule.batch(9_001) == reference.batch(9_001)


def test_the_weighted_sequence_tracks_the_weights_at_every_unit() -> None:
    sequence = _WeightedSequence([5, 3, 1])
    for t in range(1, 1000):
        sequence.next()
        for count, w in zip(sequence.counts(), (5, 3, 1), strict=True):
            assert abs(count - Fraction(t * w, 9)) < 1


# ------------------------------------------------------------------------ the pipeline


async def test_each_batch_is_split_by_weight() -> None:
    multi, _ = mixture({"a": 3, "b": 1}, parallel_generation_tasks=8)
    req = request(num_groups=4, streaming=True, enforce_order=True)
    async with multi.get_grouped_rollouts(req) as stream:
        groups = [await stream.receive() for _ in range(4 * 10)]
    assert all(c == Counter(a=3, b=1) for c in envs_by_batch(groups).values())


async def test_non_streaming_yields_one_batch_split_by_weight() -> None:
    multi, agents = mixture({"a": 3, "b": 1}, parallel_generation_tasks=4)
    async with multi.get_grouped_rollouts(request(num_groups=4)) as stream:
        groups = [g async for g in stream]
    assert envs_by_batch(groups) == {0: Counter(a=3, b=1)}
    assert (agents["a"].calls, agents["b"].calls) == (3, 1)


async def test_six_to_four_with_two_groups_serves_both_environments() -> None:
    multi, _ = mixture({"a": 0.6, "b": 0.4}, parallel_generation_tasks=2)
    req = request(num_groups=2, streaming=True)
    async with multi.get_grouped_rollouts(req) as stream:
        groups = [await stream.receive() for _ in range(20)]
    assert Counter(g[0].env_id for g in groups) == Counter(a=12, b=8)


async def test_two_environments_with_one_group_alternate() -> None:
    multi, _ = mixture({"a": 1, "b": 1}, parallel_generation_tasks=1)
    async with multi.get_grouped_rollouts(request(num_groups=1, streaming=True)) as stream:
        seen = [(await stream.receive())[0].env_id for _ in range(6)]
    assert seen == ["a", "b"] * 3


async def test_zero_weight_and_evaluation_only_tasks_get_no_work() -> None:
    a, idle, watcher = env(), env(), env()
    multi = WeightedMultiTask(
        tasks=[
            WeightedTask(a, 1, env_id="a"),
            WeightedTask(idle, 0, env_id="idle"),
            WeightedTask(watcher, 5, env_id="watcher", evaluation_only=True),
        ],
        parallel_generation_tasks=4,
    )
    async with multi.get_grouped_rollouts(request(num_groups=2, streaming=True)) as stream:
        groups = [await stream.receive() for _ in range(10)]
    assert {g[0].env_id for g in groups} == {"a"}
    assert (idle.calls, watcher.calls) == (0, 0)


async def test_a_rollout_with_an_env_id_keeps_it() -> None:
    async def labelled(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.lowlevel.checkpoint()
        return rollouts([0.0, 1.0], env_id="own")

    multi, _ = mixture({"a": 1}, script=labelled)
    async with multi.get_grouped_rollouts(request()) as stream:
        (group,) = [g async for g in stream]
    assert [r.env_id for r in group] == ["own", "own"]


async def test_a_returned_rolloutgroup_is_stamped_too() -> None:
    @attrs.define
    class GroupReturning(tr.GroupedRolloutGenerator):
        async def group_rollout(self, request: tr.GroupedRolloutRequest) -> tr.RolloutGroup:
            await trio.lowlevel.checkpoint()
            return tr.RolloutGroup(rollouts=[tr.Rollout(trajectory=["x"], reward=1.0)])

    multi = WeightedMultiTask(tasks=[WeightedTask(GroupReturning(), 1, env_id="g")])
    async with multi.get_grouped_rollouts(request()) as stream:
        (group,) = [g async for g in stream]
    assert group[0].env_id == "g"


def fail_in_env_b(exc: Exception):  # type: ignore[no-untyped-def]
    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(1)
        raise exc

    return script


async def test_a_failing_sub_agent_reaches_the_consumer_as_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = env(), env(fail_in_env_b(ValueError("bad env")))
    multi = WeightedMultiTask(
        tasks=[WeightedTask(a, 1, env_id="a"), WeightedTask(b, 1, env_id="b")],
        parallel_generation_tasks=4,
    )
    taken = 0
    with pytest.raises(ValueError, match="bad env") as info:
        async with multi.get_grouped_rollouts(request(num_groups=2, streaming=True)) as stream:
            async for _ in stream:
                taken += 1
    assert any("environment 'b'" in note for note in info.value.__notes__)
    assert a.in_flight == b.in_flight == 0


async def test_a_failing_sub_agent_is_counted_as_failed_in_its_environment(
    autojump_clock: trio.testing.MockClock,
) -> None:
    multi = WeightedMultiTask(
        tasks=[
            WeightedTask(env(forever), 1, env_id="a"),
            WeightedTask(env(fail_in_env_b(KeyError("k"))), 1, env_id="b"),
        ],
        parallel_generation_tasks=2,
    )
    with pytest.raises(KeyError):
        async with multi.get_grouped_rollouts(request(num_groups=2)) as stream:
            try:
                await stream.receive()
            finally:
                stats = stream.statistics()
    assert stats.per_env["b"].failed == 1
    assert stats.per_env["a"].failed == 0


def alternating_rewards(identical: Counter[int]):  # type: ignore[no-untyped-def]
    """Odd calls of each agent give identical rewards (filtered), even ones distinct;
    ``identical[id(agent)]`` counts the identical groups each agent returned."""

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        n = agent.calls
        await trio.sleep(1 + n % 3)
        if n % 2:
            identical[id(agent)] += 1
            return [tr.Rollout(trajectory=["x"], reward=1.0) for _ in range(2)]
        return [tr.Rollout(trajectory=["x"], reward=r) for r in (0.0, 1.0)]

    return script


async def test_streaming_enforce_order_and_filtering_work_through_the_mixture(
    autojump_clock: trio.testing.MockClock,
) -> None:
    identical: Counter[int] = Counter()
    multi, agents = mixture(
        {"a": 2, "b": 1}, script=alternating_rewards(identical), parallel_generation_tasks=6
    )
    req = request(
        num_groups=3, streaming=True, enforce_order=True, filter_groups_with_same_reward=True
    )
    with trio.fail_after(10_000):
        async with multi.get_grouped_rollouts(req) as stream:
            groups = [await stream.receive() for _ in range(3 * 8)]
            stats = stream.statistics()
            calls = {env_id: agent.calls for env_id, agent in agents.items()}
            filtered = {env_id: identical[id(agent)] for env_id, agent in agents.items()}
    assert [(g.batch_id, g.index_in_batch) for g in groups] == [
        (b, i) for b in range(8) for i in range(3)
    ]
    assert all(g.reward_std() > 1e-6 for g in groups)
    # Regenerations stay in their slot's environment, so every batch keeps its 2:1 split.
    assert all(c == Counter(a=2, b=1) for c in envs_by_batch(groups).values())
    for env_id in ("a", "b"):
        assert stats.per_env[env_id].started == calls[env_id]
        assert stats.per_env[env_id].filtered == filtered[env_id] > 0
    assert stats.per_env["a"].delivered == 16
    assert stats.per_env["b"].delivered == 8


async def test_per_environment_statistics_add_up() -> None:
    multi, _ = mixture({"a": 3, "b": 1}, parallel_generation_tasks=4)
    async with multi.get_grouped_rollouts(request(num_groups=4)) as stream:
        await trio.testing.wait_all_tasks_blocked()
        stream.drain(2)
        stats = stream.statistics()
    assert set(stats.per_env) == {"a", "b"}
    assert stats.per_env["a"].started == 3
    assert stats.per_env["b"].started == 1
    assert sum(e.delivered for e in stats.per_env.values()) == stats.delivered == 2
    assert sum(e.failed + e.filtered for e in stats.per_env.values()) == 0


async def test_calls_in_flight_over_all_environments_never_exceed_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(1 + agent.calls % 3)
        return [tr.Rollout(trajectory=["x"], reward=r) for r in (0.0, 1.0)]

    multi, agents = mixture({"a": 1, "b": 2, "c": 3}, script=slow, parallel_generation_tasks=6)
    async with multi.get_grouped_rollouts(request(num_groups=3, streaming=True)) as stream:
        for _ in range(60):
            await stream.receive()
            assert sum(a.in_flight for a in agents.values()) <= 6
            assert stream.statistics().in_flight <= 6


async def test_leaving_early_cancels_every_sub_agent_call() -> None:
    multi, agents = mixture({"a": 1, "b": 1}, script=forever, parallel_generation_tasks=8)
    async with multi.get_grouped_rollouts(request(num_groups=4, streaming=True)):
        await trio.testing.wait_all_tasks_blocked()
        assert sum(a.in_flight for a in agents.values()) == 8
    assert sum(a.in_flight for a in agents.values()) == 0
    assert all(a.exited == a.calls for a in agents.values())


async def test_the_mixture_checks_the_request_before_any_work() -> None:
    multi, agents = mixture({"a": 1}, parallel_generation_tasks=1)
    with pytest.raises(ValueError, match="parallel_generation_tasks"):
        multi.get_grouped_rollouts(request(num_groups=2))
    assert agents["a"].calls == 0


async def test_group_rollout_on_the_mixture_follows_the_weights_over_calls() -> None:
    multi, _ = mixture({"a": 2, "b": 1})
    req = request()
    seen = [(await multi.group_rollout(req))[0].env_id for _ in range(9)]
    assert Counter(seen) == Counter(a=6, b=3)
    assert seen[:3] == ["a", "a", "b"]


async def test_a_mixture_can_be_a_task_of_another_mixture() -> None:
    inner, _ = mixture({"x": 1, "y": 1})
    outer = WeightedMultiTask(
        tasks=[WeightedTask(env(), 1, env_id="plain"), WeightedTask(inner, 2, env_id="inner")],
        parallel_generation_tasks=3,
    )
    async with outer.get_grouped_rollouts(
        request(num_groups=3, streaming=True, enforce_order=True)
    ) as stream:
        groups = [await stream.receive() for _ in range(12)]
        stats = stream.statistics()
    assert Counter(g[0].env_id for g in groups) == Counter(plain=4, x=4, y=4)
    assert set(stats.per_env) == {"plain", "inner"}


# ------------------------------------------------------------------------ evaluation


@attrs.define(kw_only=True)
class MultitaskTestResponse(tr.EvaluationResponse[tr.RewardEvaluationResult]):
    def metrics(self) -> dict[str, float]:
        return {"mean_reward": float(sum(r.reward for r in self.results) / len(self.results))}


@attrs.define(kw_only=True)
class Evaluating(tr.GroupedRolloutGenerator, tr.EvaluationAgent):
    name: str
    seconds: float = 1.0
    error: Exception | None = None
    requests: list[tr.EvaluationRequest] = attrs.field(factory=list)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.lowlevel.checkpoint()
        return [tr.Rollout(trajectory=["x"], reward=r) for r in (0.0, 1.0)]

    async def run_evaluation(self, request: tr.EvaluationRequest) -> MultitaskTestResponse:
        self.requests.append(request)
        await trio.sleep(self.seconds)
        if self.error is not None:
            raise self.error
        result = tr.RewardEvaluationResult(prompt="p", response=self.name, reward=self.seconds)
        return MultitaskTestResponse(env_id=self.name, results=[result])


def eval_request(**kwargs: Any) -> tr.EvaluationRequest:
    return tr.EvaluationRequest(inference_interface=NullInference(), num_prompts=4, **kwargs)


async def test_run_evaluation_returns_one_response_per_evaluating_environment(
    autojump_clock: trio.testing.MockClock,
) -> None:
    multi = WeightedMultiTask(
        tasks=[
            WeightedTask(Evaluating(name="a", seconds=3), 1, env_id="a"),
            WeightedTask(env(), 1, env_id="no_eval"),
            WeightedTask(Evaluating(name="b", seconds=2), 0, env_id="b"),
            WeightedTask(Evaluating(name="c", seconds=1), 1, env_id="c", evaluation_only=True),
        ]
    )
    start = trio.current_time()
    response = await multi.run_evaluation(eval_request(rank_info=(1, 2)))
    assert trio.current_time() - start == 3  # concurrently
    assert list(response.responses) == ["a", "b", "c"]  # non-evaluating tasks are skipped
    assert response.responses["b"].results[0].response == "b"
    assert response.metrics() == {
        "a/mean_reward": 3.0,
        "b/mean_reward": 2.0,
        "c/mean_reward": 1.0,
    }


async def test_run_evaluation_passes_the_request_to_every_environment() -> None:
    a, b = Evaluating(name="a", seconds=0), Evaluating(name="b", seconds=0)
    multi = WeightedMultiTask(
        tasks=[WeightedTask(a, 1, env_id="a"), WeightedTask(b, 1, env_id="b")]
    )
    req = eval_request(rank_info=(0, 3))
    await multi.run_evaluation(req)
    assert a.requests == [req]
    assert b.requests == [req]


async def test_a_failing_evaluation_propagates_and_cancels_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow = Evaluating(name="slow", seconds=100)
    bad = Evaluating(name="bad", seconds=1, error=RuntimeError("eval broke"))
    multi = WeightedMultiTask(
        tasks=[WeightedTask(slow, 1, env_id="slow"), WeightedTask(bad, 1, env_id="bad")]
    )
    start = trio.current_time()
    with pytest.raises(RuntimeError, match="eval broke") as info:
        await multi.run_evaluation(eval_request())
    assert trio.current_time() - start == 1
    assert any("environment 'bad'" in note for note in info.value.__notes__)


async def test_the_multitask_response_round_trips_as_an_evaluation_response() -> None:
    multi = WeightedMultiTask(
        tasks=[WeightedTask(Evaluating(name="a", seconds=0), 1, env_id="a")], env_id="mix"
    )
    response = await multi.run_evaluation(eval_request())
    data = unstructure(response)
    assert data["type_name"] == "MultiTaskEvaluationResponse"
    back = structure(data, tr.EvaluationResponse)
    assert isinstance(back, MultiTaskEvaluationResponse)
    assert back == response
    assert isinstance(back.responses["a"], MultitaskTestResponse)
