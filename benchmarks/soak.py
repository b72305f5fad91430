"""Soak run: a million groups through the pipeline with random faults; RSS must stay flat.

Usage: python benchmarks/soak.py [--groups N] [--seed S]
       python benchmarks/soak.py --rewards [--groups N] [--seed S] [--hang-rate R]

The agent's ``group_rollout`` is instant but misbehaves at random: about 2% of calls raise
a transient error (retried in the same slot), 0.5% raise a non-transient one (skipped by
``on_failure="skip"``), 1% hang past the group deadline (a timeout, retried), and 10%
return a group whose rewards are all equal (filtered and regenerated). The consumer takes
groups in streaming mode with ``enforce_order`` and pauses now and then. The script
prints the RSS after the first 2% of the groups and at the end, the statistics, and
checks that the ledger adds up. It is not part of CI (``nox -s soak``).

With ``--rewards`` (default 100,000 groups): every group is scored by ``run_reward`` in
the run's pool of worker processes, and 1% of the reward calls (``--hang-rate``) spin
forever; ``timeout=0.2`` kills them (``RewardTimeoutError``, retried in the slot up to 3
attempts, then skipped). Printed: the groups, timeouts and retries, the ledger
(``unaccounted`` must be 0), the RSS after 2% of the groups and at the end, the event
loop's lag (``stream.metrics()`` every 2,000 groups: the median and the worst interval's
p99), and the worker processes alive after ``trio.run`` returned (must be none).
"""

from __future__ import annotations

import argparse
import random
import resource
import time
from typing import Any

import attrs
import stamina
import trio

import trio_rollouts as tr
from trio_rollouts.testing import NullInference


class Transient(Exception):
    """A fault worth another attempt."""


class Broken(Exception):
    """A fault that is not retried (the group is skipped)."""


@attrs.define
class FaultyAgent(tr.GroupedRolloutGenerator):
    rng: random.Random = attrs.field(kw_only=True)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        roll = self.rng.random()
        if roll < 0.02:
            await trio.lowlevel.checkpoint()
            raise Transient("flaky")
        if roll < 0.025:
            await trio.lowlevel.checkpoint()
            raise Broken("broken")
        if roll < 0.035:
            await trio.sleep(10)  # past the deadline
        else:
            await trio.lowlevel.checkpoint()
        same = roll < 0.135
        return [
            tr.Rollout(trajectory=["x" * 64], reward=1.0 if same else float(i), problem_id=str(i))
            for i in range(4)
        ]


def score(hang: bool, value: int) -> float:
    """A reward in a worker process; ``hang`` spins forever (until the worker is killed)."""
    while hang:
        pass
    return float(value % 2)


@attrs.define
class RewardedAgent(tr.GroupedRolloutGenerator):
    """Instant groups, each scored by one ``run_reward`` call; ``hang_rate`` of them hang."""

    rng: random.Random = attrs.field(kw_only=True)
    hang_rate: float = attrs.field(kw_only=True)
    hangs: int = attrs.field(default=0, init=False)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        hang = self.rng.random() < self.hang_rate
        self.hangs += hang
        value = self.rng.randrange(1 << 30)
        reward = await tr.run_reward(score, hang, value, timeout=0.2)
        return [
            tr.Rollout(trajectory=["x" * 64], reward=reward + i, problem_id=str(i))
            for i in range(4)
        ]


def worker_processes() -> list[int]:
    """The pids of this process's children that are trio-parallel workers (multiprocessing's
    resource tracker is not one)."""
    import psutil

    return [
        child.pid
        for child in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(child.cmdline())
    ]


async def soak_rewards(groups: int, seed: int, hang_rate: float) -> None:
    rng = random.Random(seed)
    agent = RewardedAgent(
        rng=rng,
        hang_rate=hang_rate,
        parallel_generation_tasks=16,
        buffer_size=16,
        failure_policy=skipping_policy(groups),
    )
    request = tr.GroupedRolloutRequest(
        num_groups=4,
        rollouts_per_group=4,
        inference_interface=NullInference(),
        streaming=True,
    )
    warm = max(1, groups // 50)
    start = time.perf_counter()
    rss_start = rss_end = 0
    lag_p99: list[float] = []
    async with agent.get_grouped_rollouts(request) as stream:
        stream.metrics()
        for n in range(1, groups + 1):
            await stream.receive()
            if n == warm:
                rss_start = rss_kib()
            if n % 2000 == 0:
                metrics = stream.metrics()
                if "loop/lag_p99_ms" in metrics:
                    lag_p99.append(metrics["loop/lag_p99_ms"])
                print(
                    f"  {n:,} groups, {time.perf_counter() - start:.0f} s, RSS {rss_kib():,} KiB, "
                    f"lag p99 {lag_p99[-1] if lag_p99 else float('nan'):.1f} ms",
                    flush=True,
                )
        rss_end = rss_kib()
    stats = stream.statistics()
    wall = time.perf_counter() - start
    print(
        f"groups delivered: {stats.delivered:,} in {wall:.1f} s ({stats.delivered / wall:,.0f}/s); "
        f"reward calls that hung: {agent.hangs:,}"
    )
    print(
        f"attempts {stats.attempts:,}, failed {stats.failed:,} (reward timeouts), retries "
        f"{stats.retries:,}, skipped {stats.skipped:,}, cancelled at exit {stats.cancelled:,}, "
        f"unaccounted {stats.unaccounted}"
    )
    report_end(stats, warm, rss_start, rss_end)
    lag_p99.sort()
    if lag_p99:
        print(
            f"event loop lag p99 per 2,000-group interval: median "
            f"{lag_p99[len(lag_p99) // 2]:.1f} ms, worst {lag_p99[-1]:.1f} ms"
        )
    check_ledger(stats)


def skipping_policy(groups: int, **options: Any) -> tr.FailurePolicy:
    """3 attempts without backoff, then skip (as many skips as groups)."""
    return tr.FailurePolicy(
        max_attempts=3,
        wait_initial=0.0,
        wait_max=0.0,
        wait_jitter=0.0,
        on_failure="skip",
        skip_budget=groups,
        **options,
    )


def report_end(stats: tr.RolloutStreamStatistics, warm: int, rss_start: int, rss_end: int) -> None:
    print(
        f"RSS after {warm:,} groups: {rss_start:,} KiB; at the end: {rss_end:,} KiB "
        f"({rss_end - rss_start:+,} KiB)"
    )


def check_ledger(stats: tr.RolloutStreamStatistics) -> None:
    if stats.unaccounted != 0:
        msg = f"the ledger does not add up: {stats}"
        raise SystemExit(msg)


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


async def soak(groups: int, seed: int) -> None:
    rng = random.Random(seed)
    agent = FaultyAgent(
        rng=rng,
        parallel_generation_tasks=64,
        buffer_size=16,
        failure_policy=skipping_policy(
            groups, group_timeout=0.01, retry_on=(Transient, tr.GroupTimeoutError)
        ),
    )
    request = tr.GroupedRolloutRequest(
        num_groups=4,
        rollouts_per_group=4,
        inference_interface=NullInference(),
        streaming=True,
        enforce_order=True,
        filter_groups_with_same_reward=True,
    )
    warm = max(1, groups // 50)
    start = time.perf_counter()
    rss_start = rss_end = 0
    async with agent.get_grouped_rollouts(request) as stream:
        for n in range(1, groups + 1):
            await stream.receive()
            if n % 10_000 == 0 and rng.random() < 0.1:
                await trio.sleep(0.005)  # a consumer pause
            if n == warm:
                rss_start = rss_kib()
        rss_end = rss_kib()
    stats = stream.statistics()
    wall = time.perf_counter() - start
    print(
        f"groups delivered: {stats.delivered:,} in {wall:.1f} s ({stats.delivered / wall:,.0f}/s)"
    )
    print(
        f"attempts {stats.attempts:,}, retries {stats.retries:,}, timeouts {stats.timeouts:,}, "
        f"skipped {stats.skipped:,}, filtered {stats.filtered:,}, cancelled at exit "
        f"{stats.cancelled:,}, unaccounted {stats.unaccounted}"
    )
    report_end(stats, warm, rss_start, rss_end)
    check_ledger(stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, help="default 1,000,000 (--rewards: 100,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rewards", action="store_true", help="rewards in worker processes")
    parser.add_argument("--hang-rate", type=float, default=0.01, help="reward calls that hang")
    args = parser.parse_args()
    stamina.instrumentation.set_on_retry_hooks([])  # a million retry log lines help no one
    if not args.rewards:
        trio.run(soak, args.groups or 1_000_000, args.seed)
        return
    trio.run(soak_rewards, args.groups or 100_000, args.seed, args.hang_rate)
    left = worker_processes()
    print(f"worker processes alive after the run: {len(left)} {left if left else ''}")
    if left:
        raise SystemExit("worker processes outlived the run")


if __name__ == "__main__":
    main()
