"""The failure policy under exception groups, stamina's modes, the ledger's honesty, and
the deadlines of the fast path (the watchdog) beside those of the slow path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import stamina
import trio
import trio.testing
from _fakes import request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trio_rollouts as tr
from trio_rollouts.inference import ServerError
from trio_rollouts.testing import ScriptedAgent, rollouts


class Flaky(Exception):
    """A transient failure for these tests."""


class Fatal(Exception):
    """A failure that is not transient."""


def server_error(n: int) -> ServerError:
    return ServerError(f"call {n}: 503 Service Unavailable", url="http://x/v1", status=503)


def policy(**kwargs: object) -> tr.FailurePolicy:
    kwargs.setdefault("retry_on", (Flaky, ServerError, tr.GroupTimeoutError))
    kwargs.setdefault("wait_jitter", 0)
    return tr.FailurePolicy(**kwargs)  # type: ignore[arg-type]


async def sample_in_a_nursery(*raisers: BaseException | None, depth: int = 1) -> None:
    """What an agent that samples in its own nursery does: one child per rollout; the
    children given an exception raise it, the others finish. ``depth`` nests nurseries."""

    async def child(exc: BaseException | None) -> None:
        # Children that fail do so before their first checkpoint, so that the first
        # failure's cancellation of its siblings cannot hide the others'.
        if exc is not None:
            raise exc
        await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for exc in raisers:
            if depth > 1:
                nursery.start_soon(lambda e=exc: sample_in_a_nursery(e, depth=depth - 1))
            else:
                nursery.start_soon(child, exc)


def first_call_fails_with(*make: type[Exception] | None, depth: int = 1):  # type: ignore[no-untyped-def]
    """A script whose first call fails inside its own nursery with one child per entry of
    ``make`` (None: that child succeeds); later calls succeed."""

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        n = agent.calls
        if n == 1:
            errors = [
                None if cls is None else (server_error(n) if cls is ServerError else cls(n))
                for cls in make
            ]
            await sample_in_a_nursery(*errors, depth=depth)
        return rollouts([0.0, float(n)])

    return script


@pytest.fixture
def stamina_active() -> Iterator[None]:
    """Leave stamina as found: some tests switch it off or into testing mode."""
    active = stamina.is_active()
    yield
    stamina.set_testing(False)
    stamina.set_active(active)


# ------------------------------------------------------------------ exception groups


@pytest.mark.parametrize("depth", [1, 2])
async def test_a_transient_error_from_the_agents_own_nursery_is_retried(
    autojump_clock: trio.testing.MockClock, depth: int
) -> None:
    a = ScriptedAgent(
        script=first_call_fails_with(ServerError, None, depth=depth),
        failure_policy=policy(max_attempts=3),
    )
    async with a.get_grouped_rollouts(request()) as stream:
        group = await stream.receive()
    assert [r.reward for r in group] == [0.0, 2.0]
    stats = stream.statistics()
    assert (stats.started, stats.failed, stats.retries, stats.raised) == (2, 1, 1, 0)
    assert stats.last_errors == ("ServerError: call 1: 503 Service Unavailable",)
    assert stats.unaccounted == 0


async def test_a_group_mixing_a_transient_and_another_error_is_not_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = ScriptedAgent(
        script=first_call_fails_with(Flaky, Fatal), failure_policy=policy(max_attempts=3)
    )
    # Raised as the first of the two, the other named in a note and kept with it.
    with pytest.raises((Flaky, Fatal)) as info:
        async with a.get_grouped_rollouts(request()) as stream:
            await stream.receive()
    assert any("1 other failure(s) at the same time" in note for note in info.value.__notes__)
    stats = stream.statistics()
    assert (stats.started, stats.failed, stats.retries, stats.raised) == (1, 1, 0, 1)
    (last,) = stats.last_errors  # one failure of two errors, in the order they happened
    assert last in ("2 errors: Flaky: 1; Fatal: 1", "2 errors: Fatal: 1; Flaky: 1")
    assert stats.unaccounted == 0


async def test_a_non_transient_error_in_a_group_is_raised_as_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = ScriptedAgent(
        script=first_call_fails_with(Fatal, None, depth=2), failure_policy=policy(max_attempts=3)
    )
    with pytest.raises(Fatal):
        async with a.get_grouped_rollouts(request()) as stream:
            await stream.receive()
    assert stream.statistics().last_errors == ("Fatal: 1",)


async def test_a_skipped_group_error_counts_against_the_budget_as_its_leaf(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = ScriptedAgent(
        script=first_call_fails_with(Fatal, None, depth=2),
        failure_policy=policy(on_failure="skip", skip_budget=0),
    )
    with pytest.raises(tr.FailureBudgetExceededError, match=r"Fatal: 1$") as info:
        async with a.get_grouped_rollouts(request()) as stream:
            await stream.receive()
    assert type(info.value.last_error) is Fatal
    assert info.value.__cause__ is info.value.last_error
    stats = stream.statistics()
    assert (stats.failed, stats.skipped, stats.raised, stats.unaccounted) == (1, 1, 0, 0)


def test_is_transient_classifies_by_leaves() -> None:
    p = policy()
    cancelled = trio.Cancelled._create()  # what a cancelled sibling leaves behind
    assert p.is_transient(Flaky())
    assert not p.is_transient(Fatal())
    assert p.is_transient(ExceptionGroup("g", [Flaky(), server_error(1)]))
    assert p.is_transient(ExceptionGroup("g", [ExceptionGroup("h", [Flaky()])]))
    assert p.is_transient(BaseExceptionGroup("g", [Flaky(), cancelled]))
    assert not p.is_transient(ExceptionGroup("g", [Flaky(), Fatal()]))
    assert not p.is_transient(ExceptionGroup("g", [ExceptionGroup("h", [Fatal()]), Flaky()]))
    assert not p.is_transient(BaseExceptionGroup("g", [cancelled]))


# ------------------------------------------------------------------ stamina's modes


@pytest.mark.parametrize("mode", ["testing", "inactive"])
@pytest.mark.parametrize("on_failure", ["raise", "skip"])
async def test_the_ledger_counts_only_retries_that_happened(
    autojump_clock: trio.testing.MockClock, stamina_active: None, mode: str, on_failure: str
) -> None:
    if mode == "testing":
        stamina.set_testing(True)  # one attempt, no waiting
    else:
        stamina.set_active(False)
    a = ScriptedAgent(
        script=first_call_fails_with(Flaky),
        failure_policy=policy(max_attempts=3, on_failure=on_failure),
    )
    if on_failure == "raise":
        with pytest.raises(Flaky):
            async with a.get_grouped_rollouts(request()) as stream:
                await stream.receive()
    else:
        async with a.get_grouped_rollouts(request()) as stream:
            await stream.receive()
    stats = stream.statistics()
    assert stats.retries == 0
    assert (stats.raised, stats.skipped) == ((1, 0) if on_failure == "raise" else (0, 1))
    assert stats.unaccounted == 0


async def test_stamina_testing_mode_with_attempts_still_retries(
    autojump_clock: trio.testing.MockClock, stamina_active: None
) -> None:
    stamina.set_testing(True, attempts=2)
    a = ScriptedAgent(script=first_call_fails_with(Flaky), failure_policy=policy(max_attempts=3))
    async with a.get_grouped_rollouts(request()) as stream:
        await stream.receive()
    stats = stream.statistics()
    assert (stats.started, stats.retries, stats.raised) == (2, 1, 0)


async def test_a_failure_waiting_out_its_backoff_is_neither_retried_nor_raised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = ScriptedAgent(
        script=first_call_fails_with(Flaky),
        failure_policy=policy(max_attempts=2, wait_initial=10, wait_max=10),
    )
    async with a.get_grouped_rollouts(request()) as stream:
        await trio.sleep(5)  # the first call failed at t=0; the retry starts at t=10
        stats = stream.statistics()
        assert (stats.failed, stats.waiting_to_retry, stats.retries, stats.raised) == (1, 1, 0, 0)
        assert stats.unaccounted == 0
        await stream.receive()
        assert trio.current_time() == 10
        stats = stream.statistics()
        assert (stats.waiting_to_retry, stats.retries, stats.raised) == (0, 1, 0)


async def test_leaving_during_a_backoff_cancels_the_failed_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = ScriptedAgent(
        script=first_call_fails_with(Flaky),
        failure_policy=policy(max_attempts=2, wait_initial=10, wait_max=10),
    )
    async with a.get_grouped_rollouts(request()) as stream:
        await trio.sleep(5)
    stats = stream.statistics()
    assert (stats.failed, stats.retries, stats.raised, stats.cancelled) == (1, 0, 0, 1)
    assert (stats.waiting_to_retry, stats.unaccounted) == (0, 0)


# ------------------------------------------------------------------ deadlines


def latencies(*values: float):  # type: ignore[no-untyped-def]
    """Call n sleeps values[n - 1] (the last value for later calls)."""

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        n = agent.calls
        await trio.sleep(values[min(n, len(values)) - 1])
        return rollouts([0.0, float(n)])

    return script


# The fast path (first attempts timed by the watchdog) and the slow one (filtering: a
# cancel scope per attempt) must agree.
PATHS = pytest.mark.parametrize("filtering", [False, True], ids=["fast", "slow"])


@PATHS
async def test_only_the_overdue_call_times_out(
    autojump_clock: trio.testing.MockClock, filtering: bool
) -> None:
    a = ScriptedAgent(
        script=latencies(1, 8, 2, 1),
        parallel_generation_tasks=3,
        failure_policy=policy(group_timeout=5, max_attempts=2, wait_initial=1, wait_max=1),
    )
    req = request(num_groups=3, filter_groups_with_same_reward=filtering)
    got = []
    async with a.get_grouped_rollouts(req) as stream:
        async for group in stream:
            got.append((trio.current_time(), group.index_in_batch, group[1].reward))
    # Call 2 (slot 1) is cancelled at t=5 and retried at t=6 as call 4, which takes 1 s.
    assert got == [(1, 0, 1.0), (2, 2, 3.0), (7, 1, 4.0)]
    stats = stream.statistics()
    assert (stats.timeouts, stats.failed, stats.retries, stats.unaccounted) == (1, 1, 1, 0)


@PATHS
@pytest.mark.parametrize(("latency", "late"), [(4.5, False), (5, True)])
async def test_a_call_still_running_at_its_deadline_is_late(
    autojump_clock: trio.testing.MockClock, filtering: bool, latency: float, late: bool
) -> None:
    """A call that ends as its deadline comes due is late, whichever of the two Trio
    runs first (so this runs many times)."""
    for _ in range(20):
        a = ScriptedAgent(
            script=latencies(latency, 1), failure_policy=policy(group_timeout=5, max_attempts=2)
        )
        req = request(filter_groups_with_same_reward=filtering)
        async with a.get_grouped_rollouts(req) as s:
            group = await s.receive()
        assert group[1].reward == (2.0 if late else 1.0)
        assert (s.statistics().timeouts, s.statistics().retries) == (int(late), int(late))


async def test_a_call_that_returns_late_without_a_checkpoint_is_late(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A call busy past its deadline (no checkpoint to be cancelled at) is late too."""

    async def busy(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        if agent.calls == 1:
            await trio.sleep(4)
            autojump_clock.jump(2)  # the CPU-bound stretch of a call that never yields
        return rollouts([0.0, float(agent.calls)])

    a = ScriptedAgent(script=busy, failure_policy=policy(group_timeout=5, max_attempts=2))
    async with a.get_grouped_rollouts(request()) as s:
        group = await s.receive()
    assert group[1].reward == 2.0
    assert s.statistics().timeouts == 1


@PATHS
async def test_every_attempt_has_its_own_deadline(
    autojump_clock: trio.testing.MockClock, filtering: bool
) -> None:
    a = ScriptedAgent(
        script=latencies(9, 9, 9),
        failure_policy=policy(group_timeout=5, max_attempts=3, wait_initial=1, wait_max=1),
    )
    with pytest.raises(tr.GroupTimeoutError):
        async with a.get_grouped_rollouts(request(filter_groups_with_same_reward=filtering)) as s:
            await s.receive()
    assert trio.current_time() == 5 + 1 + 5 + 1 + 5
    stats = s.statistics()
    assert (stats.timeouts, stats.retries, stats.raised, stats.unaccounted) == (3, 2, 1, 0)


@PATHS
async def test_a_worker_goes_on_after_its_deadline_fired(
    autojump_clock: trio.testing.MockClock, filtering: bool
) -> None:
    a = ScriptedAgent(
        script=latencies(9, 1, 9, 1, 1, 1),
        parallel_generation_tasks=1,
        failure_policy=policy(group_timeout=5, on_failure="skip"),
    )
    req = request(streaming=True, filter_groups_with_same_reward=filtering)
    async with a.get_grouped_rollouts(req) as stream:
        rewards = [(await stream.receive())[1].reward for _ in range(4)]
    assert rewards == [2.0, 4.0, 5.0, 6.0]
    stats = stream.statistics()
    assert (stats.timeouts, stats.skipped, stats.unaccounted) == (2, 2, 0)


@PATHS
async def test_leaving_as_a_deadline_fires_keeps_the_ledger(
    autojump_clock: trio.testing.MockClock, filtering: bool
) -> None:
    """The consumer's exit and the deadline come due at the same instant; Trio picks
    who runs first at random, so this runs many times."""
    for _ in range(20):
        a = ScriptedAgent(
            script=latencies(9),
            parallel_generation_tasks=4,
            failure_policy=policy(group_timeout=5, max_attempts=2, wait_initial=0),
        )
        req = request(streaming=True, filter_groups_with_same_reward=filtering)
        async with a.get_grouped_rollouts(req) as stream:
            await trio.sleep(5)
        stats = stream.statistics()
        assert stats.unaccounted == 0
        assert (stats.in_flight, stats.waiting_to_retry, stats.delivered) == (0, 0, 0)
        assert a.in_flight == 0


# ------------------------------------------------------------------ a property


OUTCOMES = ["ok", "ok", "flaky", "fatal", "flaky-group", "mixed-group", "slow"]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    outcomes=st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=30),
    latency=st.lists(st.integers(0, 4), min_size=1, max_size=7),
    timeout=st.sampled_from([None, 3, 5]),
    max_attempts=st.integers(1, 3),
    on_failure=st.sampled_from(["raise", "skip"]),
    filtering=st.booleans(),
    take=st.integers(1, 12),
    streaming=st.booleans(),
)
def test_the_policy_ledger_on_random_schedules(
    outcomes: list[str],
    latency: list[int],
    timeout: int | None,
    max_attempts: int,
    on_failure: str,
    filtering: bool,
    take: int,
    streaming: bool,
) -> None:
    """Random failures, group errors and overdue calls: the ledger adds up at every take
    and after the exit, failures are counted once each, timeouts only for overdue calls."""
    raised_by_script = 0
    overdue = 0

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        nonlocal raised_by_script, overdue
        n = agent.calls
        outcome = outcomes[(n - 1) % len(outcomes)]
        seconds = 7 if outcome == "slow" else latency[(n - 1) % len(latency)]
        if timeout is not None and seconds >= timeout:  # late at its deadline
            overdue += 1
        await trio.sleep(seconds)
        error: BaseException | None = {
            "flaky": Flaky(n),
            "fatal": Fatal(n),
            "flaky-group": ExceptionGroup("g", [Flaky(n)]),
            "mixed-group": ExceptionGroup("g", [Flaky(n), Fatal(n)]),
        }.get(outcome)
        if error is not None:
            raised_by_script += 1
            raise error
        return rollouts([0.0, float(n)])

    async def main() -> None:
        a = ScriptedAgent(
            script=script,
            parallel_generation_tasks=4,
            buffer_size=1,
            max_consecutive_filtered=5,
            failure_policy=policy(
                group_timeout=timeout,
                max_attempts=max_attempts,
                on_failure=on_failure,
                wait_initial=1,
                skip_budget=20,
            ),
        )
        req = request(num_groups=2, streaming=streaming, filter_groups_with_same_reward=filtering)
        taken = 0
        try:
            async with a.get_grouped_rollouts(req) as stream:
                async for _ in stream:
                    taken += 1
                    assert stream.statistics().unaccounted == 0
                    if taken == take:
                        break
        except (Flaky, Fatal, ExceptionGroup, tr.GroupTimeoutError, tr.FailureBudgetExceededError):
            pass
        stats = stream.statistics()
        assert stats.unaccounted == 0
        assert (stats.in_flight, stats.waiting_to_retry, stats.pending) == (0, 0, 0)
        assert stats.delivered == taken
        assert stats.started == a.calls
        assert a.in_flight == 0
        # A call fails by raising, or by running past its deadline; shutdown cancels
        # the others. Every failure ends once: retried, skipped, raised or cancelled.
        assert stats.failed == raised_by_script + stats.timeouts
        assert stats.timeouts <= overdue
        assert stats.failed >= stats.retries + stats.skipped + stats.raised
        if max_attempts == 1:
            assert stats.retries == 0
        if on_failure == "raise":
            assert stats.skipped == 0
        else:
            assert stats.raised == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("filtering", [False, True], ids=["fast", "slow"])
async def test_an_error_raised_as_the_deadline_cancels_the_agents_nursery_is_retried(
    autojump_clock: trio.testing.MockClock, filtering: bool
) -> None:
    """At the deadline, one sample of the agent's nursery turns the cancellation into a
    transient error (as an HTTP client may) while the other is cancelled: the group
    holds the error beside a Cancelled, and the error, not the Cancelled, is what the
    policy sees and retries."""

    async def sample(convert: bool) -> None:
        try:
            await trio.sleep(10)
        except trio.Cancelled:
            if convert:
                raise Flaky("connection dropped at the deadline") from None
            raise

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        if agent.calls == 1:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample, True)
                nursery.start_soon(sample, False)
        return rollouts([0.0, float(agent.calls)])

    a = ScriptedAgent(
        script=script, failure_policy=policy(group_timeout=5, max_attempts=2, wait_initial=1)
    )
    async with a.get_grouped_rollouts(request(filter_groups_with_same_reward=filtering)) as s:
        group = await s.receive()
    assert group[1].reward == 2.0
    stats = s.statistics()
    assert (stats.failed, stats.retries, stats.raised, stats.unaccounted) == (1, 1, 0, 0)
    assert stats.last_errors == ("Flaky: connection dropped at the deadline",)


@pytest.mark.parametrize("on_failure", ["raise", "skip"])
@pytest.mark.parametrize("filtering", [False, True], ids=["fast", "slow"])
async def test_leaving_while_a_timed_out_call_unwinds_is_a_cancellation(
    autojump_clock: trio.testing.MockClock, filtering: bool, on_failure: str
) -> None:
    """The deadline fires at t=5, the call's shielded cleanup takes 1 s, and the consumer
    leaves cleanly at t=5.5: the call ended in the shutdown. It is counted as
    cancelled, and neither raised nor skipped (nothing leaves the clean exit)."""

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        try:
            await trio.sleep(9)
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(1)  # closing a connection, say
        return rollouts([0.0, 1.0])  # pragma: no cover

    a = ScriptedAgent(
        script=script,
        parallel_generation_tasks=1,
        failure_policy=policy(group_timeout=5, on_failure=on_failure, skip_budget=0),
    )
    req = request(streaming=True, filter_groups_with_same_reward=filtering)
    async with a.get_grouped_rollouts(req) as stream:
        await trio.sleep(5.5)
    stats = stream.statistics()
    assert (stats.cancelled, stats.timeouts, stats.failed) == (1, 0, 0)
    assert (stats.raised, stats.skipped, stats.unaccounted) == (0, 0, 0)
