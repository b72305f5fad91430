"""The staleness bound on the Ray stream (invariant 7 of ``trio_rollouts.ray._merge``).

With ``max_staleness=K``, no group is handed to the consumer with ``policy_epoch -
start_epoch > K``, wherever it waited: in the merge's prefetch, or kept by a timed-out
``take()`` of the sync twin. Keep updates in a burst, taken nothing in between, make the
groups already in the merge too old; each goes back to its actor's slot (ledger:
``stale``), the ledger stays balanced, order stays gap-free, and each prompt is taken
once (a stale group's draw is given back, not settled).

One local Ray cluster (2 CPUs) serves the module (``test_ray.py``'s fixture). Skipped when
Ray is not installed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
import pytest
import trio

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

# The module's local cluster, as test_ray.py starts it (its workers import tests/).
from test_ray import ray_cluster  # noqa: E402, F401

import trio_rollouts as tr  # noqa: E402
from trio_rollouts import Problem, PromptSource  # noqa: E402
from trio_rollouts.inference import EmbeddedInference, LatencyModel  # noqa: E402
from trio_rollouts.ray import blocking_ray_rollouts, open_ray_rollouts  # noqa: E402

#: Safety net for every wait; a passing test never comes near it.
WAIT = 30.0
NUM_ACTORS = 2
#: Enough problems that no shard starts a second epoch in a test.
NUM_PROBLEMS = 40_000


@attrs.define
class Drawing(tr.GroupedRolloutGenerator):
    """Draws one problem per call and makes one inference call for it."""

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        assert self.prompts is not None
        problem = self.prompts.draw()
        iface = request.inference_interface
        response = await iface.agenerate(iface.prepare_request(problem.prompt))
        return [
            tr.Rollout(trajectory=[response.raw_text or ""], reward=float(r), problem_id=pid)
            for r, pid in enumerate([problem.problem_id] * request.rollouts_per_group)
        ]


def drawing(i: int) -> Drawing:
    source = PromptSource(
        [Problem(problem_id=f"p{n}", prompt=f"q{n}", answer=n) for n in range(NUM_PROBLEMS)],
        shuffle=False,
    )
    return Drawing(prompts=source.shard(i, NUM_ACTORS), parallel_generation_tasks=4)


@attrs.frozen
class Requests:
    """The request factory: an embedded backend per actor (it can pause for keep)."""

    max_staleness: int
    enforce_order: bool

    def __call__(self, i: int) -> tr.GroupedRolloutRequest:
        return tr.GroupedRolloutRequest(
            num_groups=2,
            rollouts_per_group=2,
            inference_interface=EmbeddedInference(
                policy=lambda prompt: (["abcd"], [1.0]),
                latency=LatencyModel(first_token=0.002, per_token=0.001, distribution="constant"),
            ),
            streaming=True,
            enforce_order=self.enforce_order,
            max_staleness=self.max_staleness,
        )


def done_in(state: dict[str, Any]) -> int:
    """How many draws a merged prompt state counts as done (no shard left epoch 0)."""
    assert all(shard["epoch"] == 0 for shard in state["shards"])
    return sum(shard["position"] - len(shard["pending"]) for shard in state["shards"])


def assert_within_the_bound_and_each_prompt_once(
    handed: list[tuple[int, int]],
    bound: int,
    taken: list[tr.RolloutGroup],
    enforce_order: bool,
    stats: tr.RolloutStreamStatistics,
    state: dict[str, Any],
) -> None:
    """No group was handed out too old (``handed``: the epoch when taken, and the group's
    start epoch); the ledger adds up; with ``enforce_order`` no slot was skipped; each
    problem was taken once, and a prompt is done exactly when its group was taken."""
    assert [(epoch, start) for epoch, start in handed if epoch - start > bound] == []
    assert stats.unaccounted == 0
    if enforce_order:
        assert_slots_in_order(taken, 0)
    problem_ids = [str(g[0].problem_id) for g in taken]
    assert [pid for pid, n in Counter(problem_ids).items() if n > 1] == []
    assert done_in(state) == len(taken)
    pending = {pid for shard in state["shards"] for _, pid in shard["pending"]}
    assert not pending & set(problem_ids)


async def prefetched(stream: Any) -> None:
    """Wait until groups wait in the merge's prefetch: at least one per actor (the merge
    asks an actor for a batch only when a whole one fits, so half of one may be all)."""
    # Across processes there is no "all tasks blocked" to wait for: poll the merge.
    with trio.fail_after(WAIT):
        while True:
            if stream.statistics().prefetched >= NUM_ACTORS:
                return
            await trio.sleep(0.01)


def assert_slots_in_order(groups: list[tr.RolloutGroup], first_batch: int) -> None:
    slots = [(g.batch_id, g.index_in_batch) for g in groups]
    assert slots == [(first_batch + n // 2, n % 2) for n in range(len(groups))]


@pytest.mark.parametrize("enforce_order", [False, True])
@pytest.mark.parametrize("max_staleness", [0, 1])
async def test_groups_waiting_in_the_merge_are_never_handed_out_beyond_the_bound(
    max_staleness: int, enforce_order: bool
) -> None:
    handed: list[tuple[int, int]] = []  # (policy_epoch when taken, start_epoch)
    taken: list[tr.RolloutGroup] = []

    async def take(stream: Any, n: int) -> None:
        with trio.fail_after(WAIT):
            for _ in range(n):
                group = await stream.receive()
                handed.append((stream.policy_epoch, group.start_epoch))
                taken.append(group)

    async with open_ray_rollouts(
        drawing, Requests(max_staleness, enforce_order), num_actors=NUM_ACTORS
    ) as stream:
        await take(stream, 2)
        # Two bursts of keep updates, each one more than the bound, taking nothing in
        # between: the groups waiting in the merge's prefetch become too old.
        for _ in range(2):
            await prefetched(stream)
            for _ in range(max_staleness + 2):
                async with stream.weight_update("keep"):
                    pass
            await take(stream, 12)
        stats = await stream.fetch_statistics()
        state = await stream.prompts_state_dict()

    assert_within_the_bound_and_each_prompt_once(
        handed, max_staleness, taken, enforce_order, stats, state
    )
    assert stats.stale >= 2 * NUM_ACTORS  # every prefetched group, each burst


@pytest.mark.parametrize("enforce_order", [False, True])
def test_groups_a_timed_out_take_kept_are_never_handed_out_beyond_the_bound(
    enforce_order: bool,
) -> None:
    handed: list[tuple[int, int]] = []
    taken: list[tr.RolloutGroup] = []

    def keep(groups: list[tr.RolloutGroup]) -> None:
        for group in groups:
            handed.append((stream.policy_epoch, group.start_epoch))
        taken.extend(groups)

    with blocking_ray_rollouts(
        drawing, Requests(0, enforce_order), num_actors=NUM_ACTORS
    ) as stream:
        keep(stream.take(2, timeout=WAIT))
        # More than arrive in time: the take times out keeping what came.
        with pytest.raises(TimeoutError):
            stream.take(NUM_PROBLEMS, timeout=0.3)
        for _ in range(2):
            with stream.weight_update("keep"):
                pass
        keep(stream.take(12, timeout=WAIT))
        stats = stream.fetch_statistics(timeout=WAIT)
        state = stream.prompts_state_dict()

    assert_within_the_bound_and_each_prompt_once(handed, 0, taken, enforce_order, stats, state)
    assert stats.stale > 0
