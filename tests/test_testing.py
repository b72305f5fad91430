"""trio_rollouts.testing: the scripted agent, the null backends and the scripted Pausable
backend behave as documented (on pytest-trio's ``autojump_clock``, so times are exact)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import trio_rollouts as tr
import trio_rollouts.testing
from trio_rollouts.inference import Pausable, WeightUpdateError
from trio_rollouts.testing import (
    NullChatInference,
    NullInference,
    ScriptedAgent,
    ScriptedPausable,
    rollouts,
)


def grouped(
    interface: tr.InferenceInterface | None = None, *, num_groups: int = 1, streaming: bool = False
) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=num_groups,
        rollouts_per_group=2,
        inference_interface=NullInference() if interface is None else interface,
        streaming=streaming,
    )


async def ask(interface: tr.InferenceInterface, prompt: str = "q") -> tr.InferenceResponse:
    return await interface.agenerate(interface.prepare_request(prompt))


# --------------------------------------------------------------------------- rollouts


def test_rollouts_makes_one_rollout_per_reward_of_one_problem() -> None:
    group = rollouts([0.0, 1.0, None], env_id="math", problem_id="q7")
    assert [r.reward for r in group] == [0.0, 1.0, None]
    assert {(r.env_id, r.problem_id) for r in group} == {("math", "q7")}
    assert all(r.trajectory == ["x"] for r in group)


# --------------------------------------------------------------------------- ScriptedAgent


async def test_a_scripted_agent_counts_calls_in_flight_and_exits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    numbers: list[int] = []

    async def script(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        numbers.append(agent.calls)
        await trio.sleep(1)
        return rollouts([0.0, 1.0])

    agent = ScriptedAgent(script=script, parallel_generation_tasks=3)
    async with agent.get_grouped_rollouts(grouped(num_groups=3)) as stream:
        groups = [g async for g in stream]
    assert len(groups) == 3
    assert sorted(numbers) == [1, 2, 3]
    assert (agent.calls, agent.in_flight, agent.max_in_flight, agent.exited) == (3, 0, 3, 3)


async def test_a_scripted_agent_counts_cancelled_calls_as_exited(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def forever(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    agent = ScriptedAgent(script=forever, parallel_generation_tasks=2)
    with trio.move_on_after(5):
        async with agent.get_grouped_rollouts(grouped(num_groups=2)) as stream:
            await stream.receive()
    assert (agent.calls, agent.in_flight, agent.exited) == (2, 0, 2)


async def test_a_fixed_group_agent_returns_a_new_list_of_the_same_rollouts() -> None:
    group = rollouts([0.0, 1.0])
    agent = ScriptedAgent(group=group)
    first = await agent.group_rollout(grouped())
    second = await agent.group_rollout(grouped())
    assert first == group
    assert second == group
    assert first is not second
    assert (agent.calls, agent.exited) == (2, 2)


@pytest.mark.parametrize("options", [{}, {"group": rollouts([1.0]), "script": object()}])
def test_a_scripted_agent_needs_a_script_or_a_group(options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"exactly one of script= .* and group="):
        ScriptedAgent(**options)  # type: ignore[arg-type]


def test_a_scripted_agent_still_validates_the_pipeline_settings() -> None:
    with pytest.raises((TypeError, ValueError), match="parallel_generation_tasks"):
        ScriptedAgent(group=rollouts([1.0]), parallel_generation_tasks=0)


# --------------------------------------------------------------------------- null backends


async def test_null_inference_answers_with_raw_text_after_its_latency(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = NullInference(completion="42", latency=2.0)
    response = await ask(interface, "6 * 7?")
    assert trio.current_time() == 2.0
    assert (response.response.content, response.raw_text) == ("42", "42")
    assert isinstance(interface, tr.ReturnsRaw)
    assert [r.prompt[-1].content for r in interface.requests] == ["6 * 7?"]


def test_null_chat_inference_is_not_returns_raw_and_the_pipeline_refuses_it() -> None:
    interface = NullChatInference()
    assert not isinstance(interface, tr.ReturnsRaw)
    with pytest.raises(TypeError, match="ReturnsRaw"):
        ScriptedAgent(group=rollouts([1.0])).get_grouped_rollouts(grouped(interface))


async def test_null_chat_inference_answers_without_raw_text() -> None:
    response = await ask(NullChatInference(completion="hi"))
    assert (response.response.content, response.raw_text) == ("hi", None)


@pytest.mark.parametrize("latency", [-1.0, "1"])
def test_a_null_backend_refuses_a_bad_latency(latency: object) -> None:
    with pytest.raises((TypeError, ValueError), match="latency"):
        NullInference(latency=latency)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- ScriptedPausable


def test_a_scripted_pausable_is_a_pausable_returns_raw_backend() -> None:
    backend = ScriptedPausable(epoch=4, modes={"drain", "keep"})
    assert isinstance(backend, Pausable)
    assert isinstance(backend, tr.ReturnsRaw)
    assert backend.supported_modes == frozenset({"drain", "keep"})
    assert backend.policy_epoch == 4
    assert backend.stamps_policy_epoch is False


def test_a_scripted_pausable_refuses_an_unknown_mode_in_its_modes() -> None:
    with pytest.raises(ValueError, match="'pause'"):
        ScriptedPausable(modes={"drain", "pause"})  # type: ignore[arg-type]


async def test_pause_and_resume_are_logged_and_set_the_epoch() -> None:
    backend = ScriptedPausable()
    await backend.pause("keep")
    assert backend.paused == "keep"
    await backend.resume(1)
    assert backend.paused is None
    assert backend.log == ["pause keep", "resume 1"]
    assert backend.policy_epoch == 1


async def test_a_mode_outside_its_modes_is_a_type_error_and_pauses_nothing() -> None:
    backend = ScriptedPausable(modes={"drain"})
    with pytest.raises(TypeError, match="cannot pause for 'keep'"):
        await backend.pause("keep")
    assert (backend.log, backend.paused) == ([], None)


async def test_a_pause_cancelled_at_its_checkpoint_records_and_pauses_nothing() -> None:
    backend = ScriptedPausable()
    with trio.CancelScope() as scope:
        scope.cancel()
        await backend.pause("drain")
    assert (backend.log, backend.paused) == ([], None)


async def test_requests_that_arrive_while_paused_wait_for_the_resume(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = ScriptedPausable(latency=1.0)
    answered: list[float] = []

    async def one() -> None:
        await ask(backend)
        answered.append(trio.current_time())

    await backend.pause("drain")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        await trio.sleep(10)
        await backend.resume(3)
    assert answered == [11.0]
    assert (await ask(backend)).policy_epoch == [(0, 3)]


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_keep_and_abort_delay_a_request_in_flight_by_the_pause(
    mode: tr.inference.WeightUpdateMode, autojump_clock: trio.testing.MockClock
) -> None:
    backend = ScriptedPausable(latency=4.0)
    responses: list[tr.InferenceResponse] = []

    async def one() -> None:
        responses.append(await ask(backend))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        await trio.sleep(1)
        await backend.pause(mode)
        await trio.sleep(10)  # the request is held: 3 s of generation are left
        await backend.resume(1)
    assert trio.current_time() == 14.0
    # Stamped with the epoch it was admitted under: the backend does not stamp changes.
    assert responses[0].policy_epoch == [(0, 0)]


async def test_drain_leaves_a_request_in_flight_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = ScriptedPausable(latency=4.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, backend)
        await trio.sleep(1)
        await backend.pause("drain")
        await trio.sleep(10)
        assert backend.paused == "drain"
        assert nursery.child_tasks == frozenset()  # the request finished at t=4
        await backend.resume(1)


async def test_fail_pause_raises_after_logging_and_leaves_it_unpaused() -> None:
    backend = ScriptedPausable(fail_pause=True)
    with pytest.raises(RuntimeError, match="pause endpoint answered 404"):
        await backend.pause("keep")
    assert (backend.log, backend.paused) == (["pause keep"], None)


async def test_fail_pause_can_be_the_exception_to_raise() -> None:
    error = tr.inference.InferenceConnectionError("connection refused")
    backend = ScriptedPausable(fail_pause=error)
    with pytest.raises(tr.inference.InferenceConnectionError) as info:
        await backend.pause("drain")
    assert info.value is error


async def test_fail_resume_raises_after_resuming() -> None:
    backend = ScriptedPausable(fail_resume=True)
    await backend.pause("abort")
    with pytest.raises(RuntimeError, match="resume endpoint answered 500"):
        await backend.resume(2)
    assert (backend.paused, backend.policy_epoch) == (None, 2)
    assert backend.log == ["pause abort", "resume 2"]


async def test_a_failing_pause_in_a_weight_update_resumes_under_the_old_epoch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    good, bad = ScriptedPausable(latency=1.0), ScriptedPausable(fail_pause=True)

    async def one_call(agent: ScriptedAgent, req: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        response = await ask(req.inference_interface)
        return [tr.Rollout(trajectory=[response.raw_text or ""], reward=float(i)) for i in range(2)]

    agent = ScriptedAgent(script=one_call, parallel_generation_tasks=1)
    async with agent.get_grouped_rollouts(grouped(good, streaming=True)) as stream:
        with pytest.raises(WeightUpdateError):
            async with stream.weight_update("keep", backends=[good, bad]):
                pytest.fail("the body must not run")
        assert good.log == bad.log == ["pause keep", "resume 0"]
        assert (good.paused, bad.paused) == (None, None)
        async with stream.weight_update("keep", backends=[good]) as update:
            assert good.paused == "keep"
        assert good.log[-2:] == ["pause keep", f"resume {update.epoch}"]


# --------------------------------------------------------------------------- the module


def test_every_public_name_is_documented() -> None:
    for name in trio_rollouts.testing.__all__:
        obj = getattr(trio_rollouts.testing, name)
        if name == "GroupScript":
            continue  # a type alias, documented by its comment
        assert obj.__doc__, name
        for attr, value in vars(obj).items() if isinstance(obj, type) else ():
            if not attr.startswith("_") and callable(value):
                assert value.__doc__, f"{name}.{attr}"
