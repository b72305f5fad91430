"""Properties of the grouped pipeline over random schedules, on Trio's MockClock.

Each test draws scenarios (request shape, per-call latencies and rewards, failing calls,
consumer pauses and take methods, early exits, outer cancellations; see
``tests/_schedules.py``), runs each one in its own ``trio.run`` with virtual time, and
checks one family of invariants from DESIGN.md ("The grouped pipeline: semantics").
A hang is a ``trio.TooSlowError`` after ``HANG_AFTER`` virtual seconds, not a stuck test.
"""

from __future__ import annotations

from collections import Counter

import pytest
import trio
import trio.testing
from _fakes import request
from _schedules import (
    HANG_AFTER,
    Outcome,
    Scenario,
    run_scenario,
    scenarios,
)
from hypothesis import given, settings

import trio_rollouts as tr
from trio_rollouts._concurrency import real_leaves
from trio_rollouts.testing import ScriptedAgent, rollouts

# Scenarios draw rewards at random, so some start with 32 identical groups: the early
# warning about that (tested in test_envs.py) is not what these properties are about.
pytestmark = pytest.mark.filterwarnings("ignore:the first 32 groups:RuntimeWarning")

#: ~70 schedules per property keeps the file at a few seconds (each run is a trio.run).
PROPERTY = settings(max_examples=70, deadline=None)


def slots(outcome: Outcome) -> list[tuple[int, int]]:
    return [(g.batch_id, g.index_in_batch) for g in outcome.delivered]


@PROPERTY
@given(scenarios())
def test_every_run_ends_with_no_call_or_task_left_running(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)  # a hang raises TooSlowError here

    assert outcome.virtual_time < HANG_AFTER
    assert outcome.in_flight_after_exit == 0
    assert outcome.calls == outcome.exited
    assert outcome.leftover_tasks == []
    assert outcome.leftover_nurseries == 0


@PROPERTY
@given(scenarios())
def test_no_slot_is_delivered_twice_and_every_group_is_well_formed(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)

    counts = Counter(slots(outcome))
    assert [slot for slot, n in counts.items() if n > 1] == []
    for group in outcome.delivered:
        assert 0 <= group.index_in_batch < scenario.num_groups
        assert group.batch_id >= 0
        assert len(group) == scenario.rollouts_per_group
    if not scenario.streaming:
        assert {g.batch_id for g in outcome.delivered} <= {0}


@PROPERTY
@given(scenarios())
def test_calls_in_flight_outstanding_batches_and_buffer_stay_bounded(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)

    w = scenario.max_outstanding
    assert outcome.max_in_flight <= w * scenario.num_groups <= scenario.parallel_generation_tasks
    for stats, _ in outcome.samples:
        assert stats.outstanding_batches <= w
        assert stats.in_flight <= scenario.parallel_generation_tasks
        assert stats.buffered <= scenario.buffer_size
    # Nothing runs ahead: slots accepted or in flight never exceed what the batches the
    # consumer fully took, plus W outstanding ones, allow.
    for accepted_or_running, allowed in outcome.slot_samples:
        assert accepted_or_running <= allowed
    # A group taken belongs to one of the W batches after the ones fully taken before it.
    for batch_id, full_batches_before in outcome.take_samples:
        assert batch_id < full_batches_before + w


@PROPERTY
@given(scenarios(streaming=False, failures=False, early_exit=False, cancel=False))
def test_non_streaming_delivers_exactly_one_batch_then_ends(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)

    assert outcome.error is None
    assert outcome.ended
    assert sorted(slots(outcome)) == [(0, i) for i in range(scenario.num_groups)]


@PROPERTY
@given(scenarios(failures=False, cancel=False))
def test_a_consumer_that_keeps_taking_gets_every_group_it_asks_for(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)

    if scenario.leave_by_raising:
        assert outcome.error is outcome.consumer_error
    else:
        assert outcome.error is None
    wanted = scenario.num_groups if scenario.take_limit is None else scenario.take_limit
    assert len(outcome.delivered) == wanted


@PROPERTY
@given(scenarios(enforce_order=True))
def test_enforce_order_delivers_whole_batches_in_batch_order(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)

    g = scenario.num_groups
    in_order = [(b, i) for b in range(len(outcome.delivered) // g + 1) for i in range(g)]
    assert slots(outcome) == in_order[: len(outcome.delivered)]


@PROPERTY
@given(scenarios(filtering=True))
def test_filtering_never_delivers_identical_rewards_and_reuses_no_slot(
    scenario: Scenario,
) -> None:
    outcome = run_scenario(scenario)

    assert all(g.reward_std() > 1e-6 for g in outcome.delivered)
    assert len(set(slots(outcome))) == len(outcome.delivered)
    # Filtered groups are regenerated in their own slot: batches fill up gap-free.
    for batch_id, full_batches_before in outcome.take_samples:
        assert batch_id < full_batches_before + scenario.max_outstanding
    if scenario.enforce_order:
        g = scenario.num_groups
        assert slots(outcome) == [divmod(n, g) for n in range(len(outcome.delivered))]


@PROPERTY
@given(scenarios())
def test_statistics_count_exactly_what_happened(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)

    final = outcome.final
    assert final is not None
    assert final.delivered == len(outcome.delivered)
    assert final.started == outcome.calls
    assert final.completed == outcome.returned
    assert final.failed == len(outcome.raised)
    assert final.started - final.completed - final.failed == outcome.cancelled
    assert final.filtered == (outcome.returned_equal if scenario.filtering else 0)
    assert final.in_flight == 0
    assert final.unaccounted == 0
    for stats, cancelled in outcome.samples:
        assert stats.started == stats.completed + stats.failed + stats.in_flight + cancelled
        assert stats.unaccounted == 0
        assert stats.delivered + stats.buffered + stats.reordering <= (
            stats.completed - stats.filtered
        )


@PROPERTY
@given(scenarios())
def test_the_exception_that_leaves_is_the_one_raised(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)

    expected = list(outcome.raised)
    if outcome.consumer_error is not None:
        expected.append(outcome.consumer_error)
    if not expected:
        assert outcome.error is None
    elif len(expected) == 1:
        # As itself, not wrapped in an ExceptionGroup (so `except BoomA` works).
        assert outcome.error is expected[0]
    else:
        # Several at once: one of them as itself (the consumer's own first), the others
        # named in a note and kept with it.
        assert any(outcome.error is e for e in expected)
        if outcome.consumer_error is not None:
            assert outcome.error is outcome.consumer_error
        assert {id(e) for e in real_leaves(outcome.error)} == {id(e) for e in expected}
    if outcome.error is not None:
        assert not isinstance(outcome.error, trio.Cancelled)


# ------------------------------------------------- regressions the properties found


async def test_statistics_ledger_counts_a_group_handed_to_a_waiting_consumer() -> None:
    # A worker whose group goes straight to a consumer waiting in receive() leaves the
    # group in transit (not buffered, not yet taken) until the consumer runs; another
    # task reading statistics() meanwhile must still see a balanced ledger.
    seen: list[tr.RolloutStreamStatistics] = []
    streams: list[tr.RolloutStream] = []

    async def instant_then_look(
        agent: ScriptedAgent, req: tr.GroupedRolloutRequest
    ) -> list[tr.Rollout]:
        if agent.calls == 2:
            seen.append(streams[0].statistics())
        return rollouts([0.0, 1.0])

    agent = ScriptedAgent(script=instant_then_look, parallel_generation_tasks=2, buffer_size=0)
    async with agent.get_grouped_rollouts(request(num_groups=2)) as stream:
        streams.append(stream)
        groups = [group async for group in stream]

    assert len(groups) == 2
    assert [stats.unaccounted for stats in seen] == [0]


async def test_a_batch_submitted_while_a_worker_waits_in_send_wakes_an_idle_worker() -> None:
    # G=1, P=2, buffer 0: of two finished groups, one goes straight to the waiting
    # consumer and the other's worker blocks in send. Taking the first group submits
    # batch 2; the idle worker must start it while the consumer does something else,
    # not only when the consumer next receives (the blocked worker is not "coming").
    async def checkpointing(
        agent: ScriptedAgent, req: tr.GroupedRolloutRequest
    ) -> list[tr.Rollout]:
        await trio.lowlevel.checkpoint()
        if agent.calls > 2:
            await trio.sleep_forever()
        return rollouts([0.0, 1.0])

    agent = ScriptedAgent(script=checkpointing, parallel_generation_tasks=2, buffer_size=0)
    async with agent.get_grouped_rollouts(request(streaming=True)) as stream:
        first = await stream.receive()
        await trio.testing.wait_all_tasks_blocked()
        assert stream.statistics().outstanding_batches == 2
        assert agent.calls == 3  # batch 2 is being generated
        assert stream.statistics().unaccounted == 0

    assert first.batch_id in (0, 1)
