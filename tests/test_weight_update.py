"""stream.weight_update: the four modes, the gate, epochs, the staleness bound, failures.

Every test runs on pytest-trio's ``autojump_clock`` against ``EmbeddedInference`` with a
constant latency model (a 4-token completion: first token at +1 s, then 1 s per token,
so an unpaused call takes 5 s), or against scripted backends; every time is exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel
import trio.testing
from _fakes import Backend, RawInterface

import trio_rollouts as tr
from trio_rollouts import ChatMessage
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceInterface,
    LatencyModel,
    WeightUpdateError,
    WeightUpdateMode,
)
from trio_rollouts.pipeline._stream import source_of
from trio_rollouts.testing import ScriptedAgent

STEADY = LatencyModel(first_token=1.0, per_token=1.0, distribution="constant")
CALL_SECONDS = 5.0  # "abcd": first token at +1, then four tokens of 1 s (the last ends it)


def fixed(completion: str) -> Any:
    def policy(prompt: list[ChatMessage]) -> tuple[Sequence[str], list[float]]:
        return [completion], [1.0]

    return policy


def embedded() -> EmbeddedInference:
    return EmbeddedInference(policy=fixed("abcd"), latency=STEADY)


async def one_call_per_rollout(
    agent: ScriptedAgent, request: tr.GroupedRolloutRequest
) -> list[tr.Rollout]:
    """One inference call per rollout; each rollout keeps the call's epoch stamps."""
    iface = request.inference_interface
    out = []
    for i in range(request.rollouts_per_group):
        response = await iface.agenerate(iface.prepare_request("q"))
        out.append(
            tr.Rollout(
                trajectory=[response.raw_text or ""],
                reward=float(i),
                policy_epoch=[list(response.policy_epoch)],
            )
        )
    return out


def epoch_agent(**options: Any) -> ScriptedAgent:
    return ScriptedAgent(script=one_call_per_rollout, **options)


def grouped(
    interface: InferenceInterface,
    *,
    num_groups: int = 2,
    rollouts_per_group: int = 1,
    streaming: bool = True,
    max_staleness: int | None = None,
    initial_epoch: int | None = None,
    enforce_order: bool = False,
) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=num_groups,
        rollouts_per_group=rollouts_per_group,
        inference_interface=interface,
        streaming=streaming,
        max_staleness=max_staleness,
        initial_epoch=initial_epoch,
        enforce_order=enforce_order,
    )


def ledger_ok(stats: tr.RolloutStreamStatistics) -> None:
    assert stats.unaccounted == 0, stats


# --------------------------------------------------------------------------- checks


async def test_bad_arguments_are_refused_before_anything_pauses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(embedded())) as stream:
        with pytest.raises(ValueError, match=r"mode must be one of 'drain'.*got 'pause'"):
            async with stream.weight_update("pause"):  # type: ignore[arg-type]
                pass
        with pytest.raises(
            ValueError, match=r"greater than the stream's policy_epoch \(0\), got 0"
        ):
            async with stream.weight_update(epoch=0):
                pass
        with pytest.raises(TypeError, match="epoch must be an int"):
            async with stream.weight_update(epoch=1.0):  # type: ignore[arg-type]
                pass
        with pytest.raises(TypeError, match=r"backends\[0\] must be an InferenceInterface"):
            async with stream.weight_update(backends=["x"]):  # type: ignore[list-item]
                pass
        assert stream.policy_epoch == 0
        assert stream.statistics().weight_updates == 0


async def test_keep_needs_a_pausable_backend(autojump_clock: trio.testing.MockClock) -> None:
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(RawInterface())) as stream:
        with pytest.raises(TypeError, match=r"mode='keep'.*RawInterface is not"):
            async with stream.weight_update("keep"):
                pass
        # drain and restart need nothing of the backend
        async with stream.weight_update("drain") as update:
            assert update.epoch == 1
        assert stream.policy_epoch == 1


async def test_a_mode_the_backend_does_not_support_is_a_type_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    iface = tr.OpenAIInference(base_url="http://127.0.0.1:9/v1", model="m")
    agent = epoch_agent(parallel_generation_tasks=2)
    request = grouped(RawInterface())
    async with agent.get_grouped_rollouts(request) as stream:
        with pytest.raises(TypeError, match=r"OpenAIInference cannot pause.*server='vllm'"):
            async with stream.weight_update("abort", backends=[iface]):
                pass
        assert not source_of(stream).epochs.updating  # type: ignore[attr-defined]


async def test_one_update_at_a_time(autojump_clock: trio.testing.MockClock) -> None:
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(embedded())) as stream:
        async with stream.weight_update():
            with pytest.raises(RuntimeError, match="already in progress"):
                async with stream.weight_update(epoch=5):
                    pass
        assert stream.policy_epoch == 1


# --------------------------------------------------------------------------- modes


async def test_drain_waits_for_calls_in_flight_and_holds_new_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    iface = embedded()
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(iface)) as stream:
        await trio.sleep(2.5)  # both calls are 2.5 s in
        async with stream.weight_update("drain") as update:
            assert trio.current_time() == pytest.approx(CALL_SECONDS)
            assert update.pause_seconds == pytest.approx(2.5)
            assert update.held == 0
            assert stream.statistics().in_flight == 0
            assert stream.policy_epoch == 0  # still the old epoch during the body
            # finished groups can be taken during the body; no new call starts
            taken = stream.drain(2)
            assert [g.start_epoch for g in taken] == [0, 0]
            await trio.sleep(10)
            assert stream.statistics().in_flight == 0
            assert stream.statistics().started == 2
        assert stream.policy_epoch == 1
        group = await stream.receive()
        assert group.start_epoch == 1
        assert group[0].policy_epoch == [[(0, 1)]]
        stats = stream.statistics()
        assert stats.weight_updates == 1
        assert stats.policy_epoch == 1
        ledger_ok(stats)
    assert stream.policy_epoch == 1  # readable after close
    assert iface.policy_epoch == 1


async def test_restart_cancels_calls_and_generates_their_slots_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    iface = embedded()
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(iface)) as stream:
        await trio.sleep(2.5)
        async with stream.weight_update("restart") as update:
            assert trio.current_time() == pytest.approx(2.5)  # not waited for
            assert update.held == 2
            assert agent.exited == 2
            stats = stream.statistics()
            assert (stats.in_flight, stats.restarted) == (0, 2)
            ledger_ok(stats)
        groups = [await stream.receive(), await stream.receive()]
        assert trio.current_time() == pytest.approx(2.5 + CALL_SECONDS)
        assert sorted((g.batch_id, g.index_in_batch) for g in groups) == [(0, 0), (0, 1)]
        assert all(g.start_epoch == 1 and g[0].policy_epoch == [[(0, 1)]] for g in groups)
        ledger_ok(stream.statistics())


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_keep_and_abort_continue_calls_under_the_new_epoch(
    mode: WeightUpdateMode, autojump_clock: trio.testing.MockClock
) -> None:
    iface = embedded()
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(iface)) as stream:
        await trio.sleep(2.5)  # token 1 is being generated
        async with stream.weight_update(mode) as update:
            assert update.held == 2
            # the token being generated is finished first (it ends at 3.0)
            assert update.pause_seconds == pytest.approx(0.5)
            await trio.sleep(100)  # held: nothing moves
            assert stream.statistics().in_flight == 2
            assert stream.statistics().completed == 0
        groups = [await stream.receive(), await stream.receive()]
        for group in groups:
            assert group.start_epoch == 0
            stamps = group[0].policy_epoch[0]
            assert stamps[0] == (0, 0)
            assert stamps[-1][1] == 1  # a boundary, exactly
        stats = stream.statistics()
        assert stats.mixed == 0  # EmbeddedInference stamps the boundary
        ledger_ok(stats)


async def test_held_time_does_not_count_against_group_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    iface = embedded()
    agent = epoch_agent(
        parallel_generation_tasks=2, failure_policy=tr.FailurePolicy(group_timeout=6.0)
    )
    async with agent.get_grouped_rollouts(grouped(iface)) as stream:
        await trio.sleep(2.5)
        async with stream.weight_update("keep"):
            await trio.sleep(30)
        groups = [await stream.receive(), await stream.receive()]
        assert len(groups) == 2
        stats = stream.statistics()
        assert stats.timeouts == 0
        ledger_ok(stats)


# --------------------------------------------------------------------------- staleness


async def test_a_staleness_bound_cancels_calls_that_would_exceed_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    iface = embedded()
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(iface, max_staleness=0)) as stream:
        await trio.sleep(2.5)
        async with stream.weight_update("keep") as update:
            assert update.held == 2  # both cancelled by the bound
            stats = stream.statistics()
            assert (stats.stale, stats.in_flight) == (2, 0)
        groups = [await stream.receive(), await stream.receive()]
        assert all(g.start_epoch == 1 for g in groups)
        ledger_ok(stream.statistics())


async def test_finished_groups_that_became_too_old_are_generated_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    iface = embedded()
    agent = epoch_agent(parallel_generation_tasks=2, buffer_size=2)
    request = grouped(iface, max_staleness=1, enforce_order=True)
    async with agent.get_grouped_rollouts(request) as stream:
        await trio.sleep(CALL_SECONDS)  # batch 0 is finished and buffered
        async with stream.weight_update():
            pass
        async with stream.weight_update():
            pass
        assert stream.policy_epoch == 2
        groups = [await stream.receive(), await stream.receive()]
        assert [(g.batch_id, g.index_in_batch) for g in groups] == [(0, 0), (0, 1)]
        assert all(g.start_epoch == 2 for g in groups)
        stats = stream.statistics()
        assert stats.stale == 2
        ledger_ok(stats)


async def test_held_groups_are_taken_back_in_order_when_they_go_stale(
    autojump_clock: trio.testing.MockClock,
) -> None:
    iface = embedded()
    agent = epoch_agent(parallel_generation_tasks=4, buffer_size=4)
    request = grouped(iface, num_groups=2, max_staleness=0, enforce_order=True)
    async with agent.get_grouped_rollouts(request) as stream:
        await trio.sleep(CALL_SECONDS)  # batches 0 and 1 are finished
        first = await stream.receive()  # batch 0 released into order; (0, 0) taken
        assert (first.batch_id, first.index_in_batch) == (0, 0)
        async with stream.weight_update():
            pass
        rest = [await stream.receive() for _ in range(3)]
        assert [(g.batch_id, g.index_in_batch) for g in rest] == [(0, 1), (1, 0), (1, 1)]
        assert all(g.start_epoch == 1 for g in rest)
        ledger_ok(stream.statistics())


async def test_non_streaming_with_a_bound_ends_after_its_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    iface = embedded()
    agent = epoch_agent(parallel_generation_tasks=2)
    request = grouped(iface, streaming=False, max_staleness=0)
    async with agent.get_grouped_rollouts(request) as stream:
        await trio.sleep(CALL_SECONDS)
        async with stream.weight_update():
            pass
        groups = [g async for g in stream]
        assert len(groups) == 2
        assert all(g.start_epoch == 1 for g in groups)
        assert stream.try_next() is None
        ledger_ok(stream.statistics())


# --------------------------------------------------------------------------- failures


async def test_a_failing_pause_resumes_everything_under_the_old_epoch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    good, bad = Backend(), Backend(fail_pause=True, fail_resume=True)
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(good)) as stream:
        with pytest.raises(WeightUpdateError, match=r"pausing Backend.*failed") as info:
            async with stream.weight_update("keep", backends=[good, bad]):
                pytest.fail("the body must not run")
        assert isinstance(info.value.__cause__, RuntimeError)
        assert any("resume endpoint answered 500" in n for n in info.value.__notes__)
        assert good.log == ["pause keep", "resume 0"]
        assert bad.log == ["pause keep", "resume 0"]
        assert stream.policy_epoch == 0
        # nothing left paused: generation goes on
        assert len(await stream.receive()) == 1
        async with stream.weight_update("keep", backends=[good]) as update:
            assert update.epoch == 1


@pytest.mark.parametrize("route", ["raise", "cancel"])
async def test_a_body_that_fails_resumes_under_the_old_epoch(
    route: str, autojump_clock: trio.testing.MockClock
) -> None:
    backend = Backend()
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(backend)) as stream:
        if route == "raise":
            with pytest.raises(KeyError):
                async with stream.weight_update("abort"):
                    raise KeyError("push failed")
        else:
            with trio.move_on_after(1):
                async with stream.weight_update("abort"):
                    await trio.sleep_forever()
        assert backend.log == ["pause abort", "resume 0"]
        assert stream.policy_epoch == 0
        assert stream.statistics().weight_updates == 0
        group = await stream.receive()
        assert group.start_epoch == 0
        ledger_ok(stream.statistics())


async def test_mixed_counts_groups_spanning_an_update_on_a_backend_without_stamps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = Backend()
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(backend)) as stream:
        await trio.sleep(0.5)
        async with stream.weight_update("keep"):
            pass
        await stream.receive()
        await stream.receive()
        stats = stream.statistics()
        assert stats.mixed == 2
        ledger_ok(stats)


async def test_initial_epoch_is_given_to_the_backend(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = Backend(epoch=3)
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(backend)) as stream:
        assert stream.policy_epoch == 3  # taken from the Pausable backend
    async with agent.get_grouped_rollouts(grouped(backend, initial_epoch=7)) as stream:
        assert stream.policy_epoch == 7
        assert backend.epoch == 7
        group = await stream.receive()
        assert group.start_epoch == 7


async def test_leaving_the_stream_during_an_update_resumes_the_backends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = Backend()
    agent = epoch_agent(parallel_generation_tasks=2)
    async with (
        agent.get_grouped_rollouts(grouped(backend)) as stream,
        stream.weight_update("keep"),
    ):
        pass
    # the stream is closed; nothing paused
    assert backend.log == ["pause keep", "resume 1"]
    with pytest.raises(RuntimeError, match="has exited"):
        async with stream.weight_update():
            pass


async def test_a_worker_failure_during_the_pause_resumes_under_the_old_epoch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = Backend()

    @attrs.define
    class Failing(tr.GroupedRolloutGenerator):
        async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
            await trio.sleep(2)
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        async with Failing(parallel_generation_tasks=1).get_grouped_rollouts(
            grouped(backend, num_groups=1)
        ) as stream:
            await trio.sleep(1)  # the call is in flight
            async with stream.weight_update("drain"):
                pytest.fail("drain cannot finish: the calls fail")
    # The failing call ended the drain, so pause was called, and cancelled at once
    # by the failure's cancellation; it was resumed under the old epoch all the same.
    assert backend.log == ["resume 0"]
    assert stream.policy_epoch == 0
    assert math.isfinite(trio.current_time())


# --------------------------------------------------------------------------- paths


async def first_call_hangs(
    agent: ScriptedAgent, request: tr.GroupedRolloutRequest
) -> list[tr.Rollout]:
    """The first call hangs until cancelled; later calls take 1 s. Rewards differ, so
    filtering keeps every group."""
    if agent.calls == 1:
        await trio.sleep_forever()
    await trio.sleep(1)
    return [tr.Rollout(trajectory=["x"], reward=float(i)) for i in range(2)]


def hanging_agent(**options: Any) -> ScriptedAgent:
    return ScriptedAgent(script=first_call_hangs, **options)


@pytest.mark.parametrize("filtering", [False, True], ids=["fast-path", "slow-path"])
async def test_a_hanging_call_times_out_later_by_the_time_it_was_held(
    filtering: bool, autojump_clock: trio.testing.MockClock
) -> None:
    agent = hanging_agent(
        parallel_generation_tasks=1,
        failure_policy=tr.FailurePolicy(group_timeout=10.0, on_failure="skip"),
    )
    request = tr.GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=2,
        inference_interface=RawInterface(),
        filter_groups_with_same_reward=filtering,
    )
    backend = Backend()
    async with agent.get_grouped_rollouts(request) as stream:
        await trio.sleep(4)
        async with stream.weight_update("keep", backends=[backend]):
            await trio.sleep(100)  # held: its clock stands still
        await trio.sleep(5.5)  # 9.5 s of its 10 s have run
        assert stream.statistics().timeouts == 0
        await trio.sleep(1)
        assert stream.statistics().timeouts == 1
        assert trio.current_time() == pytest.approx(110.5)
        stats = stream.statistics()
        assert stats.failed == 1
        ledger_ok(stats)


@pytest.mark.parametrize(
    "policy",
    [tr.FailurePolicy(), tr.FailurePolicy(group_timeout=30.0, max_attempts=3)],
    ids=["trivial", "retrying"],
)
@pytest.mark.parametrize("filtering", [False, True], ids=["fast-path", "slow-path"])
async def test_restart_regenerates_on_every_path(
    policy: tr.FailurePolicy, filtering: bool, autojump_clock: trio.testing.MockClock
) -> None:
    agent = hanging_agent(parallel_generation_tasks=1, failure_policy=policy)
    request = tr.GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=2,
        inference_interface=RawInterface(),
        filter_groups_with_same_reward=filtering,
    )
    async with agent.get_grouped_rollouts(request) as stream:
        await trio.sleep(2)
        async with stream.weight_update("restart") as update:
            assert update.held == 1
        group = await stream.receive()
        assert trio.current_time() == pytest.approx(3.0)
        assert (group.batch_id, group.index_in_batch, group.start_epoch) == (0, 0, 1)
        stats = stream.statistics()
        assert (stats.restarted, stats.started, stats.failed) == (1, 2, 0)
        ledger_ok(stats)


async def test_restart_in_a_multitask_pipeline(autojump_clock: trio.testing.MockClock) -> None:
    tasks = [
        tr.WeightedTask(agent=epoch_agent(), weight=1.0, env_id="a"),
        tr.WeightedTask(agent=epoch_agent(), weight=1.0, env_id="b"),
    ]
    agent = tr.WeightedMultiTask(tasks=tasks, parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(embedded())) as stream:
        await trio.sleep(2.5)
        async with stream.weight_update("restart") as update:
            assert update.held == 2
        groups = [await stream.receive(), await stream.receive()]
        assert all(g.start_epoch == 1 for g in groups)
        stats = stream.statistics()
        assert stats.restarted == 2
        assert sum(env.started for env in stats.per_env.values()) == 4
        ledger_ok(stats)


async def test_an_update_cancelled_before_its_body_opens_the_gate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    iface = embedded()
    agent = epoch_agent(parallel_generation_tasks=2)
    async with agent.get_grouped_rollouts(grouped(iface)) as stream:
        await trio.sleep(1)
        with trio.move_on_after(1):  # the drain needs 4 s more
            async with stream.weight_update("drain"):
                pytest.fail("the body must not run")
        assert stream.policy_epoch == 0
        assert not source_of(stream).epochs.updating  # type: ignore[attr-defined]
        groups = [await stream.receive() for _ in range(4)]
        assert [g.start_epoch for g in groups] == [0, 0, 0, 0]
        ledger_ok(stream.statistics())


async def test_a_bound_and_keep_cancelled_while_dropped_calls_exit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    @attrs.define
    class SlowToDie(tr.GroupedRolloutGenerator):
        """Its calls take 3 s, and 2 s to clean up when cancelled (shielded)."""

        async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
            try:
                await trio.sleep(3)
            finally:
                with trio.CancelScope(shield=True):
                    await trio.sleep(2)
            return [tr.Rollout(trajectory=["x"], reward=1.0)]

    agent = SlowToDie(parallel_generation_tasks=1)
    backend = Backend()
    request = grouped(backend, num_groups=1, max_staleness=0)
    async with agent.get_grouped_rollouts(request) as stream:
        await trio.sleep(1)
        with trio.move_on_after(1):  # the dropped call needs 2 s to exit
            async with stream.weight_update("keep"):
                pytest.fail("the body must not run")
        assert backend.log == []
        assert stream.statistics().stale == 0  # not exited yet
        group = await stream.receive()  # generated again, in its slot
        assert group.start_epoch == 0
        stats = stream.statistics()
        assert stats.stale == 1
        ledger_ok(stats)


async def test_held_calls_start_in_slot_order(autojump_clock: trio.testing.MockClock) -> None:
    """When an update ends, the calls it held start one by one in slot order, so a seeded
    backend that hands out its random streams in arrival order gives the same samples on
    every run."""
    order: list[tuple[int, int]] = []

    @attrs.define
    class Recording(tr.GroupedRolloutGenerator):
        def _slot_generator(self, request: tr.GroupedRolloutRequest) -> Any:
            async def generate(batch_id: int, index: int) -> list[tr.Rollout]:
                order.append((batch_id, index))  # before the call's first checkpoint
                await trio.sleep(1)
                return [tr.Rollout(trajectory=["x"], reward=0.0)]

            return generate

        async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
            raise NotImplementedError

    request = grouped(RawInterface(), num_groups=4, enforce_order=True)
    agent = Recording(parallel_generation_tasks=8, buffer_size=0)
    async with agent.get_grouped_rollouts(request) as stream:
        await trio.sleep(0.5)
        async with stream.weight_update("restart"):
            order.clear()
        await trio.sleep(0.5)
        assert order == sorted(order)
        assert len(order) == 8
