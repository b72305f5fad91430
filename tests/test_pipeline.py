"""The grouped pipeline, one behaviour per test (DESIGN.md, "The grouped pipeline")."""

from __future__ import annotations

import math
import re

import attrs
import pytest
import trio
import trio.testing
from _fakes import request

import trio_rollouts as tr
from trio_rollouts._concurrency import real_leaves
from trio_rollouts.testing import NullChatInference, NullInference, ScriptedAgent, rollouts


async def instant(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
    await trio.lowlevel.checkpoint()
    return rollouts([0.0, 1.0])


async def forever(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


def agent(script=instant, **kwargs: int) -> ScriptedAgent:  # type: ignore[no-untyped-def]
    return ScriptedAgent(script=script, **kwargs)


# ------------------------------------------------------------------------ checks


async def test_interface_without_raw_text_is_a_type_error() -> None:
    req = tr.GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=2, inference_interface=NullChatInference()
    )
    with pytest.raises(TypeError, match="ReturnsRaw"):
        agent().get_grouped_rollouts(req)


async def test_fewer_parallel_tasks_than_groups_is_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"parallel_generation_tasks \(2\) must be >= num_groups \(3\)"
    ):
        agent(parallel_generation_tasks=2).get_grouped_rollouts(request(num_groups=3))


async def test_filtering_needs_two_rollouts_per_group() -> None:
    req = request(rollouts_per_group=1, filter_groups_with_same_reward=True)
    with pytest.raises(ValueError, match="rollouts_per_group >= 2"):
        agent().get_grouped_rollouts(req)


def test_negative_buffer_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="buffer_size must be >= 0, got -1"):
        agent(buffer_size=-1)


def test_zero_parallel_tasks_is_rejected() -> None:
    with pytest.raises(ValueError, match="parallel_generation_tasks must be >= 1, got 0"):
        agent(parallel_generation_tasks=0)


async def test_unused_capacity_warns() -> None:
    with pytest.warns(RuntimeWarning, match="1 generation task"):
        agent(parallel_generation_tasks=5).get_grouped_rollouts(
            request(num_groups=2, streaming=True)
        )


async def test_checks_run_before_any_work() -> None:
    a = agent(parallel_generation_tasks=1)
    with pytest.raises(ValueError):
        async with a.get_grouped_rollouts(request(num_groups=2)):
            pass  # pragma: no cover
    assert a.calls == 0


# ------------------------------------------------------------------------ batches


async def test_non_streaming_yields_exactly_one_batch() -> None:
    a = agent(parallel_generation_tasks=12)
    async with a.get_grouped_rollouts(request(num_groups=3)) as stream:
        groups = [g async for g in stream]
    assert sorted((g.batch_id, g.index_in_batch) for g in groups) == [(0, 0), (0, 1), (0, 2)]
    assert a.calls == 3


async def test_non_streaming_receive_after_the_batch_ends_the_stream() -> None:
    async with agent().get_grouped_rollouts(request(num_groups=2)) as stream:
        await stream.receive()
        await stream.receive()
        with pytest.raises(trio.EndOfChannel):
            await stream.receive()
        assert stream.try_next() is None


async def test_streaming_numbers_batches_in_submission_order() -> None:
    a = agent(parallel_generation_tasks=4)
    req = request(num_groups=2, streaming=True, enforce_order=True)
    async with a.get_grouped_rollouts(req) as stream:
        seen = [(await stream.receive()) for _ in range(8)]
    assert [(g.batch_id, g.index_in_batch) for g in seen] == [
        (b, i) for b in range(4) for i in range(2)
    ]


async def test_stalled_consumer_stalls_generation(autojump_clock: trio.testing.MockClock) -> None:
    a = agent(parallel_generation_tasks=6, buffer_size=1)
    async with a.get_grouped_rollouts(request(num_groups=2, streaming=True)) as stream:
        await trio.testing.wait_all_tasks_blocked()
        assert a.calls == 6  # W = 3 outstanding batches of 2 groups
        assert stream.statistics().outstanding_batches == 3
        await trio.sleep(100)
        assert a.calls == 6


async def test_a_batch_frees_capacity_only_when_its_last_group_is_taken() -> None:
    a = agent(parallel_generation_tasks=4, buffer_size=10)
    req = request(num_groups=2, streaming=True, enforce_order=True)
    async with a.get_grouped_rollouts(req) as stream:
        await trio.testing.wait_all_tasks_blocked()
        assert a.calls == 4
        first = await stream.receive()
        await trio.testing.wait_all_tasks_blocked()
        assert a.calls == 4
        last = await stream.receive()
        assert (first.batch_id, last.batch_id) == (0, 0)
        await trio.testing.wait_all_tasks_blocked()
        assert a.calls == 6


async def test_buffer_holds_at_most_buffer_size_finished_groups() -> None:
    a = agent(parallel_generation_tasks=8, buffer_size=3)
    async with a.get_grouped_rollouts(request(streaming=True)) as stream:
        await trio.testing.wait_all_tasks_blocked()
        stats = stream.statistics()
        assert stats.buffered == 3
        assert stats.completed == 8


async def test_calls_in_flight_never_exceed_parallel_generation_tasks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(1 + agent.calls % 3)
        return rollouts([0.0, 1.0])

    a = agent(slow, parallel_generation_tasks=7)
    async with a.get_grouped_rollouts(request(streaming=True)) as stream:
        for _ in range(100):
            await stream.receive()
            assert stream.statistics().in_flight <= 7
    assert a.max_in_flight == 7


async def test_zero_buffer_hands_groups_over_directly() -> None:
    a = agent(parallel_generation_tasks=2, buffer_size=0)
    async with a.get_grouped_rollouts(request(streaming=True)) as stream:
        await trio.testing.wait_all_tasks_blocked()
        assert stream.statistics().buffered == 0
        groups = [await stream.receive() for _ in range(5)]
    assert len({(g.batch_id, g.index_in_batch) for g in groups}) == 5


# ------------------------------------------------------------------------ order


def latency_by_call(latencies: list[float]):  # type: ignore[no-untyped-def]
    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(latencies[(agent.calls - 1) % len(latencies)])
        return rollouts([0.0, float(agent.calls)])

    return script


async def test_enforce_order_yields_whole_batches_in_batch_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Later calls finish first, so completion order is the reverse of submission order.
    a = agent(latency_by_call([9, 8, 7, 6, 5, 4, 3, 2, 1]), parallel_generation_tasks=9)
    async with a.get_grouped_rollouts(
        request(num_groups=3, streaming=True, enforce_order=True)
    ) as stream:
        seen = [await stream.receive() for _ in range(9)]
    assert [(g.batch_id, g.index_in_batch) for g in seen] == [
        (b, i) for b in range(3) for i in range(3)
    ]


async def test_without_enforce_order_groups_come_as_they_finish(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(latency_by_call([3, 2, 1]), parallel_generation_tasks=3)
    async with a.get_grouped_rollouts(request(num_groups=3)) as stream:
        seen = [g.index_in_batch async for g in stream]
    assert seen == [2, 1, 0]


async def test_non_streaming_enforce_order_sorts_the_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(latency_by_call([3, 2, 1]), parallel_generation_tasks=3)
    async with a.get_grouped_rollouts(request(num_groups=3, enforce_order=True)) as stream:
        seen = [g.index_in_batch async for g in stream]
    assert seen == [0, 1, 2]


# ------------------------------------------------------------------------ filtering


def alternating_rewards():  # type: ignore[no-untyped-def]
    """Odd calls give identical rewards (filtered), even calls give distinct ones."""

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        n = agent.calls
        await trio.sleep(1)
        if n % 2:
            return rollouts([1.0, 1.0])
        return rollouts([0.0, 1.0])

    return script


async def test_filtering_drops_groups_with_identical_rewards(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(alternating_rewards(), parallel_generation_tasks=4)
    req = request(num_groups=4, filter_groups_with_same_reward=True)
    async with a.get_grouped_rollouts(req) as stream:
        groups = [g async for g in stream]
        stats = stream.statistics()
    assert all(g.reward_std() > 1e-6 for g in groups)
    assert sorted(g.index_in_batch for g in groups) == [0, 1, 2, 3]
    assert {g.batch_id for g in groups} == {0}
    assert stats.filtered == a.calls - 4


async def test_filtering_with_enforce_order_keeps_batch_ids_and_finishes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(alternating_rewards(), parallel_generation_tasks=4)
    req = request(
        num_groups=2, streaming=True, enforce_order=True, filter_groups_with_same_reward=True
    )
    with trio.fail_after(1000):
        async with a.get_grouped_rollouts(req) as stream:
            seen = [await stream.receive() for _ in range(10)]
    assert [(g.batch_id, g.index_in_batch) for g in seen] == [
        (b, i) for b in range(5) for i in range(2)
    ]


async def test_filtering_a_missing_reward_is_an_error_naming_env_and_problem() -> None:
    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.lowlevel.checkpoint()
        return rollouts([1.0, None], env_id="math", problem_id="q17")

    req = request(filter_groups_with_same_reward=True)
    with pytest.raises(ValueError, match=r"reward None \(env_id='math', problem_id='q17'\)"):
        async with agent(script).get_grouped_rollouts(req) as stream:
            await stream.receive()


async def test_filtering_a_nan_reward_is_an_error() -> None:
    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.lowlevel.checkpoint()
        return rollouts([1.0, math.nan])

    with pytest.raises(ValueError, match="reward nan"):
        async with agent(script).get_grouped_rollouts(
            request(filter_groups_with_same_reward=True)
        ) as stream:
            await stream.receive()


async def test_endless_identical_groups_hit_the_filter_bound() -> None:
    async def same(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.lowlevel.checkpoint()
        return rollouts([0.5, 0.5])

    a = agent(same, max_consecutive_filtered=20)
    with pytest.raises(RuntimeError, match=r"21 groups in a row had identical rewards"):
        async with a.get_grouped_rollouts(request(filter_groups_with_same_reward=True)) as stream:
            await stream.receive()
    assert a.calls == 21


def test_filter_bound_defaults_to_ten_thousand() -> None:
    assert agent().max_consecutive_filtered == 10_000


async def test_the_filter_bound_is_one_runtime_error_when_workers_cross_it_together() -> None:
    # Three workers get identical groups in the same scheduling batch: the second and
    # the third both cross max_consecutive_filtered=1 before the nursery's cancellation
    # can reach either. The documented error must still come as itself, never as a group
    # of two, whatever order Trio runs them in.
    go = trio.Event()

    async def together(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await go.wait()
        return rollouts([0.5, 0.5])

    a = agent(together, max_consecutive_filtered=1, parallel_generation_tasks=3)
    req = request(num_groups=3, filter_groups_with_same_reward=True)
    with pytest.raises(RuntimeError, match=r"2 groups in a row had identical rewards"):
        async with a.get_grouped_rollouts(req) as stream:
            await trio.testing.wait_all_tasks_blocked()
            go.set()
            await stream.receive()
    assert a.calls == 3


async def test_the_skip_budget_is_one_error_when_workers_exceed_it_together() -> None:
    # As above, for FailureBudgetExceededError: three calls fail in the same batch with
    # skip_budget=1, so two workers exceed the budget before either is cancelled.
    go = trio.Event()

    async def failing(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await go.wait()
        raise ValueError("boom")

    policy = tr.FailurePolicy(on_failure="skip", skip_budget=1)
    a = agent(failing, parallel_generation_tasks=3)
    a.failure_policy = policy
    with pytest.raises(tr.FailureBudgetExceededError, match=r"2 groups failed and were skipped"):
        async with a.get_grouped_rollouts(request(num_groups=3)) as stream:
            await trio.testing.wait_all_tasks_blocked()
            go.set()
            await stream.receive()
    assert a.calls == 3


# ------------------------------------------------------------------------ bad groups


async def test_an_empty_group_is_a_clear_error() -> None:
    async def empty(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.lowlevel.checkpoint()
        return []

    with pytest.raises(
        ValueError,
        match=r"ScriptedAgent.group_rollout \(batch_id=0, index=0\) returned an empty group",
    ):
        async with agent(empty).get_grouped_rollouts(request()) as stream:
            await stream.receive()


async def test_a_group_of_non_rollouts_is_a_clear_error() -> None:
    async def dicts(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.lowlevel.checkpoint()
        return [{"trajectory": ["x"]}]  # type: ignore[list-item]

    with pytest.raises(TypeError, match="item 0 is a dict, not a Rollout or TokenRollout"):
        async with agent(dicts).get_grouped_rollouts(request()) as stream:
            await stream.receive()


async def test_a_returned_rolloutgroup_is_placed_in_its_slot() -> None:
    @attrs.define
    class GroupReturning(tr.GroupedRolloutGenerator):
        async def group_rollout(self, request: tr.GroupedRolloutRequest) -> tr.RolloutGroup:
            await trio.lowlevel.checkpoint()
            return tr.RolloutGroup(rollouts=rollouts([1.0, 2.0]), batch_id=99)

    async with GroupReturning().get_grouped_rollouts(request(num_groups=2)) as stream:
        groups = [g async for g in stream]
    assert sorted((g.batch_id, g.index_in_batch) for g in groups) == [(0, 0), (0, 1)]


# ------------------------------------------------------------------------ errors


def fail_on_call(n: int, exc: BaseException):  # type: ignore[no-untyped-def]
    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        if agent.calls == n:
            await trio.sleep(1)
            raise exc
        await trio.sleep(10)
        return rollouts([0.0, 1.0])

    return script


async def test_a_failing_group_rollout_raises_its_own_exception(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(fail_on_call(3, ValueError("bad group")), parallel_generation_tasks=4)
    with pytest.raises(ValueError, match="bad group"):
        async with a.get_grouped_rollouts(request(streaming=True)) as stream:
            async for _ in stream:
                pass
    assert a.in_flight == 0
    assert a.calls == a.exited


async def test_a_failure_cancels_every_call_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(fail_on_call(1, KeyError("k")), parallel_generation_tasks=8)
    start = trio.current_time()
    with pytest.raises(KeyError):
        async with a.get_grouped_rollouts(request(streaming=True)) as stream:
            await stream.receive()
    assert trio.current_time() - start == 1  # the 10 s calls were cancelled, not awaited
    assert a.in_flight == 0


async def test_groups_taken_before_a_failure_stay_taken(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(agent.calls)
        if agent.calls == 3:
            raise ValueError("third")
        return rollouts([0.0, 1.0])

    a = agent(script, parallel_generation_tasks=1)
    taken: list[tr.RolloutGroup] = []
    with pytest.raises(ValueError, match="third"):
        async with a.get_grouped_rollouts(request(streaming=True)) as stream:
            async for group in stream:
                taken.append(group)
    assert [g.batch_id for g in taken] == [0, 1]


async def test_several_failures_at_once_raise_the_first_as_itself() -> None:
    # Both calls wake from one event, so both raise before either can be cancelled: one
    # bug, one exception type, the other failure named in a note and kept with it.
    go = trio.Event()

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        n = agent.calls
        await go.wait()
        raise ValueError(f"call {n}")

    a = agent(script, parallel_generation_tasks=2)
    with pytest.raises(ValueError, match=r"call [12]") as info:
        async with a.get_grouped_rollouts(request(num_groups=2)) as stream:
            await trio.testing.wait_all_tasks_blocked()
            go.set()
            await stream.receive()
    (note,) = info.value.__notes__
    assert re.fullmatch(r"1 other failure\(s\) at the same time: ValueError: call [12]", note)
    assert note[-1] != str(info.value)[-1]  # the other call's, not this one's
    assert len(real_leaves(info.value)) == 2


async def test_a_nested_single_failure_is_flattened(autojump_clock: trio.testing.MockClock) -> None:
    async def nested(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        async def inner() -> None:
            await trio.sleep(1)
            raise LookupError("from a nested nursery")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(inner)
        return rollouts([0.0, 1.0])  # pragma: no cover

    with pytest.raises(LookupError, match="from a nested nursery"):
        async with agent(nested).get_grouped_rollouts(request()) as stream:
            await stream.receive()


async def test_an_exception_in_the_consumer_propagates_and_cancels_the_pipeline() -> None:
    a = agent(forever, parallel_generation_tasks=4)
    with pytest.raises(ZeroDivisionError):
        async with a.get_grouped_rollouts(request(streaming=True)):
            await trio.testing.wait_all_tasks_blocked()
            1 / 0
    assert a.calls == 4
    assert a.in_flight == 0


async def test_a_failure_wakes_a_consumer_that_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(fail_on_call(1, ValueError("wake up")), parallel_generation_tasks=1)
    with trio.fail_after(100), pytest.raises(ValueError, match="wake up"):
        async with a.get_grouped_rollouts(request(streaming=True)) as stream:
            await stream.receive()


async def test_a_failure_never_exits_the_process(autojump_clock: trio.testing.MockClock) -> None:
    a = agent(fail_on_call(1, RuntimeError("no sys.exit")))
    with pytest.raises(RuntimeError, match=r"no sys\.exit"):
        async with a.get_grouped_rollouts(request(streaming=True)) as stream:
            await stream.receive()


# ------------------------------------------------------------------------ cancellation


async def test_leaving_early_cancels_every_call_and_task() -> None:
    a = agent(forever, parallel_generation_tasks=16)
    task = trio.lowlevel.current_task()
    before = len(task.child_nurseries)
    async with a.get_grouped_rollouts(request(num_groups=4, streaming=True)):
        await trio.testing.wait_all_tasks_blocked()
        assert a.in_flight == 16
        assert len(task.child_nurseries) == before + 1
    assert a.in_flight == 0
    assert a.exited == 16
    assert len(task.child_nurseries) == before


async def test_leaving_with_blocked_producers_raises_nothing() -> None:
    a = agent(parallel_generation_tasks=8, buffer_size=1)
    async with a.get_grouped_rollouts(request(streaming=True)) as stream:
        await stream.receive()
        await trio.testing.wait_all_tasks_blocked()  # producers now wait in send
    assert a.in_flight == 0


async def test_an_outer_cancel_scope_cancels_the_pipeline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(forever, parallel_generation_tasks=4)
    with trio.move_on_after(5) as scope:
        async with a.get_grouped_rollouts(request(streaming=True)) as stream:
            await stream.receive()
    assert scope.cancelled_caught
    assert a.in_flight == 0
    assert a.exited == 4


async def test_return_from_inside_the_block_cancels_the_pipeline() -> None:
    a = agent(forever, parallel_generation_tasks=3)

    async def take_nothing() -> str:
        async with a.get_grouped_rollouts(request(streaming=True)):
            await trio.testing.wait_all_tasks_blocked()
            return "done"

    assert await take_nothing() == "done"
    assert a.in_flight == 0


async def test_stream_is_closed_after_exit() -> None:
    async with agent().get_grouped_rollouts(request()) as stream:
        pass
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive()


# ------------------------------------------------------------------------ non-blocking


async def test_try_next_returns_none_when_nothing_is_ready(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(latency_by_call([5]), parallel_generation_tasks=2)
    async with a.get_grouped_rollouts(request(streaming=True)) as stream:
        assert stream.try_next() is None
        assert stream.drain(3) == []
        await trio.sleep(6)
        assert stream.try_next() is not None


async def test_polling_never_cancels_or_loses_work(autojump_clock: trio.testing.MockClock) -> None:
    a = agent(latency_by_call([1]), parallel_generation_tasks=1)
    got: list[tr.RolloutGroup] = []
    async with a.get_grouped_rollouts(request(num_groups=1, streaming=True)) as stream:
        for _ in range(500):  # the origin's 10 ms wait_for polling killed the stream here
            if (g := stream.try_next()) is not None:
                got.append(g)
            await trio.sleep(0.01)
        assert stream.statistics().failed == 0
    assert [g.batch_id for g in got] == list(range(len(got)))
    assert len(got) >= 4


async def test_drain_takes_only_what_is_ready() -> None:
    a = agent(parallel_generation_tasks=6, buffer_size=10)
    async with a.get_grouped_rollouts(request(streaming=True)) as stream:
        await trio.testing.wait_all_tasks_blocked()
        assert len(stream.drain(4)) == 4
        assert len(stream.drain(100)) == 2
        assert stream.drain(0) == []


async def test_drain_rejects_a_negative_count() -> None:
    async with agent().get_grouped_rollouts(request()) as stream:
        with pytest.raises(ValueError, match="drain"):
            stream.drain(-1)


async def test_try_next_with_enforce_order_waits_for_the_whole_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(latency_by_call([2, 1]), parallel_generation_tasks=2)
    async with a.get_grouped_rollouts(request(num_groups=2, enforce_order=True)) as stream:
        await trio.sleep(1.5)
        assert stream.try_next() is None
        assert stream.statistics().reordering == 1
        await trio.sleep(1)
        assert [g.index_in_batch for g in stream.drain(2)] == [0, 1]


async def test_statistics_count_what_happened(autojump_clock: trio.testing.MockClock) -> None:
    a = agent(alternating_rewards(), parallel_generation_tasks=2)
    req = request(num_groups=2, filter_groups_with_same_reward=True)
    async with a.get_grouped_rollouts(req) as stream:
        groups = [g async for g in stream]
        stats = stream.statistics()
    assert stats == tr.RolloutStreamStatistics(
        started=4,
        completed=4,
        filtered=2,
        delivered=2,
        in_flight=0,
        buffered=0,
        reordering=0,
        failed=0,
        outstanding_batches=0,
    )
    assert len(groups) == 2


def test_stream_cannot_be_built_directly() -> None:
    with pytest.raises(TypeError, match="get_grouped_rollouts"):
        tr.RolloutStream()


# ------------------------------------------------------------------------ flat rollouts


async def test_gather_returns_results_in_call_order(autojump_clock: trio.testing.MockClock) -> None:
    from trio_rollouts._concurrency import gather

    async def finish_after(seconds: int) -> int:
        await trio.sleep(seconds)
        return seconds

    calls = [lambda s=s: finish_after(s) for s in (5, 1, 4, 2, 3)]
    assert await gather(calls) == [5, 1, 4, 2, 3]


@attrs.define
class Counting(tr.RolloutGenerator):
    started: int = 0

    async def rollout(self, request: tr.RolloutRequest) -> tr.Rollout:
        self.started += 1
        await trio.sleep(1)
        return tr.Rollout(trajectory=["x"], reward=1.0)


async def test_get_reward_rollouts_runs_the_calls_concurrently(
    autojump_clock: trio.testing.MockClock,
) -> None:
    req = tr.RolloutRequest(num_rollouts=5, inference_interface=NullInference())
    start = trio.current_time()
    result = await Counting().get_reward_rollouts(req)
    assert len(result) == 5
    assert trio.current_time() - start == 1


async def test_get_reward_rollouts_needs_raw_text() -> None:
    req = tr.RolloutRequest(num_rollouts=1, inference_interface=NullChatInference())
    with pytest.raises(TypeError, match="ReturnsRaw"):
        await Counting().get_reward_rollouts(req)


async def test_the_consumers_own_exception_group_is_not_flattened() -> None:
    own = ExceptionGroup("consumer's own", [ValueError("inside")])
    with pytest.raises(ExceptionGroup) as info:
        async with agent(forever).get_grouped_rollouts(request(streaming=True)):
            await trio.testing.wait_all_tasks_blocked()
            raise own
    assert info.value is own


async def test_no_call_starts_once_shutdown_has_begun() -> None:
    a = agent(parallel_generation_tasks=8, buffer_size=0)
    async with a.get_grouped_rollouts(request(streaming=True)) as stream:
        await stream.receive()
        await trio.testing.wait_all_tasks_blocked()
        calls_at_exit = a.calls
    assert a.calls == calls_at_exit


async def test_receive_in_order_is_a_cancellation_point_with_a_group_ready(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        return rollouts([0.0, 1.0])

    agent = ScriptedAgent(script=script, parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(request(num_groups=2, enforce_order=True)) as stream:
        first = await stream.receive()
        with trio.CancelScope() as scope:
            scope.cancel()
            await stream.receive()  # batch 0's second group is ready: must still raise
            pytest.fail("receive() did not raise Cancelled")
        second = await stream.receive()  # nothing lost
    assert (first.index_in_batch, second.index_in_batch) == (0, 1)
