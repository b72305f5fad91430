"""The sync bridge's weight updates: ``with stream.weight_update(mode) as update: ...``.

The bridge holds the async stream's weight update open in its Trio thread while the body
runs in the caller's thread. These tests run in real time, against ``EmbeddedInference``
with no latency (or ``RawInterface``), so ordering comes from handshakes: a :class:`Gate`
holds ``group_rollout`` calls, before they reach the backend, until the test opens it,
and counts (thread-safely) the calls that reached it, finished, or were cancelled there.
Where a test must see that nothing happens (a paused backend), it waits for a ``take``
timeout of ``QUIET`` seconds, which a broken pause would beat by orders of magnitude.
``WAIT`` bounds every handshake only as a safety net.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence

import attrs
import pytest
import trio
from _fakes import Backend as ScriptedBackend
from _fakes import RawInterface

import trio_rollouts as tr
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceInterface,
    LatencyModel,
    WeightUpdateError,
    WeightUpdateMode,
)
from trio_rollouts.pipeline._stream import source_of

#: Safety net for every wait; a passing test never waits this long.
WAIT = 10.0
#: How long a test watches for something that must not happen.
QUIET = 0.2

MODES: list[WeightUpdateMode] = ["drain", "restart", "keep", "abort"]


class Boom(Exception):
    pass


class Gate:
    """Calls after the first ``instant`` ones wait here until :meth:`open` is called from
    the test's thread. Counts arrivals, finishes (just before a call returns or raises)
    and cancellations, thread-safely."""

    def __init__(self, instant: int = 0) -> None:
        self.instant = instant
        self._cond = threading.Condition()
        self._token: trio.lowlevel.TrioToken | None = None
        self._opened: trio.Event | None = None
        self.calls = 0
        self.arrived = 0
        self.finished = 0
        self.cancelled = 0

    def _count(self, field: str) -> None:
        with self._cond:
            setattr(self, field, getattr(self, field) + 1)
            self._cond.notify_all()

    async def enter(self) -> None:
        if self._opened is None:
            self._token = trio.lowlevel.current_trio_token()
            self._opened = trio.Event()
        self.calls += 1
        if self.calls > self.instant:
            self._count("arrived")
            try:
                await self._opened.wait()
            except trio.Cancelled:
                self._count("cancelled")
                raise

    def finish(self) -> None:
        self._count("finished")

    def wait_for(self, field: str, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: getattr(self, field) >= n, WAIT), (field, n)

    def open(self) -> None:
        assert self._token is not None
        assert self._opened is not None
        trio.from_thread.run_sync(self._opened.set, trio_token=self._token)


@attrs.define
class GatedAgent(tr.GroupedRolloutGenerator):
    """Passes the gate, then makes one inference call and returns a group whose rollouts
    carry the call's epoch stamps. With ``fail``, the first call past the gate raises
    ``Boom`` instead."""

    gate: Gate = attrs.field(kw_only=True)
    fail: bool = attrs.field(default=False, kw_only=True)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await self.gate.enter()
        if self.fail:
            self.fail = False
            self.gate.finish()
            raise Boom("the agent failed")
        iface = request.inference_interface
        response = await iface.agenerate(iface.prepare_request("q"))
        self.gate.finish()  # no checkpoint after: the group is in the stream when seen
        return [
            tr.Rollout(
                trajectory=[response.raw_text or ""],
                reward=float(i),
                policy_epoch=[list(response.policy_epoch)],
            )
            for i in range(request.rollouts_per_group)
        ]


def embedded() -> EmbeddedInference:
    return EmbeddedInference(
        policy=lambda prompt: (["abcd"], [1.0]),
        latency=LatencyModel(first_token=0.0, per_token=0.0, distribution="constant"),
    )


def agent(gate: Gate, *, tasks: int = 2, buffer_size: int = 4, fail: bool = False) -> GatedAgent:
    return GatedAgent(
        gate=gate, fail=fail, parallel_generation_tasks=tasks, buffer_size=buffer_size
    )


def request(
    interface: InferenceInterface,
    *,
    num_groups: int = 2,
    streaming: bool = True,
    max_staleness: int | None = None,
    enforce_order: bool = False,
) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=num_groups,
        rollouts_per_group=2,
        inference_interface=interface,
        streaming=streaming,
        max_staleness=max_staleness,
        enforce_order=enforce_order,
    )


def ledger_ok(stream: tr.BlockingRolloutStream) -> tr.RolloutStreamStatistics:
    stats = stream.statistics()
    assert stats.unaccounted == 0, stats
    return stats


def stamps(groups: Sequence[tr.RolloutGroup]) -> list[list[list[tuple[int, int]]]]:
    return [rollout.policy_epoch for group in groups for rollout in group.rollouts]


def slots(groups: Sequence[tr.RolloutGroup]) -> list[tuple[int, int]]:
    return [(g.batch_id, g.index_in_batch) for g in groups]


def wait_until(condition: Callable[[], bool]) -> None:
    """Poll a condition that another thread makes true (a flag of the Trio thread)."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def returns_within(seconds: float, fn: Callable[[], object]) -> object:
    """Run ``fn`` in a thread and fail, instead of hanging, if it does not end in time;
    return its result or raise its exception."""
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:
            outcome.append((False, exc))

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(seconds)
    assert not caller.is_alive(), f"blocked for more than {seconds} s"
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value


def new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before]


# --------------------------------------------------------------------------- modes


def test_drain_lets_calls_in_flight_finish_then_holds_new_ones() -> None:
    iface = EmbeddedInference(
        policy=lambda prompt: (["abcd"], [1.0]),
        latency=LatencyModel(first_token=0.05, per_token=0.0, distribution="constant"),
    )
    gate = Gate(instant=10**6)
    with tr.blocking_grouped_rollouts(agent(gate), request(iface)) as stream:
        wait_until(lambda: gate.calls == 2)
        with stream.weight_update("drain") as update:
            assert (update.epoch, update.mode, update.held) == (1, "drain", 0)
            stats = stream.statistics()
            assert (stats.in_flight, stats.completed, stats.started) == (0, 2, 2)
            assert stream.policy_epoch == 0  # the old epoch until the body returns
            finished = stream.take(2, timeout=WAIT)  # finished groups can be taken
            assert [g.start_epoch for g in finished] == [0, 0]
            assert stamps(finished) == [[[(0, 0)]]] * 4
            with pytest.raises(TimeoutError):
                stream.take(1, timeout=QUIET)  # taking freed slots, but nothing starts
            assert stream.statistics().started == 2
        assert stream.policy_epoch == 1
        later = stream.take(2, timeout=WAIT)
        assert [g.start_epoch for g in later] == [1, 1]
        assert stamps(later) == [[[(0, 1)]]] * 4
        stats = ledger_ok(stream)
        assert (stats.policy_epoch, stats.weight_updates) == (1, 1)
    assert stream.policy_epoch == 1  # readable after the block
    assert iface.policy_epoch == 1


def test_restart_cancels_calls_in_flight_and_generates_their_slots_again() -> None:
    iface = embedded()
    gate = Gate()
    with tr.blocking_grouped_rollouts(agent(gate), request(iface)) as stream:
        gate.wait_for("arrived", 2)
        with stream.weight_update("restart") as update:
            assert update.held == 2
            assert gate.cancelled == 2  # exited before the body began
            stats = ledger_ok(stream)
            assert (stats.in_flight, stats.restarted) == (0, 2)
        gate.wait_for("arrived", 4)  # the slots, generated again
        gate.open()
        groups = stream.take(2, timeout=WAIT)
        assert sorted(slots(groups)) == [(0, 0), (0, 1)]
        assert [g.start_epoch for g in groups] == [1, 1]
        assert stamps(groups) == [[[(0, 1)]]] * 4
        ledger_ok(stream)


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_keep_and_abort_hold_calls_at_the_backend_until_the_body_returns(
    mode: WeightUpdateMode,
) -> None:
    iface = embedded()
    gate = Gate()
    with tr.blocking_grouped_rollouts(agent(gate), request(iface)) as stream:
        gate.wait_for("arrived", 2)
        with stream.weight_update(mode) as update:
            assert (update.mode, update.held) == (mode, 2)
            gate.open()  # the calls reach the paused backend, which holds them
            with pytest.raises(TimeoutError):
                stream.take(1, timeout=QUIET)
            stats = stream.statistics()
            assert (stats.in_flight, stats.completed) == (2, 0)
        groups = stream.take(2, timeout=WAIT)
        assert [g.start_epoch for g in groups] == [0, 0]  # started before the update
        assert stamps(groups) == [[[(0, 1)]]] * 4  # generated under the new weights
        stats = ledger_ok(stream)
        assert (stats.policy_epoch, stats.weight_updates, stats.mixed) == (1, 1, 0)
    assert iface.policy_epoch == 1


def test_updates_follow_one_another_with_explicit_epochs() -> None:
    iface = embedded()
    gate = Gate(instant=10**6)
    with tr.blocking_grouped_rollouts(agent(gate), request(iface)) as stream:
        for epoch, mode in zip([3, 4, 10, 11], MODES, strict=True):
            with stream.weight_update(mode, epoch=epoch) as update:
                assert update.epoch == epoch
            assert stream.policy_epoch == epoch
        with stream.weight_update() as update:
            assert update.epoch == 12
        groups = stream.take(4, timeout=WAIT)
        assert stamps(groups)[-1] == [[(0, 12)]]
        stats = ledger_ok(stream)
        assert stats.weight_updates == 5


# --------------------------------------------------------------------------- a failing body


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("mode", MODES)
def test_a_body_that_raises_resumes_under_the_old_epoch_and_propagates_unchanged(
    mode: WeightUpdateMode, error: type[BaseException]
) -> None:
    iface = embedded()
    gate = Gate(instant=10**6)
    raised = error("the trainer failed")
    with tr.blocking_grouped_rollouts(agent(gate), request(iface)) as stream:
        stream.take(2, timeout=WAIT)
        with pytest.raises(error) as info, stream.weight_update(mode):
            raise raised
        assert info.value is raised
        assert raised.__context__ is None
        assert raised.__cause__ is None
        assert getattr(raised, "__notes__", []) == []
        assert "_BodyFailed" not in "".join(traceback.format_exception(raised))
        assert stream.policy_epoch == 0
        assert iface.policy_epoch == 0
        groups = stream.take(4, timeout=WAIT)  # generation goes on, under epoch 0
        assert {g.start_epoch for g in groups} == {0}
        assert stamps(groups) == [[[(0, 0)]]] * 8
        stats = ledger_ok(stream)
        assert (stats.policy_epoch, stats.weight_updates) == (0, 0)
        with stream.weight_update(mode) as update:  # the next update is as usual
            assert update.epoch == 1
        assert stream.policy_epoch == 1


#: The scripted backend, its calls instant (these tests run on the real clock).
Backend = functools.partial(ScriptedBackend, latency=0.0)


def test_a_resume_that_fails_after_a_failed_body_is_a_note_on_the_bodys_exception() -> None:
    bad = Backend(fail_resume=True)
    gate = Gate(instant=10**6)
    raised = Boom("the trainer failed")
    with tr.blocking_grouped_rollouts(agent(gate), request(RawInterface())) as stream:
        with pytest.raises(Boom) as info, stream.weight_update("restart", backends=[bad]):
            raise raised
        assert info.value is raised
        assert raised.__notes__ == [
            "resuming failed too: RuntimeError: resume endpoint answered 500"
        ]
        assert bad.log == ["pause restart", "resume 0"]
        assert stream.policy_epoch == 0
        ledger_ok(stream)


def test_a_resume_that_fails_after_the_body_returned_is_raised_at_the_exit() -> None:
    good, bad = Backend(), Backend(fail_resume=True)
    gate = Gate(instant=10**6)
    with tr.blocking_grouped_rollouts(agent(gate), request(RawInterface())) as stream:
        with (
            pytest.raises(WeightUpdateError, match="resuming 1 backend") as info,
            stream.weight_update("keep", backends=[good, bad]),
        ):
            pass
        assert isinstance(info.value.__cause__, RuntimeError)
        assert good.log == bad.log == ["pause keep", "resume 1"]
        assert stream.policy_epoch == 1  # the body returned: the epoch moved
        assert len(stream.take(2, timeout=WAIT)) == 2  # nothing is left paused
        ledger_ok(stream)


# --------------------------------------------------------------------------- errors of entering


def test_errors_of_entering_are_raised_as_themselves_and_pause_nothing() -> None:
    iface = embedded()
    gate = Gate(instant=10**6)
    with tr.blocking_grouped_rollouts(agent(gate), request(iface)) as stream:
        with (
            pytest.raises(ValueError, match=r"mode must be one of 'drain'.*got 'pause'") as v,
            stream.weight_update("pause"),  # type: ignore[arg-type]
        ):
            pytest.fail("entered")
        assert type(v.value) is ValueError
        assert v.value.__context__ is None
        with (
            pytest.raises(ValueError, match=r"policy_epoch \(0\), got 0"),
            stream.weight_update(epoch=0),
        ):
            pytest.fail("entered")
        with (
            pytest.raises(TypeError, match="epoch must be an int"),
            stream.weight_update(epoch=1.5),  # type: ignore[arg-type]
        ):
            pytest.fail("entered")
        with (
            pytest.raises(TypeError, match=r"backends\[0\] must be an InferenceInterface"),
            stream.weight_update(backends=["x"]),  # type: ignore[list-item]
        ):
            pytest.fail("entered")
        with (
            pytest.raises(TypeError, match=r"mode='keep'.*RawInterface is not"),
            stream.weight_update("keep", backends=[RawInterface()]),
        ):
            pytest.fail("entered")
        with stream.weight_update() as update:
            with (
                pytest.raises(RuntimeError, match="already in progress"),
                stream.weight_update(epoch=5),
            ):
                pytest.fail("entered")
            assert update.epoch == 1
        assert stream.policy_epoch == 1
        assert stream.statistics().weight_updates == 1
        groups = stream.take(4, timeout=WAIT)
        assert stamps(groups)[-1] == [[(0, 1)]]
        ledger_ok(stream)


def test_a_context_manager_enters_once() -> None:
    gate = Gate(instant=10**6)
    with tr.blocking_grouped_rollouts(agent(gate), request(RawInterface())) as stream:
        update = stream.weight_update()
        with update:
            pass
        with pytest.raises(RuntimeError, match="entered already"), update:
            pytest.fail("entered")
        assert stream.policy_epoch == 1


def test_a_failing_pause_resumes_what_was_paused_and_raises_weight_update_error() -> None:
    iface = embedded()
    bad = Backend(fail_pause=True)
    gate = Gate(instant=10**6)
    with tr.blocking_grouped_rollouts(agent(gate), request(iface)) as stream:
        with (
            pytest.raises(WeightUpdateError, match=r"pausing Backend.*failed") as info,
            stream.weight_update("keep", backends=[iface, bad]),
        ):
            pytest.fail("entered")
        assert isinstance(info.value.__cause__, RuntimeError)
        assert bad.log == ["pause keep", "resume 0"]
        assert stream.policy_epoch == 0
        groups = stream.take(4, timeout=WAIT)  # the embedded backend was resumed
        assert stamps(groups)[-1] == [[(0, 0)]]
        ledger_ok(stream)


def test_outside_the_block_weight_update_is_refused_and_policy_epoch_needs_an_open() -> None:
    gate = Gate(instant=10**6)
    context = tr.blocking_grouped_rollouts(agent(gate), request(RawInterface()))
    stream = context.__enter__()
    context.__exit__(None, None, None)
    with (
        pytest.raises(RuntimeError, match="inside its 'with blocking_grouped_rollouts"),
        stream.weight_update(),
    ):
        pytest.fail("entered")
    assert stream.policy_epoch == 0
    never_opened = tr.BlockingRolloutStream(agent(gate), request(RawInterface()))
    with pytest.raises(RuntimeError, match="inside its 'with blocking_grouped_rollouts"):
        _ = never_opened.policy_epoch


# --------------------------------------------------------------------------- pipeline failures


def test_a_pipeline_failure_during_the_body_reaches_the_caller() -> None:
    gate = Gate()
    iface = embedded()
    with tr.blocking_grouped_rollouts(agent(gate, fail=True), request(iface)) as stream:
        gate.wait_for("arrived", 2)

        def update_while_the_pipeline_fails() -> None:
            # Raised at the update's exit, or by the next call: never lost, never a hang.
            with stream.weight_update("keep"):
                gate.open()
                gate.wait_for("finished", 1)
            stream.take(1, timeout=WAIT)

        with pytest.raises(Boom, match="the agent failed") as info:
            returns_within(WAIT, update_while_the_pipeline_fails)
        assert info.value.__context__ is None
        assert "ClosedResourceError" not in "".join(traceback.format_exception(info.value))
        with pytest.raises(RuntimeError, match="stopped after an error"):
            stream.take(1, timeout=WAIT)


def test_a_pipeline_failure_during_a_failing_body_is_raised_by_the_next_call() -> None:
    gate = Gate()
    with tr.blocking_grouped_rollouts(agent(gate, fail=True), request(RawInterface())) as stream:
        gate.wait_for("arrived", 2)
        raised = KeyError("the trainer failed")
        with pytest.raises(KeyError) as info, stream.weight_update("keep", backends=[Backend()]):
            gate.open()
            gate.wait_for("finished", 1)
            raise raised
        assert info.value is raised
        assert raised.__context__ is None
        with pytest.raises(Boom, match="the agent failed"):
            returns_within(WAIT, lambda: stream.take(1, timeout=WAIT))


def test_a_pipeline_failure_while_a_drain_waits_reaches_the_caller() -> None:
    gate = Gate()
    with tr.blocking_grouped_rollouts(agent(gate, fail=True), request(RawInterface())) as stream:
        gate.wait_for("arrived", 2)
        epochs = source_of(stream._stream).epochs  # type: ignore[arg-type, attr-defined]

        def open_once_the_drain_waits() -> None:
            wait_until(lambda: epochs.updating)
            gate.open()

        opener = threading.Thread(target=open_once_the_drain_waits)
        opener.start()

        def drain_while_the_pipeline_fails() -> None:
            # The drain ends when the failing call has exited: the failure is raised by
            # the enter, or (when the body began before the failure cancelled the
            # update) by the exit or the next call.
            with stream.weight_update("drain"):
                pass
            stream.take(1, timeout=WAIT)

        with pytest.raises(Boom, match="the agent failed") as info:
            returns_within(WAIT, drain_while_the_pipeline_fails)
        opener.join()
        assert info.value.__context__ is None


# --------------------------------------------------------------------------- shutdown, interrupts


def test_closing_the_stream_while_an_update_is_open_ends_it_under_the_old_epoch() -> None:
    before = set(threading.enumerate())
    iface = embedded()
    gate = Gate()
    context = tr.blocking_grouped_rollouts(agent(gate), request(iface))
    stream = context.__enter__()
    gate.wait_for("arrived", 2)
    update = stream.weight_update("keep")
    assert update.__enter__().held == 2
    # The block is left while the update is open (not nested): no hang.
    returns_within(WAIT, lambda: context.__exit__(None, None, None))
    assert new_threads(before) == []
    assert gate.cancelled == 2
    with pytest.raises(RuntimeError, match="closed while the weight update was open"):
        returns_within(WAIT, lambda: update.__exit__(None, None, None))
    assert update.__exit__(Boom, Boom("x"), None) is None  # a body's error propagates
    assert stream.policy_epoch == 0
    assert iface.policy_epoch == 0


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="signals go to the main thread",
)
def test_a_keyboard_interrupt_while_entering_gives_the_update_up() -> None:
    gate = Gate()
    with tr.blocking_grouped_rollouts(agent(gate), request(RawInterface())) as stream:
        gate.wait_for("arrived", 2)
        epochs = source_of(stream._stream).epochs  # type: ignore[arg-type, attr-defined]
        main = threading.get_ident()

        def interrupt_once_the_drain_waits() -> None:
            wait_until(lambda: epochs.updating)
            signal.pthread_kill(main, signal.SIGINT)

        interrupter = threading.Thread(target=interrupt_once_the_drain_waits)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt), stream.weight_update("drain"):
            pytest.fail("entered")
        interrupter.join()
        wait_until(lambda: not epochs.updating)  # given up, in the Trio thread
        assert stream.policy_epoch == 0
        gate.open()
        groups = stream.take(2, timeout=WAIT)
        assert [g.start_epoch for g in groups] == [0, 0]
        with stream.weight_update() as update:
            assert update.epoch == 1
        ledger_ok(stream)


def test_a_hundred_updates_leave_no_task_or_thread_behind() -> None:
    before = set(threading.enumerate())
    iface = embedded()
    gate = Gate(instant=10**6)
    with tr.blocking_grouped_rollouts(agent(gate), request(iface)) as stream:
        for i in range(100):
            mode = MODES[i % 4]
            if i % 3 == 0:
                with pytest.raises(Boom), stream.weight_update(mode):
                    raise Boom
            else:
                with stream.weight_update(mode):
                    stream.drain(4)
        assert stream.policy_epoch == sum(1 for i in range(100) if i % 3)
        assert len(stream.take(4, timeout=WAIT)) == 4
        ledger_ok(stream)
    assert new_threads(before) == []


# --------------------------------------------------------------------------- staleness


def take_times_out_keeping(stream: tr.BlockingRolloutStream, n: int, kept: int) -> None:
    """A take of ``n`` that times out once ``kept`` groups have arrived (the test has
    seen them finish); they are kept for the next call."""
    with pytest.raises(TimeoutError, match=f"only {kept} of {n}"):
        stream.take(n, timeout=QUIET)


def test_a_kept_group_that_an_update_makes_too_old_is_generated_again_in_its_slot() -> None:
    gate = Gate(instant=1)
    req = request(RawInterface(), num_groups=2, streaming=False, max_staleness=0)
    with tr.blocking_grouped_rollouts(agent(gate), req) as stream:
        gate.wait_for("finished", 1)
        gate.wait_for("arrived", 1)
        take_times_out_keeping(stream, 2, kept=1)
        assert stream.statistics().delivered == 1  # taken, and kept by the bridge
        with stream.weight_update("restart"):
            pass
        stats = ledger_ok(stream)
        assert (stats.delivered, stats.stale, stats.restarted) == (0, 1, 1)
        gate.wait_for("arrived", 3)  # both slots, generated again
        gate.open()
        groups = stream.take(2, timeout=WAIT)
        assert sorted(slots(groups)) == [(0, 0), (0, 1)]
        assert [g.start_epoch for g in groups] == [1, 1]
        assert list(stream) == []  # the batch is complete: the stream ends
        stats = ledger_ok(stream)
        assert (stats.delivered, stats.outstanding_batches) == (2, 0)


def test_a_kept_group_still_fresh_is_handed_out_as_it_is() -> None:
    gate = Gate(instant=1)
    req = request(RawInterface(), num_groups=2, streaming=False, max_staleness=1)
    with tr.blocking_grouped_rollouts(agent(gate), req) as stream:
        gate.wait_for("finished", 1)
        gate.wait_for("arrived", 1)
        take_times_out_keeping(stream, 2, kept=1)
        with stream.weight_update("restart"):
            pass
        gate.open()
        groups = stream.take(2, timeout=WAIT)
        assert [g.start_epoch for g in groups] == [0, 1]  # the kept one, then the restart
        stats = ledger_ok(stream)
        assert (stats.stale, stats.restarted) == (0, 1)


@pytest.mark.usefixtures("run_ahead")
@pytest.mark.parametrize("enforce_order", [False, True])
def test_stale_kept_groups_of_completed_batches_keep_the_stream_gap_free(
    enforce_order: bool,
) -> None:
    # W = 2 batches of G = 2 are generated; the take of 5 takes all four groups (each
    # batch it completes submits one more, whose calls wait at the gate) and times out.
    gate = Gate(instant=4)
    req = request(RawInterface(), num_groups=2, max_staleness=0, enforce_order=enforce_order)
    with tr.blocking_grouped_rollouts(agent(gate, tasks=4), req) as stream:
        gate.wait_for("finished", 4)
        take_times_out_keeping(stream, 5, kept=4)
        gate.wait_for("arrived", 4)  # batches 2 and 3, submitted by the take
        with stream.weight_update("restart") as update:
            assert update.held == 4
        stats = ledger_ok(stream)
        assert (stats.delivered, stats.stale, stats.restarted) == (0, 4, 4)
        assert stats.outstanding_batches == 4  # batches 0 and 1 are outstanding again
        gate.open()
        groups = stream.take(8, timeout=WAIT)
        assert sorted(slots(groups)) == [(b, i) for b in range(4) for i in range(2)]
        if enforce_order:
            assert slots(groups) == [(b, i) for b in range(4) for i in range(2)]
        assert {g.start_epoch for g in groups} == {1}
        stats = ledger_ok(stream)
        # Refilling batches 0 and 1 submitted no extra batch: the bound holds, and the
        # next batch is 4.
        assert stats.outstanding_batches == 2
        assert min(g.batch_id for g in stream.take(4, timeout=WAIT)) == 4


@pytest.mark.usefixtures("run_ahead")
def test_stale_kept_groups_after_a_returned_group_of_their_batch_stay_in_order() -> None:
    # The caller has group (0, 0); a take then keeps (0, 1), (1, 0), (1, 1). Regenerated,
    # they come back in order after it, with no batch lost or added.
    gate = Gate(instant=4)
    req = request(RawInterface(), num_groups=2, max_staleness=0, enforce_order=True)
    with tr.blocking_grouped_rollouts(agent(gate, tasks=4), req) as stream:
        gate.wait_for("finished", 4)
        first = stream.get(timeout=WAIT)
        take_times_out_keeping(stream, 4, kept=3)
        gate.wait_for("arrived", 4)
        with stream.weight_update("restart"):
            pass
        stats = ledger_ok(stream)
        assert (stats.delivered, stats.stale) == (1, 3)
        gate.open()
        groups = stream.take(7, timeout=WAIT)
        assert slots([first, *groups]) == [(b, i) for b in range(4) for i in range(2)]
        assert [g.start_epoch for g in groups] == [1] * 7
        stats = ledger_ok(stream)
        assert stats.outstanding_batches == 2
        assert slots(stream.take(2, timeout=WAIT)) == [(4, 0), (4, 1)]


@pytest.mark.usefixtures("run_ahead")
def test_stale_kept_groups_of_one_group_batches() -> None:
    gate = Gate(instant=2)
    req = request(RawInterface(), num_groups=1, max_staleness=0)
    with tr.blocking_grouped_rollouts(agent(gate), req) as stream:
        gate.wait_for("finished", 2)
        take_times_out_keeping(stream, 3, kept=2)
        gate.wait_for("arrived", 2)  # batches 2 and 3, submitted by the take
        with stream.weight_update("restart"):
            pass
        gate.open()
        groups = stream.take(4, timeout=WAIT)
        assert sorted(slots(groups)) == [(b, 0) for b in range(4)]
        assert {g.start_epoch for g in groups} == {1}
        stats = ledger_ok(stream)
        assert (stats.stale, stats.restarted, stats.outstanding_batches) == (2, 2, 2)


def test_a_kept_group_of_an_update_body_is_checked_at_the_next_update() -> None:
    # Groups kept by a take in the body of one update, made stale by the next one.
    gate = Gate(instant=2)
    req = request(RawInterface(), num_groups=1, max_staleness=1, enforce_order=True)
    with tr.blocking_grouped_rollouts(agent(gate), req) as stream:
        gate.wait_for("finished", 2)
        with stream.weight_update("restart"):
            take_times_out_keeping(stream, 3, kept=2)
        assert stream.policy_epoch == 1
        with stream.weight_update("restart"):
            pass
        gate.open()
        groups = stream.take(4, timeout=WAIT)
        assert slots(groups) == [(b, 0) for b in range(4)]
        assert {g.start_epoch for g in groups} == {2}
        stats = ledger_ok(stream)
        assert stats.stale == 2
