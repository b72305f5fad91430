"""``stream.metrics()``: flat deltas since the last call, derived from the ledger, the
pipeline's own records (staleness, waits, pauses), the process and the backend."""

from __future__ import annotations

import math

import numpy as np
import pytest
import trio
import trio.testing

import trio_rollouts as tr
from trio_rollouts.inference import EmbeddedInference, EngineModel
from trio_rollouts.testing import ScriptedAgent, rollouts

pytestmark = pytest.mark.filterwarnings("ignore:the first 32 groups:RuntimeWarning")


def after(seconds: float) -> ScriptedAgent:
    async def script(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(seconds)
        return rollouts([0.0, 1.0])

    return ScriptedAgent(script=script, parallel_generation_tasks=1, buffer_size=8)


def request(**options: object) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        inference_interface=EmbeddedInference(),
        num_groups=1,
        rollouts_per_group=2,
        streaming=True,
        **options,  # type: ignore[arg-type]
    )


def all_finite(metrics: dict[str, float]) -> bool:
    return all(type(v) is float and math.isfinite(v) for v in metrics.values())


async def test_counters_are_deltas_since_the_last_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with after(1.0).get_grouped_rollouts(request()) as stream:
        for _ in range(3):
            await stream.receive()
        first = stream.metrics()
        second = stream.metrics()
        await stream.receive()
        third = stream.metrics()
    assert first["rollout/groups_delivered"] == 3
    assert first["rollout/interval_s"] == 3.0
    assert first["rollout/groups_per_s"] == 1.0
    assert second["rollout/groups_delivered"] == 0
    assert second["rollout/interval_s"] == 0.0
    assert third["rollout/groups_delivered"] == 1
    assert third["rollout/groups_started"] == 1
    assert all(all_finite(m) for m in (first, second, third))


async def test_the_wait_for_a_batch_is_the_time_the_consumer_waited(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with after(2.0).get_grouped_rollouts(request()) as stream:
        for _ in range(3):
            await stream.receive()
        waited = stream.metrics()["rollout/wait_for_batch_s"]
        await trio.sleep(5.0)  # the next group is ready: taking it does not wait
        await stream.receive()
        full = stream.metrics()["rollout/wait_for_batch_s"]
    assert waited == 6.0
    assert full == 0.0


async def test_staleness_percentiles_are_those_of_the_groups_taken(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = after(1.0)
    agent = ScriptedAgent(script=agent.script, parallel_generation_tasks=4, buffer_size=8)
    ages: list[int] = []
    async with agent.get_grouped_rollouts(request(max_staleness=3)) as stream:
        await trio.sleep(4.5)  # four groups of epoch 0 wait in the buffer
        for _ in range(3):
            async with stream.weight_update("drain"):
                pass
        for _ in range(6):
            group = await stream.receive()
            ages.append(stream.policy_epoch - group.start_epoch)
        metrics = stream.metrics()
    assert ages[:4] == [3, 3, 3, 3]
    expected = np.array(ages, dtype=np.float64)
    assert metrics["rollout/staleness_mean"] == pytest.approx(expected.mean())
    assert metrics["rollout/staleness_max"] == expected.max()
    for q, key in ((50, "p50"), (99, "p99")):
        assert metrics[f"rollout/staleness_{key}"] == np.percentile(
            expected, q, method="inverted_cdf"
        )
    assert metrics["rollout/weight_updates"] == 3
    assert metrics["rollout/policy_epoch"] == 3


async def test_a_pause_is_timed_and_counted(autojump_clock: trio.testing.MockClock) -> None:
    async with after(4.0).get_grouped_rollouts(request()) as stream:
        await trio.sleep(1.0)
        async with stream.weight_update("drain") as update:
            pass
        metrics = stream.metrics()
    assert update.pause_seconds == 3.0
    assert metrics["rollout/weight_update_pause_s"] == 3.0


async def test_the_loop_lag_is_sampled_from_the_first_call_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with after(1.0).get_grouped_rollouts(request()) as stream:
        first = stream.metrics()
        await trio.sleep(2.0)
        second = stream.metrics()
    assert not any(key.startswith("loop/") for key in first)
    # On the MockClock nothing runs late.
    assert (second["loop/lag_p50_ms"], second["loop/lag_p99_ms"]) == (0.0, 0.0)
    assert second["process/rss_mb"] > 1


async def test_the_engine_models_replicas_are_reported(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Any(tr.RewardOnlyAgent):
        async def get_reward(self, problem: tr.Problem, response: object) -> float:
            return 1.0 if len(problem.problem_id or "") % 2 else 0.0

    problems = [tr.Problem(prompt=f"question {i}" * 20, problem_id=f"p{i}") for i in range(8)]
    interface = EmbeddedInference(engine=EngineModel(), replicas=2, seed=1)
    agent = Any(prompts=tr.PromptSource(problems), parallel_generation_tasks=4)
    group_request = tr.GroupedRolloutRequest(
        inference_interface=interface, num_groups=4, rollouts_per_group=4
    )
    async with agent.get_grouped_rollouts(group_request) as stream:
        async for _ in stream:
            pass
        metrics = stream.metrics()
    assert all_finite(metrics)
    for replica in (0, 1):
        assert 0.0 < metrics[f"inference/{replica}/prefix_cache_hit_rate"] < 1.0
    total = sum(s.generation_tokens for s in interface.engine_statistics())
    assert metrics["inference/0/generation_tokens"] + metrics["inference/1/generation_tokens"] == (
        total
    )


async def test_the_probe_stops_with_the_stream(autojump_clock: trio.testing.MockClock) -> None:
    async with after(1.0).get_grouped_rollouts(request()) as stream:
        stream.metrics()
        await trio.sleep(1.0)
    last = stream.metrics()  # after the async with: the last interval
    await trio.sleep(1.0)
    assert last["rollout/groups_delivered"] == 0
    assert "loop/lag_p50_ms" in last
    assert "loop/lag_p50_ms" not in stream.metrics()


def test_the_sync_bridge_reports_the_same_metrics() -> None:
    agent = after(0.01)
    with tr.blocking_grouped_rollouts(agent, request()) as stream:
        stream.take(3, timeout=10)
        metrics = stream.metrics()
    assert metrics["rollout/groups_delivered"] == 3
    assert all_finite(metrics)
