"""Cutting the sample, not the group (``_cuts.py``): over-provisioned members
(``extra_rollouts``), members cut at the staleness bound, and their accounting
(``RolloutGroup.cuts``, ``statistics().cut``, ``statistics().wasted_tokens``).

The member runner is tested directly with scripted members (exact times on the
autojump clock); the agents and the pipeline with the embedded backend, whose
heavy-tailed latency model makes cuts happen, and a property test over random
schedules of takes and weight updates.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trio_rollouts as tr
from trio_rollouts._context import CallContext, CallCuts, call_context, current_call
from trio_rollouts.envs import CalculatorEnvironment
from trio_rollouts.inference import (
    EmbeddedInference,
    EngineModel,
    InferenceResponse,
    LatencyModel,
)
from trio_rollouts.pipeline._cuts import run_members
from trio_rollouts.pipeline._ledger import Ledger
from trio_rollouts.renderers import PlainRenderer
from trio_rollouts.testing import ScriptedAgent

pytestmark = pytest.mark.filterwarnings("ignore:the first 32 groups:RuntimeWarning")

HEAVY = LatencyModel(first_token=0.2, per_token=0.02, distribution="lognormal", sigma=1.5)
PROBLEMS = [tr.Problem(prompt=f"question {i}", answer="A", problem_id=f"p{i}") for i in range(400)]


class Exact(tr.RewardOnlyAgent):
    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        return float(response.response.content.strip() == str(problem.answer))


def heavy(seed: int, parallel: int) -> tuple[EmbeddedInference, Exact]:
    """A heavy-tailed embedded backend and an agent drawing from PROBLEMS."""
    interface = EmbeddedInference(seed=seed, latency=HEAVY)
    agent = Exact(prompts=tr.PromptSource(PROBLEMS, seed=0), parallel_generation_tasks=parallel)
    return interface, agent


# --------------------------------------------------------------------------- the runner


def scripted(durations: dict[int, float], tokens: dict[int, int] | None = None):  # type: ignore[no-untyped-def]
    """A member that takes ``durations[draw]`` seconds, reporting ``tokens[draw]``
    generated tokens before it sleeps (as a backend reports a cancelled call's)."""

    async def member(draw: int) -> tuple[int, int | None, float]:
        progress = current_call().progress
        if progress is not None and tokens is not None:
            progress.generated_tokens += tokens.get(draw, 0)
        await trio.sleep(durations[draw])
        return draw, current_call().start_epoch, trio.current_time()

    return member


def group_call(epoch: int = 0) -> tuple[CallCuts, Ledger]:
    """A call in flight under ``epoch``, in the running task's context, whose cuts are
    booked in a ledger of its own (as the pipeline books them)."""
    ledger = Ledger(None)

    def book(cut: object) -> None:
        assert isinstance(cut, tr.Cut)
        ledger.cut += 1
        if cut.generated_tokens is not None:
            ledger.wasted_tokens += cut.generated_tokens

    call = CallCuts(epoch, book)
    call_context.set(CallContext(start_epoch=epoch, cuts=call))
    return call, ledger


async def test_extra_members_are_cut_when_enough_have_finished(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call, ledger = group_call()
    member = scripted({0: 3.0, 1: 1.0, 2: 4.0, 3: 2.0}, tokens={0: 5, 2: 7})
    kept = await run_members(2, 2, member)
    # The first two to finish (draws 1 and 3), in member order.
    assert [draw for draw, _ in kept] == [1, 3]
    assert trio.current_time() == 2.0
    assert sorted(call.cuts) == [tr.Cut(5, 2.0, 0), tr.Cut(7, 2.0, 0)]
    assert (ledger.cut, ledger.wasted_tokens) == (2, 12)
    assert call.watchers == []


async def test_members_running_at_the_bound_are_cut_and_sampled_again_under_the_new_epoch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call, ledger = group_call()
    member = scripted({0: 1.0, 1: 10.0, 2: 2.0, 3: 10.0, 4: 1.0, 5: 3.0})
    async with trio.open_nursery() as nursery:

        async def runner() -> None:
            nonlocal kept
            kept = await run_members(4, 0, member)

        kept: list[tuple[int, tuple[int, int | None, float]]] = []
        nursery.start_soon(runner)
        await trio.sleep(5.0)
        await trio.testing.wait_all_tasks_blocked()
        call.cut_at(1)  # the pipeline's signal: the stream reached epoch 1
    # Members 1 and 3 were cut at t=5 and came back as draws 4 and 5 under epoch 1.
    assert [draw for draw, _ in kept] == [0, 4, 2, 5]
    assert [result[1] for _, result in kept] == [0, 1, 0, 1]
    assert [result[2] for _, result in kept] == [1.0, 6.0, 2.0, 8.0]
    assert sorted(call.cuts) == [tr.Cut(0, 5.0, 0), tr.Cut(0, 5.0, 0)]
    assert ledger.cut == 2
    # Kept members started under epoch 0: the call still counts from there.
    assert call.start_epoch == 0


async def test_a_call_whose_members_were_all_cut_counts_from_the_new_epoch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call, _ = group_call(epoch=2)
    member = scripted({0: 10.0, 1: 10.0, 2: 1.0, 3: 1.0})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_members, 2, 0, member)
        await trio.testing.wait_all_tasks_blocked()
        call.cut_at(3)
        await trio.testing.wait_all_tasks_blocked()
        assert call.start_epoch == 3
    assert len(call.cuts) == 2


async def test_a_failing_member_fails_the_group_as_itself_and_cuts_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call, ledger = group_call()

    async def member(draw: int) -> int:
        if draw == 1:
            await trio.sleep(1.0)
            raise ValueError("member 1 broke")
        await trio.sleep(100.0)
        return draw

    with pytest.raises(ValueError, match="member 1 broke"):
        await run_members(3, 1, member)
    assert (ledger.cut, call.cuts, call.watchers) == (0, [], [])


async def test_cancelling_the_runner_cancels_every_member_and_books_no_cut(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call, ledger = group_call()
    started: list[int] = []

    async def member(draw: int) -> int:
        started.append(draw)
        await trio.sleep_forever()
        raise AssertionError  # pragma: no cover

    with trio.move_on_after(1.0) as scope:
        await run_members(2, 2, member)
    assert scope.cancelled_caught
    assert sorted(started) == [0, 1, 2, 3]
    assert (ledger.cut, call.cuts, call.watchers) == (0, [], [])


async def test_outside_a_pipeline_extra_members_still_race(
    autojump_clock: trio.testing.MockClock,
) -> None:
    member = scripted({0: 3.0, 1: 1.0, 2: 2.0})
    kept = await run_members(2, 1, member)
    assert [draw for draw, _ in kept] == [1, 2]


async def test_a_cut_members_tokens_are_unknown_when_its_backend_cannot_tell(
    autojump_clock: trio.testing.MockClock,
) -> None:
    call, ledger = group_call()

    async def member(draw: int) -> int:
        progress = current_call().progress
        assert progress is not None
        if draw == 1:
            progress.known = False  # an HTTP request cancelled mid-flight
        await trio.sleep(1.0 + draw)
        return draw

    await run_members(1, 1, member)
    assert call.cuts == [tr.Cut(None, 1.0, 0)]
    assert (ledger.cut, ledger.wasted_tokens) == (1, 0)


# --------------------------------------------------------------------------- the models


def test_cuts_round_trip_through_json_and_bad_cuts_are_refused() -> None:
    rollout = tr.Rollout(trajectory=["a"], reward=1.0)
    group = tr.RolloutGroup(rollouts=[rollout], cuts=[(3, 1.5, 0), (None, 0.25, 2)])
    assert group.cuts == (tr.Cut(3, 1.5, 0), tr.Cut(None, 0.25, 2))
    data = json.loads(json.dumps(tr.unstructure(group)))
    assert data["cuts"] == [[3, 1.5, 0], [None, 0.25, 2]]
    assert tr.structure(data, tr.RolloutGroup) == group
    assert tr.RolloutGroup(rollouts=[rollout]).cuts == ()
    with pytest.raises(TypeError, match=r"cuts must be a list of \(generated_tokens"):
        tr.RolloutGroup(rollouts=[rollout], cuts=[(1, -1.0, 0)])
    with pytest.raises(tr.ValidationError, match=r"3 items"):
        tr.structure({"rollouts": [{"trajectory": ["a"]}], "cuts": [[1, 2]]}, tr.RolloutGroup)


def test_extra_rollouts_must_be_a_count() -> None:
    with pytest.raises(ValueError, match="extra_rollouts"):
        tr.GroupedRolloutRequest(
            inference_interface=EmbeddedInference(),
            num_groups=1,
            rollouts_per_group=2,
            extra_rollouts=-1,
        )
    with pytest.raises(TypeError, match="extra_rollouts"):
        tr.GroupedRolloutRequest(
            inference_interface=EmbeddedInference(),
            num_groups=1,
            rollouts_per_group=2,
            extra_rollouts=1.5,
        )


# --------------------------------------------------------------------------- the agents


async def test_reward_only_agents_keep_the_first_members_to_finish(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface, agent = heavy(seed=3, parallel=6)
    request = tr.GroupedRolloutRequest(
        inference_interface=interface,
        num_groups=6,
        rollouts_per_group=4,
        extra_rollouts=3,
        seed=11,
    )
    async with agent.get_grouped_rollouts(request) as stream:
        groups = [group async for group in stream]
        statistics = stream.statistics()
    assert len(groups) == 6
    cuts = [cut for group in groups for cut in group.cuts]
    assert all(len(group) == 4 and len(group.cuts) == 3 for group in groups)
    assert statistics.cut == len(cuts) == 18
    assert statistics.wasted_tokens == sum(cut.generated_tokens or 0 for cut in cuts)
    assert all(cut.generated_tokens is not None and cut.epoch == 0 for cut in cuts)
    assert statistics.unaccounted == 0
    # The sampling record shows each kept member's own seed.
    for group in groups:
        seeds = [rollout.sampling[0][0].seed for rollout in group]  # type: ignore[union-attr]
        assert len(set(seeds)) == 4


async def test_multi_turn_agents_keep_the_first_episodes_to_finish(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(seed=5, latency=HEAVY)
    agent = tr.MultiTurnAgent(
        environment=CalculatorEnvironment,
        renderer=PlainRenderer(),
        prompts=tr.PromptSource(
            [
                tr.Problem(problem_id=f"p{i}", prompt=f"What is {i} + 1?", answer=i + 1)
                for i in range(9)
            ]
        ),
        parallel_generation_tasks=4,
    )
    request = tr.GroupedRolloutRequest(
        inference_interface=interface, num_groups=4, rollouts_per_group=3, extra_rollouts=2
    )
    async with agent.get_grouped_rollouts(request) as stream:
        groups = [group async for group in stream]
        statistics = stream.statistics()
    assert [len(group) for group in groups] == [3] * 4
    assert [len(group.cuts) for group in groups] == [2] * 4
    assert statistics.cut == 8


async def keep_loop(
    agent: tr.GroupedRolloutGenerator,
    request: tr.GroupedRolloutRequest,
    steps: int,
    per_step: int,
    mode: str = "keep",
) -> tuple[list[tr.RolloutGroup], tr.RolloutStreamStatistics, int]:
    """An asynchronous loop: ``per_step`` groups, then an update; the largest age of a
    taken group."""
    taken: list[tr.RolloutGroup] = []
    oldest = 0
    async with agent.get_grouped_rollouts(request) as stream:
        for _ in range(steps):
            for _ in range(per_step):
                group = await stream.receive()
                oldest = max(oldest, stream.policy_epoch - group.start_epoch)
                taken.append(group)
            async with stream.weight_update(mode):  # type: ignore[arg-type]
                await trio.sleep(0.5)
        statistics = stream.statistics()
    return taken, statistics, oldest


@pytest.mark.parametrize("bound", [1, 2])
async def test_members_are_cut_at_the_bound_and_the_bound_holds(
    autojump_clock: trio.testing.MockClock, bound: int
) -> None:
    interface, agent = heavy(seed=7, parallel=16)
    request = tr.GroupedRolloutRequest(
        inference_interface=interface,
        num_groups=4,
        rollouts_per_group=4,
        streaming=True,
        max_staleness=bound,
        seed=2,
        group_calls=False,  # one call per member: a group call's members end together
    )
    taken, statistics, oldest = await keep_loop(agent, request, steps=12, per_step=4)
    assert oldest <= bound
    assert statistics.cut > 0
    assert statistics.unaccounted == 0
    assert all(len(group) == 4 for group in taken)
    for group in taken:
        # A group's cuts were members of an older epoch, cut at the bound.
        for cut in group.cuts:
            assert cut.epoch + bound >= group.start_epoch
        # Its start is the oldest start among the members it kept (a member's first
        # token may come after a keep update it was held through).
        epochs = [rollout.policy_epoch[0][0][1] for rollout in group]  # type: ignore[index]
        assert group.start_epoch <= min(epochs)


async def test_custom_agents_keep_the_group_level_rule(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def slow(agent: ScriptedAgent, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(3.0)
        return [tr.Rollout(trajectory=["a"], reward=float(i)) for i in range(2)]

    agent = ScriptedAgent(script=slow, parallel_generation_tasks=8)
    request = tr.GroupedRolloutRequest(
        inference_interface=EmbeddedInference(),
        num_groups=2,
        rollouts_per_group=2,
        streaming=True,
        max_staleness=1,
        extra_rollouts=2,
    )
    taken, statistics, oldest = await keep_loop(agent, request, steps=4, per_step=2)
    assert oldest <= 1
    assert statistics.cut == 0
    assert all(group.cuts == () for group in taken)


async def test_the_engine_queues_older_epochs_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Calls of an older epoch wait ahead of newer ones (the priority policy); with
    ``fcfs`` they wait in arrival order."""
    order: dict[str, list[int]] = {}

    async def call(
        interface: EmbeddedInference, finished: list[int], epoch: int, delay: float
    ) -> None:
        await trio.sleep(delay)
        call_context.set(CallContext(start_epoch=epoch))
        await interface.agenerate(interface.prepare_request(f"prompt {epoch}"))
        finished.append(epoch)

    for policy in ("priority", "fcfs"):
        engine = EngineModel(max_num_seqs=1, scheduling_policy=policy)  # type: ignore[arg-type]
        interface = EmbeddedInference(engine=engine, seed=1)
        finished: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, interface, finished, 5, 0.0)  # runs first: alone
            nursery.start_soon(call, interface, finished, 3, 0.001)  # then these wait
            nursery.start_soon(call, interface, finished, 1, 0.002)
        order[policy] = finished
    assert order["priority"] == [5, 1, 3]
    assert order["fcfs"] == [5, 3, 1]


# --------------------------------------------------------------------------- properties


@st.composite
def schedules(draw: st.DrawFn) -> dict[str, object]:
    return {
        "bound": draw(st.sampled_from([None, 0, 1, 2])),
        "extra": draw(st.sampled_from([0, 0, 1, 2])),
        "per_group": draw(st.sampled_from([1, 2, 4, 8])),
        "num_groups": draw(st.sampled_from([1, 2, 3])),
        "seed": draw(st.integers(0, 1000)),
        "modes": draw(
            st.lists(st.sampled_from(["keep", "keep", "abort", "drain", "restart"]), min_size=1)
        ),
        "per_step": draw(st.integers(1, 4)),
        "flaky": draw(st.sampled_from([0.0, 0.0, 0.2])),
        "stop_after": draw(st.sampled_from([None, 0.5, 3.0])),
        "group_calls": draw(st.booleans()),
    }


class Flaky(Exception):
    pass


class FlakyExact(Exact):
    """Rewards that fail now and then (transient: retried in the slot)."""

    flaky: float = 0.0
    draws: int = 0

    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        self.draws += 1
        if self.flaky and (hash((problem.problem_id, self.draws)) % 100) < self.flaky * 100:
            raise Flaky(problem.problem_id)
        return await super().get_reward(problem, response)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schedule=schedules())
def test_cuts_keep_the_bound_the_ledger_and_each_prompt_once(schedule: dict[str, object]) -> None:
    """Over random schedules of takes and updates (every mode), with over-provisioning,
    cuts at the bound, transient failures retried and an early exit sometimes: no group
    is taken older than its bound, each has ``rollouts_per_group`` rollouts, the ledger
    adds up, every cut is counted, and no problem is delivered twice in a data epoch."""
    bound = schedule["bound"]
    extra = schedule["extra"]
    modes = schedule["modes"]
    source = tr.PromptSource(PROBLEMS, seed=int(schedule["seed"]))  # type: ignore[call-overload]
    agent = FlakyExact(
        prompts=source,
        parallel_generation_tasks=schedule["per_group"] * schedule["num_groups"],  # type: ignore[operator]
        failure_policy=tr.FailurePolicy(
            max_attempts=3,
            retry_on=(Flaky,),
            wait_initial=0.01,
            on_failure="skip",
            skip_budget=10**6,
        ),
    )
    agent.flaky = schedule["flaky"]  # type: ignore[assignment]
    request = tr.GroupedRolloutRequest(
        inference_interface=EmbeddedInference(seed=int(schedule["seed"]), latency=HEAVY),  # type: ignore[call-overload]
        num_groups=schedule["num_groups"],
        rollouts_per_group=3,
        extra_rollouts=extra,
        streaming=True,
        max_staleness=bound,
        seed=1,
        group_calls=schedule["group_calls"],
    )
    seen: list[str] = []
    observed: dict[str, object] = {}

    async def main() -> None:
        oldest = 0
        cuts = 0
        with trio.move_on_after(schedule["stop_after"] or math.inf):  # type: ignore[arg-type]
            async with agent.get_grouped_rollouts(request) as stream:
                for mode in modes:  # type: ignore[attr-defined]
                    for _ in range(schedule["per_step"]):  # type: ignore[call-overload]
                        group = await stream.receive()
                        oldest = max(oldest, stream.policy_epoch - group.start_epoch)
                        assert len(group) == 3
                        cuts += len(group.cuts)
                        seen.append(group[0].problem_id or "")
                    async with stream.weight_update(mode):
                        await trio.sleep(0.5)
                observed["statistics"] = stream.statistics()
            observed["final"] = stream.statistics()
        observed["oldest"] = oldest
        observed["cuts"] = cuts

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    if bound is not None:
        assert observed["oldest"] <= bound  # type: ignore[operator]
    final = observed.get("final")
    if final is not None:
        assert final.unaccounted == 0  # type: ignore[attr-defined]
        assert final.cut >= observed["cuts"]  # type: ignore[attr-defined, operator]
        if not extra and (bound is None or schedule["group_calls"]):
            assert final.cut == 0  # type: ignore[attr-defined]
    # Each problem delivered at most once (the run never reaches a second data epoch).
    assert max(Counter(seen).values(), default=1) == 1
