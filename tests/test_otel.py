"""``trio_rollouts.otel``: one ``rl.sample`` span per group call, through the SDK's
in-memory exporter; nothing traced while it is off."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import trio
import trio.testing
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import trio_rollouts as tr
from trio_rollouts import otel
from trio_rollouts.inference import EmbeddedInference, InferenceResponse

pytestmark = pytest.mark.filterwarnings("ignore:the first 32 groups:RuntimeWarning")

PROBLEMS = [tr.Problem(prompt=f"question {i}", answer="A", problem_id=f"p{i}") for i in range(64)]


class Alternating(tr.RewardOnlyAgent):
    """Rewards that differ within most groups; every third problem's group is all 0
    (filtered when filtering is on)."""

    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        number = int((problem.problem_id or "p0")[1:])
        return 0.0 if number % 3 == 0 else float(sum(map(ord, response.response.content)) % 2)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    otel.instrument(tracer_provider=provider)
    try:
        yield spans
    finally:
        otel.uninstrument()


async def test_each_group_call_is_one_span_with_its_lifecycle(
    exporter: InMemorySpanExporter, autojump_clock: trio.testing.MockClock
) -> None:
    agent = Alternating(prompts=tr.PromptSource(PROBLEMS, seed=0), parallel_generation_tasks=4)
    request = tr.GroupedRolloutRequest(
        inference_interface=EmbeddedInference(seed=1),
        num_groups=2,
        rollouts_per_group=4,
        streaming=True,
        max_staleness=0,
        filter_groups_with_same_reward=True,
    )
    taken: list[tr.RolloutGroup] = []
    async with agent.get_grouped_rollouts(request) as stream:
        for _ in range(3):
            taken += [await stream.receive() for _ in range(2)]
            async with stream.weight_update("drain"):
                pass
    statistics = stream.statistics()
    spans = exporter.get_finished_spans()
    assert {span.name for span in spans} == {"rl.sample"}
    assert len(spans) == statistics.started
    outcomes = Counter(span.attributes["rl.outcome"] for span in spans)  # type: ignore[index]
    assert outcomes["delivered"] == statistics.delivered == len(taken)
    assert outcomes["filtered"] == statistics.filtered > 0
    assert outcomes["stale"] + outcomes["cancelled"] + outcomes["not_taken"] >= statistics.stale
    delivered = [span for span in spans if span.attributes["rl.outcome"] == "delivered"]  # type: ignore[index]
    by_slot = {(g.batch_id, g.index_in_batch): g for g in taken}
    for span in delivered:
        events = [event.name for event in span.events]
        assert events == ["admitted", "first_token", "done", "reward", "delivered"]
        group = by_slot[(span.attributes["rl.batch_id"], span.attributes["rl.index"])]  # type: ignore[index]
        assert span.attributes["rl.start_epoch"] == group.start_epoch  # type: ignore[index]
        assert span.attributes["rl.staleness"] == 0  # type: ignore[index]
        reward = next(event for event in span.events if event.name == "reward")
        assert reward.attributes["rl.reward_mean"] == pytest.approx(group.reward_mean())  # type: ignore[index]
        assert span.start_time is not None
        assert span.end_time is not None


async def test_a_failing_call_ends_its_span_with_the_error(
    exporter: InMemorySpanExporter, autojump_clock: trio.testing.MockClock
) -> None:
    class Broken(tr.RewardOnlyAgent):
        async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
            raise LookupError("no reward")

    agent = Broken(prompts=tr.PromptSource(PROBLEMS), parallel_generation_tasks=1)
    request = tr.GroupedRolloutRequest(
        inference_interface=EmbeddedInference(), num_groups=1, rollouts_per_group=2
    )
    with pytest.raises(LookupError):
        async with agent.get_grouped_rollouts(request) as stream:
            await stream.receive()
    (span,) = exporter.get_finished_spans()
    assert span.attributes["rl.outcome"] == "failed"  # type: ignore[index]
    assert span.events[0].name == "admitted"
    assert any(event.name == "exception" for event in span.events)


async def test_nothing_is_traced_when_off(autojump_clock: trio.testing.MockClock) -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    otel.instrument(tracer_provider=provider)
    otel.uninstrument()
    assert not otel.is_instrumented()
    agent = Alternating(prompts=tr.PromptSource(PROBLEMS), parallel_generation_tasks=2)
    request = tr.GroupedRolloutRequest(
        inference_interface=EmbeddedInference(), num_groups=2, rollouts_per_group=2
    )
    async with agent.get_grouped_rollouts(request) as stream:
        async for _ in stream:
            pass
    assert spans.get_finished_spans() == ()
