"""Prompts on Ray: each actor owns a shard of the run's PromptSource, and the merged
state restores all of them, so a run killed and restarted from its checkpoint takes every
prompt of every epoch exactly once (DESIGN.md, "Resumable runs"; invariant 6 of
``trio_rollouts.ray._merge``).

One local Ray cluster (2 CPUs) serves the module, as in ``test_ray.py``; the agents live
in this module and the cluster's workers import it. Skipped when Ray is not installed.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

ray = pytest.importorskip("ray", reason="the ray extra is not installed")


import trio_rollouts as tr  # noqa: E402
from trio_rollouts import Problem, PromptSource  # noqa: E402
from trio_rollouts._context import current_call  # noqa: E402
from trio_rollouts.ray import (  # noqa: E402
    RolloutActor,
    blocking_ray_rollouts,
    open_ray_rollouts,
)
from trio_rollouts.testing import NullInference  # noqa: E402

#: Safety net for every wait; a passing test never comes near it.
WAIT = 30.0
NUM_PROBLEMS = 10
EPOCHS = 3
FILTERED = {"p3"}  # identical rewards: filtered every time, done without being taken


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    # As in test_ray.py: the cluster's workers import this module from tests/.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent), *([saved] if saved else [])]
    )
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        yield
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------ agents


def problems(n: int = NUM_PROBLEMS) -> list[Problem]:
    return [Problem(problem_id=f"p{i}", prompt=f"q{i}", answer=i) for i in range(n)]


@attrs.define
class Drawing(tr.GroupedRolloutGenerator):
    """Draws one problem per call and notes the draw's epoch in the rollouts; calls after
    the first ``hang_after`` wait forever."""

    latency: float = attrs.field(default=0.02, kw_only=True)
    hang_after: int | None = attrs.field(default=None, kw_only=True)
    calls: int = attrs.field(default=0, kw_only=True)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        assert self.prompts is not None
        problem = self.prompts.draw()
        draws = current_call().draws
        assert draws is not None
        epoch = draws[-1][1]
        self.calls += 1
        if self.hang_after is not None and self.calls > self.hang_after:
            await trio.sleep_forever()
        await trio.sleep(random.uniform(0, self.latency))  # completions out of order
        pid = problem.problem_id
        rewards = [1.0, 1.0] if pid in FILTERED else [0.0, 1.0]
        return [
            tr.Rollout(trajectory=["x"], reward=r, problem_id=pid, extra={"epoch": epoch})
            for r in rewards
        ]


@attrs.frozen
class Shards:
    """The agent factory of the documented pattern: actor ``i`` draws from shard ``i`` of
    a fresh source (built in the actor, as after a restart)."""

    num_actors: int
    seed: int = 0
    shuffle: bool = True
    hang_after: int | None = None

    def __call__(self, i: int) -> Drawing:
        source = PromptSource(problems(), seed=self.seed, shuffle=self.shuffle)
        return Drawing(
            prompts=source.shard(i, self.num_actors),
            hang_after=self.hang_after,
            parallel_generation_tasks=4,
            buffer_size=2,
        )


def whole_source(i: int) -> Drawing:
    """Wrong: every actor draws from the same problems."""
    return Drawing(prompts=PromptSource(problems()), parallel_generation_tasks=4)


@attrs.define
class Promptless(tr.GroupedRolloutGenerator):
    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        await trio.sleep(0.01)
        return [tr.Rollout(trajectory=["x"], reward=float(r)) for r in range(2)]


def promptless(i: int) -> Promptless:
    return Promptless(parallel_generation_tasks=4)


def request(*, num_groups: int = 2, enforce_order: bool = False) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=num_groups,
        rollouts_per_group=2,
        inference_interface=NullInference(),
        streaming=True,
        enforce_order=enforce_order,
        filter_groups_with_same_reward=True,
    )


Key = tuple[int, str]


def key(group: tr.RolloutGroup) -> Key:
    """The draw a group was made from: (epoch, problem_id)."""
    return (group[0].extra["epoch"], str(group[0].problem_id))


def pending(state: dict[str, Any]) -> set[Key]:
    """The draws not done in a merged state, over every shard."""
    return {(e, pid) for shard in state["shards"] for e, pid in shard["pending"]}


def finished(state: dict[str, Any]) -> bool:
    """Every problem of epochs 0 .. EPOCHS - 1 is done in every shard."""
    return all(
        shard["epoch"] >= EPOCHS and all(e >= EPOCHS for e, _ in shard["pending"])
        for shard in state["shards"]
    )


def assert_each_prompt_taken_once(kept: list[Key]) -> None:
    counts = Counter(kept)
    assert [k for k, n in counts.items() if n > 1] == []  # no draw taken twice
    expected = sorted(p.problem_id for p in problems() if p.problem_id not in FILTERED)
    for epoch in range(EPOCHS):
        assert sorted(pid for e, pid in kept if e == epoch) == expected, epoch


# ------------------------------------------------------------------------ exactly once


@pytest.mark.parametrize("enforce_order", [False, True])
async def test_a_run_killed_and_restored_from_its_checkpoint_takes_each_prompt_once(
    enforce_order: bool,
) -> None:
    """Run, checkpoint, take more (lost), leave as a crash would; restore the checkpoint
    into fresh sources, twice; then run until every epoch is done: counted from the
    checkpoints kept, each epoch's prompts are taken exactly once."""
    rng = random.Random(7 + enforce_order)
    factory = Shards(num_actors=2)
    kept: list[Key] = []
    checkpoint: dict[str, Any] | None = None
    for _ in range(2):
        async with open_ray_rollouts(
            factory,
            request(enforce_order=enforce_order),
            num_actors=2,
            prompts_state=checkpoint,
        ) as stream:
            with trio.fail_after(WAIT):
                taken = [key(await stream.receive()) for _ in range(rng.randint(3, 9))]
                checkpoint = await stream.prompts_state_dict()
                kept += taken
                # Taken after the checkpoint: lost with the run.
                for _ in range(rng.randint(1, 6)):
                    await stream.receive()
        assert json.loads(json.dumps(checkpoint)) == checkpoint
        # Done in the checkpoint: what was taken before it; not done: nothing taken.
        assert not pending(checkpoint) & set(kept)
    async with open_ray_rollouts(
        factory, request(enforce_order=enforce_order), num_actors=2, prompts_state=checkpoint
    ) as stream:
        with trio.fail_after(2 * WAIT):
            while True:
                kept.append(key(await stream.receive()))
                if finished(await stream.prompts_state_dict()):
                    break
    assert_each_prompt_taken_once(kept)


def test_the_blocking_twin_killed_and_restored_takes_each_prompt_once() -> None:
    factory = Shards(num_actors=2, seed=3)
    kept: list[Key] = []
    with blocking_ray_rollouts(factory, request(), num_actors=2) as stream:
        kept += [key(g) for g in stream.take(5, timeout=WAIT)]
        kept.append(key(stream.get(timeout=WAIT)))
        checkpoint = stream.prompts_state_dict()
        stream.take(4, timeout=WAIT)  # lost
    with blocking_ray_rollouts(factory, request(), num_actors=2, prompts_state=checkpoint) as s:
        for group in s:
            kept.append(key(group))
            if finished(s.prompts_state_dict()):
                break
    assert_each_prompt_taken_once(kept)


# ------------------------------------------------------------------------ what is done


async def test_a_group_in_the_prefetch_is_done_only_once_handed_out() -> None:
    async with open_ray_rollouts(
        Shards(num_actors=1),
        request(num_groups=2, enforce_order=True),
        num_actors=1,
        prefetch_batches=1,
    ) as stream:
        with trio.fail_after(WAIT):
            # One whole batch waits in the merge: it is full, and asks the actor for no more.
            while stream.statistics().prefetched < 2:  # noqa: ASYNC110 - across processes
                await trio.sleep(0.01)
            before = pending(await stream.prompts_state_dict())
            prefetched = stream.drain(2)
            assert len(prefetched) == 2
            assert {key(g) for g in prefetched} <= before  # in the merge: not done
            after = pending(await stream.prompts_state_dict())
            assert not {key(g) for g in prefetched} & after  # handed out: done


def test_the_blocking_twin_settles_only_the_groups_it_returns() -> None:
    # Three groups, then every call hangs: a take of five times out and keeps three.
    factory = Shards(num_actors=1, shuffle=False, hang_after=3)
    with blocking_ray_rollouts(factory, request(num_groups=1), num_actors=1) as stream:
        deadline = time.monotonic() + WAIT
        while stream.fetch_statistics().completed < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(TimeoutError, match="only 3 of 5"):
            stream.take(5, timeout=2.0)
        state = stream.prompts_state_dict()
        held = {(0, "p0"), (0, "p1"), (0, "p2")}
        assert held <= pending(state)  # kept by the bridge, not returned: not done
        first = stream.get(timeout=0)
        assert key(first) in held
        assert pending(stream.prompts_state_dict()) == pending(state) - {key(first)}
        rest = stream.drain(5)
        assert {key(g) for g in rest} == held - {key(first)}
        assert pending(stream.prompts_state_dict()) == pending(state) - held


def test_an_actor_gives_back_the_groups_never_settled_when_it_stops() -> None:
    """What the merge relies on at close: groups served but never settled (left in its
    prefetch) are drawn again first."""
    source = PromptSource(problems(40), shuffle=False)
    agent = Drawing(prompts=source, parallel_generation_tasks=2, buffer_size=1)
    actor = RolloutActor(agent, request(num_groups=1))
    info = actor.start(caller_settles=True)
    assert info.tracks_prompts
    assert info.prompts_fingerprint is not None
    groups = actor.take(3, timeout=WAIT)
    slots = [(g.batch_id, g.index_in_batch) for g in groups]
    actor.settle(slots[:1])
    actor.settle([*slots[:1], (99, 0)])  # settled twice, or unknown: ignored
    state = actor.prompts_state()
    out = {(e, pid) for e, pid in state["pending"]}
    assert key(groups[0]) not in out
    assert {key(g) for g in groups[1:]} <= out  # served, not settled: not done
    actor.stop(WAIT)
    left = source.pending()
    assert key(groups[0]) not in left
    assert {key(g) for g in groups[1:]} <= set(left)
    # Every draw not done was given back: they are drawn again, before any new one.
    assert [(0, source.draw().problem_id) for _ in left] == left


def test_a_plain_actor_counts_a_served_group_done() -> None:
    source = PromptSource(problems(40), shuffle=False)
    actor = RolloutActor(Drawing(prompts=source, parallel_generation_tasks=2), request())
    assert not actor.start().tracks_prompts  # the pipeline's default: done when taken
    groups = actor.take(2, timeout=WAIT)
    assert not {key(g) for g in groups} & set(source.pending())
    actor.stop(WAIT)


# ------------------------------------------------------------------------ errors


def test_prompt_checks_run_before_any_actor_starts() -> None:
    two = PromptSource.merge_state_dicts(
        [PromptSource(problems()).shard(i, 2).state_dict() for i in range(2)]
    )
    with pytest.raises(ValueError, match="a merged state of 3 shards is needed, got 2"):
        open_ray_rollouts(Shards(num_actors=3), request(), num_actors=3, prompts_state=two)
    with pytest.raises(ValueError, match="would be pickled to each of the 2 actors"):
        open_ray_rollouts(whole_source(0), request(), num_actors=2)
    with pytest.raises(TypeError, match="PromptSource in its prompts field, got NoneType"):
        open_ray_rollouts(promptless(0), request(), num_actors=1, prompts_state=two)
    with pytest.raises(TypeError, match="prompts_state must be a dict"):
        open_ray_rollouts(Shards(2), request(), num_actors=2, prompts_state=[])  # type: ignore[arg-type]


async def test_actors_drawing_the_same_problems_are_refused() -> None:
    with pytest.raises(ValueError, match="rollout actors 0 and 1 draw from prompt sources"):
        async with open_ray_rollouts(whole_source, request(), num_actors=2):
            pass  # pragma: no cover


async def test_an_agent_without_prompts_has_no_prompt_state() -> None:
    state = PromptSource.merge_state_dicts([PromptSource(problems()).state_dict()])
    with pytest.raises(TypeError, match="PromptSource in its prompts field") as info:
        async with open_ray_rollouts(promptless, request(), num_actors=1, prompts_state=state):
            pass  # pragma: no cover
    assert "rollout actor 0 of 1" in info.value.__notes__[0]
    async with open_ray_rollouts(promptless, request(), num_actors=1) as stream:
        await stream.receive()  # no books kept, nothing to settle
        with pytest.raises(TypeError, match=r"actors \[0\] have none"):
            await stream.prompts_state_dict()
    with pytest.raises(RuntimeError, match="has exited"):
        await stream.prompts_state_dict()


async def test_a_shard_of_another_source_is_refused_in_its_actor() -> None:
    other = PromptSource.merge_state_dicts(
        [PromptSource(problems(), seed=5).shard(i, 2).state_dict() for i in range(2)]
    )
    with pytest.raises(ValueError, match="seed is 5 in the state, 0 here"):
        async with open_ray_rollouts(Shards(2), request(), num_actors=2, prompts_state=other):
            pass  # pragma: no cover
