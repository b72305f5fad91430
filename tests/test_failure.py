"""Failing groups: deadlines, retries in the same slot, skip or raise, and the ledger."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from _fakes import request

import trio_rollouts as tr
from trio_rollouts.inference import InferenceConnectionError
from trio_rollouts.testing import ScriptedAgent, rollouts


class Flaky(Exception):
    """A transient failure for these tests."""


def failing_calls(failures: set[int], exc: type[Exception] = Flaky, latency: float = 1.0):  # type: ignore[no-untyped-def]
    """Calls whose number is in ``failures`` raise ``exc``; the others succeed."""

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        n = agent.calls
        await trio.sleep(latency)
        if n in failures:
            raise exc(f"call {n}")
        return rollouts([0.0, float(n)])

    return script


def policy(**kwargs: object) -> tr.FailurePolicy:
    kwargs.setdefault("retry_on", (Flaky,))
    return tr.FailurePolicy(**kwargs)  # type: ignore[arg-type]


def agent(script, **kwargs: object) -> ScriptedAgent:  # type: ignore[no-untyped-def]
    return ScriptedAgent(script=script, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ deadline


async def test_a_group_past_its_deadline_fails_with_group_timeout_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(failing_calls(set(), latency=10), failure_policy=policy(group_timeout=5))
    start = trio.current_time()
    with pytest.raises(tr.GroupTimeoutError, match=r"group_timeout=5 s"):
        async with a.get_grouped_rollouts(request()) as stream:
            await stream.receive()
    assert trio.current_time() - start == 5
    assert a.in_flight == 0


async def test_a_timed_out_group_counts_as_a_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(
        failing_calls(set(), latency=10),
        failure_policy=policy(group_timeout=5, on_failure="skip", skip_budget=0),
    )
    with pytest.raises(tr.FailureBudgetExceededError):
        async with a.get_grouped_rollouts(request()) as stream:
            await stream.receive()
    stats = stream.statistics()
    assert (stats.timeouts, stats.failed, stats.skipped) == (1, 1, 1)


async def test_the_deadline_is_transient_by_default() -> None:
    assert tr.GroupTimeoutError in tr.FailurePolicy().retry_on
    assert InferenceConnectionError in tr.FailurePolicy().retry_on


# ------------------------------------------------------------------------ retries


async def test_a_transient_failure_is_retried_in_the_same_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(failing_calls({1, 2}), failure_policy=policy(max_attempts=3))
    async with a.get_grouped_rollouts(request()) as stream:
        group = await stream.receive()
        stats = stream.statistics()
    assert (group.batch_id, group.index_in_batch) == (0, 0)
    assert group.rewards().tolist() == [0.0, 3.0]
    assert (stats.attempts, stats.retries, stats.failed, stats.delivered) == (3, 2, 2, 1)


async def test_retries_back_off_between_attempts(autojump_clock: trio.testing.MockClock) -> None:
    backoff = policy(max_attempts=3, wait_initial=2.0, wait_jitter=0.0, wait_max=100.0)
    a = agent(failing_calls({1, 2}, latency=0), failure_policy=backoff)
    start = trio.current_time()
    async with a.get_grouped_rollouts(request()) as stream:
        await stream.receive()
    assert trio.current_time() - start >= 2.0 + 4.0  # exponential: 2 s, then 4 s


async def test_a_timed_out_attempt_is_retried(autojump_clock: trio.testing.MockClock) -> None:
    async def slow_first(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(100 if agent.calls == 1 else 1)
        return rollouts([0.0, 1.0])

    retry_timeouts = tr.FailurePolicy(group_timeout=5, max_attempts=2, wait_jitter=0)
    a = agent(slow_first, failure_policy=retry_timeouts)
    async with a.get_grouped_rollouts(request()) as stream:
        await stream.receive()
        stats = stream.statistics()
    assert (stats.timeouts, stats.retries, stats.delivered) == (1, 1, 1)


async def test_a_non_transient_failure_is_not_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(failing_calls({1}, exc=KeyError), failure_policy=policy(max_attempts=5))
    with pytest.raises(KeyError):
        async with a.get_grouped_rollouts(request()) as stream:
            await stream.receive()
    assert a.calls == 1


async def test_attempts_are_bounded(autojump_clock: trio.testing.MockClock) -> None:
    a = agent(failing_calls(set(range(100))), failure_policy=policy(max_attempts=3))
    with pytest.raises(Flaky, match="call 3"):
        async with a.get_grouped_rollouts(request()) as stream:
            await stream.receive()
    assert a.calls == 3
    assert stream.statistics().retries == 2


# ------------------------------------------------------------------------ skip


async def test_skipped_groups_never_reach_the_consumer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(
        failing_calls({2, 3, 5}),
        parallel_generation_tasks=1,
        failure_policy=policy(on_failure="skip"),
    )
    async with a.get_grouped_rollouts(request(num_groups=1, streaming=True)) as stream:
        groups = [await stream.receive() for _ in range(4)]
        stats = stream.statistics()
    assert [g.batch_id for g in groups] == [0, 1, 2, 3]
    assert [g.rewards()[1] for g in groups] == [1.0, 4.0, 6.0, 7.0]
    assert stats.skipped == 3


async def test_skipping_past_the_budget_raises_with_count_and_last_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = agent(
        failing_calls(set(range(100))), failure_policy=policy(on_failure="skip", skip_budget=4)
    )
    with pytest.raises(
        tr.FailureBudgetExceededError, match=r"5 groups failed .* skip_budget=4.*Flaky: call 5"
    ) as info:
        async with a.get_grouped_rollouts(request()) as stream:
            await stream.receive()
    assert info.value.skipped == 5
    assert isinstance(info.value.last_error, Flaky)
    assert info.value.__cause__ is info.value.last_error


async def test_skip_retries_first_then_skips(autojump_clock: trio.testing.MockClock) -> None:
    a = agent(
        failing_calls({1, 2, 3}),
        failure_policy=policy(on_failure="skip", max_attempts=2, wait_jitter=0),
    )
    async with a.get_grouped_rollouts(request()) as stream:
        group = await stream.receive()
        stats = stream.statistics()
    # Calls 1 (retried) and 2 (skipped), then 3 (retried) and 4 (succeeds).
    assert group.rewards()[1] == 4.0
    assert (stats.retries, stats.skipped, stats.failed) == (2, 1, 3)


async def test_last_errors_name_the_recent_failures(autojump_clock: trio.testing.MockClock) -> None:
    a = agent(failing_calls({1, 2}), failure_policy=policy(on_failure="skip"))
    async with a.get_grouped_rollouts(request()) as stream:
        await stream.receive()
        assert stream.statistics().last_errors == ("Flaky: call 1", "Flaky: call 2")


# ------------------------------------------------------------------------ the ledger


async def test_the_ledger_adds_up_while_running_and_after_exit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def mixed(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        n = agent.calls
        await trio.sleep(n % 7)
        if n % 5 == 0:
            raise Flaky(f"call {n}")
        return rollouts([1.0, 1.0] if n % 3 == 0 else [0.0, 1.0])

    a = agent(
        mixed,
        parallel_generation_tasks=6,
        buffer_size=2,
        failure_policy=policy(on_failure="skip", max_attempts=2, wait_jitter=0),
    )
    req = request(
        num_groups=2, streaming=True, enforce_order=True, filter_groups_with_same_reward=True
    )
    async with a.get_grouped_rollouts(req) as stream:
        for _ in range(30):
            await stream.receive()
            assert stream.statistics().unaccounted == 0
        await trio.sleep(50)  # let work pile up: buffered, blocked senders, reordering
        assert stream.statistics().unaccounted == 0
    stats = stream.statistics()
    assert stats.unaccounted == 0
    assert (stats.in_flight, stats.pending, stats.buffered, stats.reordering) == (0, 0, 0, 0)
    assert stats.cancelled > 0
    assert stats.delivered == 30


async def test_the_ledger_adds_up_after_a_failure(autojump_clock: trio.testing.MockClock) -> None:
    a = agent(failing_calls({7}, exc=KeyError), parallel_generation_tasks=4)
    with pytest.raises(KeyError):
        async with a.get_grouped_rollouts(request(streaming=True)) as stream:
            async for _ in stream:
                pass
    stats = stream.statistics()
    assert stats.unaccounted == 0
    assert stats.raised == 1


# ------------------------------------------------------------------------ the policy


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("group_timeout", 0, "group_timeout must be > 0"),
        ("group_timeout", -1.5, "group_timeout must be > 0"),
        ("max_attempts", 0, "max_attempts must be >= 1, got 0"),
        ("skip_budget", -1, "skip_budget must be >= 0, got -1"),
        ("on_failure", "ignore", "on_failure must be 'raise' or 'skip', got 'ignore'"),
        ("wait_initial", -1, "wait_initial must be a number of seconds >= 0, got -1"),
    ],
)
def test_a_bad_policy_value_is_rejected(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tr.FailurePolicy(**{field: value})  # type: ignore[arg-type]


def test_retry_on_must_hold_exception_types() -> None:
    with pytest.raises(TypeError, match="retry_on must be a tuple of Exception subclasses"):
        tr.FailurePolicy(retry_on=("Flaky",))  # type: ignore[arg-type]


def test_an_agent_needs_a_failure_policy_object() -> None:
    with pytest.raises(TypeError, match="failure_policy must be a FailurePolicy"):
        agent(failing_calls(set()), failure_policy={"max_attempts": 3})


async def test_a_call_cancelled_inside_its_own_nursery_counts_as_cancelled() -> None:
    async def with_nursery(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(trio.sleep_forever)
        return rollouts([0.0, 1.0])  # pragma: no cover

    a = agent(with_nursery, parallel_generation_tasks=3)
    async with a.get_grouped_rollouts(request(streaming=True)) as stream:
        await trio.testing.wait_all_tasks_blocked()
    stats = stream.statistics()
    assert (stats.cancelled, stats.failed, stats.last_errors) == (3, 0, ())
    assert stats.unaccounted == 0
