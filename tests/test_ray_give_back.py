"""The actor's side of the Ray stream's staleness bound, without Ray: a rollout actor gives
the groups the merge found too old back to its stream with the source's ``take_back``
(``trio_rollouts.pipeline._stream.source_of``), exactly as here.

A group given back as stale is generated again in its own slot before any other slot
(ledger: ``stale``), its prompt draw is given back (drawn again first, never settled),
and with ``enforce_order`` the groups given back after it come after its new group: the
order stays gap-free.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from _fakes import request

import trio_rollouts as tr
from trio_rollouts import Problem, PromptSource
from trio_rollouts.pipeline._stream import source_of
from trio_rollouts.testing import ScriptedAgent, rollouts


async def draw_and_wait(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
    assert agent.prompts is not None
    problem = agent.prompts.draw()
    await trio.sleep(1)
    return rollouts([0.0, 1.0], problem_id=problem.problem_id)


def drawing_agent() -> ScriptedAgent:
    source = PromptSource(
        [Problem(problem_id=f"p{n}", prompt=f"q{n}", answer=n) for n in range(100)],
        shuffle=False,
    )
    return ScriptedAgent(
        script=draw_and_wait, prompts=source, parallel_generation_tasks=4, buffer_size=4
    )


def slots(groups: list[tr.RolloutGroup]) -> list[tuple[int, int]]:
    return [(g.batch_id, g.index_in_batch) for g in groups]


def pending(agent: ScriptedAgent) -> list[str]:
    assert agent.prompts is not None
    return [pid for _, pid in agent.prompts.state_dict()["pending"]]


async def test_a_stale_group_given_back_with_enforce_order_comes_again_in_its_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = drawing_agent()
    async with agent.get_grouped_rollouts(
        request(num_groups=2, streaming=True, enforce_order=True)
    ) as stream:
        assert source_of(stream).settle_on_handover()
        served = [await stream.receive() for _ in range(4)]
        assert slots(served) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        first, stale, *after = served
        source_of(stream).handed((first.batch_id, first.index_in_batch))  # reached its consumer
        # The merge found (0, 1) too old: it gives it back, and what it held after it.
        source_of(stream).take_back(after, regenerate=False)
        source_of(stream).take_back([stale], regenerate=True)
        stats = stream.statistics()
        assert (stats.delivered, stats.stale, stats.unaccounted) == (1, 1, 0)
        assert stale[0].problem_id in pending(agent)  # given back, not done
        again = [await stream.receive() for _ in range(5)]
        assert slots(again) == [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
        assert again[0] is not stale
        assert again[0][0].problem_id == stale[0].problem_id  # drawn again, first
        assert again[1:3] == after
        assert stream.statistics().unaccounted == 0


async def test_a_stale_group_given_back_is_generated_again_in_its_slot_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = drawing_agent()  # W = 4 batches of one group
    async with agent.get_grouped_rollouts(request(num_groups=1, streaming=True)) as stream:
        source_of(stream).settle_on_handover()
        served = [await stream.receive() for _ in range(2)]
        source_of(stream).take_back(served[1:], regenerate=True)
        stats = stream.statistics()
        assert (stats.delivered, stats.stale, stats.unaccounted) == (1, 1, 0)
        assert served[1][0].problem_id in pending(agent)
        # Batches 2 and 3 (finished), then what the four workers make next: the slot
        # again first, then batches 4 and 5 (submitted by the two takes) and 6 (by the
        # take of batch 2).
        groups = [await stream.receive() for _ in range(6)]
        expected = {(b, 0) for b in range(7)} - set(slots(served[:1]))
        assert set(slots(groups)) == expected
        (regenerated,) = [g for g in groups if slots([g]) == slots(served[1:])]
        assert regenerated is not served[1]
        assert regenerated[0].problem_id == served[1][0].problem_id  # drawn again
        assert stream.statistics().unaccounted == 0


async def test_put_back_needs_enforce_order(autojump_clock: trio.testing.MockClock) -> None:
    agent = drawing_agent()
    async with agent.get_grouped_rollouts(request(num_groups=2, streaming=True)) as stream:
        group = await stream.receive()
        with pytest.raises(RuntimeError, match="enforce_order"):
            source_of(stream).take_back([group], regenerate=False)
