"""PromptSource: seeded epochs, draws, checkpoints, and the pipeline keeping its books.

The pipeline tests run on pytest-trio's ``autojump_clock`` with scripted agents, so every
schedule is exact.
"""

from __future__ import annotations

import json
import pathlib
import random
import signal
import subprocess
import sys
import threading
from collections import Counter

import attrs
import pytest
import trio
import trio.testing

import trio_rollouts as tr
from trio_rollouts import Problem, PromptSource
from trio_rollouts.testing import NullInference


def problems(n: int) -> list[Problem]:
    return [Problem(problem_id=f"p{i}", prompt=f"q{i}", answer=i) for i in range(n)]


def drawn_ids(source: PromptSource, n: int) -> list[str]:
    return [source.draw().problem_id for _ in range(n)]


# --------------------------------------------------------------------------- the source


def test_epochs_are_seeded_permutations() -> None:
    source = PromptSource(problems(6), seed=3)
    first, second = drawn_ids(source, 6), drawn_ids(source, 6)
    assert sorted(first) == sorted(second) == [f"p{i}" for i in range(6)]
    assert first != second  # another permutation per epoch
    again = PromptSource(problems(6), seed=3)
    assert drawn_ids(again, 12) == first + second
    assert drawn_ids(PromptSource(problems(6), seed=4), 6) != first
    ordered = PromptSource(problems(4), shuffle=False)
    assert drawn_ids(ordered, 6) == ["p0", "p1", "p2", "p3", "p0", "p1"]
    assert ordered.epoch == 1


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"problems\[0\] and problems\[2\] are both 'a'"):
        PromptSource([("a", "x", 1), ("b", "y", 2), ("a", "z", 3)])
    with pytest.raises(ValueError, match="must not be empty"):
        PromptSource([])
    with pytest.raises(TypeError, match="shuffle must be a bool"):
        PromptSource(problems(2), shuffle=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        PromptSource(problems(2), seed=-1)
    with pytest.raises(TypeError, match=r"problems\[1\] must be a Problem"):
        PromptSource([("a", "x", 1), "b"])  # type: ignore[list-item]


def test_the_state_is_plain_data_and_restores_the_draws_not_done() -> None:
    source = PromptSource(problems(5), seed=1)
    ids = drawn_ids(source, 3)
    source._settle(0, ids[0], True)
    source._settle(0, ids[1], False)  # ids[2] stays out
    state = source.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state["pending"] == [[0, ids[1]], [0, ids[2]]]
    rest = drawn_ids(source, 2)  # the given-back one first, then the permutation
    assert rest[0] == ids[1]

    restored = PromptSource(problems(5), seed=1)
    restored.load_state_dict(json.loads(json.dumps(state)))
    # drawn but not done come back first, then the permutation goes on where it was
    assert drawn_ids(restored, 4)[:3] == [ids[1], ids[2], rest[1]]


def test_a_state_from_another_source_is_refused() -> None:
    state = PromptSource(problems(5), seed=1).state_dict()
    with pytest.raises(ValueError, match="seed is 1 in the state, 2 here"):
        PromptSource(problems(5), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="problems is 5 in the state, 4 here"):
        PromptSource(problems(4), seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle is True in the state, False here"):
        PromptSource(problems(5), seed=1, shuffle=False).load_state_dict(state)
    renamed = [Problem(problem_id=f"x{i}", prompt="q") for i in range(5)]
    with pytest.raises(ValueError, match="ids_sha256"):
        PromptSource(renamed, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['position'\] must be an int from 0 to 5"):
        PromptSource(problems(5), seed=1).load_state_dict({**state, "position": 9})
    with pytest.raises(ValueError, match=r"state\['pending'\]\[0\] must be \[epoch, problem_id\]"):
        PromptSource(problems(5), seed=1).load_state_dict({**state, "pending": [[0, "zz"]]})


def test_draws_from_many_threads_are_each_handed_out_once() -> None:
    source = PromptSource(problems(100), seed=5)
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()

    def draw_many() -> None:
        for _ in range(250):
            source.draw()
        with lock:
            seen.extend(source.pending())

    threads = [threading.Thread(target=draw_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pending = source.pending()
    assert len(pending) == len(set(pending)) == 1000
    assert Counter(epoch for epoch, _ in pending) == dict.fromkeys(range(10), 100)


def test_shards_are_disjoint_and_their_merged_state_restores_each() -> None:
    source = PromptSource(problems(10), seed=2)
    shards = [source.shard(i, 3) for i in range(3)]
    ids = [{p.problem_id for p in shard.problems} for shard in shards]
    assert set.union(*ids) == {f"p{i}" for i in range(10)}
    assert sum(len(s) for s in ids) == 10
    for shard in shards:
        shard.draw()
    merged = PromptSource.merge_state_dicts([s.state_dict() for s in shards])
    assert json.loads(json.dumps(merged)) == merged
    fresh = [source.shard(i, 3) for i in range(3)]
    for shard, state in zip(fresh, PromptSource.split_state_dict(merged, 3), strict=True):
        shard.load_state_dict(state)
    assert [s.pending() for s in fresh] == [[p] for s in shards for p in s.pending()]
    with pytest.raises(ValueError, match="a merged state of 2 shards is needed, got 3"):
        PromptSource.split_state_dict(merged, 2)


# --------------------------------------------------------------------------- the pipeline


@attrs.define
class Drawing(tr.GroupedRolloutGenerator):
    """Draws one problem per call; ``script`` decides each call's fate by problem id."""

    fail: set[str] = attrs.Factory(set)
    same_reward: set[str] = attrs.Factory(set)
    draws_per_call: int = 1
    latency: float = 1.0

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        assert self.prompts is not None
        drawn = [self.prompts.draw() for _ in range(self.draws_per_call)]
        await trio.sleep(self.latency)
        pid = drawn[0].problem_id if drawn else None
        if pid in self.fail:
            self.fail.discard(pid)
            raise ConnectionError(f"failed on {pid}")
        rewards = [1.0, 1.0] if pid in self.same_reward else [0.0, 1.0]
        return [tr.Rollout(trajectory=["x"], reward=r, problem_id=pid) for r in rewards]


def grouped(**kwargs: object) -> tr.GroupedRolloutRequest:
    fields: dict[str, object] = {"num_groups": 1, "rollouts_per_group": 2, "streaming": True}
    return tr.GroupedRolloutRequest(
        inference_interface=NullInference(),
        **{**fields, **kwargs},  # type: ignore[arg-type]
    )


async def test_taken_and_filtered_groups_are_done_and_the_rest_drawn_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = PromptSource(problems(6), shuffle=False)
    agent = Drawing(
        prompts=source,
        parallel_generation_tasks=2,
        buffer_size=2,
        fail={"p1"},
        same_reward={"p2"},
        failure_policy=tr.FailurePolicy(max_attempts=2, retry_on=(ConnectionError,)),
    )
    async with agent.get_grouped_rollouts(grouped(filter_groups_with_same_reward=True)) as s:
        first = await s.receive()
        second = await s.receive()
        # p1 failed and was retried: its problem was given back and drawn again first.
        assert {first[0].problem_id, second[0].problem_id} == {"p0", "p1"}
        await trio.sleep(3)  # more groups finish; nobody takes them
        state = source.state_dict()
        stats = s.statistics()
        assert stats.filtered == 1  # p2: done, not trained
    done = {first[0].problem_id, second[0].problem_id, "p2"}
    pending = [pid for _, pid in source.pending()]
    assert not done & set(pending)
    # finished but untaken groups, and calls cancelled at close, are drawn again first
    assert sorted(pending) == sorted(pid for _, pid in state["pending"])
    restored = PromptSource(problems(6), shuffle=False)
    restored.load_state_dict(source.state_dict())
    rest = drawn_ids(restored, 6 - len(done))
    assert sorted(rest) == sorted({f"p{i}" for i in range(6)} - done)


async def test_a_call_that_draws_none_or_two_is_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    for count, message in [(0, "drew no prompt"), (2, "drew 2 prompts")]:
        source = PromptSource(problems(4), shuffle=False)
        agent = Drawing(prompts=source, parallel_generation_tasks=1, draws_per_call=count)
        with pytest.raises(ValueError, match=message):
            async with agent.get_grouped_rollouts(grouped()) as stream:
                await stream.receive()
        assert len(source.pending()) == count  # given back, not lost


async def test_rollouts_about_another_problem_are_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    @attrs.define
    class Liar(tr.GroupedRolloutGenerator):
        async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
            assert self.prompts is not None
            self.prompts.draw()
            return [tr.Rollout(trajectory=["x"], reward=0.0, problem_id="other")]

    agent = Liar(prompts=PromptSource(problems(2)), parallel_generation_tasks=1)
    with pytest.raises(ValueError, match=r"drew problem 'p\d', but its rollout 0 has"):
        async with agent.get_grouped_rollouts(grouped(rollouts_per_group=1)) as stream:
            await stream.receive()


@pytest.mark.usefixtures("run_ahead")
async def test_restarted_and_stale_calls_give_their_problems_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = PromptSource(problems(4), shuffle=False)
    agent = Drawing(prompts=source, parallel_generation_tasks=2, latency=5)
    async with agent.get_grouped_rollouts(grouped(max_staleness=0)) as stream:
        await trio.sleep(1)
        async with stream.weight_update("restart"):
            assert sorted(pid for _, pid in source.pending()) == ["p0", "p1"]
        groups = [await stream.receive(), await stream.receive()]
        assert sorted(g[0].problem_id for g in groups) == ["p0", "p1"]
        assert stream.statistics().restarted == 2


def test_reward_only_agent_needs_prompts_or_get_prompt() -> None:
    class Scored(tr.RewardOnlyAgent):
        async def get_reward(self, problem: Problem, response: object) -> float:
            return 1.0

    with pytest.raises(TypeError, match="needs prompts: pass prompts=PromptSource"):
        Scored()
    Scored(prompts=PromptSource(problems(2)))
    with pytest.raises(TypeError, match="prompts must be a PromptSource or None, got list"):
        Scored(prompts=problems(2))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- property

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trio_rollouts._context import current_call  # noqa: E402

NUM_PROBLEMS = 7
EPOCHS = 2
FILTERED = {"p3"}  # identical rewards: filtered every time, done without being taken


@attrs.define
class Recording(tr.GroupedRolloutGenerator):
    """Draws one problem per call and notes the draw's epoch; every ``fail_every``-th
    call (counted across the run's agents, in ``calls[0]``) fails."""

    calls: list[int]
    fail_every: int = 0
    latencies: list[float] = attrs.Factory(list)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        assert self.prompts is not None
        problem = self.prompts.draw()
        draws = current_call().draws
        assert draws is not None
        epoch = draws[-1][1]
        n = self.calls[0]
        self.calls[0] += 1
        await trio.sleep(self.latencies[n % len(self.latencies)])
        if self.fail_every and n % self.fail_every == self.fail_every - 1:
            raise ConnectionError("flaky")
        pid = problem.problem_id
        rewards = [1.0, 1.0] if pid in FILTERED else [0.0, 1.0]
        return [
            tr.Rollout(trajectory=["x"], reward=r, problem_id=pid, extra={"epoch": epoch})
            for r in rewards
        ]


actions = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.integers(1, 3)),
        st.tuples(st.just("checkpoint"), st.just(0)),
        st.tuples(st.just("kill"), st.integers(0, 2)),
        st.tuples(st.just("close"), st.just(0)),
        st.tuples(st.just("restart"), st.just(0)),
        st.tuples(st.just("wait"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schedule=actions,
    fail_every=st.sampled_from([0, 3, 4, 7]),
    latencies=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=1, max_size=4),
    skip=st.booleans(),
    enforce_order=st.booleans(),
    num_groups=st.integers(1, 2),
    seed=st.integers(0, 3),
)
def test_every_prompt_of_every_epoch_is_done_once_across_kills(
    schedule: list[tuple[str, int]],
    fail_every: int,
    latencies: list[float],
    skip: bool,
    enforce_order: bool,
    num_groups: int,
    seed: int,
) -> None:
    """Kill the consumer anywhere, restore the last checkpoint into a fresh source and
    pipeline, go on: counted from the checkpoints kept, each epoch's prompts are taken
    or filtered exactly once."""
    policy = tr.FailurePolicy(
        max_attempts=2, retry_on=(ConnectionError,), on_failure="skip" if skip else "raise"
    )
    kept: list[tuple[int, str]] = []  # (epoch, problem_id) taken, as of the checkpoint
    uncommitted: list[tuple[int, str]] = []
    checkpoint = PromptSource(problems(NUM_PROBLEMS), seed=seed).state_dict()

    def fresh_source() -> PromptSource:
        source = PromptSource(problems(NUM_PROBLEMS), seed=seed)
        source.load_state_dict(checkpoint)
        return source

    def finished(source: PromptSource) -> bool:
        return source.epoch >= EPOCHS and all(e >= EPOCHS for e, _ in source.pending())

    calls = [0]

    async def main() -> None:
        nonlocal checkpoint
        source = fresh_source()
        # The schedule, then takes and checkpoints until every epoch is done.
        steps = iter([*schedule, *[("take", 1), ("checkpoint", 0)] * 1000])
        while True:
            agent = Recording(
                prompts=source,
                calls=calls,
                # Failures only when skipped: raised ones crash the run, and a crash
                # on every restart could repeat with the failures' period.
                fail_every=fail_every if skip else 0,
                latencies=list(latencies),
                parallel_generation_tasks=2 * num_groups,
                buffer_size=1,
                failure_policy=policy,
            )
            request = tr.GroupedRolloutRequest(
                num_groups=num_groups,
                rollouts_per_group=2,
                inference_interface=NullInference(),
                streaming=True,
                enforce_order=enforce_order,
                filter_groups_with_same_reward=True,
            )
            killed = False
            with trio.CancelScope() as scope:
                try:
                    async with agent.get_grouped_rollouts(request) as stream:
                        for action, arg in steps:
                            if action == "take":
                                for _ in range(arg):
                                    group = await stream.receive()
                                    uncommitted.append(
                                        (group[0].extra["epoch"], group[0].problem_id)
                                    )
                            elif action == "wait":
                                await trio.sleep(arg)
                            elif action == "checkpoint":
                                kept.extend(uncommitted)
                                uncommitted.clear()
                                checkpoint = source.state_dict()
                                if finished(source):
                                    return
                            elif action == "restart":
                                async with stream.weight_update("restart"):
                                    pass
                            elif action == "close":
                                break  # a clean close: the same source goes on
                            else:
                                killed = True
                                if arg == 0:
                                    break
                                if arg == 1:
                                    raise KeyError("killed")
                                scope.cancel()
                                await trio.sleep(1)
                            assert stream.statistics().unaccounted == 0
                        else:
                            pytest.fail("the run never finished its epochs")
                except KeyError:
                    pass
                except ConnectionError:
                    killed = True  # the run crashed (failures raise): restore, as a kill
            if killed:
                uncommitted.clear()
                source = fresh_source()

    async def run() -> None:
        with trio.fail_after(1_000_000):
            await main()

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    per_epoch: dict[int, list[str]] = {}
    for epoch, pid in kept:
        per_epoch.setdefault(epoch, []).append(pid)
    expected = sorted(f"p{i}" for i in range(NUM_PROBLEMS) if f"p{i}" not in FILTERED)
    for epoch in range(EPOCHS):
        assert sorted(per_epoch.get(epoch, [])) == expected, (epoch, per_epoch)


def test_a_run_killed_by_sigkill_and_restarted_takes_each_prompt_once(
    tmp_path: pathlib.Path,
) -> None:
    """The sync bridge in a subprocess, SIGKILLed at random moments and restarted from
    its last checkpoint, until every epoch is done: counted from the checkpoint, each
    epoch's prompts were taken (or filtered) exactly once."""
    num_problems, epochs = 12, 4
    checkpoint = tmp_path / "checkpoint.json"
    worker = pathlib.Path(__file__).with_name("_resume_worker.py")
    rng = random.Random(11)
    kills = 0
    for _ in range(40):
        process = subprocess.Popen(
            [sys.executable, str(worker), str(checkpoint), str(num_problems), str(epochs)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        kill_after = rng.randint(1, 8) if kills < 6 else None
        finished = False
        for lines, line in enumerate(process.stdout, start=1):
            if line.strip() == "finished":
                finished = True
                break
            if kill_after is not None and lines >= kill_after:
                process.send_signal(signal.SIGKILL)
                kills += 1
                break
        process.stdout.close()
        assert process.wait(timeout=60) in (0, -signal.SIGKILL)
        if finished:
            break
    else:
        pytest.fail("the run never finished")
    assert kills >= 3  # 48 groups to take, at most 8 taken between kills
    kept = json.loads(checkpoint.read_text())["kept"]
    expected = sorted(f"p{i}" for i in range(num_problems) if f"p{i}" != "p2")
    for epoch in range(epochs):
        assert sorted(pid for e, pid in kept if e == epoch) == expected


def test_given_back_draws_come_again_in_the_order_first_drawn() -> None:
    """Whatever order calls give their problems back in (the order their tasks unwind,
    which Trio varies), they are drawn again in the order a seed fixes."""
    orders = set()
    for back in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
        source = PromptSource(problems(6), seed=4)
        drawn = drawn_ids(source, 4)
        for i in back:
            source._settle(0, drawn[i], False)
        again = drawn_ids(source, 4)
        assert again == drawn
        orders.add(tuple(again))
    assert len(orders) == 1


async def test_the_arithmetic_environment_draws_from_its_prompts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from trio_rollouts.envs import ArithmeticEnvironment

    env = ArithmeticEnvironment(num_problems=4, parallel_generation_tasks=2)
    source = PromptSource(env.problems, shuffle=False)
    env.prompts = source
    request = tr.GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=2,
        inference_interface=tr.EmbeddedInference(seed=0),
        streaming=True,
    )
    async with env.get_grouped_rollouts(request) as stream:
        groups = [await stream.receive() for _ in range(4)]
    assert sorted(g[0].problem_id for g in groups) == sorted(p.problem_id for p in env.problems)
