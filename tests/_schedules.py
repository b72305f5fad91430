"""Random schedules for the grouped pipeline, run on Trio's MockClock.

A :class:`Scenario` fixes a request, per-call latencies and rewards, the calls that fail,
and what the consumer does (how it takes, how long it pauses, when it leaves, whether an
outer cancel scope fires). :func:`run_scenario` runs it in a fresh ``trio.run`` with a
MockClock (virtual time, so every schedule is deterministic and fast) and returns an
:class:`Outcome`: everything the property tests check. Nothing is asserted inside the
pipeline's tasks (an ``AssertionError`` there would be just another pipeline failure);
observations are recorded and checked afterwards.
"""

from __future__ import annotations

import math
import warnings
from typing import Literal

import attrs
import trio
import trio.testing
from _fakes import request
from hypothesis import strategies as st

import trio_rollouts as tr
from trio_rollouts.testing import ScriptedAgent, rollouts

#: Virtual seconds after which a run counts as hung (TooSlowError fails the test).
HANG_AFTER = 10_000.0

Method = Literal["receive", "timed_receive", "try_next", "drain", "iterate"]


class BoomA(Exception):
    """Raised by a scripted group_rollout at a chosen call."""


class BoomB(Exception):
    """A second failure type, so two failures can be told apart."""


class ConsumerError(Exception):
    """Raised by the consumer's own body to leave the ``async with``."""


@attrs.frozen(kw_only=True)
class Scenario:
    num_groups: int
    parallel_generation_tasks: int
    buffer_size: int
    rollouts_per_group: int
    streaming: bool
    enforce_order: bool
    filtering: bool
    #: Virtual seconds per call, cycled by call number; None: returns without a checkpoint.
    latencies: tuple[float | None, ...]
    #: Whether a call's rewards are all equal, cycled by call number.
    equal_rewards: tuple[bool, ...]
    #: Call number -> exception class it raises (after its latency).
    failures: tuple[tuple[int, type[Exception]], ...]
    #: Groups the consumer takes before it leaves; None: until the stream ends.
    take_limit: int | None
    #: How the consumer leaves after take_limit groups: break, or raise ConsumerError.
    leave_by_raising: bool
    #: How each take is done, cycled.
    methods: tuple[Method, ...]
    drain_size: int
    #: Virtual seconds slept before each take, cycled; None: no sleep.
    pauses: tuple[float | None, ...]
    #: An outer ``trio.move_on_after`` around the ``async with``; None: no outer cancel.
    cancel_after: float | None

    @property
    def max_outstanding(self) -> int:
        return self.parallel_generation_tasks // self.num_groups if self.streaming else 1

    @property
    def warns(self) -> bool:
        return self.streaming and self.parallel_generation_tasks % self.num_groups != 0


@attrs.define
class Outcome:
    """What happened in one run, for the property tests to judge."""

    scenario: Scenario
    delivered: list[tr.RolloutGroup] = attrs.Factory(list)
    #: Statistics sampled at every take and at the start of every call, with the number
    #: of calls cancelled so far.
    samples: list[tuple[tr.RolloutStreamStatistics, int]] = attrs.Factory(list)
    #: At every call's start: accepted-or-in-flight slots, and the slots the consumer's
    #: fully taken batches allow ((full batches taken + W) * G).
    slot_samples: list[tuple[int, int]] = attrs.Factory(list)
    #: At every take: (batch_id, batches fully taken before this take).
    take_samples: list[tuple[int, int]] = attrs.Factory(list)
    final: tr.RolloutStreamStatistics | None = None
    error: BaseException | None = None
    raised: list[BaseException] = attrs.Factory(list)
    consumer_error: ConsumerError | None = None
    outer_cancelled: bool = False
    #: Whether the stream ended by itself (non-streaming, taken to the end).
    ended: bool = False
    warned: bool = False
    returned: int = 0
    returned_equal: int = 0
    cancelled: int = 0
    calls: int = 0
    exited: int = 0
    in_flight_after_exit: int = 0
    max_in_flight: int = 0
    leftover_tasks: list[str] = attrs.Factory(list)
    leftover_nurseries: int = 0
    virtual_time: float = 0.0


class _LiveTasks(trio.abc.Instrument):
    def __init__(self) -> None:
        self.live: set[trio.lowlevel.Task] = set()

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.live.add(task)

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self.live.discard(task)


def _rewards(scenario: Scenario, call: int) -> list[float]:
    size = scenario.rollouts_per_group
    if scenario.equal_rewards[call % len(scenario.equal_rewards)]:
        return [0.5] * size
    return [float(i) for i in range(size)]


def run_scenario(scenario: Scenario) -> Outcome:
    outcome = Outcome(scenario)
    live = _LiveTasks()
    stream_box: list[tr.RolloutStream] = []
    full_batches_taken = [0]
    g = scenario.num_groups
    w = scenario.max_outstanding
    failures = dict(scenario.failures)

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        call = agent.calls - 1
        if stream_box:
            stats = stream_box[0].statistics()
            outcome.samples.append((stats, outcome.cancelled))
            slots = stats.completed - stats.filtered + stats.in_flight
            outcome.slot_samples.append((slots, (full_batches_taken[0] + w) * g))
        latency = scenario.latencies[call % len(scenario.latencies)]
        try:
            if latency is not None:
                await trio.sleep(latency)
        except trio.Cancelled:
            outcome.cancelled += 1
            raise
        if call in failures:
            exc = failures[call](f"call {call} failed")
            outcome.raised.append(exc)
            raise exc
        rewards = _rewards(scenario, call)
        outcome.returned += 1
        outcome.returned_equal += len(set(rewards)) == 1
        return rollouts(rewards)

    agent = ScriptedAgent(
        script=script,
        parallel_generation_tasks=scenario.parallel_generation_tasks,
        buffer_size=scenario.buffer_size,
    )
    req = request(
        num_groups=g,
        rollouts_per_group=scenario.rollouts_per_group,
        streaming=scenario.streaming,
        enforce_order=scenario.enforce_order,
        filter_groups_with_same_reward=scenario.filtering,
    )

    def record(group: tr.RolloutGroup) -> None:
        stream = stream_box[0]
        outcome.samples.append((stream.statistics(), outcome.cancelled))
        outcome.take_samples.append((group.batch_id, full_batches_taken[0]))
        outcome.delivered.append(group)
        if sum(d.batch_id == group.batch_id for d in outcome.delivered) == g:
            full_batches_taken[0] += 1

    def wants_more() -> bool:
        limit = scenario.take_limit
        return limit is None or len(outcome.delivered) < limit

    async def consume(stream: tr.RolloutStream) -> None:
        takes = 0
        while wants_more():
            pause = scenario.pauses[takes % len(scenario.pauses)]
            method = scenario.methods[takes % len(scenario.methods)]
            takes += 1
            if pause is not None:
                await trio.sleep(pause)
            if method == "receive":
                try:
                    record(await stream.receive())
                except trio.EndOfChannel:
                    outcome.ended = True
                    return
            elif method == "timed_receive":
                # A receive cancelled while it waits must lose nothing.
                with trio.move_on_after(0.75):
                    try:
                        record(await stream.receive())
                    except trio.EndOfChannel:
                        outcome.ended = True
                        return
            elif method == "iterate":
                async for group in stream:
                    record(group)
                    break
                else:
                    outcome.ended = True
                    return
            else:
                if method == "try_next":
                    group = stream.try_next()
                    got = [] if group is None else [group]
                else:
                    want = scenario.drain_size
                    if scenario.take_limit is not None:
                        want = min(want, scenario.take_limit - len(outcome.delivered))
                    got = stream.drain(want)
                for group in got:
                    record(group)
                if not got:
                    if not scenario.streaming and len(outcome.delivered) == g:
                        outcome.ended = True
                        return
                    # Nothing ready: wait a little virtual time (a plain checkpoint would
                    # keep the run loop busy and the MockClock from ever jumping).
                    await trio.sleep(max(pause or 0.0, 0.25))
        if scenario.leave_by_raising:
            outcome.consumer_error = ConsumerError("consumer leaves")
            raise outcome.consumer_error

    async def main() -> None:
        with trio.fail_after(HANG_AFTER):
            before = set(live.live)
            try:
                with trio.move_on_after(
                    math.inf if scenario.cancel_after is None else scenario.cancel_after
                ) as outer:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        cm = agent.get_grouped_rollouts(req)
                    outcome.warned = any(issubclass(w.category, RuntimeWarning) for w in caught)
                    async with cm as stream:
                        stream_box.append(stream)
                        await consume(stream)
                outcome.outer_cancelled = outer.cancelled_caught
            except Exception as exc:  # judged by the tests; Cancelled must propagate
                outcome.error = exc
            finally:
                outcome.calls = agent.calls
                outcome.exited = agent.exited
                outcome.in_flight_after_exit = agent.in_flight
                outcome.max_in_flight = agent.max_in_flight
                outcome.leftover_tasks = [t.name for t in live.live - before]
                outcome.leftover_nurseries = len(trio.lowlevel.current_task().child_nurseries)
                if stream_box:
                    outcome.final = stream_box[0].statistics()
                outcome.virtual_time = trio.current_time()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0), instruments=[live])
    return outcome


# ------------------------------------------------------------------------- strategies

_LATENCIES = st.sampled_from([None, 0.0, 0.5, 1.0, 2.0, 3.0, 5.0])
_PAUSES = st.sampled_from([None, 0.0, 0.5, 1.0, 3.0, 10.0])
_METHODS: tuple[Method, ...] = ("receive", "timed_receive", "try_next", "drain", "iterate")


@st.composite
def scenarios(
    draw: st.DrawFn,
    *,
    streaming: bool | None = None,
    enforce_order: bool | None = None,
    filtering: bool | None = None,
    failures: bool = True,
    early_exit: bool = True,
    cancel: bool = True,
) -> Scenario:
    """Scenarios; a keyword fixes that dimension (``failures=False`` etc. turn one off)."""
    g = draw(st.integers(1, 4))
    streaming = draw(st.booleans()) if streaming is None else streaming
    filtering = draw(st.booleans()) if filtering is None else filtering
    equal = draw(st.lists(st.booleans(), min_size=1, max_size=6))
    if filtering:
        # At least one call in the cycle has distinct rewards, so every slot fills.
        equal[draw(st.integers(0, len(equal) - 1))] = False
    fail_points: tuple[tuple[int, type[Exception]], ...] = ()
    if failures:
        points = draw(st.lists(st.integers(0, 24), max_size=2, unique=True))
        fail_points = tuple(zip(points, (BoomA, BoomB), strict=False))
    if streaming:
        take_limit: int | None = draw(st.integers(0 if early_exit else 1, 3 * g + 3))
    elif early_exit:
        take_limit = draw(st.none() | st.integers(0, g))
    else:
        take_limit = None
    return Scenario(
        num_groups=g,
        parallel_generation_tasks=draw(st.integers(g, 16)),
        buffer_size=draw(st.integers(0, 4)),
        rollouts_per_group=draw(st.integers(2 if filtering else 1, 3)),
        streaming=streaming,
        enforce_order=draw(st.booleans()) if enforce_order is None else enforce_order,
        filtering=filtering,
        latencies=tuple(draw(st.lists(_LATENCIES, min_size=1, max_size=8))),
        equal_rewards=tuple(equal),
        failures=fail_points,
        take_limit=take_limit,
        leave_by_raising=early_exit and draw(st.booleans()),
        methods=tuple(draw(st.lists(st.sampled_from(_METHODS), min_size=1, max_size=4))),
        drain_size=draw(st.integers(1, 3)),
        pauses=tuple(draw(st.lists(_PAUSES, min_size=1, max_size=5))),
        cancel_after=draw(st.none() | st.floats(0, 30)) if cancel else None,
    )


def exception_leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in exception_leaves(sub)]
    return [exc]
