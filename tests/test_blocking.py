"""The sync bridge (DESIGN.md, "The sync bridge"): a grouped pipeline driven from plain
synchronous code, with Trio running in a background thread.

These tests run in real time. Ordering comes from handshakes, never from sleeps: a
:class:`Gate` holds ``group_rollout`` calls until the test opens it, and counts the calls
that reached it and the calls that finished. ``WAIT`` bounds every handshake only as a
safety net; no passing test comes near it.
"""

from __future__ import annotations

import math
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

import pytest
import trio
from _fakes import request

import trio_rollouts as tr
from trio_rollouts.testing import ScriptedAgent, rollouts

#: Safety net for every wait; a passing test never waits this long.
WAIT = 10.0


class Boom(Exception):
    pass


class Gate:
    """Calls after the first ``instant`` ones wait here until :meth:`open` is called from
    the test's thread. Counts arrivals, finishes and cancellations (thread-safely)."""

    def __init__(self, instant: int = 0) -> None:
        self.instant = instant
        self._cond = threading.Condition()
        self._token: trio.lowlevel.TrioToken | None = None
        self._opened: trio.Event | None = None
        self.arrived = 0
        self.finished = 0
        self.cancelled = 0

    def _count(self, field: str) -> None:
        with self._cond:
            setattr(self, field, getattr(self, field) + 1)
            self._cond.notify_all()

    async def script(self, agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        if self._opened is None:
            self._token = trio.lowlevel.current_trio_token()
            self._opened = trio.Event()
        if agent.calls > self.instant:
            self._count("arrived")
            try:
                await self._opened.wait()
            except trio.Cancelled:
                self._count("cancelled")
                raise
        # Counted before returning: the worker puts the group in the stream's buffer
        # without a checkpoint, so a later call from the test's thread finds it there.
        self._count("finished")
        return rollouts([0.0, 1.0])

    def wait_for(self, field: str, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: getattr(self, field) >= n, WAIT), (field, n)

    def open(self) -> None:
        assert self._token is not None
        assert self._opened is not None
        trio.from_thread.run_sync(self._opened.set, trio_token=self._token)

    def open_from_trio(self) -> None:
        """:meth:`open`, called from the Trio thread itself."""
        assert self._opened is not None
        self._opened.set()


def gated(gate: Gate, *, tasks: int = 2, buffer_size: int = 4) -> ScriptedAgent:
    return ScriptedAgent(
        script=gate.script, parallel_generation_tasks=tasks, buffer_size=buffer_size
    )


def returns_within(seconds: float, fn: Callable[[], object]) -> object:
    """Run ``fn`` and fail, instead of hanging, if it does not return in time."""
    result: list[object] = []
    caller = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    caller.start()
    caller.join(seconds)
    assert not caller.is_alive(), f"blocked for more than {seconds} s"
    assert result, "raised"
    return result[0]


def new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before]


def slots(groups: list[tr.RolloutGroup]) -> list[tuple[int, int]]:
    return sorted((g.batch_id, g.index_in_batch) for g in groups)


# ------------------------------------------------------------------------ receiving


def test_take_blocks_until_n_groups_have_arrived() -> None:
    # Two batches of two are in flight; three calls finish at once, the fourth waits. A
    # fifth call can only start once take() has taken a whole batch: take() is running,
    # and it cannot have 5 groups before the gate opens.
    gate = Gate(instant=3)
    agent = gated(gate, tasks=4)

    def open_once_take_is_waiting() -> None:
        gate.wait_for("arrived", 2)
        gate.open()

    opener = threading.Thread(target=open_once_take_is_waiting)
    with tr.blocking_grouped_rollouts(agent, request(num_groups=2, streaming=True)) as stream:
        opener.start()
        groups = stream.take(5, timeout=WAIT)
        opener.join()

    assert len(groups) == 5


def test_drain_returns_nothing_at_once_when_no_group_is_ready() -> None:
    gate = Gate()
    with tr.blocking_grouped_rollouts(gated(gate), request(streaming=True)) as stream:
        gate.wait_for("arrived", 2)
        assert returns_within(WAIT, lambda: stream.drain(4)) == []


def test_try_next_returns_none_at_once_when_no_group_is_ready() -> None:
    gate = Gate()
    with tr.blocking_grouped_rollouts(gated(gate), request(streaming=True)) as stream:
        gate.wait_for("arrived", 2)
        assert returns_within(WAIT, stream.try_next) is None


def test_drain_returns_exactly_the_groups_that_are_ready() -> None:
    gate = Gate(instant=3)
    agent = gated(gate, tasks=3, buffer_size=3)
    with tr.blocking_grouped_rollouts(agent, request(streaming=True)) as stream:
        gate.wait_for("finished", 3)
        groups = stream.drain(5)
        assert stream.drain(5) == []

    assert len(groups) == 3


def test_get_times_out_when_nothing_comes_and_the_group_arrives_on_the_next_call() -> None:
    gate = Gate()
    with tr.blocking_grouped_rollouts(gated(gate), request()) as stream:
        gate.wait_for("arrived", 1)
        with pytest.raises(TimeoutError, match=r"no rollout group arrived within 0\.05 s"):
            stream.get(timeout=0.05)
        gate.open()
        group = stream.get(timeout=WAIT)

    assert (group.batch_id, group.index_in_batch) == (0, 0)


def test_take_timeout_keeps_the_groups_received_for_the_next_call() -> None:
    gate = Gate(instant=2)
    agent = gated(gate, tasks=3, buffer_size=3)
    with tr.blocking_grouped_rollouts(agent, request(num_groups=3)) as stream:
        gate.wait_for("finished", 2)
        gate.wait_for("arrived", 1)
        with pytest.raises(TimeoutError, match="only 2 of 3"):
            stream.take(3, timeout=0.05)
        gate.open()
        groups = stream.take(3, timeout=WAIT)

    assert slots(groups) == [(0, 0), (0, 1), (0, 2)]


def test_get_with_zero_timeout_returns_a_ready_group() -> None:
    gate = Gate(instant=1)
    with tr.blocking_grouped_rollouts(gated(gate), request(streaming=True)) as stream:
        gate.wait_for("finished", 1)
        group = stream.get(timeout=0)

    assert (group.batch_id, group.index_in_batch) == (0, 0)


def test_take_with_zero_timeout_returns_ready_groups() -> None:
    gate = Gate(instant=2)
    with tr.blocking_grouped_rollouts(gated(gate), request(streaming=True)) as stream:
        gate.wait_for("finished", 2)
        groups = stream.take(2, timeout=0)

    assert slots(groups) == [(0, 0), (1, 0)]


def test_get_with_zero_timeout_on_an_ended_stream_raises_end_of_channel() -> None:
    gate = Gate(instant=1)
    with tr.blocking_grouped_rollouts(gated(gate), request()) as stream:
        gate.wait_for("finished", 1)
        stream.get(timeout=WAIT)
        with pytest.raises(trio.EndOfChannel):
            stream.get(timeout=0)


def test_take_with_zero_timeout_returns_the_last_groups_of_an_ended_stream() -> None:
    gate = Gate(instant=2)
    with tr.blocking_grouped_rollouts(gated(gate), request(num_groups=2)) as stream:
        gate.wait_for("finished", 2)
        groups = stream.take(3, timeout=0)

    assert slots(groups) == [(0, 0), (0, 1)]


def test_iterating_a_non_streaming_request_yields_num_groups_groups_then_stops() -> None:
    agent = gated(Gate(instant=4), tasks=4)
    with tr.blocking_grouped_rollouts(agent, request(num_groups=4)) as stream:
        groups = list(stream)

    assert slots(groups) == [(0, 0), (0, 1), (0, 2), (0, 3)]


# ------------------------------------------------------------------------ failures


def raise_boom(chaining: str) -> NoReturn:
    """Raise ``Boom`` with no chaining (``"none"``), with a ``__cause__`` (``"cause"``:
    ``raise ... from``), or with a ``__context__`` (``"context"``: raised while handling
    another exception)."""
    if chaining == "cause":
        try:
            {}["answer"]
        except KeyError as exc:
            raise Boom("the agent failed") from exc
    if chaining == "context":
        try:
            {}["answer"]
        except KeyError:
            raise Boom("the agent failed")  # noqa: B904 - the context is the point
    raise Boom("the agent failed")


def failing_after(gate: Gate, chaining: str = "none") -> ScriptedAgent:
    """An agent whose one call fails once the gate opens (so, after the block is entered:
    a pipeline that fails at once may fail before ``__enter__`` returns)."""

    async def failing_group_rollout(
        agent: ScriptedAgent, req: tr.GroupedRolloutRequest
    ) -> list[tr.Rollout]:
        await gate.script(agent, req)
        raise_boom(chaining)

    return ScriptedAgent(script=failing_group_rollout, parallel_generation_tasks=1)


def raised_in(exc: BaseException) -> list[str]:
    return [frame.name for frame in traceback.extract_tb(exc.__traceback__)]


def test_a_failure_is_raised_as_itself_in_the_callers_thread_at_its_next_call() -> None:
    gate = Gate()
    agent = failing_after(gate)
    with tr.blocking_grouped_rollouts(agent, request(streaming=True)) as stream:
        gate.wait_for("arrived", 1)
        gate.open()
        with pytest.raises(Boom, match="the agent failed") as info:
            stream.take(1, timeout=WAIT)

    assert "failing_group_rollout" in raised_in(info.value)


def test_a_failure_is_raised_at_exit_when_the_caller_made_no_call() -> None:
    gate = Gate()
    agent = failing_after(gate)
    with (
        pytest.raises(Boom, match="the agent failed") as info,
        tr.blocking_grouped_rollouts(agent, request(streaming=True)),
    ):
        gate.wait_for("arrived", 1)
        gate.open()
        gate.wait_for("finished", 1)  # counted just before the raise, in the same step

    assert "failing_group_rollout" in raised_in(info.value)
    assert agent.in_flight == 0


def test_a_failure_is_raised_once_then_calls_say_the_pipeline_stopped() -> None:
    gate = Gate()
    agent = failing_after(gate)
    with tr.blocking_grouped_rollouts(agent, request(streaming=True)) as stream:
        gate.wait_for("arrived", 1)
        gate.open()
        with pytest.raises(Boom):
            stream.get(timeout=WAIT)
        with pytest.raises(RuntimeError, match="stopped after an error"):
            stream.get(timeout=WAIT)
    # The exit raises nothing: the failure was already raised.


# ------------------------------------------------------------------------ clean errors

#: The calls that take groups, each of which raises the pipeline's failure.
TAKING_CALLS: dict[str, Callable[[tr.BlockingRolloutStream], object]] = {
    "take": lambda stream: stream.take(1, timeout=WAIT),
    "get": lambda stream: stream.get(timeout=WAIT),
    "iteration": lambda stream: list(stream),
}


def open_the_gate_when_the_caller_waits(monkeypatch: pytest.MonkeyPatch, gate: Gate) -> None:
    """Open ``gate`` from inside the caller's ``RolloutStream.receive``: the failure then
    arrives while the caller's call is waiting in the stream, so the call sees the
    stream close under it (the route on which the error used to be chained to an
    unrelated ``trio.ClosedResourceError``)."""
    receive = tr.RolloutStream.receive

    async def receive_after_opening_the_gate(stream: tr.RolloutStream) -> tr.RolloutGroup:
        gate.open_from_trio()
        return await receive(stream)

    monkeypatch.setattr(tr.RolloutStream, "receive", receive_after_opening_the_gate)


def assert_chained_as_raised(exc: BaseException, chaining: str) -> None:
    """``exc`` carries the chaining it was raised with in the agent, and nothing else."""
    if chaining == "none":
        assert exc.__context__ is None
        assert exc.__cause__ is None
        assert exc.__suppress_context__ is False
    elif chaining == "cause":
        assert isinstance(exc.__cause__, KeyError)
        assert exc.__context__ is exc.__cause__
        assert exc.__suppress_context__ is True
    else:
        assert isinstance(exc.__context__, KeyError)
        assert exc.__cause__ is None
        assert exc.__suppress_context__ is False


@pytest.mark.parametrize("chaining", ["none", "cause", "context"])
@pytest.mark.parametrize("call", list(TAKING_CALLS))
def test_a_failure_reaching_a_waiting_call_is_raised_with_its_own_chaining_only(
    monkeypatch: pytest.MonkeyPatch, call: str, chaining: str
) -> None:
    gate = Gate()
    agent = failing_after(gate, chaining)
    open_the_gate_when_the_caller_waits(monkeypatch, gate)
    with tr.blocking_grouped_rollouts(agent, request(streaming=True)) as stream:
        gate.wait_for("arrived", 1)
        with pytest.raises(Boom, match="the agent failed") as info:
            TAKING_CALLS[call](stream)

    assert gate.finished == 1
    assert_chained_as_raised(info.value, chaining)
    assert "ClosedResourceError" not in "".join(traceback.format_exception(info.value))


@pytest.mark.parametrize("chaining", ["none", "cause", "context"])
def test_a_failure_raised_at_exit_carries_its_own_chaining_only(chaining: str) -> None:
    gate = Gate()
    agent = failing_after(gate, chaining)
    with (
        pytest.raises(Boom, match="the agent failed") as info,
        tr.blocking_grouped_rollouts(agent, request(streaming=True)),
    ):
        gate.wait_for("arrived", 1)
        gate.open()
        gate.wait_for("finished", 1)

    assert_chained_as_raised(info.value, chaining)


# ------------------------------------------------------------------------ shutdown


def test_leaving_the_block_cancels_every_call_in_flight_and_joins_the_thread() -> None:
    before = set(threading.enumerate())
    gate = Gate()
    agent = gated(gate, tasks=4)
    with tr.blocking_grouped_rollouts(agent, request(num_groups=2, streaming=True)):
        gate.wait_for("arrived", 4)
        assert len(new_threads(before)) == 1

    assert new_threads(before) == []
    assert gate.cancelled == 4
    assert agent.in_flight == 0
    assert agent.calls == agent.exited == 4


def test_a_hundred_open_close_cycles_leave_no_thread_behind() -> None:
    before = set(threading.enumerate())
    for _ in range(100):
        agent = gated(Gate(instant=1))
        with tr.blocking_grouped_rollouts(agent, request(streaming=True)) as stream:
            stream.get(timeout=WAIT)
        assert agent.in_flight == 0

    assert new_threads(before) == []


def test_keyboard_interrupt_in_the_block_stops_the_pipeline_and_propagates() -> None:
    before = set(threading.enumerate())
    gate = Gate()
    agent = gated(gate)
    with (
        pytest.raises(KeyboardInterrupt),
        tr.blocking_grouped_rollouts(agent, request(streaming=True)),
    ):
        gate.wait_for("arrived", 2)
        raise KeyboardInterrupt

    assert new_threads(before) == []
    assert gate.cancelled == 2
    assert agent.in_flight == 0


# ------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    ("call", "value"),
    [
        (lambda stream: stream.take(-1), "-1"),
        (lambda stream: stream.take(1, timeout=-1), "-1"),
        (lambda stream: stream.get(timeout=-1), "-1"),
        (lambda stream: stream.get(timeout=math.nan), "nan"),
        (lambda stream: stream.drain(-1), "-1"),
    ],
    ids=["take(-1)", "take(timeout=-1)", "get(timeout=-1)", "get(timeout=nan)", "drain(-1)"],
)
def test_bad_arguments_raise_value_error_naming_the_value(
    call: Callable[[tr.BlockingRolloutStream], object], value: str
) -> None:
    gate = Gate()
    with tr.blocking_grouped_rollouts(gated(gate), request(streaming=True)) as stream:
        with pytest.raises(ValueError, match=value):
            call(stream)
        assert gate.finished == 0


def test_a_bad_request_raises_before_any_thread_starts() -> None:
    before = set(threading.enumerate())
    agent = gated(Gate(), tasks=1)

    with pytest.raises(ValueError, match=r"parallel_generation_tasks \(1\) must be >= num_groups"):
        tr.blocking_grouped_rollouts(agent, request(num_groups=2))

    assert new_threads(before) == []
    assert agent.calls == 0
