"""``run_reward``: reward code in worker processes that a deadline or a cancellation kills.

Real processes take real time: the timeouts here are short (0.5 to 2 s), and wall times
are only checked against generous upper bounds. The reward functions are module-level, so
the workers import them from this module.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import psutil
import pytest
import trio
import trio.testing
import trio_parallel

import trio_rollouts as tr
from trio_rollouts.inference import EmbeddedInference, InferenceResponse, LatencyModel

#: A slack for "on time" on a loaded machine: starting a worker and tearing one down.
SLACK = 10.0


class RewardCrashed(Exception):
    """What a reward function of these tests raises."""


def add(a: int, b: int) -> int:
    return a + b


def crash(reason: str) -> float:
    raise RewardCrashed(reason)


def spin(*args: object) -> float:
    """A reward that never returns, and no signal handler of Python's interrupts."""
    while True:
        pass


def pid(*args: object) -> int:
    return os.getpid()


def sleep_then_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def last_number(answer: str, completion: str) -> float:
    """1.0 when the completion's last word is the answer."""
    words = completion.replace(".", " ").split()
    return 1.0 if words and words[-1] == answer else 0.0


def worker_pids() -> set[int]:
    """The reward workers alive: the children of this process that multiprocessing
    spawned (not its resource tracker, which lives as long as the interpreter)."""
    pids = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):  # exited meanwhile
            if "spawn_main" in " ".join(child.cmdline()):
                pids.add(child.pid)
    return pids


def workers_limited_to(tokens: int) -> None:
    tr.current_reward_limiter().total_tokens = tokens


# --------------------------------------------------------------------------- results


async def test_the_result_of_fn_comes_back() -> None:
    assert await tr.run_reward(add, 2, 3, timeout=5) == 5


async def test_fn_runs_in_another_process() -> None:
    assert await tr.run_reward(pid, timeout=5) != os.getpid()


async def test_an_exception_of_fn_propagates_as_itself() -> None:
    with pytest.raises(RewardCrashed, match="no answer to compare") as info:
        await tr.run_reward(crash, "no answer to compare", timeout=5)
    # With the worker's traceback, down to the line that raised.
    assert info.traceback[-1].name == "crash"


async def test_lambdas_and_closures_are_pickled_by_value() -> None:
    offset = 10
    assert await tr.run_reward(lambda x: x + offset, 1, timeout=5) == 11


async def test_keyword_arguments_go_through_a_partial() -> None:
    assert await tr.run_reward(functools.partial(add, b=4), 1, timeout=5) == 5


# --------------------------------------------------------------------------- deadlines


async def test_a_reward_that_spins_forever_times_out_and_its_worker_is_killed() -> None:
    workers_limited_to(1)
    first = await tr.run_reward(pid, timeout=5)
    assert worker_pids() == {first}
    start = time.monotonic()
    with pytest.raises(tr.RewardTimeoutError, match=r"spin ran past timeout=0\.5 s") as info:
        await tr.run_reward(spin, timeout=0.5)
    assert 0.5 <= time.monotonic() - start < 0.5 + SLACK
    assert isinstance(info.value, TimeoutError)
    # Killed and reaped before the error was raised.
    assert not psutil.pid_exists(first)
    assert worker_pids() == set()


async def test_after_a_timeout_the_pool_serves_the_next_call_with_a_fresh_worker() -> None:
    workers_limited_to(1)
    first = await tr.run_reward(pid, timeout=5)
    with pytest.raises(tr.RewardTimeoutError):
        await tr.run_reward(spin, timeout=0.5)
    second = await tr.run_reward(pid, timeout=5)
    assert second != first
    assert worker_pids() == {second}


async def test_timeouts_do_not_grow_the_pool_past_its_limiter() -> None:
    workers_limited_to(2)
    most = 0

    def count() -> None:
        nonlocal most
        most = max(most, len(worker_pids()))

    async def timed_out() -> None:
        with pytest.raises(tr.RewardTimeoutError):
            await tr.run_reward(spin, timeout=0.5)
        count()

    async def served(i: int) -> None:
        assert await tr.run_reward(add, i, i, timeout=5) == 2 * i
        count()

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(timed_out)
    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(served, i)
    count()
    assert 1 <= most <= 2


async def test_waiting_for_a_worker_does_not_count_against_the_timeout() -> None:
    # One worker, two calls of 0.6 s each with a timeout of 1 s: the second waits for the
    # first, 0.6 s, and still has its whole second.
    workers_limited_to(1)
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(functools.partial(tr.run_reward, sleep_then_pid, 0.6, timeout=1))


async def test_the_timeout_is_measured_on_the_real_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Trio's clock jumps whenever every task waits for a worker; the reward's deadline
    # does not, so a reward of 0.3 s of real time fits in a timeout of 2 s...
    assert await tr.run_reward(sleep_then_pid, 0.3, timeout=2) > 0
    # ...and a reward that spins still times out, after its real 0.5 s.
    start = time.monotonic()
    with pytest.raises(tr.RewardTimeoutError):
        await tr.run_reward(spin, timeout=0.5)
    assert time.monotonic() - start >= 0.5


async def test_the_imports_fn_needs_do_not_count_against_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module that takes 1 s to import (sympy takes a fraction of that): its function
    # still has its whole timeout of 0.5 s, in a fresh worker.
    (tmp_path / "slow_to_import.py").write_text(
        "import time\ntime.sleep(1.0)\n\n\ndef score(x):\n    return x + 1\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    import slow_to_import  # type: ignore[import-not-found]

    assert await tr.run_reward(slow_to_import.score, 1, timeout=0.5) == 2


async def test_a_worker_that_dies_is_reported_with_what_to_check() -> None:
    with pytest.raises(trio_parallel.BrokenWorkerError) as info:
        await tr.run_reward(os._exit, 3, timeout=5)
    assert any("if __name__ ==" in note for note in info.value.__notes__)
    # The pool goes on with a fresh worker.
    assert await tr.run_reward(add, 1, 1, timeout=5) == 2


# --------------------------------------------------------------------------- cancellation


async def test_a_cancellation_from_outside_kills_the_worker() -> None:
    workers_limited_to(1)
    first = await tr.run_reward(pid, timeout=5)
    start = time.monotonic()
    with trio.move_on_after(0.5) as scope:
        await tr.run_reward(spin, timeout=60)
    assert scope.cancelled_caught
    assert time.monotonic() - start < 0.5 + SLACK
    assert not psutil.pid_exists(first)
    assert worker_pids() == set()
    assert await tr.run_reward(add, 1, 1, timeout=5) == 2


def test_no_worker_outlives_the_run() -> None:
    alive: list[set[int]] = []

    async def main() -> None:
        workers_limited_to(2)
        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(functools.partial(tr.run_reward, add, i, 1, timeout=5))
        alive.append(worker_pids())

    trio.run(main)
    assert len(alive[0]) == 2
    assert worker_pids() == set()
    assert not any(psutil.pid_exists(p) for p in alive[0])


def test_each_run_has_its_own_pool() -> None:
    async def main() -> tuple[int, trio.CapacityLimiter]:
        return await tr.run_reward(pid, timeout=5), tr.current_reward_limiter()

    first, first_limiter = trio.run(main)
    second, second_limiter = trio.run(main)
    assert first != second
    assert first_limiter is not second_limiter
    assert first_limiter.total_tokens == (os.cpu_count() or 1)


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("value", "error", "says"),
    [
        (None, TypeError, "timeout must be a finite number of seconds > 0, got None"),
        ("1", TypeError, "timeout must be a finite number of seconds > 0, got '1'"),
        (True, TypeError, "timeout must be a finite number of seconds > 0, got True"),
        (0, ValueError, "timeout must be > 0 seconds, got 0"),
        (-1.0, ValueError, "timeout must be > 0 seconds, got -1.0"),
        (math.nan, ValueError, "timeout must be > 0 seconds, got nan"),
        (math.inf, ValueError, "timeout must be a finite number of seconds > 0, got inf"),
    ],
)
async def test_a_bad_timeout_is_refused_before_any_work(
    value: Any, error: type[Exception], says: str
) -> None:
    with pytest.raises(error) as info:
        await tr.run_reward(add, 1, 2, timeout=value)
    assert str(info.value) == says


async def test_fn_must_be_a_synchronous_callable() -> None:
    with pytest.raises(TypeError, match="fn must be a callable"):
        await tr.run_reward(42, timeout=1)  # type: ignore[arg-type]

    async def score() -> float:
        return 1.0

    with pytest.raises(TypeError, match="fn must be a synchronous function"):
        await tr.run_reward(score, timeout=1)  # type: ignore[arg-type]


def test_a_reward_timeout_is_transient_by_default() -> None:
    assert tr.RewardTimeoutError in tr.FailurePolicy().retry_on
    assert tr.FailurePolicy().is_transient(tr.RewardTimeoutError("late"))


# --------------------------------------------------------------------------- in agents

PROBLEMS = [
    tr.Problem(problem_id=f"q{i}", prompt=f"What is {i} + {i}?", answer=2 * i) for i in range(4)
]


def answers(prompt: list[tr.ChatMessage]) -> tuple[Sequence[str], Sequence[float]]:
    """Right half of the time: 'The answer is 2i.' or 'The answer is 2i+1.'"""
    i = int(prompt[-1].content.split()[2])
    return [f"The answer is {2 * i}.", f"The answer is {2 * i + 1}."], [0.5, 0.5]


@attrs.define(kw_only=True)
class WorkerScored(tr.RewardOnlyAgent):
    """Scores each completion with ``score(answer, completion)`` in a worker."""

    score: Any = last_number
    timeout: float = 5.0

    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        reward: float = await tr.run_reward(
            self.score, str(problem.answer), response.response.content, timeout=self.timeout
        )
        return reward


def grouped(num_groups: int = 2) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=num_groups,
        rollouts_per_group=4,
        inference_interface=EmbeddedInference(
            seed=0, policy=answers, latency=LatencyModel(first_token=0.01, per_token=0)
        ),
    )


async def test_a_reward_only_agent_scores_in_workers() -> None:
    agent = WorkerScored(prompts=tr.PromptSource(PROBLEMS, seed=0))
    async with agent.get_grouped_rollouts(grouped()) as stream:
        groups = [await stream.receive() for _ in range(2)]
    for group in groups:
        for rollout in group:
            completion = rollout.extra["completion"]
            answer = 2 * int(rollout.problem_id.removeprefix("q"))
            assert rollout.reward == (1.0 if completion == f"The answer is {answer}." else 0.0)
    assert {r.reward for group in groups for r in group} == {0.0, 1.0}


@pytest.mark.parametrize("on_failure", ["raise", "skip"])
def test_a_group_whose_reward_spins_is_retried_then_fails_on_time(on_failure: str) -> None:
    stream_statistics: list[tr.RolloutStreamStatistics] = []

    async def main() -> None:
        workers_limited_to(2)
        agent = WorkerScored(
            prompts=tr.PromptSource(PROBLEMS, seed=0),
            score=spin,
            timeout=0.5,
            failure_policy=tr.FailurePolicy(
                max_attempts=2,
                wait_initial=0.01,
                wait_jitter=0,
                on_failure=on_failure,  # type: ignore[arg-type]
                skip_budget=0,
            ),
        )
        try:
            async with agent.get_grouped_rollouts(grouped(num_groups=1)) as stream:
                await stream.receive()
        finally:
            stream_statistics.append(stream.statistics())

    expected = tr.RewardTimeoutError if on_failure == "raise" else tr.FailureBudgetExceededError
    start = time.monotonic()
    with pytest.raises(expected) as info:
        trio.run(main)
    # Two attempts of 0.5 s each, plus starting workers for them.
    assert time.monotonic() - start < 2 * 0.5 + 2 * SLACK
    if on_failure == "skip":
        assert isinstance(info.value.__cause__, tr.RewardTimeoutError)
    (stats,) = stream_statistics
    assert (stats.failed, stats.retries) == (2, 1)
    assert stats.unaccounted == 0
    assert worker_pids() == set()


class Scored(tr.BaseEnvironment):
    """One turn; the episode's reward is computed in a worker at the end."""

    def __init__(self, problem: tr.Problem) -> None:
        super().__init__()
        self.problem = problem

    async def reset(self) -> Sequence[tr.ChatMessage]:
        await trio.lowlevel.checkpoint()
        return [tr.ChatMessage(role="user", content=str(self.problem.prompt))]

    async def step(self, turn: tr.AssistantTurn) -> tr.EnvironmentStep:
        reward = await tr.run_reward(
            last_number, str(self.problem.answer), turn.content, timeout=5.0
        )
        return tr.EnvironmentStep(done=True, reward=reward)


async def test_an_environment_scores_in_a_worker_in_a_multi_turn_agent() -> None:
    agent = tr.MultiTurnAgent(
        environment=Scored,
        renderer=tr.PlainRenderer(),
        prompts=tr.PromptSource(PROBLEMS, seed=0),
    )
    async with agent.get_grouped_rollouts(grouped(num_groups=1)) as stream:
        group = await stream.receive()
    assert len(group) == 4
    assert all(r.reward in (0.0, 1.0) for r in group)
