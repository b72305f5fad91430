"""Admission inside the staleness bound (``_admission.py``): with ``max_staleness=K`` a
new group call starts only when, if the consumer takes ``num_groups`` groups per update,
it would be taken before the bound drops it."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import trio_rollouts as tr
from trio_rollouts._context import current_call
from trio_rollouts.testing import ScriptedAgent, rollouts


def sleeper(seconds: float, started: list[tuple[int, int]] | None = None) -> Any:
    async def script(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(seconds)
        return rollouts([0.0, 1.0])

    return script


def request(**options: Any) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=options.pop("num_groups", 2),
        rollouts_per_group=2,
        inference_interface=tr.EmbeddedInference(),
        streaming=options.pop("streaming", True),
        **options,
    )


def ahead(stats: tr.RolloutStreamStatistics) -> int:
    return stats.in_flight + stats.pending + stats.waiting_to_retry


@pytest.mark.parametrize("bound", [0, 1, 2])
async def test_no_more_calls_start_than_the_bound_lets_be_taken(
    autojump_clock: trio.testing.MockClock, bound: int
) -> None:
    agent = ScriptedAgent(script=sleeper(1.0), parallel_generation_tasks=16)
    async with agent.get_grouped_rollouts(request(max_staleness=bound)) as stream:
        await trio.testing.wait_all_tasks_blocked()
        assert stream.statistics().started == (bound + 1) * 2
        # Each group taken since the last update is one fewer that may be ahead.
        for taken in range(1, 3):
            await stream.receive()
            await trio.testing.wait_all_tasks_blocked()
            # (A call always starts when nothing is ahead of it.)
            assert ahead(stream.statistics()) <= max((bound + 1) * 2 - taken, 1)
        async with stream.weight_update():
            pass
        await trio.testing.wait_all_tasks_blocked()
        assert ahead(stream.statistics()) == (bound + 1) * 2


async def test_a_consumer_that_takes_g_groups_per_update_never_sees_a_call_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Equal call times: the groups complete in the order they started, so the rule is
    exact and nothing is thrown away, however far parallel_generation_tasks reaches."""
    agent = ScriptedAgent(script=sleeper(1.0), parallel_generation_tasks=64)
    async with agent.get_grouped_rollouts(request(max_staleness=1, num_groups=4)) as stream:
        for _ in range(10):
            for _ in range(4):
                group = await stream.receive()
                assert stream.policy_epoch - group.start_epoch <= 1
                assert ahead(stream.statistics()) <= 2 * 4
            async with stream.weight_update("keep"):
                await trio.sleep(0.5)
        stats = stream.statistics()
        assert (stats.stale, stats.restarted) == (0, 0)
        assert stats.unaccounted == 0


async def test_without_the_rule_the_same_run_throws_calls_away(
    autojump_clock: trio.testing.MockClock, run_ahead: None
) -> None:
    """The run above with admission off: calls started far ahead go stale."""
    agent = ScriptedAgent(script=sleeper(1.0), parallel_generation_tasks=64)
    async with agent.get_grouped_rollouts(request(max_staleness=1, num_groups=4)) as stream:
        for _ in range(10):
            for _ in range(4):
                await stream.receive()
            async with stream.weight_update("keep"):
                await trio.sleep(0.5)
        assert stream.statistics().stale > 0


@pytest.mark.parametrize("enforce_order", [False, True])
async def test_a_consumer_that_never_updates_still_gets_every_group(
    autojump_clock: trio.testing.MockClock, enforce_order: bool
) -> None:
    """Nothing ahead: a call always starts (a consumer that takes more than num_groups
    groups per update must not wait forever)."""
    agent = ScriptedAgent(script=sleeper(1.0), parallel_generation_tasks=8)
    req = request(max_staleness=0, enforce_order=enforce_order)
    async with agent.get_grouped_rollouts(req) as stream:
        with trio.fail_after(1000):
            groups = [await stream.receive() for _ in range(20)]
    assert len(groups) == 20


async def test_waiting_slots_start_in_slot_order(autojump_clock: trio.testing.MockClock) -> None:
    order: list[tuple[int, int]] = []

    async def script(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        slot = current_call().group
        assert slot is not None
        order.append(slot[1:])
        await trio.sleep(1.0)
        return rollouts([0.0, 1.0])

    agent = ScriptedAgent(script=script, parallel_generation_tasks=16)
    async with agent.get_grouped_rollouts(request(max_staleness=0)) as stream:
        for _ in range(6):
            await stream.receive()
            await stream.receive()
            async with stream.weight_update():
                pass
    assert order == sorted(order)


async def test_without_a_bound_or_streaming_nothing_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = ScriptedAgent(script=sleeper(1.0), parallel_generation_tasks=16)
    async with agent.get_grouped_rollouts(request()) as stream:
        await trio.testing.wait_all_tasks_blocked()
        assert stream.statistics().started == 16
    agent = ScriptedAgent(script=sleeper(1.0), parallel_generation_tasks=4)
    async with agent.get_grouped_rollouts(
        request(max_staleness=0, streaming=False, num_groups=4)
    ) as stream:
        await trio.testing.wait_all_tasks_blocked()
        assert stream.statistics().started == 4
