"""Scaling out on Ray (trio_rollouts.ray): rollout actors and one merged stream.

One local Ray cluster (2 CPUs) serves the whole module; each test starts its own actors,
one or two, each in its own process. The agents below live in this module, and the
cluster's workers import it (the fixture puts ``tests/`` on their ``PYTHONPATH``), so they
travel by reference like any user's agent in an installed package.

Skipped when Ray is not installed (it is the optional ``ray`` extra). Across processes a
test cannot wait for "all tasks blocked"; where a test must see that something does *not*
happen (run-ahead), it waits for the expected state and then a short settling time.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from _fakes import RawInterface  # noqa: E402

import trio_rollouts as tr  # noqa: E402
from trio_rollouts import ChatMessage  # noqa: E402
from trio_rollouts.inference import (  # noqa: E402
    EmbeddedInference,
    LatencyModel,
    WeightUpdateError,
    WeightUpdateMode,
)
from trio_rollouts.pipeline._stream import source_of  # noqa: E402
from trio_rollouts.ray import (  # noqa: E402
    RayRolloutStreamStatistics,
    RolloutActor,
    RolloutActorDiedError,
    blocking_ray_rollouts,
    open_ray_rollouts,
)
from trio_rollouts.testing import ScriptedPausable  # noqa: E402

#: Safety net for every wait; a passing test never comes near it.
WAIT = 30.0


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    # The cluster's processes inherit the environment at ray.init(). (A runtime_env with
    # the same variable works too, but its workers cannot come from Ray's prestarted pool:
    # every actor would cost a process start, about a third of this module's runtime.)
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


class Boom(Exception):
    pass


def group_of(tag: str, n: int) -> list[tr.Rollout | tr.TokenRollout]:
    """A group that exercises the models: both rollout classes, epochs, extra keys."""
    return [
        tr.Rollout(
            trajectory=["question", f"answer {n}"],
            reward=float(n % 3),
            env_id=tag,
            problem_id=str(n),
            policy_epoch=[[(0, 1)], [(0, 1), (5, 2)]],
            kv_cache_epoch=[[], [(3, 1)]],
            num_evictions=[0, 1],
            extra={"judge": {"score": 0.5, "notes": ["ok"]}},
        ),
        tr.TokenRollout(
            trajectory=[[1, 2, 3], [4, 5]],
            reward=[0.25, 0.5],
            generation_mask=[[False, True, True], [True, True]],
            logprobs=[[-0.1, -0.2], [-0.3, -0.4]],
            env_id=tag,
            problem_id=str(n),
            policy_epoch=[[(0, 3)], [(0, 3)]],
            extra={"tokenizer": "bpe"},
        ),
    ]


@attrs.define
class Counting(tr.GroupedRolloutGenerator):
    """Returns ``group_of(tag, n)`` for its n-th call; raises Boom on call ``fail_at``."""

    tag: str = attrs.field(default="a", kw_only=True)
    fail_at: int = attrs.field(default=0, kw_only=True)
    calls: int = attrs.field(default=0, kw_only=True)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list:  # type: ignore[type-arg]
        self.calls += 1
        n = self.calls
        await trio.sleep(0.001)
        if n == self.fail_at:
            raise Boom(f"call {n} of {self.tag}")
        return group_of(self.tag, n)


@attrs.define
class Hanging(tr.GroupedRolloutGenerator):
    """Every call waits forever (until cancelled)."""

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list:  # type: ignore[type-arg]
        await trio.sleep_forever()
        raise AssertionError("unreachable")


@attrs.define
class FailsFirst(tr.GroupedRolloutGenerator):
    """The first call raises Boom; the others wait forever: no group is ever made."""

    calls: int = attrs.field(default=0, kw_only=True)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list:  # type: ignore[type-arg]
        self.calls += 1
        if self.calls == 1:
            raise Boom("the first call")
        await trio.sleep_forever()
        raise AssertionError("unreachable")


@attrs.define
class Stubborn(tr.GroupedRolloutGenerator):
    """Every call blocks the actor's Trio loop and never sees a cancellation."""

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list:  # type: ignore[type-arg]
        while True:
            time.sleep(1)  # noqa: ASYNC251 - the point: a call that ignores cancellation


def hanging() -> Hanging:
    return Hanging(parallel_generation_tasks=4)


def tagged(i: int) -> Counting:
    return Counting(tag=f"actor{i}", parallel_generation_tasks=4, buffer_size=2)


def request(
    *, num_groups: int = 2, streaming: bool = True, enforce_order: bool = False
) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=num_groups,
        rollouts_per_group=2,
        inference_interface=RawInterface(),
        streaming=streaming,
        enforce_order=enforce_order,
    )


def assert_released(actors: tuple[object, ...], within: float = 5.0) -> None:
    """Every actor is gone within ``within`` seconds: a call fails with Ray's actor error.
    (Ray kills asynchronously: a call sent right after ``ray.kill`` may still run.)"""
    deadline = time.monotonic() + within
    for actor in actors:
        while True:
            try:
                ray.get(actor.pid.remote(), timeout=WAIT)  # type: ignore[attr-defined]
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, f"{actor} is still alive after {within} s"
            time.sleep(0.05)


# ------------------------------------------------------------------------ groups and order


async def test_groups_cross_the_process_boundary_intact() -> None:
    async with open_ray_rollouts(
        Counting(tag="t"), request(num_groups=1, streaming=False), num_actors=1
    ) as stream:
        (group,) = [g async for g in stream]
    assert group.rollouts == group_of("t", 1)
    assert [type(r) for r in group] == [tr.Rollout, tr.TokenRollout]
    assert group[0].extra == {"judge": {"score": 0.5, "notes": ["ok"]}}
    assert tr.unstructure(group) == tr.unstructure(
        tr.RolloutGroup(rollouts=group_of("t", 1), batch_id=0, index_in_batch=0)
    )


async def test_enforce_order_interleaves_whole_batches_round_robin() -> None:
    async with open_ray_rollouts(tagged, request(enforce_order=True), num_actors=2) as stream:
        groups = [await stream.receive() for _ in range(12)]
    # Global batch ids 0, 1, 2, ... in delivery order; batch b is actor b % 2's batch b // 2.
    assert [(g.batch_id, g.index_in_batch) for g in groups] == [
        (b, i) for b in range(6) for i in range(2)
    ]
    assert [g[0].env_id for g in groups] == [f"actor{g.batch_id % 2}" for g in groups]


async def test_non_streaming_yields_one_batch_per_actor_then_ends() -> None:
    async with open_ray_rollouts(
        tagged, request(num_groups=3, streaming=False), num_actors=2
    ) as stream:
        groups = [g async for g in stream]
        with pytest.raises(trio.EndOfChannel):
            await stream.receive()
        assert stream.try_next() is None
    # Without enforce_order the interleaving is arrival order, but the slots are fixed.
    assert sorted((g.batch_id, g.index_in_batch) for g in groups) == [
        (b, i) for b in range(2) for i in range(3)
    ]
    assert {g[0].env_id for g in groups if g.batch_id == 1} == {"actor1"}


async def test_a_cancelled_receive_loses_no_group() -> None:
    async with open_ray_rollouts(tagged, request(enforce_order=True), num_actors=1) as stream:
        with trio.CancelScope() as scope:
            scope.cancel()
            await stream.receive()
        first = await stream.receive()
    assert (first.batch_id, first.index_in_batch) == (0, 0)


# ------------------------------------------------------------------------ bounds and statistics


async def settled_statistics(stream: object, started: list[int]) -> RayRolloutStreamStatistics:
    """Poll the actors until their ``started`` counters are ``started``, then once more
    after a settling time, and return that snapshot."""
    with trio.fail_after(WAIT):
        while True:
            stats = await stream.fetch_statistics()  # type: ignore[attr-defined]
            if [s.started for s in stats.per_actor] == started:
                break
            await trio.sleep(0.05)
    await trio.sleep(0.5)
    return await stream.fetch_statistics()  # type: ignore[attr-defined,no-any-return]


async def test_each_actor_runs_ahead_by_its_pipeline_bound_plus_one_prefetched_batch() -> None:
    # P = 4, G = 2: W = 2 batches outstanding in each actor's pipeline. The merge takes one
    # batch from each (prefetch), which frees one more: (W + 1) * G = 6 calls per actor.
    async with open_ray_rollouts(tagged, request(enforce_order=True), num_actors=2) as stream:
        stats = await settled_statistics(stream, [6, 6])
        assert stats.prefetched == 4
        assert stats.delivered == 0
        # Taking actor 0's batch lets the merge ask actor 0, and only actor 0, for one more.
        await stream.receive()
        await stream.receive()
        stats = await settled_statistics(stream, [8, 6])
        assert stats.delivered == 2


async def test_statistics_sum_the_actors_and_count_each() -> None:
    async with open_ray_rollouts(tagged, request(enforce_order=True), num_actors=2) as stream:
        for _ in range(8):
            await stream.receive()
        stats = await stream.fetch_statistics()
        actor_0, actor_1 = stats.per_actor
        assert (actor_0.delivered, actor_1.delivered, stats.delivered) == (4, 4, 8)
        assert stats.started == actor_0.started + actor_1.started
        assert stats.completed == actor_0.completed + actor_1.completed
        assert stats.unaccounted == 0
        assert stream.statistics().delivered == 8  # the cached view needs no round trip
    stats = stream.statistics()
    assert stats.unaccounted == 0
    assert stats.in_flight == 0  # the actors' final counters: every call has exited
    assert stats.pending == stats.prefetched == 0


# ------------------------------------------------------------------------ failures


async def test_an_exception_in_an_actor_reaches_the_consumer_as_itself() -> None:
    def agent(i: int) -> Counting:
        return Counting(tag=f"actor{i}", fail_at=3 if i == 1 else 0)

    with pytest.raises(Boom, match="call 3 of actor1") as info:
        async with open_ray_rollouts(agent, request(), num_actors=2) as stream:
            async for _ in stream:
                pass
    assert type(info.value) is Boom  # Ray's RayTaskError envelope is gone
    assert "raised in rollout actor 1 of 2" in info.value.__notes__[0]
    assert "group_rollout" in info.value.__notes__[1]  # the actor's traceback
    assert_released(stream.actors)


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
async def test_an_actor_that_dies_is_an_error_naming_it(how: str) -> None:
    with pytest.raises(RolloutActorDiedError, match="rollout actor 1 of 2") as info:
        async with open_ray_rollouts(tagged, request(), num_actors=2) as stream:
            await stream.receive()
            if how == "ray.kill":
                ray.kill(stream.actors[1])
            else:
                os.kill(stream.actor_info[1].pid, signal.SIGKILL)  # type: ignore[union-attr]
            with trio.fail_after(WAIT):
                async for _ in stream:
                    pass
    assert info.value.actor_index == 1
    assert info.value.actor_id == stream.actor_info[1].actor_id  # type: ignore[union-attr]
    assert_released(stream.actors)


def test_checks_run_before_any_actor_starts() -> None:
    with pytest.raises(ValueError, match=r"parallel_generation_tasks \(1\) must be >= num_groups"):
        open_ray_rollouts(Counting(parallel_generation_tasks=1), request(), num_actors=2)
    with pytest.raises(ValueError, match="num_actors must be >= 1, got 0"):
        open_ray_rollouts(Counting(), request(), num_actors=0)
    with pytest.raises(TypeError, match="agent must be a GroupedRolloutGenerator"):
        open_ray_rollouts("agent", request(), num_actors=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_restarts"):
        open_ray_rollouts(Counting(), request(), num_actors=1, actor_options={"max_restarts": 1})


async def test_a_factory_runs_in_the_actor_and_its_errors_are_raised_as_themselves() -> None:
    def bad_request(i: int) -> tr.GroupedRolloutRequest:
        return request(num_groups=8)  # more groups than Counting's 4 tasks

    with pytest.raises(ValueError, match="parallel_generation_tasks") as info:
        async with open_ray_rollouts(tagged, bad_request, num_actors=1):
            pass  # pragma: no cover
    assert "rollout actor 0 of 1" in info.value.__notes__[0]


@attrs.define
class LockedInterface(RawInterface):
    """Holds a lock, as a client with a connection pool would: it cannot be pickled."""

    lock: object = attrs.field(factory=threading.Lock)


async def test_an_unpicklable_request_is_refused_with_a_hint_and_works_as_a_factory() -> None:
    def locked(i: int) -> tr.GroupedRolloutRequest:
        return tr.GroupedRolloutRequest(
            num_groups=1, rollouts_per_group=2, inference_interface=LockedInterface()
        )

    with pytest.raises(TypeError) as info:
        async with open_ray_rollouts(Counting(), locked(0), num_actors=1):
            pass  # pragma: no cover
    assert "pass a function that builds the request in the actor" in str(info.value.__notes__)
    async with open_ray_rollouts(Counting(), locked, num_actors=1) as stream:
        assert len([g async for g in stream]) == 1


async def test_actors_the_cluster_cannot_place_are_a_timeout_naming_them() -> None:
    with pytest.raises(TimeoutError, match=r"rollout actors \[0\] did not start"):
        async with open_ray_rollouts(
            Counting(), request(), num_actors=1, actor_options={"num_cpus": 3}, start_timeout=1
        ):
            pass  # pragma: no cover


# ------------------------------------------------------------------------ shutdown


async def test_leaving_stops_every_pipeline_and_releases_every_actor() -> None:
    async with open_ray_rollouts(hanging(), request(), num_actors=2) as stream:
        stats = await settled_statistics(stream, [4, 4])
        assert stats.in_flight == 8
        started = time.monotonic()
    assert time.monotonic() - started < 5
    assert stream.statistics().in_flight == 0  # stopped gracefully: every call exited
    assert_released(stream.actors)
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive()


async def test_cancelling_the_consumer_stops_every_actor() -> None:
    with trio.CancelScope() as scope:
        async with open_ray_rollouts(hanging(), request(), num_actors=2) as stream:
            scope.deadline = trio.current_time() + 0.3  # once the actors have started
            await stream.receive()
    assert scope.cancelled_caught
    assert_released(stream.actors)


async def test_an_actor_that_ignores_cancellation_is_killed_after_stop_timeout() -> None:
    async with open_ray_rollouts(
        Stubborn(), request(num_groups=1), num_actors=1, stop_timeout=0.5
    ) as stream:
        await trio.sleep(0.2)
        started = time.monotonic()
    assert time.monotonic() - started < 5
    assert_released(stream.actors)


# ------------------------------------------------------------------------ the sync twin
#
# The blocking stream is driven from the test's own thread, which runs no Trio (a sync
# test): a Trio call on any of its paths would raise "must be called from async context"
# here. Each entry point has a test: open, take, get, try_next, drain, iteration,
# statistics, fetch_statistics, metrics, weight_update (below, with the weight updates),
# leaving the block, and errors raised in the caller's thread.

#: The name of the blocking stream's Trio thread.
TRIO_THREAD = "trio_rollouts:ray"


def trio_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == TRIO_THREAD]


def assert_outside_trio() -> None:
    with pytest.raises(RuntimeError, match="must be called from async context"):
        trio.current_time()


def wait_prefetched(stream: object, n: int) -> None:
    """Wait until ``n`` groups wait in the merge (the merge counts them exactly)."""
    deadline = time.monotonic() + WAIT
    while stream.statistics().prefetched < n:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"{n} groups never reached the merge"
        time.sleep(0.01)


def counting_then_hanging(i: int) -> tr.GroupedRolloutGenerator:
    """Actor 0 makes its groups; actor 1's calls never end."""
    return tagged(i) if i == 0 else hanging()


def test_blocking_twin_opens_outside_trio_and_leaving_releases_everything() -> None:
    assert_outside_trio()
    context = blocking_ray_rollouts(tagged, request(), num_actors=2)
    assert trio_threads() == []  # checked and built, nothing started yet
    with context as stream:
        assert_outside_trio()
        # __enter__ returned once every actor had started.
        infos = stream.actor_info
        assert [info.index for info in infos if info is not None] == [0, 1]
        assert len({info.pid for info in infos if info is not None}) == 2
        assert len(stream.actors) == 2
        assert len(trio_threads()) == 1
        assert stream.policy_epoch == 0
        stream.take(1, timeout=WAIT)
        actors = stream.actors
    assert trio_threads() == []  # joined
    assert_released(actors)
    assert stream.policy_epoch == 0  # readable after the block
    with pytest.raises(RuntimeError, match="inside its 'with"):
        stream.take(1)
    with pytest.raises(RuntimeError, match="inside its 'with"):
        stream.statistics()


def test_blocking_twin_open_errors_are_raised_in_the_callers_thread() -> None:
    # Checked at once, before any actor or thread starts.
    with pytest.raises(ValueError, match=r"parallel_generation_tasks \(1\) must be >= num_groups"):
        blocking_ray_rollouts(Counting(parallel_generation_tasks=1), request(), num_actors=2)
    with pytest.raises(ValueError, match="max_concurrency must be >= 7"):
        blocking_ray_rollouts(
            Counting(), request(), num_actors=1, actor_options={"max_concurrency": 1}
        )

    def bad_request(i: int) -> tr.GroupedRolloutRequest:
        return request(num_groups=8)  # more groups than Counting's 4 tasks

    # Checked in the actor, raised from __enter__ as itself.
    with (
        pytest.raises(ValueError, match="parallel_generation_tasks") as info,
        blocking_ray_rollouts(tagged, bad_request, num_actors=1),
    ):
        pytest.fail("the block ran")
    assert "rollout actor 0 of 1" in info.value.__notes__[0]
    with (
        pytest.raises(TimeoutError, match=r"rollout actors \[0\] did not start"),
        blocking_ray_rollouts(
            Counting(), request(), num_actors=1, actor_options={"num_cpus": 3}, start_timeout=1
        ),
    ):
        pytest.fail("the block ran")
    assert trio_threads() == []


def test_blocking_twin_take_waits_for_n_groups_in_order() -> None:
    with blocking_ray_rollouts(tagged, request(enforce_order=True), num_actors=2) as stream:
        groups = stream.take(5, timeout=WAIT)
        groups += stream.take(3)  # no timeout
        assert stream.take(0) == []
        with pytest.raises(ValueError, match="take"):
            stream.take(-1)
        with pytest.raises(ValueError, match="timeout"):
            stream.take(1, timeout=-1)
    assert [(g.batch_id, g.index_in_batch) for g in groups] == [
        (b, i) for b in range(4) for i in range(2)
    ]
    assert [g[0].env_id for g in groups] == [f"actor{g.batch_id % 2}" for g in groups]


def test_blocking_twin_take_that_times_out_keeps_its_groups_for_the_next_call() -> None:
    with blocking_ray_rollouts(
        counting_then_hanging, request(streaming=False), num_actors=2
    ) as stream:
        wait_prefetched(stream, 2)  # actor 0's batch; actor 1 never makes one
        with pytest.raises(TimeoutError, match="only 2 of 3 rollout groups arrived within"):
            stream.take(3, timeout=0.2)
        assert stream.statistics().prefetched == 0  # the take kept them
        kept = stream.take(2, timeout=0)  # returned first, at once
        assert sorted((g.batch_id, g.index_in_batch) for g in kept) == [(0, 0), (0, 1)]
        assert stream.statistics().delivered == 2


def test_blocking_twin_get_try_next_and_drain_take_what_is_ready() -> None:
    with blocking_ray_rollouts(
        counting_then_hanging, request(streaming=False), num_actors=2
    ) as stream:
        wait_prefetched(stream, 2)
        # None of these waits for actor 1, which never makes a group.
        first = stream.drain(1)
        second = stream.try_next()
        assert stream.try_next() is None
        assert stream.drain(3) == []
        with pytest.raises(TimeoutError, match=r"no rollout group arrived within 0\.2 s"):
            stream.get(timeout=0.2)
        with pytest.raises(ValueError, match="drain"):
            stream.drain(-1)
        stats = stream.statistics()
    assert second is not None
    assert sorted((g.batch_id, g.index_in_batch) for g in [*first, second]) == [(0, 0), (0, 1)]
    assert (stats.delivered, stats.prefetched) == (2, 0)
    assert [s.delivered for s in stats.per_actor] == [2, 0]


def test_blocking_twin_iterates_and_gets_until_every_actors_batch_is_taken() -> None:
    with blocking_ray_rollouts(
        tagged, request(num_groups=3, streaming=False, enforce_order=True), num_actors=2
    ) as stream:
        groups = [stream.get(timeout=WAIT)]
        groups += list(stream)
        assert list(stream) == []
        with pytest.raises(trio.EndOfChannel):
            stream.get(timeout=WAIT)
        assert stream.try_next() is None
        assert stream.drain(3) == []
        assert stream.take(2, timeout=WAIT) == []  # the stream ended
    assert [(g.batch_id, g.index_in_batch) for g in groups] == [
        (b, i) for b in range(2) for i in range(3)
    ]


def test_blocking_twin_statistics_are_the_merged_counters() -> None:
    with blocking_ray_rollouts(tagged, request(enforce_order=True), num_actors=2) as stream:
        stream.take(4, timeout=WAIT)
        stats = stream.statistics()
        assert isinstance(stats, RayRolloutStreamStatistics)
        assert [s.delivered for s in stats.per_actor] == [2, 2]
        assert (stats.delivered, stats.unaccounted) == (4, 0)
        fetched = stream.fetch_statistics(timeout=WAIT)  # asks every actor now
        assert isinstance(fetched, RayRolloutStreamStatistics)
        assert fetched.delivered == 4
        assert fetched.started == sum(s.started for s in fetched.per_actor) >= 4
        assert fetched.unaccounted == 0
        with pytest.raises(ValueError, match="timeout"):
            stream.fetch_statistics(timeout=-1)


def test_blocking_twin_metrics_are_deltas_since_the_open_and_the_last_call() -> None:
    entered = time.monotonic()
    with blocking_ray_rollouts(tagged, request(enforce_order=True), num_actors=2) as stream:
        stream.take(4, timeout=WAIT)
        asked = time.monotonic()
        first = stream.metrics()
        first_bound = time.monotonic() - entered
        stream.take(2, timeout=WAIT)
        second = stream.metrics()
        second_bound = time.monotonic() - asked
    # The first interval starts when the stream opened, not before; the second one when
    # the first call was made.
    assert 0 < first["rollout/interval_s"] <= first_bound
    assert 0 < second["rollout/interval_s"] <= second_bound
    assert (first["rollout/groups_delivered"], second["rollout/groups_delivered"]) == (4, 2)
    assert first["rollout/policy_epoch"] == second["rollout/policy_epoch"] == 0
    assert not any(key.startswith("loop/") for key in first)  # the first call starts the probe
    for value in [*first.values(), *second.values()]:
        assert isinstance(value, float)
        assert math.isfinite(value)
    with pytest.raises(RuntimeError, match="inside its 'with"):
        stream.metrics()


def test_blocking_twin_raises_an_actor_exception_in_the_callers_thread_once() -> None:
    with blocking_ray_rollouts(FailsFirst(), request(), num_actors=1) as stream:
        with pytest.raises(Boom, match="the first call") as info:
            stream.take(100, timeout=WAIT)
        assert type(info.value) is Boom
        assert "raised in rollout actor 0 of 1" in info.value.__notes__[0]
        with pytest.raises(RuntimeError, match="stopped after an error"):
            stream.take(1)
        actors = stream.actors
    # Raised once: the exit does not raise it again.
    assert_released(actors)


def test_blocking_twin_raises_an_actor_exception_at_the_exit_at_the_latest() -> None:
    with (
        pytest.raises(Boom, match="the first call"),
        blocking_ray_rollouts(FailsFirst(), request(), num_actors=1),
    ):
        (thread,) = trio_threads()
        thread.join(WAIT)  # the failure ends the Trio thread; no call is made
        assert not thread.is_alive()
    assert trio_threads() == []


def test_blocking_twin_raises_an_actor_death_in_the_callers_thread() -> None:
    with blocking_ray_rollouts(tagged, request(enforce_order=True), num_actors=2) as stream:
        stream.take(2, timeout=WAIT)
        ray.kill(stream.actors[1])
        # The round-robin needs actor 1's next batch: the take sees its death.
        with pytest.raises(RolloutActorDiedError, match="rollout actor 1 of 2") as info:
            stream.take(100, timeout=WAIT)
        actors = stream.actors
    assert info.value.actor_index == 1
    assert_released(actors)


def test_an_async_stream_built_outside_trio_times_its_metrics_and_stops_its_probe() -> None:
    assert_outside_trio()
    context = open_ray_rollouts(tagged, request(), num_actors=1)  # no Trio call here

    async def use() -> None:
        entered = trio.current_time()
        async with context as stream:
            await stream.receive()
            first = stream.metrics()
            assert 0 < first["rollout/interval_s"] <= trio.current_time() - entered
            assert first["rollout/groups_delivered"] == 1
            await trio.sleep(0.2)  # the loop-lag probe samples meanwhile (every 50 ms)
        last = stream.metrics()  # after the async with: the last interval
        await trio.sleep(0.2)
        await trio.testing.wait_all_tasks_blocked()  # a probe still running has sampled
        after = stream.metrics()
        assert "loop/lag_p50_ms" in last
        assert "loop/lag_p50_ms" not in after  # the probe stopped with the stream

    trio.run(use)


# ------------------------------------------------------------------------ weight updates


def one_completion(prompt: list[ChatMessage]) -> tuple[list[str], list[float]]:
    return ["abcd"], [1.0]


@attrs.define
class Stamping(tr.GroupedRolloutGenerator):
    """One inference call per group; its rollouts carry the call's epoch stamps."""

    tag: str = attrs.field(default="a", kw_only=True)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        iface = request.inference_interface
        response = await iface.agenerate(iface.prepare_request("q"))
        return [
            tr.Rollout(
                trajectory=[response.raw_text or ""],
                reward=float(i),
                env_id=self.tag,
                policy_epoch=[list(response.policy_epoch)],
            )
            for i in range(request.rollouts_per_group)
        ]


def stamping(i: int) -> Stamping:
    return Stamping(tag=f"actor{i}", parallel_generation_tasks=4, buffer_size=2)


@attrs.define(eq=False, kw_only=True)
class PauseFails(ScriptedPausable):
    """A Pausable backend whose pause for ``keep`` fails (as a server without the
    endpoint answers)."""

    latency: float = 0.001

    async def pause(self, mode: WeightUpdateMode) -> None:
        self.fail_pause = mode == "keep"
        await super().pause(mode)


def embedded_request(i: int) -> tr.GroupedRolloutRequest:
    """Built in each actor (EmbeddedInference keeps per-run state), in batch order, so
    that taking many groups needs new calls from every actor."""
    return tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=2,
        inference_interface=EmbeddedInference(
            policy=one_completion,
            latency=LatencyModel(first_token=0.002, per_token=0.001, distribution="constant"),
        ),
        streaming=True,
        enforce_order=True,
    )


def pause_fails_in_actor_1(i: int) -> tr.GroupedRolloutRequest:
    if i == 0:
        return embedded_request(i)
    return tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=2,
        inference_interface=PauseFails(),
        streaming=True,
        enforce_order=True,
    )


def last_epochs(groups: list[tr.RolloutGroup]) -> set[int]:
    """The epoch each rollout's generation ended under."""
    return {rollout.policy_epoch[0][-1][1] for group in groups for rollout in group}


async def receive(stream: object, n: int) -> list[tr.RolloutGroup]:
    # With enforce_order, n groups are n / 2 from each actor: more than an actor runs ahead
    # (6), so both must generate.
    with trio.fail_after(WAIT):
        return [await stream.receive() for _ in range(n)]  # type: ignore[attr-defined]


async def test_a_weight_update_pauses_every_actor_then_resumes_them_under_its_epoch() -> None:
    async with open_ray_rollouts(stamping, embedded_request, num_actors=2) as stream:
        await receive(stream, 2)
        assert stream.policy_epoch == 0
        async with stream.weight_update("drain") as update:
            assert (update.epoch, update.mode, update.held) == (1, "drain", 0)
            stats = await stream.fetch_statistics()
            assert [s.in_flight for s in stats.per_actor] == [0, 0]
            started = [s.started for s in stats.per_actor]
            await trio.sleep(0.3)  # nothing starts in either actor
            stats = await stream.fetch_statistics()
            assert [s.started for s in stats.per_actor] == started
            assert stream.policy_epoch == 0
        assert stream.policy_epoch == 1
        groups = await receive(stream, 20)
        fresh = [g for g in groups if g.start_epoch == 1]
        assert {g[0].env_id for g in fresh} == {"actor0", "actor1"}
        assert last_epochs(fresh) == {1}
        stats = await stream.fetch_statistics()
        # Not summed: the merged stream's own epoch and count of updates.
        assert (stats.policy_epoch, stats.weight_updates) == (1, 1)
        assert [(s.policy_epoch, s.weight_updates) for s in stats.per_actor] == [(1, 1)] * 2
        assert stats.unaccounted == 0
    assert stream.policy_epoch == 1  # readable after the stream closed


async def test_every_mode_reaches_every_actor() -> None:
    async with open_ray_rollouts(stamping, embedded_request, num_actors=2) as stream:
        for epoch, mode in enumerate(["drain", "restart", "keep", "abort"], start=1):
            async with stream.weight_update(mode) as update:  # type: ignore[arg-type]
                assert (update.epoch, update.mode) == (epoch, mode)
            groups = await receive(stream, 20)
            assert last_epochs(groups) <= {epoch - 1, epoch}
            assert epoch in last_epochs(groups)
        stats = await stream.fetch_statistics()
        assert [s.policy_epoch for s in stats.per_actor] == [4, 4]
        assert stats.unaccounted == 0


async def test_a_failing_body_resumes_every_actor_under_the_old_epoch() -> None:
    async with open_ray_rollouts(stamping, embedded_request, num_actors=2) as stream:
        raised = Boom("the trainer failed")
        with pytest.raises(Boom) as info:
            async with stream.weight_update("keep"):
                raise raised
        assert info.value is raised
        assert getattr(raised, "__notes__", []) == []
        assert stream.policy_epoch == 0
        groups = await receive(stream, 20)  # both actors generate again
        assert last_epochs(groups) == {0}
        stats = await stream.fetch_statistics()
        assert [(s.policy_epoch, s.weight_updates) for s in stats.per_actor] == [(0, 0)] * 2
        assert stats.weight_updates == 0


async def test_an_actor_that_cannot_pause_resumes_the_others_and_raises_its_error() -> None:
    async with open_ray_rollouts(stamping, pause_fails_in_actor_1, num_actors=2) as stream:
        with pytest.raises(WeightUpdateError, match="pausing PauseFails") as info:
            async with stream.weight_update("keep"):
                pytest.fail("the body ran")
        assert "raised in rollout actor 1 of 2" in info.value.__notes__[0]
        assert "pause endpoint answered 404" in str(info.value)
        assert stream.policy_epoch == 0
        groups = await receive(stream, 20)  # actor 0 was resumed
        assert last_epochs(groups) == {0}
        async with stream.weight_update("drain") as update:  # a mode both can pause for
            assert update.epoch == 1
        assert stream.policy_epoch == 1


async def test_bad_arguments_and_refusing_actors_are_errors_raised_as_themselves() -> None:
    async with open_ray_rollouts(Counting(), request(), num_actors=2) as stream:
        with pytest.raises(TypeError, match="takes no backends"):
            async with stream.weight_update(backends=[RawInterface()]):
                pytest.fail("the body ran")
        with pytest.raises(ValueError, match="mode must be one of"):
            async with stream.weight_update("pause"):  # type: ignore[arg-type]
                pytest.fail("the body ran")
        with pytest.raises(ValueError, match=r"policy_epoch \(0\), got 0"):
            async with stream.weight_update(epoch=0):
                pytest.fail("the body ran")
        # Each actor refuses a mode its backend cannot pause for, as its stream does.
        with pytest.raises(TypeError, match="RawInterface is not") as info:
            async with stream.weight_update("keep"):
                pytest.fail("the body ran")
        assert "raised in rollout actor" in info.value.__notes__[0]
        async with stream.weight_update(epoch=7) as update:
            assert update.epoch == 7
            with pytest.raises(RuntimeError, match="already in progress"):
                async with stream.weight_update():
                    pytest.fail("the body ran")
        assert stream.policy_epoch == 7


@pytest.mark.parametrize("when", ["before", "during"])
async def test_an_actor_that_dies_in_an_update_is_an_error_naming_it(when: str) -> None:
    with pytest.raises(RolloutActorDiedError, match="rollout actor 1 of 2") as info:
        async with open_ray_rollouts(stamping, embedded_request, num_actors=2) as stream:
            await receive(stream, 2)
            if when == "before":
                ray.kill(stream.actors[1])
            async with stream.weight_update("keep"):
                ray.kill(stream.actors[1])
                with trio.fail_after(WAIT):
                    await trio.sleep_forever()  # until the watcher fails the stream
    assert info.value.actor_index == 1
    assert_released(stream.actors)


def test_blocking_twin_weight_update() -> None:
    with blocking_ray_rollouts(stamping, embedded_request, num_actors=2) as stream:
        stream.take(2, timeout=WAIT)
        wait_prefetched(stream, 4)  # a batch of each actor waits in the merge
        with stream.weight_update("keep") as update:
            assert (update.epoch, update.mode) == (1, "keep")
            assert stream.policy_epoch == 0
            # Groups already in the merge can be taken during the body.
            assert len(stream.drain(4)) == 4
            with pytest.raises(RuntimeError, match="already in progress"), stream.weight_update():
                pytest.fail("the body ran")
        assert stream.policy_epoch == 1
        with pytest.raises(ValueError, match="mode must be one of"):
            stream.weight_update("pause").__enter__()  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"policy_epoch \(1\), got 1"):
            stream.weight_update(epoch=1).__enter__()
        with pytest.raises(Boom), stream.weight_update("drain"):
            raise Boom
        assert stream.policy_epoch == 1
        with (
            pytest.raises(TypeError, match="takes no backends"),
            stream.weight_update(backends=[RawInterface()]),
        ):
            pytest.fail("the body ran")
        groups = stream.take(20, timeout=WAIT)
        assert 1 in last_epochs(groups)
        stats = stream.fetch_statistics(timeout=WAIT)
        assert (stats.policy_epoch, stats.weight_updates) == (1, 1)
        assert [s.policy_epoch for s in stats.per_actor] == [1, 1]
    assert stream.policy_epoch == 1


def test_leaving_the_blocking_twin_ends_an_open_weight_update_under_the_old_epoch() -> None:
    with blocking_ray_rollouts(stamping, embedded_request, num_actors=2) as stream:
        stream.take(2, timeout=WAIT)
        update = stream.weight_update("keep")
        assert update.__enter__().epoch == 1
        actors = stream.actors
    # The block's exit ended the update under the old epoch, then stopped the actors.
    assert trio_threads() == []
    assert_released(actors)
    with pytest.raises(RuntimeError, match="the stream closed while the weight update was open"):
        update.__exit__(None, None, None)
    assert stream.policy_epoch == 0


def test_an_actor_gives_up_a_begin_its_end_overtook_and_refuses_it_later() -> None:
    # The actor class itself, in this process: Ray may run an update's end before its
    # begin (actor threads run calls in any order); nothing may stay paused.
    actor = RolloutActor(hanging(), request())
    actor.start()
    epochs = source_of(actor._stream).epochs  # type: ignore[arg-type, attr-defined]
    refused: list[BaseException] = []

    def begin() -> None:
        try:
            actor.begin_weight_update(1, "drain", 1)  # waits for calls that never end
        except RuntimeError as exc:
            refused.append(exc)

    beginner = threading.Thread(target=begin)
    beginner.start()
    deadline = time.monotonic() + WAIT
    while not epochs.updating:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert actor.end_weight_update(1, body_failed=True) == []
    beginner.join(WAIT)
    assert "given up" in str(refused[0])
    assert not epochs.updating
    with pytest.raises(RuntimeError, match="ended already"):
        actor.begin_weight_update(1, "drain", 1)
    update = actor.begin_weight_update(2, "restart", 1)
    assert update.held == 4
    assert actor.end_weight_update(2, body_failed=False) == []
    assert actor.end_weight_update(2, body_failed=False) == []  # idempotent
    stats = actor.statistics()
    assert (stats.policy_epoch, stats.restarted, stats.unaccounted) == (1, 4, 0)
    actor.stop(WAIT)
