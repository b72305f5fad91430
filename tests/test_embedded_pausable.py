"""EmbeddedInference as a Pausable backend: the four modes, exact epoch stamps, holds.

Async tests run on pytest-trio's ``autojump_clock``. Most use ``STEADY`` latency: a request
admitted at ``s`` waits until ``s + 1`` (first token), then token ``k`` is generated from
``s + 1 + k`` to ``s + 2 + k``, so a six-token completion finishes at ``s + 7`` unpaused.
Every time below is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import trio_rollouts
import trio_rollouts.inference
from trio_rollouts import ChatMessage, GenerationArgs
from trio_rollouts.inference import (
    WEIGHT_UPDATE_MODES,
    EmbeddedInference,
    InferenceResponse,
    LatencyModel,
    Pausable,
    WeightUpdateError,
    WeightUpdateMode,
)

STEADY = LatencyModel(first_token=1.0, per_token=1.0, distribution="constant")
INSTANT = LatencyModel(first_token=0.0, per_token=0.0, distribution="constant")


def fixed(completion: str) -> Any:
    def policy(prompt: list[ChatMessage]) -> tuple[Sequence[str], list[float]]:
        return [completion], [1.0]

    return policy


def steady(completion: str = "abcdef") -> EmbeddedInference:
    return EmbeddedInference(policy=fixed(completion), latency=STEADY)


@attrs.define
class Call:
    """A request running in the background: its response and when it finished."""

    response: InferenceResponse | None = None
    finished_at: float | None = None
    cancelled_at: float | None = None

    @property
    def done(self) -> bool:
        return self.response is not None


def start(
    nursery: trio.Nursery,
    interface: EmbeddedInference,
    prompt: str = "Q",
    scope: trio.CancelScope | None = None,
    **args: Any,
) -> Call:
    call = Call()
    request = interface.prepare_request(prompt, GenerationArgs(**args))

    async def run() -> None:
        with scope if scope is not None else trio.CancelScope():
            try:
                call.response = await interface.agenerate(request)
            except trio.Cancelled:
                call.cancelled_at = trio.current_time()
                raise
            call.finished_at = trio.current_time()

    nursery.start_soon(run)
    return call


async def at(t0: float, offset: float) -> None:
    await trio.sleep_until(t0 + offset)


def state_of(interface: EmbeddedInference) -> Any:
    """The pause state of the current run (private: to check that nothing is left)."""
    return interface._run_state()


def assert_idle(interface: EmbeddedInference) -> None:
    state = state_of(interface)
    assert state.pause is None
    assert (state.admitted, state.decoding) == (0, 0)
    assert state.held.statistics().tasks_waiting == 0
    assert state.prefilling.statistics().tasks_waiting == 0
    assert state.quiet.statistics().tasks_waiting == 0


# --------------------------------------------------------------------------- contract


def test_exports() -> None:
    for name in ("Pausable", "WeightUpdateError", "WEIGHT_UPDATE_MODES", "WeightUpdateMode"):
        assert hasattr(trio_rollouts.inference, name)
    assert trio_rollouts.WeightUpdateError is WeightUpdateError
    assert issubclass(WeightUpdateError, RuntimeError)


def test_embedded_is_pausable_in_all_modes() -> None:
    interface = EmbeddedInference()
    assert isinstance(interface, Pausable)
    assert interface.supported_modes == frozenset(WEIGHT_UPDATE_MODES)
    assert len(interface.supported_modes) == 4
    assert interface.stamps_policy_epoch is True
    assert interface.policy_epoch == 0
    interface.set_generation_epoch(3)
    assert interface.policy_epoch == interface.generation_epoch == 3


# ------------------------------------------------------------------- keep and abort


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_pause_waits_for_the_token_step_in_progress(
    autojump_clock: trio.abc.Clock, mode: Any
) -> None:
    interface = steady()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        call = start(nursery, interface)
        await at(t0, 3.5)  # token 2 runs from 3 to 4
        await interface.pause(mode)
        assert trio.current_time() == t0 + 4
        assert state_of(interface).decoding == 0
        await at(t0, 10)
        await trio.testing.wait_all_tasks_blocked()
        assert not call.done
        await interface.resume(1)
    assert call.response is not None
    assert call.response.response.content == "abcdef"
    assert call.response.finish_reason == "stop"
    assert call.response.policy_epoch == [(0, 0), (3, 1)]
    if mode == "keep":
        # Tokens 3, 4, 5 from 10 to 13; the cache of tokens 0-2 is kept, and the tokens
        # after the boundary attend to it: no boundary in kv_cache_epoch.
        assert call.finished_at == t0 + 13
        assert call.response.kv_cache_epoch == [(0, 0)]
    else:
        # The continuation prefills again (10 to 11), then tokens 3, 4, 5 to 14; the
        # whole cache is recomputed under epoch 1: tokens 3 on attend to epoch 1's KV.
        assert call.finished_at == t0 + 14
        assert call.response.kv_cache_epoch == [(0, 0), (3, 1)]
    assert_idle(interface)


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_no_token_is_generated_while_paused(
    autojump_clock: trio.abc.Clock, mode: Any
) -> None:
    """Four requests a quarter second apart: the pause stops each at its next token step,
    and each goes on from there; the token counts at the boundary are exact."""
    interface = steady()
    t0 = trio.current_time()
    calls: list[Call] = []
    async with trio.open_nursery() as nursery:
        for offset in (0.0, 0.25, 0.5, 0.75):
            await at(t0, offset)
            calls.append(start(nursery, interface))
        await at(t0, 3.1)
        await interface.pause(mode)
        # The steps in progress end at 4, 3.25, 3.5 and 3.75.
        assert trio.current_time() == t0 + 4
        await at(t0, 100)
        await trio.testing.wait_all_tasks_blocked()
        assert not any(call.done for call in calls)
        await interface.resume(1)
    boundaries = [3, 2, 2, 2]
    prefill = 1 if mode == "abort" else 0
    for call, k in zip(calls, boundaries, strict=True):
        assert call.response is not None
        assert call.response.response.content == "abcdef"
        assert call.response.policy_epoch == [(0, 0), (k, 1)]
        assert call.finished_at == t0 + 100 + prefill + (6 - k)
        expected_cache = [(0, 0), (k, 1)] if mode == "abort" else [(0, 0)]
        assert call.response.kv_cache_epoch == expected_cache


async def test_abort_keeps_the_final_finish_reason(autojump_clock: trio.abc.Clock) -> None:
    interface = steady()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        call = start(nursery, interface, max_tokens=5)
        await at(t0, 2.5)
        await interface.pause("abort")
        await at(t0, 5)
        await interface.resume(2)
    assert call.response is not None
    assert call.response.response.content == "abcde"
    assert call.response.finish_reason == "length"
    assert call.response.policy_epoch == [(0, 0), (2, 2)]
    assert call.response.kv_cache_epoch == [(0, 0), (2, 2)]
    assert call.response.token_ids[call.response.prompt_length :] == [ord(c) for c in "abcde"]
    assert len(call.response.logprobs or []) == 5
    assert call.finished_at == t0 + 5 + 1 + 3


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_a_request_stopped_before_its_first_token(
    autojump_clock: trio.abc.Clock, mode: Any
) -> None:
    interface = steady("abc")
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        call = start(nursery, interface)
        await at(t0, 0.25)
        await interface.pause(mode)
        assert trio.current_time() == t0 + 0.25  # no token step to wait for
        await at(t0, 5)
        await trio.testing.wait_all_tasks_blocked()
        assert not call.done
        await interface.resume(3)
    assert call.response is not None
    assert call.response.response.content == "abc"
    assert call.response.policy_epoch == [(0, 3)]  # no empty segment of epoch 0
    assert call.response.kv_cache_epoch == [(0, 3)]
    # keep waits the rest of the first-token time (0.75), abort all of it again.
    assert call.finished_at == t0 + 5 + (1.0 if mode == "abort" else 0.75) + 3


async def test_several_updates_on_one_request(autojump_clock: trio.abc.Clock) -> None:
    """keep then abort, and abort then keep: the stamping rules compose."""
    keep_then_abort, abort_then_keep = steady(), steady()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        first = start(nursery, keep_then_abort)  # token k from k + 1 to k + 2
        await at(t0, 0.25)
        second = start(nursery, abort_then_keep)  # token k from k + 1.25 to k + 2.25
        await at(t0, 2.5)
        async with trio.open_nursery() as pauses:
            pauses.start_soon(keep_then_abort.pause, "keep")  # holds at token 2 at 3
            pauses.start_soon(abort_then_keep.pause, "abort")  # stops at token 2 at 3.25
        assert trio.current_time() == t0 + 3.25
        await keep_then_abort.resume(1)  # tokens 2 and 3 from 3.25 to 5.25
        await abort_then_keep.resume(1)  # prefill to 4.25, token 2 to 5.25
        await at(t0, 4.5)
        async with trio.open_nursery() as pauses:
            pauses.start_soon(keep_then_abort.pause, "abort")  # stops at token 4
            pauses.start_soon(abort_then_keep.pause, "keep")  # holds at token 3
        assert trio.current_time() == t0 + 5.25
        await keep_then_abort.resume(2)
        await abort_then_keep.resume(2)
    assert first.response is not None
    assert second.response is not None
    assert first.response.policy_epoch == [(0, 0), (2, 1), (4, 2)]
    assert first.response.kv_cache_epoch == [(0, 0), (4, 2)]
    assert second.response.policy_epoch == [(0, 0), (2, 1), (3, 2)]
    assert second.response.kv_cache_epoch == [(0, 0), (2, 1)]
    assert first.finished_at == t0 + 5.25 + 1 + 2  # prefill again, then tokens 4 and 5
    assert second.finished_at == t0 + 5.25 + 3  # tokens 3, 4 and 5


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_resuming_under_the_same_epoch_adds_no_boundary(
    autojump_clock: trio.abc.Clock, mode: Any
) -> None:
    """As after a failed update: generation goes on under the old epoch."""
    interface = steady()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        call = start(nursery, interface)
        await at(t0, 3.5)
        await interface.pause(mode)
        await interface.resume(0)
    assert call.response is not None
    assert call.response.policy_epoch == [(0, 0)]
    assert call.response.kv_cache_epoch == [(0, 0)]


# ----------------------------------------------------------------- new requests, drain


@pytest.mark.parametrize("mode", WEIGHT_UPDATE_MODES)
async def test_new_requests_are_held_until_resume(
    autojump_clock: trio.abc.Clock, mode: Any
) -> None:
    interface = steady("abc")
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        await interface.pause(mode)
        await at(t0, 1)
        call = start(nursery, interface)
        await at(t0, 6)
        await trio.testing.wait_all_tasks_blocked()
        assert not call.done
        assert state_of(interface).admitted == 0  # held before admission
        await interface.resume(2)
    assert call.response is not None
    assert call.response.policy_epoch == [(0, 2)]
    assert call.response.kv_cache_epoch == [(0, 2)]
    assert call.finished_at == t0 + 6 + 1 + 3  # all the latency comes after resume
    assert interface.policy_epoch == 2
    assert_idle(interface)


@pytest.mark.parametrize("mode", ["drain", "restart"])
async def test_drain_and_restart_let_calls_in_flight_finish(
    autojump_clock: trio.abc.Clock, mode: Any
) -> None:
    """The pipeline pauses once no call is in flight; a call in flight anyway (a caller
    outside the pipeline) finishes under the old epoch, and pause returns after it."""
    interface = steady("abc")
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        old = start(nursery, interface)
        await at(t0, 1.5)
        nursery.start_soon(interface.pause, mode)
        await at(t0, 2)
        new = start(nursery, interface)
        await at(t0, 4)
        await trio.testing.wait_all_tasks_blocked()
        assert old.done
        assert not new.done
        await at(t0, 6)
        await interface.resume(1)
    assert old.response is not None
    assert new.response is not None
    assert old.finished_at == t0 + 4
    assert old.response.policy_epoch == [(0, 0)]
    assert new.response.policy_epoch == [(0, 1)]
    assert new.finished_at == t0 + 6 + 4


@pytest.mark.parametrize("mode", ["drain", "restart"])
async def test_drain_pause_with_nothing_in_flight_returns_at_once(
    autojump_clock: trio.abc.Clock, mode: Any
) -> None:
    interface = steady()
    t0 = trio.current_time()
    await interface.pause(mode)
    assert trio.current_time() == t0
    await interface.resume(1)
    assert_idle(interface)


# ------------------------------------------------------------------------ determinism


UPDATES: dict[int, WeightUpdateMode] = {3: "keep", 8: "abort", 12: "drain", 16: "restart"}
SCHEDULE_LATENCY = LatencyModel(first_token=0.05, per_token=0.01, distribution="lognormal")


async def run_schedule(interface: EmbeddedInference, *, paused: bool) -> list[InferenceResponse]:
    """Twenty requests over four prompts arriving on a fixed schedule; with ``paused``,
    an update of each mode happens meanwhile (some requests arrive while paused)."""
    responses: dict[int, InferenceResponse] = {}

    async def one(i: int) -> None:
        request = interface.prepare_request(f"prompt {i % 4}", GenerationArgs(max_tokens=12))
        responses[i] = await interface.agenerate(request)

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(20):
            await at(t0, 0.05 * i)
            nursery.start_soon(one, i)
            if paused and i in UPDATES:
                await trio.sleep(0.02)
                await interface.pause(UPDATES[i])
                await trio.sleep(0.5)
                await interface.resume(interface.policy_epoch + 1)
    return [responses[i] for i in range(20)]


async def test_pausing_does_not_change_the_tokens(autojump_clock: trio.abc.Clock) -> None:
    plain = await run_schedule(EmbeddedInference(seed=11, latency=SCHEDULE_LATENCY), paused=False)
    paused_interface = EmbeddedInference(seed=11, latency=SCHEDULE_LATENCY)
    paused = await run_schedule(paused_interface, paused=True)
    assert paused_interface.policy_epoch == 4
    for a, b in zip(plain, paused, strict=True):
        assert a.response == b.response
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
        assert a.finish_reason == b.finish_reason
        assert a.policy_epoch == [(0, 0)]
    # The pauses did something: some responses span an update, some start later.
    assert any(len(r.policy_epoch) > 1 for r in paused)
    assert any(r.policy_epoch[0][1] > 0 for r in paused)
    assert len({r.response.content for r in plain}) > 1


# ------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("mode", ["wait", "KEEP", "", None, 1, ["keep"]])
async def test_an_unknown_mode_is_a_type_error(autojump_clock: trio.abc.Clock, mode: Any) -> None:
    interface = steady("ab")
    with pytest.raises(TypeError, match="mode") as info:
        await interface.pause(mode)
    message = str(info.value)
    assert repr(mode) in message
    for allowed in WEIGHT_UPDATE_MODES:
        assert repr(allowed) in message
    # Not paused: a request runs at once.
    t0 = trio.current_time()
    assert (await interface.agenerate(interface.prepare_request("Q"))).response.content == "ab"
    assert trio.current_time() == t0 + 3


@pytest.mark.parametrize(
    ("epoch", "error"),
    [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("1", TypeError), (None, TypeError)],
)
async def test_a_bad_epoch_is_rejected_and_changes_nothing(
    autojump_clock: trio.abc.Clock, epoch: Any, error: type[Exception]
) -> None:
    interface = steady("abc")
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        await interface.pause("keep")
        call = start(nursery, interface)
        with pytest.raises(error, match="epoch"):
            await interface.resume(epoch)
        assert interface.policy_epoch == 0
        await at(t0, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert not call.done  # still paused
        await interface.resume(1)
    assert call.response is not None
    assert call.response.policy_epoch == [(0, 1)]


async def test_pausing_twice_is_a_runtime_error(autojump_clock: trio.abc.Clock) -> None:
    interface = steady()
    await interface.pause("keep")
    for mode in WEIGHT_UPDATE_MODES:
        with pytest.raises(RuntimeError, match="'keep'"):
            await interface.pause(mode)
    assert state_of(interface).pause.mode == "keep"
    await interface.resume(1)
    await interface.pause("abort")  # a new pause after resume is fine
    await interface.resume(2)
    assert_idle(interface)


async def test_resume_without_pause_only_sets_the_epoch(autojump_clock: trio.abc.Clock) -> None:
    interface = steady()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        call = start(nursery, interface)
        await at(t0, 3.5)
        await interface.resume(5)
        assert trio.current_time() == t0 + 3.5
        assert interface.policy_epoch == interface.generation_epoch == 5
    assert call.response is not None
    assert call.finished_at == t0 + 7  # never held
    assert call.response.policy_epoch == [(0, 0), (3, 5)]  # as set_generation_epoch
    assert call.response.kv_cache_epoch == [(0, 0)]  # later tokens attend to the old KV
    assert_idle(interface)


async def test_set_generation_epoch_still_works(autojump_clock: trio.abc.Clock) -> None:
    interface = steady()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        call = start(nursery, interface)
        await at(t0, 2.5)
        interface.set_generation_epoch(4)
        assert interface.policy_epoch == 4
    assert call.response is not None
    assert call.response.policy_epoch == [(0, 0), (2, 4)]


# ---------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_held_requests_can_be_cancelled(autojump_clock: trio.abc.Clock, mode: Any) -> None:
    """A request held in flight, one held in its first-token wait and one held at
    admission: each exits as soon as it is cancelled, and nothing is left."""
    interface = steady()
    t0 = trio.current_time()
    scopes = [trio.CancelScope() for _ in range(3)]
    async with trio.open_nursery() as nursery:
        in_flight = start(nursery, interface, scope=scopes[0])
        await at(t0, 3.5)
        prefilling = start(nursery, interface, scope=scopes[1])
        await at(t0, 3.75)
        await interface.pause(mode)
        arriving = start(nursery, interface, scope=scopes[2])
        await at(t0, 6)
        await trio.testing.wait_all_tasks_blocked()
        for scope in scopes:
            scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        for call in (in_flight, prefilling, arriving):
            assert call.cancelled_at == t0 + 6
            assert not call.done
        state = state_of(interface)
        assert (state.admitted, state.decoding) == (0, 0)
        assert state.held.statistics().tasks_waiting == 0
        await interface.resume(1)
    assert trio.current_time() == t0 + 6
    assert_idle(interface)
    # A drain pause now has nothing to wait for.
    await interface.pause("drain")
    assert trio.current_time() == t0 + 6
    await interface.resume(2)


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_a_cancelled_pause_undoes_itself(autojump_clock: trio.abc.Clock, mode: Any) -> None:
    """Request A's step ends at 3.25 (it holds), B's at 4; the pause is cancelled at 3.5,
    before it holds: A goes on at once, not aborted, and B never stops."""
    interface = steady()
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        b = start(nursery, interface)
        await at(t0, 0.25)
        a = start(nursery, interface)
        await at(t0, 3.1)
        with trio.move_on_at(t0 + 3.5) as scope:
            await interface.pause(mode)
        assert scope.cancelled_caught
        assert state_of(interface).pause is None
    assert a.response is not None
    assert b.response is not None
    assert a.finished_at == t0 + 0.25 + 7 + 0.25  # held from 3.25 to 3.5
    assert b.finished_at == t0 + 7
    for call in (a, b):
        assert call.response is not None
        assert call.response.policy_epoch == [(0, 0)]
        assert call.response.kv_cache_epoch == [(0, 0)]
    assert_idle(interface)
    # Not left paused: a new pause is allowed.
    await interface.pause(mode)
    await interface.resume(0)


async def test_cancelling_a_pause_that_waits_for_a_drain(autojump_clock: trio.abc.Clock) -> None:
    interface = steady("abc")
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        old = start(nursery, interface)
        await at(t0, 1)

        async def pause_briefly() -> None:
            with trio.move_on_at(t0 + 2) as scope:
                await interface.pause("drain")
            assert scope.cancelled_caught

        nursery.start_soon(pause_briefly)
        await at(t0, 1.5)
        new = start(nursery, interface)
    assert old.finished_at == t0 + 4
    # Held from 1.5 to 2, then admitted under epoch 0: 2 + 1 + 3.
    assert new.finished_at == t0 + 6
    assert new.response is not None
    assert new.response.policy_epoch == [(0, 0)]
    assert_idle(interface)


async def test_a_pause_called_cancelled_does_nothing(autojump_clock: trio.abc.Clock) -> None:
    interface = steady()
    with trio.CancelScope() as scope:
        scope.cancel()
        await interface.pause("keep")
    assert scope.cancelled_caught
    assert_idle(interface)


async def test_resume_completes_even_when_cancelled(autojump_clock: trio.abc.Clock) -> None:
    interface = steady("abc")
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        await interface.pause("keep")
        call = start(nursery, interface)
        await at(t0, 1)
        with trio.CancelScope() as scope:
            scope.cancel()
            await interface.resume(7)
        assert not scope.cancelled_caught
        assert interface.policy_epoch == 7
        assert state_of(interface).pause is None
    assert call.response is not None
    assert call.response.policy_epoch == [(0, 7)]
    assert call.finished_at == t0 + 5


# ------------------------------------------------------------------------ Trio runs


def test_a_pause_does_not_leak_into_another_run() -> None:
    interface = EmbeddedInference(policy=fixed("ok"), latency=INSTANT)

    async def pause_and_leave() -> None:
        await interface.pause("keep")
        await interface.resume(3)
        await interface.pause("abort")  # never resumed: ends with this run

    trio.run(pause_and_leave, clock=trio.testing.MockClock(autojump_threshold=0))
    assert interface.policy_epoch == 3  # the epoch is shared across runs
    # The sync generate() runs its own Trio run: not paused there.
    response = interface.generate(interface.prepare_request("Q"))
    assert response.response.content == "ok"
    assert response.policy_epoch == [(0, 3)]

    async def pause_again() -> None:
        await interface.pause("drain")  # no "already paused"
        await interface.resume(4)

    trio.run(pause_again)
    assert interface.policy_epoch == 4


async def test_latency_is_unchanged_without_pauses(autojump_clock: trio.abc.Clock) -> None:
    latency = LatencyModel(first_token=2.0, per_token=0.25, distribution="constant")
    interface = EmbeddedInference(policy=fixed("abcd"), latency=latency)
    t0 = trio.current_time()
    await interface.agenerate(interface.prepare_request("Q"))
    assert math.isclose(trio.current_time() - t0, 2.0 + 4 * 0.25)
