"""The engine model: ``EmbeddedInference(engine=EngineModel(...), replicas=R)``.

Every figure here is exact: the engine runs on the ``MockClock``, a step takes
``base + per_prefill_token * prefilled + per_decode_seq * decoding`` seconds, and tokens
are code points, so a prompt's length is the length of its plain rendering.
"""

from __future__ import annotations

import math

import attrs
import pytest
import trio
import trio.testing

import trio_rollouts as tr
from trio_rollouts import GenerationArgs
from trio_rollouts._context import CallContext, call_context, current_call
from trio_rollouts.inference import (
    EmbeddedInference,
    EngineModel,
    EngineStatistics,
    GeneratesGroups,
    InferenceRequest,
    InferenceResponse,
)
from trio_rollouts.inference._placement import Placement

#: Round numbers, so that times can be checked exactly.
MODEL = EngineModel(
    max_num_seqs=8,
    max_num_batched_tokens=1024,
    block_size=4,
    num_blocks=1024,
    base=1.0,
    per_prefill_token=0.01,
    per_decode_seq=0.1,
)


def fixed(completion: str) -> tr.inference.Policy:
    def policy(prompt: list[tr.ChatMessage]) -> tuple[list[str], list[float]]:
        return [completion], [1.0]

    return policy


def ids_request(length: int, first: int = 65) -> InferenceRequest:
    """A token-id prompt of ``length`` ids (code points), its first id ``first``."""
    return InferenceRequest(prompt=[], prompt_ids=[first] + [97] * (length - 1))


async def test_one_request_takes_a_prefill_step_then_one_decode_step_per_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(engine=MODEL, policy=fixed("xyz"))
    start = trio.current_time()
    response = await interface.agenerate(ids_request(20))
    # Step 1 prefills the 20 ids and samples "x"; two decode steps sample "y" and "z".
    assert trio.current_time() - start == pytest.approx((1.0 + 0.01 * 20) + 2 * (1.0 + 0.1))
    assert response.response.content == "xyz"
    assert response.token_ids is not None
    assert response.token_ids[20:] == [ord(c) for c in "xyz"]
    assert response.finish_reason == "stop"
    (stats,) = interface.engine_statistics()
    assert stats == EngineStatistics(
        replica=0,
        prompt_tokens=20,
        prefix_cache_hits=0,
        prefill_tokens=20,
        generation_tokens=3,
        preemptions=0,
        running=0,
        waiting=0,
        busy_seconds=pytest.approx(3.4),
        steps=3,
    )


async def test_an_empty_completion_finishes_after_its_prefill(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(engine=MODEL, policy=fixed(""))
    response = await interface.agenerate(ids_request(8))
    assert response.response.content == ""
    assert trio.current_time() == pytest.approx(1.0 + 0.08)
    assert interface.engine_statistics()[0].generation_tokens == 0


async def test_a_repeated_prompt_is_served_from_the_prefix_cache_but_its_last_token(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(engine=MODEL, policy=fixed("x"))
    await interface.agenerate(ids_request(16))
    await interface.agenerate(ids_request(16))
    await interface.agenerate(ids_request(17))
    stats = interface.engine_statistics()[0]
    # 16 ids: 4 full blocks, but the last id is computed to sample from: 3 blocks hit.
    # 17 ids: the 4 full blocks of the first 16 hit (the 16 + "x" of the first request
    # are not a full block: 17 ids, 4 full blocks, the fifth partial).
    assert stats.prompt_tokens == 16 + 16 + 17
    assert stats.prefix_cache_hits == 12 + 16
    assert stats.prefill_tokens == 16 + 4 + 1
    assert stats.prefix_cache_hit_rate == pytest.approx(28 / 49)


async def test_without_prefix_caching_nothing_is_shared(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(
        engine=attrs.evolve(MODEL, prefix_caching=False), policy=fixed("x")
    )
    for _ in range(2):
        await interface.agenerate(ids_request(16))
    assert interface.engine_statistics()[0].prefix_cache_hits == 0


async def test_siblings_admitted_in_one_step_share_the_prompt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first sibling's blocks are cached as soon as it is scheduled: the others
    admitted in the same step find them."""
    interface = EmbeddedInference(engine=MODEL, policy=fixed("x"))
    responses = await interface.agenerate_group(ids_request(17), 4)
    assert len(responses) == 4
    stats = interface.engine_statistics()[0]
    assert stats.prefill_tokens == 17 + 3 * 1
    assert stats.prefix_cache_hits == 3 * 16
    # One step prefills them all (and samples "x" for each).
    assert trio.current_time() == pytest.approx(1.0 + 0.01 * 20)


async def test_max_num_seqs_queues_the_rest_first_come_first_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = attrs.evolve(MODEL, max_num_seqs=2, prefix_caching=False)
    interface = EmbeddedInference(engine=model, policy=fixed("xy"))
    finished: list[int] = []

    async def one(i: int) -> None:
        call_context.set(CallContext(group=(0, 0, i)))  # admission order among simultaneous calls
        await interface.agenerate(ids_request(4, first=65 + i))
        finished.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(one, i)
        # Twice: the first wait wakes beside the engine's own, before it has placed them.
        await trio.testing.wait_all_tasks_blocked()
        await trio.testing.wait_all_tasks_blocked()
        (stats,) = interface.engine_statistics()
        assert (stats.running, stats.waiting) == (2, 1)
    assert finished[2] == 2
    # Two steps for the first two (prefill + 1 decode), then the third: 2 more steps.
    assert trio.current_time() == pytest.approx(
        (1.0 + 0.08) + (1.0 + 0.2) + (1.0 + 0.04) + (1.0 + 0.1)
    )


async def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = attrs.evolve(MODEL, max_num_batched_tokens=10)
    interface = EmbeddedInference(engine=model, policy=fixed("x"))
    await interface.agenerate(ids_request(25))
    stats = interface.engine_statistics()[0]
    assert stats.steps == 3  # 10 + 10 + 5 ids, the last chunk samples "x"
    assert trio.current_time() == pytest.approx(3 * 1.0 + 0.01 * 25)


async def test_when_blocks_run_out_the_newest_request_is_preempted_and_recomputed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 6 blocks of 4 ids: two requests of 8 prompt ids fit (4 blocks) but not their 12
    # generated ids each.
    model = attrs.evolve(MODEL, num_blocks=6, prefix_caching=False)
    completion = "abcdefghijkl"
    interface = EmbeddedInference(engine=model, policy=fixed(completion))
    alone = EmbeddedInference(engine=MODEL, policy=fixed(completion))
    reference = await alone.agenerate(ids_request(8, first=66))
    responses: dict[int, InferenceResponse] = {}

    async def one(i: int) -> None:
        call_context.set(CallContext(group=(0, 0, i)))
        responses[i] = await interface.agenerate(ids_request(8, first=65 + i))

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(one, i)
    stats = interface.engine_statistics()[0]
    assert stats.preemptions >= 1
    assert responses[1].num_evictions == stats.preemptions
    assert responses[0].num_evictions == 0
    # Preemption changes timing, never the tokens.
    assert responses[1].token_ids == reference.token_ids
    assert responses[1].response.content == completion
    assert stats.prefill_tokens > 16  # the preempted request was computed again


async def test_a_request_that_cannot_fit_in_the_cache_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(engine=attrs.evolve(MODEL, num_blocks=2), policy=fixed("xyz"))
    with pytest.raises(ValueError, match=r"num_blocks \* block_size = 8"):
        await interface.agenerate(ids_request(6))


async def test_a_cancelled_request_leaves_the_engine_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(engine=MODEL, policy=fixed("x" * 100))
    with trio.move_on_after(5.0):
        await interface.agenerate(ids_request(8))
    (stats,) = interface.engine_statistics()
    assert (stats.running, stats.waiting) == (0, 0)
    # The engine is free: the next request is not slowed by the cancelled one.
    short = EmbeddedInference(engine=MODEL, policy=fixed("x"))
    start = trio.current_time()
    await short.agenerate(ids_request(8))
    assert trio.current_time() - start == pytest.approx(1.08)


async def test_replicas_without_an_engine_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"replicas=2 needs engine=EngineModel"):
        EmbeddedInference(replicas=2)
    with pytest.raises(ValueError, match=r"routing must be one of"):
        EmbeddedInference(engine=MODEL, replicas=2, routing="random")  # type: ignore[arg-type]
    assert EmbeddedInference().engine_statistics() == ()


def test_engine_model_checks_its_fields() -> None:
    with pytest.raises((TypeError, ValueError), match="max_num_seqs"):
        EngineModel(max_num_seqs=0)
    with pytest.raises((TypeError, ValueError), match="base"):
        EngineModel(base=-1.0)
    assert EngineModel().step_seconds(0, 1) == pytest.approx(0.001545 + 0.0000256)
    assert EngineModel(per_prefill_step=0.5).step_seconds(1, 0) == pytest.approx(
        0.001545 + 0.00000596 + 0.5
    )
    assert EngineModel.gpu().base == pytest.approx(0.023475)


# --------------------------------------------------------------------------- groups


async def test_a_group_call_samples_what_calls_one_after_the_other_sample(
    autojump_clock: trio.testing.MockClock,
) -> None:
    policy = tr.inference.HashedPromptPolicy()
    request = InferenceRequest(prompt=[tr.ChatMessage(role="user", content="2+2?")])
    for engine in (None, MODEL):
        grouped = EmbeddedInference(seed=3, engine=engine, policy=policy)
        one_by_one = EmbeddedInference(seed=3, engine=engine, policy=policy)
        assert isinstance(grouped, GeneratesGroups)
        group = await grouped.agenerate_group(request, 6)
        alone = [await one_by_one.agenerate(request) for _ in range(6)]
        assert [r.response.content for r in group] == [r.response.content for r in alone]
        assert [r.logprobs for r in group] == [r.logprobs for r in alone]


async def test_choice_i_of_a_seeded_group_is_a_call_with_seed_plus_i(
    autojump_clock: trio.testing.MockClock,
) -> None:
    args = GenerationArgs(seed=1000, temperature=1.0)
    request = InferenceRequest(
        prompt=[tr.ChatMessage(role="user", content="q")], generation_args=args
    )
    interface = EmbeddedInference(seed=1)
    group = await interface.agenerate_group(request, 5)
    for i, response in enumerate(group):
        alone = await interface.agenerate(
            attrs.evolve(request, generation_args=attrs.evolve(args, seed=1000 + i))
        )
        assert response.response.content == alone.response.content


async def test_a_bad_n_is_refused_before_anything_is_sent() -> None:
    interface = EmbeddedInference(engine=MODEL)
    request = interface.prepare_request("q")
    with pytest.raises(ValueError, match="n must be >= 1"):
        await interface.agenerate_group(request, 0)
    with pytest.raises(TypeError, match="n must be an int"):
        await interface.agenerate_group(request, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="n must be an int"):
        await interface.agenerate_group(request, True)


async def test_a_cancelled_group_leaves_none_of_its_choices(
    autojump_clock: trio.testing.MockClock,
) -> None:
    for engine in (None, MODEL):
        interface = EmbeddedInference(engine=engine, policy=fixed("x" * 50))
        with trio.move_on_after(0.001 if engine is None else 3.0) as scope:
            await interface.agenerate_group(ids_request(8), 4)
        assert scope.cancelled_caught
        for stats in interface.engine_statistics():
            assert (stats.running, stats.waiting) == (0, 0)


# --------------------------------------------------------------------------- placement


async def spread(
    routing: str, *, calls_per_group: int = 8, groups: int = 8, replicas: int = 4
) -> tuple[EmbeddedInference, dict[int, set[int]]]:
    """``groups`` groups of separate calls arriving at once; where each group went."""
    interface = EmbeddedInference(
        engine=MODEL,
        replicas=replicas,
        routing=routing,
        policy=fixed("xy"),  # type: ignore[arg-type]
    )
    placed: dict[int, set[int]] = {}
    pick = Placement.pick

    def recording(self: Placement, load: list[int], group: object, episode: int | None) -> int:
        index = pick(self, load, group, episode)  # type: ignore[arg-type]
        if isinstance(group, tuple):
            placed.setdefault(group[1], set()).add(index)
        return index

    Placement.pick = recording  # type: ignore[method-assign,assignment]
    try:
        await _spread(interface, groups, calls_per_group)
    finally:
        Placement.pick = pick  # type: ignore[method-assign]
    return interface, placed


async def _spread(interface: EmbeddedInference, groups: int, calls_per_group: int) -> None:
    async def member(g: int) -> None:
        call_context.set(CallContext(group=(0, g, 0)))
        await interface.agenerate(ids_request(40, first=65 + g))

    async with trio.open_nursery() as nursery:
        for g in range(groups):
            for _ in range(calls_per_group):
                nursery.start_soon(member, g)


async def test_group_routing_keeps_each_group_on_one_replica_and_spreads_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface, placed = await spread("group")
    assert all(len(replicas) == 1 for replicas in placed.values())
    loads = [s.prompt_tokens for s in interface.engine_statistics()]
    assert loads == [2 * 8 * 40] * 4  # two groups per replica
    # Each group's prompt is prefilled once (its siblings hit its blocks).
    assert sum(s.prefill_tokens for s in interface.engine_statistics()) == 8 * (40 + 7 * 4)


async def test_least_loaded_and_round_robin_scatter_groups(
    autojump_clock: trio.testing.MockClock,
) -> None:
    grouped, _ = await spread("group")
    for routing in ("least_loaded", "round_robin"):
        interface, placed = await spread(routing)
        assert all(len(replicas) == 4 for replicas in placed.values())
        prefilled = sum(s.prefill_tokens for s in interface.engine_statistics())
        assert prefilled > sum(s.prefill_tokens for s in grouped.engine_statistics())


async def test_two_runs_place_alike(autojump_clock: trio.testing.MockClock) -> None:
    first, placed_first = await spread("group", groups=12, calls_per_group=3)
    second, placed_second = await spread("group", groups=12, calls_per_group=3)
    assert placed_first == placed_second
    assert first.engine_statistics() == second.engine_statistics()


async def test_the_first_call_of_a_group_is_not_always_on_the_first_replica(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ties between idle replicas are broken by a seeded hash of the group key."""
    firsts = set()
    for g in range(16):
        interface = EmbeddedInference(engine=MODEL, replicas=4, policy=fixed("x"))
        call_context.set(CallContext(group=(0, g, 0)))
        await interface.agenerate(ids_request(8))
        firsts.add(next(s.replica for s in interface.engine_statistics() if s.prompt_tokens))
    assert len(firsts) > 1


def test_the_margin_counts_other_groups_calls_not_the_groups_own() -> None:
    placement = tr.inference._placement.Placement(replicas=2, routing="group", margin=2)
    group = (0, 7, 0)
    load = [0, 0]
    home = placement.pick(load, group, None)
    # Eight siblings arriving together stay home: their own calls are not held against it.
    for _ in range(7):
        load[home] += 1
        assert placement.pick(load, group, None) == home
    # Three calls of other groups on the home replica (more than the margin): the next
    # call of the group goes to the least loaded one.
    load[home] += 1 + 3
    assert placement.pick(load, group, None) == 1 - home
    # Released calls count no more.
    for _ in range(8):
        placement.release(group, home)


async def test_an_episode_follows_its_replica(autojump_clock: trio.testing.MockClock) -> None:
    """A group whose home is busy past the margin moves; an episode that moved keeps
    its new replica for its next turns."""
    placement = tr.inference._placement.Placement(replicas=2, routing="group", margin=0)
    group = (0, 1, 0)
    home = placement.pick([0, 0], group, 0)
    other = 1 - home
    load = [0, 0]
    load[home] = 5
    moved = placement.pick(load, group, 1)  # episode 1: the home is too busy
    assert moved == other
    load = [0, 0]
    assert placement.pick(load, group, 1) == other  # episode 1 stays where it went
    assert placement.pick(load, group, 0) == home  # episode 0 stays home
    assert placement.pick(load, group, None) == other  # the group's replica moved


def test_round_robin_ignores_load() -> None:
    placement = tr.inference._placement.Placement(replicas=3, routing="round_robin")
    assert [placement.pick([9, 0, 0], (0, 0, i), None) for i in range(4)] == [0, 1, 2, 0]


def test_least_loaded_picks_the_least_loaded_and_rotates_ties() -> None:
    placement = tr.inference._placement.Placement(replicas=3, routing="least_loaded")
    assert placement.pick([2, 1, 2], (0, 0, 0), None) == 1
    assert [placement.pick([0, 0, 0], None, None) for _ in range(3)] == [2, 0, 1]


# --------------------------------------------------------------------------- pausing


async def test_keep_stamps_the_token_where_the_new_epoch_began(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(engine=MODEL, policy=fixed("abcdefghij"))
    result: list[InferenceResponse] = []

    async def call() -> None:
        result.append(await interface.agenerate(ids_request(8)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        # The prefill step ends at 1.08 (token 0), then decode steps of 1.1 each.
        await trio.sleep(1.08 + 3 * 1.1 + 0.5)
        await interface.pause("keep")
        await trio.sleep(10.0)  # nothing is generated while paused
        paused_tokens = interface.engine_statistics()[0].generation_tokens
        await trio.sleep(10.0)
        assert interface.engine_statistics()[0].generation_tokens == paused_tokens
        await interface.resume(1)
    (response,) = result
    # Tokens 0..3 by 4.38; the pause (at 4.88) waits for the step in progress, which
    # samples token 4 at 5.48.
    k = paused_tokens
    assert k == 5
    assert response.policy_epoch == [(0, 0), (k, 1)]
    # The tokens after the boundary attend to the KV computed before it.
    assert response.kv_cache_epoch == [(0, 0)]
    assert response.response.content == "abcdefghij"


async def test_abort_recomputes_the_cache_and_continues(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(engine=MODEL, policy=fixed("abcdefghij"))
    result: list[InferenceResponse] = []

    async def call() -> None:
        result.append(await interface.agenerate(ids_request(8)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await trio.sleep(1.08 + 1.1 + 0.5)
        await interface.pause("abort")
        k = interface.engine_statistics()[0].generation_tokens
        await interface.resume(1)
    (response,) = result
    assert response.policy_epoch == [(0, 0), (k, 1)]
    # From token k on, the tokens attend to the cache computed again under epoch 1.
    assert response.kv_cache_epoch == [(0, 0), (k, 1)]
    assert response.response.content == "abcdefghij"
    # The prompt and the k tokens were prefilled again after the resume.
    assert interface.engine_statistics()[0].prefill_tokens == 8 + 8 + k


async def test_drain_waits_for_the_requests_in_flight_and_holds_new_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(engine=MODEL, policy=fixed("abc"))
    result: list[InferenceResponse] = []

    async def call() -> None:
        result.append(await interface.agenerate(ids_request(8)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        await trio.testing.wait_all_tasks_blocked()
        await interface.pause("drain")
        assert len(result) == 1  # it finished under the old epoch
        assert result[0].policy_epoch == [(0, 0)]
        nursery.start_soon(call)
        await trio.sleep(100.0)
        assert len(result) == 1  # held while paused
        await interface.resume(1)
    assert result[1].policy_epoch == [(0, 1)]


async def test_a_weight_update_never_serves_blocks_of_older_weights(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface = EmbeddedInference(engine=MODEL, policy=fixed("x"))
    await interface.agenerate(ids_request(16))
    await interface.pause("keep")
    await interface.resume(1)
    await interface.agenerate(ids_request(16))
    assert interface.engine_statistics()[0].prefix_cache_hits == 0
    await interface.agenerate(ids_request(16))
    assert interface.engine_statistics()[0].prefix_cache_hits == 12


# --------------------------------------------------------------------------- agents


class Counting(EmbeddedInference):
    """Counts the calls and group calls it receives."""

    calls: int = 0
    group_calls: int = 0

    async def base_generate_group(
        self, request: InferenceRequest, n: int
    ) -> list[InferenceResponse]:
        self.group_calls += 1
        return await super().base_generate_group(request, n)

    async def _engine_generate(self, *args: object) -> list[InferenceResponse]:  # type: ignore[override]
        self.calls += 1
        return await super()._engine_generate(*args)  # type: ignore[arg-type]


class Exact(tr.RewardOnlyAgent):
    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        return float(response.response.content.strip() == str(problem.answer))


PROBLEMS = [tr.Problem(prompt=f"question {i}", answer="A", problem_id=f"p{i}") for i in range(6)]


@pytest.mark.parametrize("group_calls", [True, False])
async def test_reward_only_agents_send_a_group_as_one_call_unless_asked_not_to(
    autojump_clock: trio.testing.MockClock, group_calls: bool
) -> None:
    interface = Counting(engine=MODEL, replicas=2)
    agent = Exact(prompts=tr.PromptSource(PROBLEMS, seed=0), parallel_generation_tasks=3)
    request = tr.GroupedRolloutRequest(
        num_groups=3,
        rollouts_per_group=4,
        inference_interface=interface,
        group_calls=group_calls,
    )
    async with agent.get_grouped_rollouts(request) as stream:
        batch = [await stream.receive() for _ in range(3)]
    assert all(len(group) == 4 for group in batch)
    if group_calls:
        assert interface.group_calls >= 3
        assert interface.calls == interface.group_calls  # one engine call per group
    else:
        assert interface.group_calls == 0
        assert interface.calls >= 12
    # Either way each group's calls went to one replica: its prompt prefilled once.
    hits = sum(s.prefix_cache_hits for s in interface.engine_statistics())
    prompts = sum(s.prompt_tokens for s in interface.engine_statistics())
    assert hits >= prompts * 3 / 4 * 0.8


def test_episode_and_group_are_unset_outside_the_pipeline() -> None:
    assert current_call().group is None
    assert current_call().episode is None
    assert math.isfinite(EngineModel().base)


# --------------------------------------------------------------------------- episodes


class Talk(tr.BaseEnvironment):
    """Three turns; ``reset`` says the problem (and ``salt``, if any: resets differ)."""

    def __init__(self, problem: tr.Problem, salt: str = "", fail: bool = False) -> None:
        super().__init__()
        self.problem = problem
        self.salt = salt
        self.fail = fail
        self.steps = 0

    async def reset(self) -> list[tr.ChatMessage]:
        await trio.sleep(0.01)
        if self.fail:
            raise RuntimeError("the sandbox did not start")
        return [tr.ChatMessage(role="user", content=f"{self.problem.prompt}{self.salt}")]

    async def step(self, turn: tr.AssistantTurn) -> tr.EnvironmentStep:
        await trio.sleep(0.1)
        self.steps += 1
        if self.steps >= 3:
            return tr.EnvironmentStep(done=True, reward=1.0)
        return tr.EnvironmentStep(
            messages=[tr.ChatMessage(role="user", content=f"more {self.steps}")]
        )


async def episodes(
    environment: object, *, group_calls: bool = True, live_environments: int | None = None
) -> tuple[Counting, list[tr.RolloutGroup]]:
    interface = Counting(engine=MODEL, replicas=2)
    agent = tr.MultiTurnAgent(
        environment=environment,  # type: ignore[arg-type]
        renderer=tr.PlainRenderer(),
        prompts=tr.PromptSource(PROBLEMS, seed=0),
        parallel_generation_tasks=2,
        live_environments=live_environments,
    )
    request = tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=4,
        inference_interface=interface,
        group_calls=group_calls,
        seed=5,
    )
    async with agent.get_grouped_rollouts(request) as stream:
        groups = [await stream.receive() for _ in range(2)]
    return interface, groups


async def test_the_first_turns_of_a_groups_episodes_are_one_group_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    interface, groups = await episodes(Talk)
    group_calls = interface.group_calls
    assert group_calls >= 2
    # One engine call for each group's first turns, one per episode for turns 2 and 3.
    assert interface.calls == group_calls + group_calls * 4 * 2
    for group in groups:
        assert len(group) == 4
        for rollout in group:
            assert isinstance(rollout, tr.TokenRollout)
            assert rollout.fidelity == "exact"
            assert rollout.extra["episode"]["turns"] == 3


@pytest.mark.parametrize(
    "setting",
    ["resets differ", "group_calls=False", "live_environments"],
)
async def test_first_turns_are_separate_calls_when_they_cannot_be_one(
    autojump_clock: trio.testing.MockClock, setting: str
) -> None:
    count = iter(range(10**6))
    if setting == "resets differ":
        interface, groups = await episodes(lambda problem: Talk(problem, salt=str(next(count))))
    elif setting == "group_calls=False":
        interface, groups = await episodes(Talk, group_calls=False)
    else:
        interface, groups = await episodes(Talk, live_environments=8)
    assert interface.group_calls == 0
    assert interface.calls >= 2 * 4 * 3
    assert all(len(group) == 4 for group in groups)


async def test_an_episode_that_fails_before_its_first_turn_does_not_hold_its_siblings(
    autojump_clock: trio.testing.MockClock,
) -> None:
    made = iter(range(10**6))

    def environment(problem: tr.Problem) -> Talk:
        return Talk(problem, fail=next(made) == 2)

    interface = Counting(engine=MODEL)
    agent = tr.MultiTurnAgent(
        environment=environment,
        renderer=tr.PlainRenderer(),
        prompts=tr.PromptSource(PROBLEMS, seed=0),
        parallel_generation_tasks=1,
    )
    request = tr.GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=4, inference_interface=interface
    )
    with pytest.raises(RuntimeError, match="the sandbox did not start"):
        async with agent.get_grouped_rollouts(request) as stream:
            await stream.receive()
    for stats in interface.engine_statistics():
        assert (stats.running, stats.waiting) == (0, 0)
